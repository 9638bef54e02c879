"""Dynamic data (``data.assignment``, docs/spec/dynamic_data.md): one worker's batches
when the scheduler hands each epoch's chunks to whichever worker asks next.

Chunk c of epoch e is the c-th batch of the epoch's permutation (the one static shards
are cut from): ``epoch_permutation(n, e, seed)[c * b:(c + 1) * b]``. An epoch has
``per_epoch`` = steps per epoch x N chunks, the samples the static shards of all N
workers hold (the same remainder is dropped), so an epoch is one pass over the same
samples whichever worker trains them. The job's budget is steps x N chunks: the global
batches the lr schedule counts.

A worker keeps ``CHUNKS_IN_FLIGHT`` requests in flight (``ChunkFeed.epoch``), so the
answers travel while the steps train: only the batch itself is made on the step's path.
One in flight was not enough: with steps as short as a round trip the answer was not in
yet for a quarter of the steps (docs/benchmarks/heterogeneity.md).
What it trained is counted per epoch (``trained``), for its end record: the tests check
from them that every sample of an epoch was trained exactly once.

Each wait for an answer is the timeline's span ``data`` (ssdsgd/timeline.py), on the
training thread between two steps (inside the ``compute`` span of the next step, if any),
with ``first`` 1 for an epoch's first answer (asked with nothing in flight) and 0 for
the others: the report sums them per worker (ssdsgd/timeline_merge.py).
"""
from __future__ import annotations

import collections

import numpy as np

from . import epoch_permutation
from ..timeline import RECORDER as TIMELINE, now

#: CHUNK requests a worker keeps in flight while it trains: the dealer answers each with
#: one chunk, in the order they arrive, so a worker holds at most this many chunks
#: beside the one it trains.
CHUNKS_IN_FLIGHT = 2


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
        ``epoch`` it is handed, until the epoch's (or the job's) chunks are gone. The
        answers come in the order asked: once one says there is no more, the requests
        still in flight are answered too (the same, or a chunk dealt again after a
        restarted scheduler, which is trained) before the epoch ends; once one says
        pause, every later one does (they reached the dealer before this worker's
        checkpoint barrier, which ends the pause)."""
        perm = epoch_permutation(self.dataset.n_train, epoch, self.seed)
        b, per_epoch = self.batch_size, self.plan["per_epoch"]
        asked, more, batch, first = collections.deque(), True, 0, True
        while True:
            while more and len(asked) < CHUNKS_IN_FLIGHT:
                asked.append(self._ask(epoch))
            if not asked:
                return
            chunk, over = self._take(asked.popleft(), epoch, per_epoch, first)
            first = False
            if over == "pause":             # every worker stops here: a checkpoint
                if self.on_pause is None:
                    raise ValueError("the dealer paused a worker that takes no checkpoint")
                while asked:
                    later, why = self._take(asked.popleft(), epoch, per_epoch, False)
                    if why != "pause":
                        raise RuntimeError(f"the scheduler answered {later, why} after a "
                                           f"pause at chunk {chunk} of epoch {epoch}")
                self.on_pause(chunk)
                continue
            if chunk is None:
                more = False
                if over == "budget":        # every chunk of the job is handed out
                    self.over, self.position = over, self.plan["budget"]
                continue
            idx = perm[chunk * b:(chunk + 1) * b]
            self._count(epoch, idx)
            self.position = epoch * per_epoch + chunk + 1
            if more:                        # the next, while this trains
                asked.append(self._ask(epoch))
            yield batch, self.dataset.train_batch(idx, chunk_rng(self.seed, epoch, chunk))
            batch += 1

    def _ask(self, epoch):
        return self.kv.ask_chunk(epoch, self.plan, pause=True) if self.pause_due() else \
            self.kv.ask_chunk(epoch, self.plan)

    def _take(self, asked, epoch, per_epoch, first):
        """``take_chunk``, timed as the span ``data`` while the timeline records (the
        module's doc); an attribute check while it does not."""
        if not TIMELINE.on:
            return self.kv.take_chunk(asked, epoch, per_epoch)
        t0 = now()
        try:
            return self.kv.take_chunk(asked, epoch, per_epoch)
        finally:
            TIMELINE.span("data", t0, key="first", value=int(first))

    def _count(self, epoch, idx):
        t = self.trained.setdefault(epoch, {"batches": 0, "samples": 0, "index_sum": 0,
                                            "index_sq": 0})
        t["batches"] += 1
        t["samples"] += len(idx)
        t["index_sum"] += int(idx.sum())
        t["index_sq"] += int((idx.astype(np.int64) ** 2).sum())
