"""CIFAR-10 in its binary format (https://www.cs.toronto.edu/~kriz/cifar.html).

``data.path`` is the directory holding ``data_batch_1.bin`` .. ``data_batch_5.bin`` and
``test_batch.bin`` (or the ``cifar-10-batches-bin`` directory inside it, as the tarball
unpacks). Each record is 1 label byte (0-9) and 3072 pixel bytes: the 1024 red, then
green, then blue values of a 32x32 image, rows first (CHW).

Training augmentation (the usual ResNet-on-CIFAR recipe): zero-pad 4 pixels, random
32x32 crop, random horizontal flip; every image is normalized with the CIFAR-10 mean and
standard deviation (the values gluoncv's CIFAR scripts use).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from . import DataError, Dataset

RECORD = 1 + 3 * 32 * 32
TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
TEST_FILE = "test_batch.bin"
MEAN = np.array([0.4914, 0.4822, 0.4465], np.float32).reshape(1, 3, 1, 1)
STD = np.array([0.2023, 0.1994, 0.2010], np.float32).reshape(1, 3, 1, 1)
PAD = 4


def find_dir(path) -> Path:
    """The directory that holds the .bin files (``path`` or its cifar-10-batches-bin)."""
    root = Path(path)
    if not root.is_dir():
        raise DataError(f"{root}: CIFAR-10 data directory not found (data.path)")
    sub = root / "cifar-10-batches-bin"
    if not (root / TEST_FILE).exists() and sub.is_dir():
        return sub
    return root


def _check(file: Path) -> int:
    """Number of records in ``file``; DataError if missing or of the wrong size."""
    try:
        size = file.stat().st_size
    except FileNotFoundError:
        raise DataError(f"{file}: missing CIFAR-10 file (expected {', '.join(TRAIN_FILES)} "
                        f"and {TEST_FILE} in {file.parent})") from None
    if size == 0 or size % RECORD:
        raise DataError(f"{file}: size {size} bytes is not a positive multiple of the "
                        f"{RECORD}-byte CIFAR-10 record (1 label byte + 3072 pixel bytes)")
    return size // RECORD


def count_records(path) -> int:
    """Number of training records, from the file sizes alone."""
    root = find_dir(path)
    counts = [_check(root / f) for f in TRAIN_FILES]
    _check(root / TEST_FILE)
    return sum(counts)


def read_file(file: Path) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 (n, 3, 32, 32), labels int64 (n,)) of one .bin file."""
    n = _check(file)
    raw = np.fromfile(file, dtype=np.uint8)
    if raw.size != n * RECORD:  # changed under us
        raise DataError(f"{file}: short read ({raw.size} of {n * RECORD} bytes)")
    raw = raw.reshape(n, RECORD)
    labels = raw[:, 0].astype(np.int64)
    bad = np.flatnonzero(labels > 9)
    if bad.size:
        raise DataError(f"{file}: record {bad[0]} has label {labels[bad[0]]}, expected 0-9 "
                        "(not a CIFAR-10 binary file?)")
    return raw[:, 1:].reshape(n, 3, 32, 32), labels


def normalize(images_u8: np.ndarray) -> np.ndarray:
    return (images_u8.astype(np.float32) / 255.0 - MEAN) / STD


def augment(images_u8: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Pad 4 + random 32x32 crop + random horizontal flip, then normalize."""
    n = len(images_u8)
    x = normalize(images_u8)
    padded = np.zeros((n, 3, 32 + 2 * PAD, 32 + 2 * PAD), np.float32)
    padded[:, :, PAD:PAD + 32, PAD:PAD + 32] = x
    offsets = rng.integers(0, 2 * PAD + 1, size=(n, 2))
    flips = rng.random(n) < 0.5
    out = np.empty_like(x)
    for i in range(n):
        dy, dx = offsets[i]
        crop = padded[i, :, dy:dy + 32, dx:dx + 32]
        out[i] = crop[:, :, ::-1] if flips[i] else crop
    return out


class Cifar10Dataset(Dataset):
    name = "cifar10"
    num_classes = 10

    def __init__(self, path, augment: bool = True):
        root = find_dir(path)
        for f in (*TRAIN_FILES, TEST_FILE):  # fail on any bad file before reading a byte
            _check(root / f)
        parts = [read_file(root / f) for f in TRAIN_FILES]
        self.x_train = np.concatenate([p[0] for p in parts])
        self.y_train = np.concatenate([p[1] for p in parts])
        self.x_test, self.y_test = read_file(root / TEST_FILE)
        self.n_train, self.n_val = len(self.y_train), len(self.y_test)
        self.augment = augment
        self.root = root

    def train_batch(self, indices, rng):
        imgs = self.x_train[indices]
        x = augment(imgs, rng) if self.augment else normalize(imgs)
        return x, self.y_train[indices]

    def val_batches(self, batch_size):
        for i in range(0, self.n_val, batch_size):
            yield normalize(self.x_test[i:i + batch_size]), self.y_test[i:i + batch_size]


def write_bin(file: os.PathLike, images_u8: np.ndarray, labels) -> None:
    """Write images (n, 3, 32, 32) uint8 and labels in the CIFAR-10 binary format."""
    images_u8 = np.asarray(images_u8, np.uint8).reshape(len(labels), -1)
    rec = np.concatenate([np.asarray(labels, np.uint8).reshape(-1, 1), images_u8], axis=1)
    rec.tofile(file)
