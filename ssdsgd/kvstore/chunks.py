"""Dynamic data (docs/spec/dynamic_data.md): the scheduler hands each epoch's chunks to
whichever worker asks next, so a fast worker trains more of an epoch than a slow one and
every chunk of it is trained exactly once.

A chunk is one batch of the epoch's permutation (``ssdsgd.data.dynamic``): chunk c of
epoch e is the global chunk number g = e x per_epoch + c. The job's budget is a number
of global chunks (epochs x per_epoch, at most max_steps x N): once g reaches it, the job
is over for every worker. The dealer knows nothing of the data but these counts, which
every worker states in each request (the first fixes them; another value is refused:
the workers would disagree on what an epoch is).

A mid-epoch checkpoint (train.checkpoint_every_s, docs/spec/dynamic_data.md rule 7) is
a pause: worker 0's request asks for one when its clock says so; from then on every
request of the current epoch is answered ``over: pause`` with the cursor (``at``) and
nothing is handed out, so every worker stops after the chunks it has and meets the
others at the checkpoint's barrier, where the cursor is the data position. The
barrier's release (``release``) ends the pause.

A pure decider: ``deal(rank, meta)`` -> the answer's meta, or ``ChunkError`` (the
scheduler refuses the request with it, in one line).
"""


class ChunkError(ValueError):
    """A request the dealer cannot answer (the scheduler sends it back as an ERROR)."""


class Dealer:
    """The cursor of the job's data: the next global chunk to hand out."""

    def __init__(self):
        self.plan = None          # (per_epoch, budget, start) of the first request
        self.next = 0             # the next global chunk to hand out
        self.dealt = {}           # rank -> chunks handed to it (the job's figures)
        self.paused = False       # a mid-epoch checkpoint: nothing handed out until release
        self.holes = []           # a restarted scheduler's: dealt, lost, to deal again

    def deal(self, rank, meta):
        """The next chunk of ``meta['epoch']`` for worker ``rank``, or why there is none:
        ``over: epoch`` (that epoch's chunks are all handed out: the worker's epoch ends),
        ``over: budget`` (the job's are: its training ends) or ``over: pause`` with
        ``at``, the cursor (a checkpoint first; ``meta['pause']``: worker 0 asks for it)."""
        epoch = meta["epoch"]
        if meta.get("pause") and rank != 0:
            raise ChunkError(f"worker {rank} asked for a pause, but only worker 0 asks for a "
                             "pause (a mid-epoch checkpoint, by its clock)")
        per_epoch, budget = self._agree(meta)
        again = [g for g in self.holes if g // per_epoch == epoch]
        if again:      # lost with a scheduler that died: dealt again first, to an asker
            self.holes.remove(again[0])
            self.dealt[rank] = self.dealt.get(rank, 0) + 1
            return {"epoch": epoch, "chunk": again[0] - epoch * per_epoch}
        current = self.next // per_epoch
        if self.next >= budget:
            return {"epoch": epoch, "over": "budget"}
        if epoch < current:
            return {"epoch": epoch, "over": "epoch"}
        if epoch > current:
            raise ChunkError(f"worker {rank} asked for a chunk of epoch {epoch} while "
                             f"epoch {current} still has chunks (from chunk "
                             f"{self.next - current * per_epoch} of {per_epoch})")
        if meta.get("pause"):
            self.paused = True
        if self.paused:
            return {"epoch": epoch, "over": "pause", "at": self.next}
        chunk = self.next - epoch * per_epoch
        self.next += 1
        self.dealt[rank] = self.dealt.get(rank, 0) + 1
        return {"epoch": epoch, "chunk": chunk}

    def rebuild(self, reports, unknown=()):
        """A restarted scheduler's dealer, from each worker's report (rank -> its REJOIN's
        ``chunks``, ``chunk_record.py``; None: it asked for none): the cursor after the
        last chunk any worker got (at least a pause's), the chunks of an epoch a worker
        asks again for that no worker got (their answers were lost) to deal again first,
        and a pause kept. ``unknown``: workers that finished before and did not come
        back, whose chunks nobody reports. A line saying so, or None (no worker asked for
        a chunk yet); ChunkError if the reports cannot be a job's, or if chunks look lost
        that a finished worker may hold (the caller ends the job with it)."""
        reports = {r: c for r, c in reports.items() if c}
        if not reports:
            return None
        plans = {tuple(c["plan"]) for c in reports.values()}
        if len(plans) != 1:
            raise ChunkError(f"the workers report different data plans {sorted(plans)}")
        self.plan = plans.pop()
        per_epoch, _, start = self.plan
        got = sorted(g for c in reports.values() for g in c["got"])
        if len(set(got)) != len(got):
            raise ChunkError("two workers report the same chunk")
        pauses = {c["pause"] for c in reports.values() if c["pause"] is not None}
        self.next = max([start, *(g + 1 for g in got[-1:]), *pauses])
        self.paused = bool(pauses)
        self.dealt = {r: c["count"] for r, c in reports.items()}
        asking = [epoch for c in reports.values() for epoch in c["asking"]]
        newest = max((g // per_epoch for g in got), default=start // per_epoch)
        received, holes = set(got), []
        for epoch in sorted(set(asking)):
            if newest >= epoch + 2:      # the reports no longer list that epoch's chunks
                raise ChunkError(f"a worker still waits for a chunk of epoch {epoch}, and "
                                 f"another is in epoch {newest} already")
            holes += [g for g in range(max(start, epoch * per_epoch),
                                       min(self.next, (epoch + 1) * per_epoch))
                      if g not in received]
        if holes and unknown:
            raise ChunkError(f"chunks {holes} were handed out and no worker that came back "
                             f"got them, but worker(s) {sorted(unknown)} finished before "
                             "and may have: which were lost is not known")
        if len(holes) > len(asking):
            raise ChunkError(f"chunks {holes} were handed out and no worker got them, but "
                             f"only {len(asking)} worker(s) ask again")
        if holes and self.paused:
            raise ChunkError(f"chunks {holes} were handed out and lost before a pause")
        self.holes = holes
        return (f"the data's cursor rebuilt at chunk {self.next} from "
                f"{len(reports)} worker(s)' reports" + (f"; chunks {holes} were handed out "
                "and lost with the scheduler: dealt again" if holes else "")
                + ("; paused for a checkpoint" if self.paused else ""))

    def release(self):
        """A barrier was released: a pause (whose checkpoint's barrier it was) ends."""
        self.paused = False

    def _agree(self, meta):
        plan = tuple(meta.get(k) for k in ("per_epoch", "budget", "start"))
        if None in plan:
            raise ChunkError("a chunk request names per_epoch, budget and start")
        per_epoch, budget, start = plan
        if self.plan is None:
            if start > budget:
                raise ChunkError(f"a chunk request starts at chunk {start}, beyond its "
                                 f"budget of {budget}")
            self.plan, self.next = plan, start
        elif plan != self.plan:
            raise ChunkError(f"a chunk request's plan (per_epoch, budget, start) {plan} "
                             f"differs from the job's {self.plan}: the workers disagree "
                             "on the data")
        return per_epoch, budget
