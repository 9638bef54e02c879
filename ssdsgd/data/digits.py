"""The embedded default dataset: scikit-learn's 8x8 handwritten digits (1797 images).

A fixed, stratified 80/20 split (random_state 0): 1437 training and 360 test images,
shaped (1, 8, 8), scaled to [0, 1] and standardized with the training set's mean and
standard deviation. No augmentation (the images are too small for crops to help).

The images are read from the file scikit-learn ships (``sklearn/datasets/data/
digits.csv.gz``) and split with a numpy transcription of its ``train_test_split(...,
stratify=y)``, index for index the same. That spares sklearn.datasets and
sklearn.model_selection (0.5 s of CPU in a fresh process; in a worker, where MXNet's own
``mxnet/model.py`` has already imported scikit-learn's base and scipy, about 0.05-0.1 s).
"""
from __future__ import annotations

import gzip
import importlib.util
import math
from pathlib import Path

import numpy as np

from . import Dataset, DataError

N_TOTAL = 1797
N_TEST = 360
N_TRAIN = N_TOTAL - N_TEST


def load_digits():
    """(x, y): x float64 (1797, 64) pixels 0..16, y int64 -- scikit-learn's
    ``load_digits(return_X_y=True)``, read without importing scikit-learn."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the digits dataset needs scikit-learn installed (its data file)")
    path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1], data[:, -1].astype(np.int64)


def _approximate_mode(class_counts, n_draws, rng):
    """scikit-learn's ``utils._approximate_mode``: per-class draws summing to n_draws,
    ties in the left-over fractions broken by rng (the same calls, so the same split)."""
    continuous = class_counts / class_counts.sum() * n_draws
    floored = np.floor(continuous)
    need_to_add = int(n_draws - floored.sum())
    if need_to_add > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (inds,) = np.where(remainder == value)
            add_now = min(len(inds), need_to_add)
            floored[rng.choice(inds, size=add_now, replace=False)] += 1
            need_to_add -= add_now
            if need_to_add == 0:
                break
    return floored.astype(int)


def stratified_split(y, test_size, seed):
    """(train_idx, test_idx) exactly as ``train_test_split(..., test_size=test_size,
    random_state=seed, stratify=y)`` picks them (StratifiedShuffleSplit, scikit-learn
    1.3): test_size an int count or a float fraction (rounded up)."""
    n = len(y)
    n_test = math.ceil(test_size * n) if isinstance(test_size, float) else int(test_size)
    rng = np.random.RandomState(seed)
    _, y_idx = np.unique(y, return_inverse=True)
    counts = np.bincount(y_idx)
    by_class = np.split(np.argsort(y_idx, kind="mergesort"), np.cumsum(counts)[:-1])
    n_i = _approximate_mode(counts, n - n_test, rng)
    t_i = _approximate_mode(counts - n_i, n_test, rng)
    train, test = [], []
    for i, members in enumerate(by_class):
        perm = members.take(rng.permutation(counts[i]), mode="clip")
        train.extend(perm[:n_i[i]])
        test.extend(perm[n_i[i]:n_i[i] + t_i[i]])
    return rng.permutation(train), rng.permutation(test)


def load_split():
    """(x_train, y_train, x_test, y_test); x float32 (n, 1, 8, 8), y int64."""
    data, target = load_digits()
    x = (data.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    y = target.astype(np.int64)
    train, test = stratified_split(y, N_TEST, 0)
    x_tr, y_tr, x_te, y_te = x[train], y[train], x[test], y[test]
    mean, std = x_tr.mean(), x_tr.std()
    x_tr = (x_tr - mean) / std
    x_te = (x_te - mean) / std
    return x_tr, y_tr, x_te, y_te


class DigitsDataset(Dataset):
    name = "digits"
    num_classes = 10

    def __init__(self):
        self.x_train, self.y_train, self.x_test, self.y_test = load_split()
        self.n_train = len(self.y_train)
        self.n_val = len(self.y_test)
        assert self.n_train == N_TRAIN

    def train_batch(self, indices, rng):
        return self.x_train[indices], self.y_train[indices]

    def val_batches(self, batch_size):
        for i in range(0, self.n_val, batch_size):
            yield self.x_test[i:i + batch_size], self.y_test[i:i + batch_size]
