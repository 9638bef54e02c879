"""cluster.on_worker_failure: continue. Which step a dead worker leaves the job from: the
scheduler asks every server for the first step it has not received from that worker, and
the smallest answer, once every server has given one, is the step from which every server
aggregates without it. A pure decider: the scheduler sends the questions and the outcome."""


def removal_refusal(rank, others, training, choice_pending=None, pushed=True):
    """Why the job cannot go on without dead worker ``rank``, or None. ``others``: the
    ranks of the other workers in the job (not leaving); ``training``: those of them that
    have not finished; ``choice_pending``: why worker ``rank`` may not go yet in this
    job's mode (the policy's ``not_yet_leaving``), or None; ``pushed``: has a heartbeat
    of worker 0 counted a push? A worker pushes only after its INITs were answered and
    (the Trainer's order) its optimizer reached every server, so before that worker 0's
    initial values and optimizer, which the others start from and wait for, may be
    missing on a server. Any rank may be removed, worker 0 too: the chief's part passes
    to the lowest rank left (docs/spec/membership.md rule 8)."""
    if not others:
        return "it was the last worker in the job (the job ends with it)"
    if rank == 0 and not pushed:
        return ("worker 0 died before its first push (the initial values and the optimizer "
                "it sends, which the others start from, may not have reached every server)")
    if not training and rank < min(others):
        return (f"every other worker has finished its part, so none is left to take the "
                f"chief's part from worker {rank} (the last validation and the summary)")
    if choice_pending:
        return f"worker {rank} cannot be removed yet: {choice_pending}"
    return None


class RemovalError(ValueError):
    """An answer that answers no question asked."""


class Removals:
    def __init__(self):
        self.pending = {}     # rank of a dead worker -> {"waiting": servers, "step": min}

    def begin(self, rank, servers):
        """Worker ``rank`` is dead; ``servers`` (the scheduler's connections) are asked."""
        self.pending[rank] = {"waiting": set(servers), "step": None}

    def forget(self, server):
        """Server ``server`` died (cluster.server_replicas: its backup, which saw the same
        pushes, answers for the keys it takes): no removal waits for it any more. The
        decisions that completes (removals some other server has answered)."""
        out = []
        for rank, removal in sorted(self.pending.items()):
            if server not in removal["waiting"]:
                continue                 # answered, or decided already
            removal["waiting"].discard(server)
            if not removal["waiting"] and removal["step"] is not None:
                out.append({"removed": rank, "from_step": removal["step"]})
        return out

    def answer(self, server, meta):
        """Server ``server``'s MEMBERSHIP answer ``{removed, next_step}``; the decision
        ``{removed, from_step}`` once every server has answered, else None."""
        removal = self.pending.get(meta["removed"])
        if removal is None or server not in removal["waiting"] or "next_step" not in meta:
            raise RemovalError("MEMBERSHIP: not an answer to a removal")
        removal["waiting"].discard(server)
        step = meta["next_step"]
        removal["step"] = step if removal["step"] is None else min(removal["step"], step)
        if removal["waiting"]:
            return None
        return {"removed": meta["removed"], "from_step": removal["step"]}
