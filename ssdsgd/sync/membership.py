"""Which chunk each worker trains at each step when workers join or leave a lockstep job
(ssgd, ssd: every member pushes every step; docs/spec/membership.md, "The data").

Why not the scheduler's dealer (``kvstore/chunks.py``): it hands a chunk to whichever
worker asks first, so in a job where every member must push every step a fast worker can
take the budget's last chunk while a slow one gets none and the servers wait for it
forever (why dynamic data is refused with ``sync.quorum: all``). Here the chunks of a
step follow from the membership alone, which every worker knows before it makes that
step's batch: at step t the members M(t), in rank order, train the global chunks
G(t), G(t) + 1, ..., G(t) + |M(t)| - 1, where G(t) = the sum of |M(t')| over t' < t.
Global chunk g is chunk g mod per_epoch of epoch g // per_epoch (dynamic data's chunks,
docs/spec/dynamic_data.md rule 1), so an epoch is still one pass over the same samples
and the budget is the same number of global batches. With no change, worker r at step t
trains global chunk t N + r.

The job ends after the last step whose chunks all fit in the budget (at most |M| - 1
chunks are dropped, as static data drops an epoch's remainder). A pure function of the
changes: no messages.

A job resumed from a checkpoint at step t (rule 11) starts again with its first N
workers at t, the chunks before it being the checkpoint's G(t) (``start_step``,
``start_chunk``); its checkpoints are due where the chunks pass an epoch end, a step
every member computes alike (``checkpoint_due``).
"""


class Membership:
    """The job's workers over its steps: ``num_workers`` from step 0, then the joins and
    departures the servers decided (``join``/``leave`` with their first step)."""

    def __init__(self, num_workers, per_epoch, budget, start_step=0, start_chunk=0):
        self.first = list(range(num_workers))
        self.per_epoch, self.budget = per_epoch, budget
        self.start_step, self.start_chunk = start_step, start_chunk   # a resumed job's
        self.changes = {}      # rank -> (from_step of its join or 0, from_step of leaving)

    def join(self, rank, from_step):
        if rank in self.changes or rank < len(self.first):
            raise ValueError(f"worker {rank} is in the job already")
        if from_step < self.start_step:
            raise ValueError(f"worker {rank} joins at step {from_step}, before the resumed "
                             f"job's first step {self.start_step}")
        self.changes[rank] = (from_step, None)

    def leave(self, rank, from_step):
        start, _ = self.changes.get(rank, (0, None))
        self.changes[rank] = (start, from_step)

    def members(self, t):
        """M(t), in rank order."""
        ranks = set(self.first) | set(self.changes)
        return [r for r in sorted(ranks) if self._in(r, t)]

    def chief(self, t, removed=()):
        """The chief at step t (docs/spec/membership.md rule 8): the lowest rank in the
        job then, or of the last step that had members, but the ``removed`` ones (dead
        workers the servers dropped, cluster.on_worker_failure: continue, whose data may
        leave later, rule 10); worker 0 until it leaves or is removed."""
        while True:
            members = [r for r in self.members(t) if r not in removed]
            if members or t <= self.start_step:
                return members[0] if members else None
            t -= 1

    def _in(self, rank, t):
        start, end = self.changes.get(rank, (0, None))
        return start <= t and (end is None or t < end)

    def first_chunk(self, t):
        """G(t): the global chunks the steps before t trained (t >= the first step)."""
        edges = sorted({self.start_step, t} | {s for pair in self.changes.values()
                                               for s in pair if s is not None and s < t})
        return self.start_chunk + sum((b - a) * len(self.members(a))
                                      for a, b in zip(edges, edges[1:]))

    def checkpoint_due(self, t, every):
        """Is a checkpoint due once step t - 1 is done: do the chunks before t pass an
        end of every ``every``-th epoch that the chunks before t - 1 had not (the
        budget's end excepted: the job's last checkpoint is its own)?"""
        if t <= self.start_step or not every:
            return False
        span = self.per_epoch * every
        now = self.first_chunk(t)
        return now // span > self.first_chunk(t - 1) // span and now < self.budget

    def chunk(self, rank, t):
        """(epoch, chunk) worker ``rank`` trains at step t, or None: not a member then, or
        the step does not fit in the budget (the job is over)."""
        members = self.members(t)
        if rank not in members or t < self.start_step or t >= self.end():
            return None
        g = self.first_chunk(t) + members.index(rank)
        return divmod(g, self.per_epoch)

    def end(self):
        """The first step that is not trained: its chunks would pass the budget."""
        t, g = self.start_step, self.start_chunk
        edges = sorted({s for pair in self.changes.values() for s in pair
                        if s is not None and s > t})
        for edge in edges + [None]:
            size = len(self.members(t))
            span = None if edge is None else edge - t
            if size:
                fit = (self.budget - g) // size
                if span is None or fit < span:
                    return t + fit
            g += size * span
            t = edge
        raise AssertionError("unreachable")
