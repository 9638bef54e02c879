"""Datasets for the training program, and the per-worker epoch shards.

Every dataset is a :class:`Dataset`: ``n_train`` training samples addressed by index,
``train_batch(indices, rng)`` returns one (augmented) batch as numpy arrays, and
``val_batches(batch_size)`` walks the whole validation set in order.

Sharding (:func:`shard_indices`): in epoch ``e`` every worker draws the same permutation
of the training set from ``seed + e``, keeps only the first
``steps * batch_size * num_workers`` indices (the remainder is dropped, so every worker
runs exactly ``steps`` steps and none is left waiting) and takes its own contiguous,
disjoint block of ``steps * batch_size`` of them.

Dynamic data (``data.assignment``, docs/spec/dynamic_data.md) hands the same
permutation's batches to whichever worker asks next instead: ``ssdsgd.data.dynamic``.

A missing or malformed data file raises :class:`DataError`, one line naming the file.
"""
from __future__ import annotations

import collections
import concurrent.futures
from typing import Iterator

import numpy as np

__all__ = ["DataError", "Dataset", "open_dataset", "steps_per_epoch", "count_train",
           "shard_indices", "epoch_permutation", "batch_rng", "Loader", "validate_data"]


class DataError(ValueError):
    """A data file is missing or malformed. The message is one line naming the file."""


class Dataset:
    """Interface of a dataset (see the module docstring)."""

    name = "dataset"
    num_classes = 10
    n_train = 0
    n_val = 0
    top_k = 1  # validation reports top-1, and top-k too when k > 1

    def train_batch(self, indices: np.ndarray, rng: np.random.Generator):
        """Return (data float32 NCHW, label int64) for the given training indices."""
        raise NotImplementedError

    def val_batches(self, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        raise NotImplementedError


def open_dataset(config) -> Dataset:
    """Open the dataset of ``config.data`` (raises DataError for bad files)."""
    d = config.data
    if d.dataset == "digits":
        from .digits import DigitsDataset
        ds = DigitsDataset()
    elif d.dataset == "cifar10":
        from .cifar10 import Cifar10Dataset
        ds = Cifar10Dataset(d.path, augment=d.augmentation)
    elif d.dataset == "imagenet":
        from .imagenet import ImageNetDataset
        ds = ImageNetDataset(d.path, augment=d.augmentation, crop_size=d.crop_size,
                             resize_size=d.resize_size, num_classes=d.num_classes)
    else:  # the config validation makes this unreachable
        raise DataError(f"data.dataset: unknown dataset {d.dataset!r}")
    if d.num_classes is not None and d.dataset != "imagenet":
        ds.num_classes = d.num_classes
    return ds


def count_train(config) -> int:
    """Number of training samples, cheaply (file sizes, index lengths; no decoding)."""
    d = config.data
    if d.dataset == "digits":
        from .digits import N_TRAIN
        return N_TRAIN
    if d.dataset == "cifar10":
        from .cifar10 import count_records
        return count_records(d.path)
    if d.dataset == "imagenet":
        from .imagenet import count_records
        return count_records(d.path)
    raise DataError(f"data.dataset: unknown dataset {d.dataset!r}")


def steps_per_epoch(config, num_workers: int, n_train: int | None = None) -> int:
    """Steps every worker runs per epoch: n_train // (num_workers * batch_size)."""
    n = count_train(config) if n_train is None else n_train
    per_step = num_workers * config.data.batch_size
    if n < per_step:
        raise DataError(f"data.batch_size: {num_workers} worker(s) x batch "
                        f"{config.data.batch_size} = {per_step} exceeds the {n} training "
                        "samples; not even one step per epoch")
    return n // per_step


def validate_data(config) -> None:
    """Open the data once (checks files, sizes and a first record); raise DataError."""
    open_dataset(config)
    steps_per_epoch(config, config.cluster.workers)


def epoch_permutation(n: int, epoch: int, seed: int) -> np.ndarray:
    """The order of the training set in ``epoch``, the same on every worker: static
    shards are blocks of it, dynamic chunks (ssdsgd.data.dynamic) its batches."""
    return np.random.RandomState((seed + epoch) % 2**32).permutation(n)


def shard_indices(n: int, epoch: int, seed: int, rank: int, num_workers: int,
                  batch_size: int) -> np.ndarray:
    """This worker's training indices for ``epoch``, shaped (steps, batch_size)."""
    if not 0 <= rank < num_workers:
        raise ValueError(f"rank {rank} not in [0, {num_workers})")
    steps = n // (num_workers * batch_size)
    perm = epoch_permutation(n, epoch, seed)
    block = steps * batch_size
    return perm[rank * block:(rank + 1) * block].reshape(steps, batch_size)


def batch_rng(seed: int, epoch: int, rank: int, step: int) -> np.random.Generator:
    """The augmentation RNG of one batch: a pure function of its position, so a run is
    deterministic whatever the loader threads' timing."""
    return np.random.default_rng([seed, epoch, rank, step])


class Loader:
    """Prepares one worker's batches of an epoch, in order, ``threads`` at a time.

    ``for step, (data, label) in Loader(ds, seed, threads).epoch(epoch, rank, N, bs)``.
    With threads = 0 batches are made in the calling thread.
    """

    def __init__(self, dataset: Dataset, seed: int, threads: int = 2):
        self.dataset = dataset
        self.seed = seed
        self.threads = threads
        self._pool = (concurrent.futures.ThreadPoolExecutor(threads, "ssdsgd-loader")
                      if threads > 0 else None)

    def _make(self, idx, epoch, rank, step):
        return self.dataset.train_batch(idx, batch_rng(self.seed, epoch, rank, step))

    def epoch(self, epoch: int, rank: int, num_workers: int, batch_size: int,
              start_step: int = 0):
        shards = shard_indices(self.dataset.n_train, epoch, self.seed, rank, num_workers,
                               batch_size)
        steps = range(start_step, len(shards))
        if self._pool is None:
            for s in steps:
                yield s, self._make(shards[s], epoch, rank, s)
            return
        window = collections.deque()
        it = iter(steps)
        for s in it:
            window.append((s, self._pool.submit(self._make, shards[s], epoch, rank, s)))
            if len(window) >= 2 * self.threads:
                break
        while window:
            s, fut = window.popleft()
            nxt = next(it, None)
            if nxt is not None:
                window.append((nxt, self._pool.submit(self._make, shards[nxt], epoch, rank,
                                                      nxt)))
            yield s, fut.result()

    def close(self):
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
