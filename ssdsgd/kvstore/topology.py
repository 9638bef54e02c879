"""The job's layout, decided by the scheduler from the nodes that registered: whether a
REGISTER's fields fit its role, each node's rank, and the topology every node receives.
Pure functions over the scheduler's records of the nodes (dicts with ``role``,
``asked_rank``, ``host``, ``port``, ``routing_id``; ``rank`` once assigned)."""


def registration_error(role, meta, nodes):
    """Why a REGISTER of ``role`` with ``meta`` (fields already type-checked) cannot join
    beside the ``nodes`` registered so far; None if it can."""
    if role == "server" and not (meta.get("host") and meta.get("port")):
        return "a server registers the host and port it listens on"
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


def listening(nodes):
    """The nodes whose ports others connect to: the servers, and the workers that relay
    pulls (sync.pull_relay: chain), in rank order."""
    return by_rank(nodes, "server") + [n for n in by_rank(nodes, "worker") if n["port"]]


def topology(nodes, num_workers, num_servers):
    """What every node receives (besides its own ``rank``): the servers' addresses, the
    workers' connection ids in rank order, and, when any worker relays pulls, every
    worker's relay address (None for one that does not)."""
    workers = by_rank(nodes, "worker")
    layout = {"num_workers": num_workers, "num_servers": num_servers,
              "servers": [[n["host"], n["port"]] for n in by_rank(nodes, "server")],
              "workers": [n["routing_id"] for n in workers]}
    if any(n["port"] for n in workers):
        layout["relays"] = [[n["host"], n["port"]] if n["port"] else None for n in workers]
    return layout
