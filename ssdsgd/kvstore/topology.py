"""The job's layout, decided by the scheduler from the nodes that registered: whether a
REGISTER's fields fit its role, each node's rank, the topology every node receives, and
whether the addresses in it can be reached. Functions over the scheduler's records of the
nodes (dicts with ``role``, ``asked_rank``, ``host``, ``port``, ``routing_id``,
``max_message``; ``rank`` once assigned); all pure but ``unreachable``, which connects."""
import socket


def node_name(info):
    return f"{info['role']} {info['rank']} (pid {info.get('pid', '?')} on {info.get('hostname', '?')})"


def registration_error(role, meta, nodes):
    """Why a REGISTER of ``role`` with ``meta`` (fields already type-checked) cannot join
    beside the ``nodes`` registered so far; None if it can."""
    if role == "server" and not (meta.get("host") and meta.get("port")):
        return "a server registers the host and port it listens on"
    if role == "server" and "max_message" in meta:
        return "only a worker states the largest message it sends"
    if role == "worker":
        if bool(meta.get("host")) != bool(meta.get("port")):
            return ("a worker that relays pulls registers both the host and the port it "
                    "listens on")
        if not meta.get("routing_id"):
            return "a worker registers the id of its connections to the servers"
        if any(n.get("routing_id") == meta["routing_id"] for n in nodes):
            return "another worker registered the same connection id"
    return None


def assign_ranks(nodes, counts):
    """Each node's ``rank``: the one it asked for if no other node of its role asked for
    it too (and it exists), else the lowest free one. ``counts``: role -> how many."""
    for role, count in counts.items():
        members = [n for n in nodes if n["role"] == role]
        asked = [n["asked_rank"] for n in members]
        taken = {r for r in asked if 0 <= r < count and asked.count(r) == 1}
        free = iter(sorted(set(range(count)) - taken))
        for n in members:
            n["rank"] = n["asked_rank"] if n["asked_rank"] in taken else next(free)


def by_rank(nodes, role):
    return sorted((n for n in nodes if n["role"] == role), key=lambda n: n["rank"])


def unreachable(nodes, timeout=5.0):
    """Why one of ``nodes`` cannot be reached at the address it advertised (a TCP connect
    to each, from here: the scheduler's host), or None if every one can."""
    for n in nodes:
        try:
            socket.create_connection((n["host"], n["port"]), timeout=timeout).close()
        except (OSError, TypeError, ValueError) as e:
            return (f"{node_name(n)} advertised {n['host']}:{n['port']}, which the scheduler "
                    f"cannot reach ({getattr(e, 'strerror', None) or e}); set its address "
                    "with --interface or SSDSGD_NODE_HOST")
    return None


def listening(nodes):
    """The nodes whose ports others connect to: the servers, and the workers that relay
    pulls (sync.pull_relay: chain), in rank order."""
    return by_rank(nodes, "server") + [n for n in by_rank(nodes, "worker") if n["port"]]


def message_limit(nodes):
    """The most data bytes a message to a server may carry, as the model says: what
    worker 0 stated its largest message would be (``protocol.message_bound`` of its
    model); None when it knew no model when it registered (a store created before the
    model). Every node takes it within its own SSDSGD_MAX_MESSAGE_BYTES (``job_limit``)."""
    stated = [n.get("max_message") for n in nodes if n["role"] == "worker" and n["rank"] == 0]
    return stated[0] if stated else None


def job_limit(env, topo):
    """A node's message limit: the model's, from the topology (``message_limit``), never
    above this node's own SSDSGD_MAX_MESSAGE_BYTES (a user may lower it)."""
    return min(env.max_message_bytes, topo.get("max_message_bytes", env.max_message_bytes))


def limit_note(env, limit):
    """Where a worker's message ``limit`` comes from, for the error of a message above it
    (None: its own SSDSGD_MAX_MESSAGE_BYTES, which the error names)."""
    return None if limit == env.max_message_bytes else (
        f"the job's limit of {limit} data bytes, set by the model worker 0 had when it "
        "joined (protocol.message_bound; docs/reliability.md): a key added since is not in "
        "it; create the store with the whole model (as gluon.Trainer does)")


def topology(nodes, num_workers, num_servers):
    """What every node receives (besides its own ``rank``): the servers' addresses, the
    workers' connection ids in rank order, the model's message limit if worker 0 stated
    one (``message_limit``) and, when any worker relays pulls, every worker's relay
    address (None for one that does not)."""
    workers = by_rank(nodes, "worker")
    layout = {"num_workers": num_workers, "num_servers": num_servers,
              "servers": [[n["host"], n["port"]] for n in by_rank(nodes, "server")],
              "workers": [n["routing_id"] for n in workers]}
    if message_limit(nodes):
        layout["max_message_bytes"] = message_limit(nodes)
    if any(n["port"] for n in workers):
        layout["relays"] = [[n["host"], n["port"]] if n["port"] else None for n in workers]
    return layout
