"""The job's layout, decided by the scheduler from the nodes that registered: whether a
REGISTER's fields fit its role, each node's rank, the topology every node receives, the
servers' addresses once they listen, and whether the addresses can be reached. Functions
over the scheduler's records of the nodes (dicts with ``role``, ``asked_rank``, ``host``,
``port``, ``routing_id``; ``rank`` once assigned); all pure but ``unreachable``, which
connects."""
import socket

from .security import claim_error


def node_name(info):
    return f"{info['role']} {info['rank']} (pid {info.get('pid', '?')} on {info.get('hostname', '?')})"


def registration(role, meta, who, nodes, counts, started):
    """A REGISTER of ``role`` with ``meta`` (fields already type-checked) beside the
    ``nodes`` registered so far: (its meta, why it cannot join or None). ``who``: the node
    its key names ('worker 1'; None when the keys name no node), whose rank it takes if it
    asked for none; ``counts``: role -> how many the job has; ``started``: all came."""
    if who is not None and meta.get("rank", -1) == -1 and who.startswith(role + " "):
        meta = dict(meta, rank=int(who.split()[1]))     # its key says which
    wrong = claim_error(who, role, meta.get("rank", -1))
    if wrong is None and who is not None and any(n.get("who") == who for n in nodes):
        wrong = f"{who} has registered already"
    return meta, wrong or _registration_error(role, meta, nodes, counts, started)


def _registration_error(role, meta, nodes, counts, started):
    """Why a REGISTER of ``role`` with ``meta`` (fields already type-checked) cannot join
    beside the ``nodes`` registered so far (``counts``: role -> how many the job has;
    ``started``: all have registered); None if it can."""
    if role == "server" and not meta.get("host"):
        return "a server registers the host it will listen on"
    if role == "server" and meta.get("port"):
        return ("a server has no port when it registers: it binds one once the job's "
                "message limit is known, and says so with LISTEN")
    if role == "worker":
        if bool(meta.get("host")) != bool(meta.get("port")):
            return ("a worker that relays pulls registers both the host and the port it "
                    "listens on")
        if not meta.get("routing_id"):
            return "a worker registers the id of its connections to the servers"
        if any(n.get("routing_id") == meta["routing_id"] for n in nodes):
            return "another worker registered the same connection id"
    if started or sum(n["role"] == role for n in nodes) >= counts[role]:
        return (f"the job already has its {counts[role]} {role}s "
                f"(SSDSGD_NUM_{role.upper()}S={counts[role]})")
    return None


def record(meta, role, who, now):
    """The scheduler's record of a node that registered with ``meta``; ``who``: the node
    its key names (None: the keys name no node)."""
    return {"role": role, "asked_rank": meta.get("rank", -1), "host": meta.get("host"),
            "port": meta.get("port"), "pid": meta.get("pid"), "hostname": meta.get("hostname"),
            "routing_id": meta.get("routing_id"), "who": who, "rank": -1, "last_seen": now,
            "finished": False}


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


def relays(nodes):
    """The workers whose ports others connect to (their pull relays: sync.pull_relay:
    chain), in rank order; bound before they register, so checked with the ranks."""
    return [n for n in by_rank(nodes, "worker") if n["port"]]


def relay_address(relays, rank):
    """Worker ``rank``'s pull relay, [host, port], from a topology's ``relays`` (the
    start's workers' by rank; None where the job relays nothing), or None: it has none
    (it does not relay, or it joined later: no chain knows its address)."""
    if not relays or not 0 <= rank < len(relays):
        return None
    return relays[rank]


def reachable_or_why(nodes, optional_relays=False, log=print):
    """Why the job cannot start, or None: every relaying worker must be reachable at its
    advertised address (the servers bind later, startup.py). A pull relay the job may
    do without (``optional_relays``: sync.pull_relay auto) is dropped instead, every
    worker's, so the topology has none and no pull is relayed (said through ``log``)."""
    wrong = unreachable(relays(nodes))
    if not wrong or not optional_relays:
        return wrong
    for n in nodes:
        if n["role"] == "worker":
            n["host"] = n["port"] = None
    log(f"no pull relay in this job: {wrong}")
    return None


def servers(nodes):
    """Every server's address, in rank order, once each said where it listens (LISTEN)."""
    return [[n["host"], n["port"]] for n in by_rank(nodes, "server")]


def job_limit(env, topo):
    """A node's message limit: the model's, as worker 0 stated it (``max_message_bytes``
    of the scheduler's LISTEN, which ``topo`` holds), never above this node's own
    SSDSGD_MAX_MESSAGE_BYTES (a user may lower it)."""
    return min(env.max_message_bytes, topo.get("max_message_bytes", env.max_message_bytes))


def topology(nodes, num_workers, num_servers):
    """What every node receives once all registered (besides its own ``rank``): the
    workers' connection ids in rank order and, when any worker relays pulls, every
    worker's relay address (None for one that does not). The servers' addresses come
    later (``servers``), once each listens with the job's message limit."""
    workers = by_rank(nodes, "worker")
    layout = {"num_workers": num_workers, "num_servers": num_servers,
              "workers": [n["routing_id"] for n in workers]}
    if any(n["port"] for n in workers):
        layout["relays"] = [[n["host"], n["port"]] if n["port"] else None for n in workers]
    return layout
