"""ImageNet (or any image-classification set) as RecordIO files made by MXNet's im2rec.

``data.path`` holds ``train.rec`` + ``train.idx`` and ``val.rec`` + ``val.idx``. Records
are read with ``mx.recordio.MXIndexedRecordIO`` (one reader per loader thread: a reader
is not thread-safe) and decoded with OpenCV; the label is the record header's (first)
label.

Training augmentation (the usual ResNet recipe): random resized crop to ``crop_size``
(area 8%-100%, aspect ratio 3/4-4/3), random horizontal flip. Validation: resize the
shorter side to ``resize_size`` (default round(crop_size / 0.875), i.e. 256 for 224) and
center-crop ``crop_size``. Both normalize with the ImageNet mean and standard deviation.
"""
from __future__ import annotations

import math
import threading
from pathlib import Path

import cv2
import numpy as np

from . import DataError, Dataset

MEAN = np.array([0.485, 0.456, 0.406], np.float32) * 255
STD = np.array([0.229, 0.224, 0.225], np.float32) * 255


def _pair(root: Path, split: str) -> tuple[Path, Path]:
    rec, idx = root / f"{split}.rec", root / f"{split}.idx"
    if not rec.is_file():
        raise DataError(f"{rec}: missing RecordIO file (data.path must hold train.rec/.idx "
                        "and val.rec/.idx, as made by im2rec)")
    if not idx.is_file():
        raise DataError(f"{idx}: missing index for {rec.name} (make it with im2rec, or "
                        "MXIndexedRecordIO when writing)")
    return rec, idx


def read_index(idx: Path, rec: Path) -> list[int]:
    """The record keys listed in ``idx``, checked against the size of ``rec``."""
    size = rec.stat().st_size
    keys = []
    with open(idx) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.split("\t")
            try:
                key, pos = int(parts[0]), int(parts[1])
            except (ValueError, IndexError):
                raise DataError(f"{idx}: line {lineno} is not 'key<TAB>offset': "
                                f"{line.strip()[:40]!r}") from None
            if not 0 <= pos < size:
                raise DataError(f"{idx}: line {lineno}: offset {pos} is outside "
                                f"{rec.name} ({size} bytes); index and record file differ")
            keys.append(key)
    if not keys:
        raise DataError(f"{idx}: empty index (no records)")
    return keys


def count_records(path) -> int:
    root = Path(path)
    if not root.is_dir():
        raise DataError(f"{root}: ImageNet data directory not found (data.path)")
    rec, idx = _pair(root, "train")
    _pair(root, "val")
    return len(read_index(idx, rec))


