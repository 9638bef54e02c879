"""The embedded default dataset: scikit-learn's 8x8 handwritten digits (1797 images).

A fixed, stratified 80/20 split (random_state 0): 1437 training and 360 test images,
shaped (1, 8, 8), scaled to [0, 1] and standardized with the training set's mean and
standard deviation. No augmentation (the images are too small for crops to help).
"""
from __future__ import annotations

import numpy as np

from . import Dataset

N_TOTAL = 1797
N_TEST = 360
N_TRAIN = N_TOTAL - N_TEST


def load_split():
    """(x_train, y_train, x_test, y_test); x float32 (n, 1, 8, 8), y int64."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    digits = load_digits()
    x = (digits.data.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    y = digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=N_TEST, random_state=0,
                                              stratify=y)
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
