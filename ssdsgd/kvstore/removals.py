"""cluster.on_worker_failure: continue. Which step a dead worker leaves the job from: the
scheduler asks every server for the first step it has not received from that worker, and
the smallest answer, once every server has given one, is the step from which every server
aggregates without it. A pure decider: the scheduler sends the questions and the outcome."""


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
