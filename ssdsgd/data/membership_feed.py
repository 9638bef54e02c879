"""One worker's batches in a job that workers may join (``cluster.max_workers`` above
the workers; docs/spec/membership.md rule 7): the chunk of each step follows from the
membership (``ssdsgd.sync.membership.Membership``), which every worker knows in time
from its servers' replies (``kv.joins_before``).

Chunk c of epoch e is dynamic data's (``data/dynamic.py``): the c-th batch of the
epoch's permutation, its augmentation a function of its place, so a chunk is the same
batch whichever worker trains it. With no join, worker r trains global chunk t N + r at
step t. The same interface as ``ChunkFeed`` (``epoch``, ``over``, ``plan``,
``position``, ``trained``), so the training program's loop takes either.
"""
from __future__ import annotations

from . import epoch_permutation
from .dynamic import ChunkFeed, chunk_rng
from ..sync.membership import Membership


class MembershipFeed(ChunkFeed):
    """``step()``: the worker's next step (the training program's ``run.step``);
    ``start_step``: a resumed job's first, with ``plan["start"]`` the chunks before it
    (docs/spec/membership.md rule 11)."""

    def __init__(self, kv, dataset, seed: int, batch_size: int, plan: dict, rank: int,
                 num_workers: int, step, start_step: int = 0):
        super().__init__(kv, dataset, seed, batch_size, plan)
        self.rank, self.step = rank, step
        self.members = Membership(num_workers, plan["per_epoch"], plan["budget"],
                                  start_step=start_step, start_chunk=plan["start"])

    def where(self, t: int):
        """(epoch, chunk) this worker trains at step t, or None: the job is over."""
        for rank, start in sorted(self.kv.joins_before(t).items()):
            if rank not in self.members.changes:
                self.members.join(rank, start)
        for rank, end in sorted(self.kv.leaves_before(t).items()):
            if self.members.changes.get(rank, (0, None))[1] is None:
                self.members.leave(rank, end)
        return self.members.chunk(self.rank, t)

    def left_at(self):
        """The step this worker left the job at, or None."""
        return self.members.changes.get(self.rank, (0, None))[1]

    def first_epoch(self) -> int:
        """The epoch of this worker's next step (a joiner's first)."""
        where = self.where(self.step())
        return self.plan["budget"] // self.plan["per_epoch"] if where is None else where[0]

    def epoch(self, epoch: int):
        """(batch number of this worker in the epoch, (data, label)) of every step whose
        chunk is in ``epoch``, until one is in a later epoch or the budget is spent."""
        perm = epoch_permutation(self.dataset.n_train, epoch, self.seed)
        b, batch = self.batch_size, 0
        while True:
            where = self.where(self.step())
            if where is None:
                left = self.left_at()
                self.over = "left" if left is not None and self.step() >= left else "budget"
                self.position = self.plan["budget"]
                return
            if where[0] != epoch:
                return
            chunk = where[1]
            idx = perm[chunk * b:(chunk + 1) * b]
            self._count(epoch, idx)
            self.position = self.members.first_chunk(self.step()) + len(
                self.members.members(self.step()))
            yield batch, self.dataset.train_batch(idx, chunk_rng(self.seed, epoch, chunk))
            batch += 1