def random_resized_crop(img: np.ndarray, size: int, rng: np.random.Generator,
                        scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> np.ndarray:
    h, w = img.shape[:2]
    area = h * w
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        cw = int(round(math.sqrt(target * aspect)))
        ch = int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            y = int(rng.integers(0, h - ch + 1))
            x = int(rng.integers(0, w - cw + 1))
            return cv2.resize(img[y:y + ch, x:x + cw], (size, size),
                              interpolation=cv2.INTER_LINEAR)
    return center_crop(resize_short(img, size), size)  # fallback, as torchvision does


def resize_short(img: np.ndarray, size: int) -> np.ndarray:
    h, w = img.shape[:2]
    if h < w:
        nh, nw = size, max(size, int(round(w * size / h)))
    else:
        nw, nh = size, max(size, int(round(h * size / w)))
    return cv2.resize(img, (nw, nh), interpolation=cv2.INTER_LINEAR)


def center_crop(img: np.ndarray, size: int) -> np.ndarray:
    h, w = img.shape[:2]
    y, x = (h - size) // 2, (w - size) // 2
    return img[y:y + size, x:x + size]


def to_chw(img_rgb: np.ndarray) -> np.ndarray:
    return ((img_rgb.astype(np.float32) - MEAN) / STD).transpose(2, 0, 1)


class RecordFile:
    """An indexed .rec file, read through one MXIndexedRecordIO per thread."""

    def __init__(self, rec: Path, idx: Path):
        self.rec, self.idx = rec, idx
        self.keys = read_index(idx, rec)
        self._local = threading.local()
        self._readers = []
        self._lock = threading.Lock()

    def _reader(self):
        r = getattr(self._local, "reader", None)
        if r is None:
            import mxnet as mx
            try:
                r = mx.recordio.MXIndexedRecordIO(str(self.idx), str(self.rec), "r")
            except Exception as exc:  # noqa: BLE001 - re-raised as one line
                raise DataError(f"{self.idx}: cannot open with {self.rec.name} "
                                f"({str(exc).strip().splitlines()[-1]})") from None
            self._local.reader = r
            with self._lock:
                self._readers.append(r)
        return r

    def read(self, i: int) -> tuple[np.ndarray, int]:
        """Decode record number ``i`` (0-based position in the index): (RGB HWC, label)."""
        import mxnet as mx
        key = self.keys[i]
        try:
            header, payload = mx.recordio.unpack(self._reader().read_idx(key))
        except DataError:
            raise
        except Exception as exc:  # noqa: BLE001 - MXNetError carries a C++ traceback
            last = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
            raise DataError(f"{self.rec}: corrupt record {key} "
                            f"({last[-1].strip() if last else type(exc).__name__})") from None
        img = cv2.imdecode(np.frombuffer(payload, np.uint8), cv2.IMREAD_COLOR)
        if img is None:
            raise DataError(f"{self.rec}: record {key} does not hold a decodable image")
        label = header.label
        label = int(label if np.isscalar(label) else np.asarray(label).ravel()[0])
        return cv2.cvtColor(img, cv2.COLOR_BGR2RGB), label

    def close(self):
        with self._lock:
            for r in self._readers:
                r.close()
            self._readers.clear()


class ImageNetDataset(Dataset):
    name = "imagenet"
    top_k = 5

    def __init__(self, path, augment: bool = True, crop_size: int = 224,
                 resize_size: int | None = None, num_classes: int | None = None):
        root = Path(path)
        if not root.is_dir():
            raise DataError(f"{root}: ImageNet data directory not found (data.path)")
        self.train = RecordFile(*_pair(root, "train"))
        self.val = RecordFile(*_pair(root, "val"))
        self.n_train, self.n_val = len(self.train.keys), len(self.val.keys)
        self.augment = augment
        self.crop_size = crop_size
        self.resize_size = resize_size or int(round(crop_size / 0.875))
        if self.resize_size < crop_size:
            raise DataError(f"data.resize_size: {self.resize_size} is smaller than "
                            f"data.crop_size {crop_size}")
        self.num_classes = num_classes or 1000
        self.top_k = 5 if self.num_classes > 5 else 1
        for rf in (self.train, self.val):  # catch a wrong file early: decode one record
            _, label = rf.read(0)
            if not 0 <= label < self.num_classes:
                raise DataError(f"{rf.rec}: record {rf.keys[0]} has label {label}, expected "
                                f"0-{self.num_classes - 1} (set data.num_classes?)")

    def _train_one(self, i, rng):
        img, label = self.train.read(int(i))
        if self.augment:
            img = random_resized_crop(img, self.crop_size, rng)
            if rng.random() < 0.5:
                img = img[:, ::-1]
        else:
            img = center_crop(resize_short(img, self.resize_size), self.crop_size)
        return to_chw(img), label

    def train_batch(self, indices, rng):
        out = [self._train_one(i, rng) for i in indices]
        return np.stack([o[0] for o in out]), np.array([o[1] for o in out], np.int64)

    def val_batches(self, batch_size):
        for start in range(0, self.n_val, batch_size):
            xs, ys = [], []
            for i in range(start, min(start + batch_size, self.n_val)):
                img, label = self.val.read(i)
                xs.append(to_chw(center_crop(resize_short(img, self.resize_size),
                                             self.crop_size)))
                ys.append(label)
            yield np.stack(xs), np.array(ys, np.int64)
