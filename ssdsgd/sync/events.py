"""The policies' own messages: each event's fields, checked where it arrives.

The transport carries a POLICY message (``{"event": name, ...}``) and a PUSH's or PULL's
``policy`` options without reading them (``kvstore/kinds.py``); the policy that receives
one checks it here before any use, as the transport checks its own kinds. A node trusts
no peer: an unknown event, a field it does not carry or one of the wrong type is refused
with a one-line ``PolicyError`` naming it.
"""
from .. import fields as F


class PolicyError(ValueError):
    """A request or event a policy cannot take; the message names why (one line)."""


GROUP_NUMBER = (F.int_in(0, F.MAX_STEP), "a group number")
MAX_LOG = 1 << 19        # half of the transport's meta bound: the envelope fits around it

# a PUSH's or PULL's ``policy`` object: options of the request
OPTIONS = {
    "push": {"latest": (F.BOOL, False)},   # quorum: reply with the newest closed round
    "pull": {"final": (F.BOOL, False)},    # quorum: this worker is done; the final weights
}

# a REPLY's ``policy`` fields: quorum auto's record (server 0's final replies; the rule's
# ``record``, quorum_rules.py), at most MAX_CHANGES changes
MAX_CHANGES = 200
_SECONDS = (lambda v: F.is_number(v) and v >= 0, "a number of seconds >= 0")
_CHANGE = {"worker": (F.WORKER, True), "change": (F.one_of("out", "in"), True),
           "round": (F.STEP, True), "time": (_SECONDS, True), "lag": (_SECONDS, True),
           "rounds": (F.COUNT, True), "seconds": (_SECONDS, True),
           "bound": (_SECONDS, True)}
_WORKERS = (lambda v: isinstance(v, list) and len(v) <= F.MAX_RANK
            and all(F.int_in(0, F.MAX_RANK)(r) for r in v), "a list of worker ranks")
_CHANGES = (lambda v: isinstance(v, list) and len(v) <= MAX_CHANGES
            and all(isinstance(c, dict) for c in v),
            f"a list of at most {MAX_CHANGES} objects")
_RECORD = {"rule": (F.one_of("auto"), True), "rounds": (F.STEP, True),
           "excused": (_WORKERS, True), "changes": (_CHANGES, True), "dropped": (F.STEP, True)}
# ``joins``, ``leaves``: every join and departure the server decided, [[rank,
# from_step], ...] (docs/spec/membership.md rule 6: how the workers hear of a change
# before its step)
REPLY = {"quorum_auto": (F.OBJ, False), "joins": (F.CHANGES, False),
         "leaves": (F.CHANGES, False)}


def reply_fields(given):
    """The checked ``policy`` fields of a server's REPLY (None: it has none)."""
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise PolicyError(f"a REPLY's policy fields must be a JSON object, got "
                          f"{F.short(given)}")
    F.check_fields("a REPLY's policy fields", REPLY, given, PolicyError)
    record = given.get("quorum_auto")
    if record is not None:
        F.check_fields("quorum auto's record", _RECORD, record, PolicyError)
        for change in record["changes"]:
            F.check_fields("a change of quorum auto's record", _CHANGE, change, PolicyError)
    return given


# POLICY events: the hops (sender's role, receiver's role) each travels, and its fields
_WORKER_SERVER, _WORKER_SCHEDULER, _SCHEDULER_WORKER = (
    {("worker", "server")}, {("worker", "scheduler")}, {("scheduler", "worker")})
_MEMBERS = {"group": (GROUP_NUMBER, True), "members": (F.RANKS, True)}
EVENTS = {
    # quorum (docs/spec/quorum.md)
    "pause": (_WORKER_SERVER, {}),                 # a worker enters a barrier (rule 2a)
    "round": ({("server", "scheduler"), ("scheduler", "server")},   # server 0's decisions
              {"log": ((F.text(MAX_LOG), "a string of round decisions"), True),
               "first": (F.STEP, True)}),      # the number of its first (decision_log.py)
    # preduce (docs/spec/preduce.md)
    "ready": (_WORKER_SCHEDULER, {"final": (F.BOOL, False)}),   # my local step is done
    "group": (_SCHEDULER_WORKER, dict(_MEMBERS, repeat=(F.BOOL, False),    # average with
                                      final=(F.BOOL, False))),             # these members
    "average": (_WORKER_SERVER, _MEMBERS),         # my weights, for this group's average
}


def message(name, **fields):
    """The payload of event ``name`` (checked: a sender's mistake fails here, not there)."""
    payload = {"event": name, **fields}
    read(payload)
    return payload


def read(payload, hop=None):
    """(name, fields) of a POLICY payload; ``hop``: (sender's role, this node's role)."""
    name = payload.get("event")
    if not isinstance(name, str) or name not in EVENTS:
        raise PolicyError(f"unknown policy event {F.short(name)}; known: {', '.join(EVENTS)}")
    hops, table = EVENTS[name]
    if hop is not None and tuple(hop) not in hops:
        raise PolicyError(f"the policy event {name!r} does not go from a {hop[0]} to a "
                          f"{hop[1]}")
    fields = {k: v for k, v in payload.items() if k != "event"}
    F.check_fields(f"policy event {name!r}", table, fields, PolicyError)
    return name, fields


def options(request, given):
    """The checked ``policy`` options of a PUSH or PULL (``request``: 'push' or 'pull')."""
    F.check_fields(f"{request.upper()}'s policy options", OPTIONS[request], given, PolicyError)
    return given
