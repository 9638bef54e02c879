"""Workers that join a running job (docs/spec/membership.md): whether a joiner may come
in, and from which step. The mirror of ``removals.py``; the messages around it are
``join_wiring.py``.

The scheduler asks every server to hold: each answers the first step no push of any key
has reached, and applies nothing from that step on until it hears the decision. From
the largest answer H, ``boundary(H)`` (the stage rule's, ``ssdsgd.sync.stage.
join_boundary``, handed over by the node wiring: the transport names no algorithm) is
the step s from which every server waits for the joiner too and the joiner pushes: a
step after H, late enough that every worker hears of the join, in a reply sent after
its server admitted the joiner, before it makes its batch of step s. Because every
server held from its own answer, none has applied step s when the decision comes: the
join cannot land in the middle of a step some server already closed without it.

A pure decider: the scheduler sends the questions, the answers and the outcome; the
reasons a joiner is refused are one line each. The wiring is ``join_wiring.py``.
"""
from .. import fields as F

JOINS = F.JOINS     # a REPLY's ``policy`` field ``joins``


def joins_of(policy):
    """{rank: from_step} of a REPLY's ``policy`` meta (already checked to be an object),
    or {}; JoinError in one line if its ``joins`` is malformed."""
    if not policy or "joins" not in policy:
        return {}
    if not JOINS[0](policy["joins"]):
        raise JoinError(f"a REPLY's joins must be {JOINS[1]}, got {F.short(policy['joins'])}")
    return {rank: step for rank, step in policy["joins"]}


class JoinError(ValueError):
    """A join the job cannot take, or an answer to no question asked (one line)."""


def refusal(max_workers, in_job, ever, started, finished):
    """Why a worker may not join now, or None: ``in_job`` workers in the job now, ``ever``
    ranks handed out so far (a joiner takes the next: ranks are never reused), ``started``
    (every first node registered), ``finished`` (a worker already sent FINISH: the job is
    ending)."""
    if not started:
        return "the job has not started yet (a joiner comes once every first node registered)"
    if finished:
        return "the job is finishing (a worker already finished its part): nothing to join"
    if ever >= max_workers:
        return (f"the job takes at most cluster.max_workers = {max_workers} workers and has "
                f"had {ever} (a joiner takes a new rank; ranks are not reused)")
    return None


class Admissions:
    """The joins being decided: rank -> the servers still to answer and the largest step
    they named. ``boundary(step)``: the first step at or after ``step`` a worker may join
    at (the stage rule's)."""

    def __init__(self, boundary):
        self.boundary = boundary
        self.pending = {}

    def begin(self, rank, servers):
        """Worker ``rank`` registered to join; ``servers`` (the scheduler's connections)
        are asked to hold."""
        if rank in self.pending:
            raise JoinError(f"worker {rank} is joining already")
        self.pending[rank] = {"waiting": set(servers), "step": 0}

    def answer(self, server, meta):
        """Server ``server``'s JOIN answer ``{joined, next_step}``; the decision
        ``{joined, from_step}`` once every server has answered, else None."""
        join = self.pending.get(meta.get("joined"))
        if join is None or server not in join["waiting"] or "next_step" not in meta:
            raise JoinError("JOIN: not an answer to a join")
        join["waiting"].discard(server)
        join["step"] = max(join["step"], meta["next_step"])
        if join["waiting"]:
            return None
        del self.pending[meta["joined"]]
        return {"joined": meta["joined"], "from_step": self.boundary(join["step"])}

