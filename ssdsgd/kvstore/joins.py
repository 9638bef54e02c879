"""Workers that join a running job, or leave it, at a step every worker hears of in time
(docs/spec/membership.md): whether a joiner may come in or a worker go, and from which
step. The mirror of ``removals.py`` (a dead worker's removal, decided after the fact);
the messages around it are ``join_wiring.py``.

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

def joins_of(policy, field="joins"):
    """{rank: from_step} of a REPLY's ``policy`` meta (already checked to be an object)
    ``field`` (``joins`` or ``leaves``), or {}; JoinError in one line if it is malformed."""
    if not policy or field not in policy:
        return {}
    if not F.CHANGES[0](policy[field]):
        raise JoinError(f"a REPLY's {field} must be {F.CHANGES[1]}, got "
                        f"{F.short(policy[field])}")
    return {rank: step for rank, step in policy[field]}


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


def leave_refusal(rank, members, leaving, finished, choice_pending=None):
    """Why worker ``rank`` may not leave now, or None: ``members`` the ranks of the
    workers in the job now, ``leaving`` those whose departure is being decided or was
    decided, ``finished`` (a worker still in the job already sent FINISH: it is ending),
    ``choice_pending`` why worker 0 may not go yet (ssd's knobs at auto are worker 0's
    choice, agreed at the end of the warm-up), or None. Any worker may leave, worker 0
    too: the chief's duties pass to the lowest rank still in the job
    (docs/spec/membership.md rule 8)."""
    if rank not in members:
        return f"worker {rank} is not in the job (it never joined, left, or finished)"
    if rank in leaving:
        return f"worker {rank} is leaving already"
    if finished:
        return "the job is finishing (a worker already finished its part): nothing to leave"
    if not set(members) - set(leaving) - {rank}:
        return f"worker {rank} is the last worker in the job (the job ends with it)"
    if rank == 0 and choice_pending:
        return f"worker 0 cannot leave yet: {choice_pending}"
    return None


# what a decider says of its changes: the message kind, the noun, the participle
_WORDS = {"joined": ("JOIN", "join", "joining"), "leaving": ("LEAVE", "departure", "leaving")}


class Admissions:
    """The joins (``field`` ``joined``) or departures (``leaving``) being decided: rank ->
    the servers still to answer and the largest step they named. ``boundary(step)``: the
    first step at or after ``step`` a worker may join or leave at (the stage rule's: a
    departure, like a join, must be heard of by every worker before the batch of its
    step, docs/spec/membership.md rule 6), or None while it cannot be known yet (ssd's k,
    agreed by the workers at the end of the warm-up): then the change waits, every server
    holding, until ``settle`` finds its step."""

    def __init__(self, boundary, field="joined"):
        self.boundary, self.field = boundary, field
        self.pending = {}
        self._kind, self._noun, self._doing = _WORDS[field]

    def answered(self, rank) -> bool:
        """Has every server answered the change of worker ``rank`` still pending (so it
        waits for its step to be known)?"""
        change = self.pending.get(rank)
        return change is not None and not change["waiting"]

    def settle(self):
        """The decisions of the changes every server answered whose step can be known now
        (after an agreement), in rank order."""
        out = []
        for rank in sorted(r for r in self.pending if self.answered(r)):
            decision = self._decision(rank, self.pending[rank]["step"])
            if decision is not None:
                out.append(decision)
        return out

    def _decision(self, rank, step):
        from_step = self.boundary(step)
        if from_step is None:
            return None
        del self.pending[rank]
        return {self.field: rank, "from_step": from_step}

    def begin(self, rank, servers):
        """Worker ``rank`` asked to join or leave; ``servers`` (the scheduler's
        connections) are asked to hold."""
        if rank in self.pending:
            raise JoinError(f"worker {rank} is {self._doing} already")
        self.pending[rank] = {"waiting": set(servers), "step": 0}

    def forget(self, server):
        """Server ``server`` died (cluster.server_replicas: its backup, which saw the same
        pushes, answers for the keys it takes): no change waits for it any more. The
        decisions that completes, in rank order."""
        for change in self.pending.values():
            change["waiting"].discard(server)
        return self.settle()

    def answer(self, server, meta):
        """Server ``server``'s answer ``{joined | leaving, next_step}``; the decision
        ``{joined | leaving, from_step}`` once every server has answered, else None."""
        change = self.pending.get(meta.get(self.field))
        if change is None or server not in change["waiting"] or "next_step" not in meta:
            raise JoinError(f"{self._kind}: not an answer to a {self._noun}")
        change["waiting"].discard(server)
        change["step"] = max(change["step"], meta["next_step"])
        if change["waiting"]:
            return None
        return self._decision(meta[self.field], change["step"])

