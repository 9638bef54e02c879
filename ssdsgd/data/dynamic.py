"""Dynamic data (``data.assignment``, docs/spec/dynamic_data.md): one worker's batches
when the scheduler hands each epoch's chunks to whichever worker asks next.

Chunk c of epoch e is the c-th batch of the epoch's permutation (the one static shards
are cut from): ``epoch_permutation(n, e, seed)[c * b:(c + 1) * b]``. An epoch has
``per_epoch`` = steps per epoch x N chunks, the samples the static shards of all N
workers hold (the same remainder is dropped), so an epoch is one pass over the same
samples whichever worker trains them. The job's budget is steps x N chunks: the global
batches the lr schedule counts.

A worker asks for its next chunk as soon as it has one (``ChunkFeed.epoch``), so the
answer travels while the step trains: only the batch itself is made on the step's path.
What it trained is counted per epoch (``trained``), for its end record: the tests check
from them that every sample of an epoch was trained exactly once.
"""
from __future__ import annotations

import numpy as np

from . import epoch_permutation


def chunk_rng(seed: int, epoch: int, chunk: int) -> np.random.Generator:
    """The augmentation RNG of one chunk: a pure function of its place in the epoch,
    whichever worker trains it."""
    return np.random.default_rng([seed, epoch, chunk])


def chunk_plan(per_epoch: int, total_steps: int, num_workers: int, start: int) -> dict:
    """What every chunk request states (kvstore/chunks.py): chunks per epoch, the job's
    budget in chunks, and the global chunk the run started at (a resumed run's cursor)."""
    return {"per_epoch": per_epoch, "budget": total_steps * num_workers, "start": start}


class ChunkFeed:
    """One worker's batches under dynamic data, from the scheduler's chunks (``kv``:
    the ssd_sync store: ``ask_chunk`` / ``take_chunk``). A mid-epoch checkpoint
    (docs/spec/dynamic_data.md rule 7): ``pause_due()`` (worker 0's clock) makes a
    request ask the dealer to pause; at a pause, ``on_pause(cursor)`` takes the
    checkpoint between two batches, and the epoch goes on."""

    def __init__(self, kv, dataset, seed: int, batch_size: int, plan: dict,
                 pause_due=None, on_pause=None):
        self.kv, self.dataset, self.seed, self.batch_size = kv, dataset, seed, batch_size
        self.plan = plan
        self.pause_due, self.on_pause = pause_due or (lambda: False), on_pause
        self.over = None          # "budget" once the job's chunks are all handed out
        self.position = plan["start"]     # 1 + the global number of the last chunk taken
        self.trained = {}         # epoch -> {batches, samples, index_sum, index_sq}

    def epoch(self, epoch: int):
        """(batch number of this worker in the epoch, (data, label)) for every chunk of
        ``epoch`` it is handed, until the epoch's (or the job's) chunks are gone."""
        perm = epoch_permutation(self.dataset.n_train, epoch, self.seed)
        b = self.batch_size
        fut = self._ask(epoch)
        batch = 0
        while True:
            chunk, over = self.kv.take_chunk(fut, epoch, self.plan["per_epoch"])
            if over == "pause":             # every worker stops here: a checkpoint
                if self.on_pause is None:
                    raise ValueError("the dealer paused a worker that takes no checkpoint")
                self.on_pause(chunk)
                fut = self._ask(epoch)
                continue
            if chunk is None:
                if over == "budget":        # every chunk of the job is handed out
                    self.over, self.position = over, self.plan["budget"]
                return
            fut = self._ask(epoch)          # the next, while this trains
            idx = perm[chunk * b:(chunk + 1) * b]
            self._count(epoch, idx)
            self.position = epoch * self.plan["per_epoch"] + chunk + 1
            yield batch, self.dataset.train_batch(idx, chunk_rng(self.seed, epoch, chunk))
            batch += 1

    def _ask(self, epoch):
        return self.kv.ask_chunk(epoch, self.plan, pause=True) if self.pause_due() else \
            self.kv.ask_chunk(epoch, self.plan)

    def _count(self, epoch, idx):
        t = self.trained.setdefault(epoch, {"batches": 0, "samples": 0, "index_sum": 0,
                                            "index_sq": 0})
        t["batches"] += 1
        t["samples"] += len(idx)
        t["index_sum"] += int(idx.sum())
        t["index_sq"] += int((idx.astype(np.int64) ** 2).sum())
