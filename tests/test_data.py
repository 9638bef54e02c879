"""ssdsgd.data: shards, loader determinism, and the readers on small real-format files."""
import os
from pathlib import Path

import mxnet as mx
import numpy as np
import pytest

from ssdsgd.config import parse_config
from ssdsgd.data import (DataError, Loader, count_train, open_dataset, shard_indices,
                         steps_per_epoch, validate_data)
from ssdsgd.data import cifar10, imagenet
from ssdsgd.data.digits import DigitsDataset, N_TEST, N_TRAIN


def one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg, msg
    return msg


# ----------------------------------------------------------------------------- shards

@pytest.mark.parametrize("n, workers, batch", [(1437, 2, 32), (100, 3, 7), (50, 1, 50)])
def test_shards_are_disjoint_equal_and_drop_the_remainder(n, workers, batch):
    shards = [shard_indices(n, 0, 42, r, workers, batch) for r in range(workers)]
    steps = n // (workers * batch)
    for s in shards:
        assert s.shape == (steps, batch)
    flat = np.concatenate([s.ravel() for s in shards])
    assert len(set(flat.tolist())) == len(flat) == steps * batch * workers
    assert flat.min() >= 0 and flat.max() < n


def test_shards_reshuffle_per_epoch_and_are_deterministic():
    a0 = shard_indices(1000, 0, 7, 1, 4, 16)
    assert np.array_equal(a0, shard_indices(1000, 0, 7, 1, 4, 16))
    assert not np.array_equal(a0, shard_indices(1000, 1, 7, 1, 4, 16))
    assert not np.array_equal(a0, shard_indices(1000, 0, 8, 1, 4, 16))
    with pytest.raises(ValueError):
        shard_indices(1000, 0, 7, 4, 4, 16)


def test_steps_per_epoch_and_too_large_batch():
    cfg = parse_config({"model": {"name": "digits_mlp"},
                        "data": {"dataset": "digits", "batch_size": 32}})
    assert count_train(cfg) == N_TRAIN == 1437
    assert steps_per_epoch(cfg, 2) == 22
    big = parse_config({"model": {"name": "digits_mlp"},
                        "data": {"dataset": "digits", "batch_size": 1000}})
    with pytest.raises(DataError) as info:
        steps_per_epoch(big, 2)
    assert "data.batch_size" in one_line(info) and "1437" in str(info.value)


# ----------------------------------------------------------------------------- digits

def test_digits_split_and_normalization():
    ds = DigitsDataset()
    assert (ds.n_train, ds.n_val) == (N_TRAIN, N_TEST)
    assert ds.x_train.shape == (N_TRAIN, 1, 8, 8) and ds.x_train.dtype == np.float32
    assert abs(float(ds.x_train.mean())) < 1e-4 and abs(float(ds.x_train.std()) - 1) < 1e-3
    assert sorted(set(ds.y_test.tolist())) == list(range(10))
    again = DigitsDataset()
    assert np.array_equal(ds.y_test, again.y_test)  # fixed split


@pytest.mark.parametrize("test_size, seed", [(N_TEST, 0), (0.25, 0), (0.25, 1), (0.25, 7),
                                             (0.1, 3), (101, 5)])
def test_digits_numpy_split_is_scikit_learns(test_size, seed):
    """The numpy transcription picks the same rows as train_test_split(stratify=y), in
    the same order (every accuracy figure of the project was measured on that split)."""
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import train_test_split
    from ssdsgd.data.digits import load_digits, stratified_split
    x, y = load_digits()
    sk_x, sk_y = sk_load_digits(return_X_y=True)
    assert np.array_equal(x, sk_x) and np.array_equal(y, sk_y) and x.dtype == sk_x.dtype
    rows = np.arange(len(y))
    sk_train, sk_test = train_test_split(rows, test_size=test_size, random_state=seed,
                                         stratify=y)
    train, test = stratified_split(y, test_size, seed)
    assert np.array_equal(train, sk_train) and np.array_equal(test, sk_test)


def test_digits_dataset_is_the_former_scikit_learn_split():
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import train_test_split
    digits = sk_load_digits()
    x = (digits.data.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    y = digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=N_TEST, random_state=0,
                                              stratify=y)
    mean, std = x_tr.mean(), x_tr.std()
    ds = DigitsDataset()
    assert np.array_equal(ds.y_train, y_tr) and np.array_equal(ds.y_test, y_te)
    assert np.array_equal(ds.x_train, (x_tr - mean) / std)
    assert np.array_equal(ds.x_test, (x_te - mean) / std)


@pytest.mark.system
def test_digits_worker_does_not_import_scikit_learn():
    """Loading the digits imports no scikit-learn module of its own (MXNet, imported
    by a worker, still brings sklearn.base)."""
    import subprocess
    import sys
    code = ("import sys; from ssdsgd.data.digits import DigitsDataset; DigitsDataset(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'sklearn'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ,
                                           "PYTHONPATH": str(Path(__file__).parents[1])})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_loader_threads_give_the_same_batches_as_inline():
    ds = Cifar10Like(n=64)
    inline = list(Loader(ds, seed=3, threads=0).epoch(2, 1, 2, 8))
    loader = Loader(ds, seed=3, threads=3)
    threaded = list(loader.epoch(2, 1, 2, 8))
    loader.close()
    assert [s for s, _ in inline] == [s for s, _ in threaded] == list(range(4))
    for (_, (xa, ya)), (_, (xb, yb)) in zip(inline, threaded):
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)
    other = list(Loader(ds, seed=3, threads=0).epoch(3, 1, 2, 8))
    assert not np.array_equal(inline[0][1][0], other[0][1][0])


class Cifar10Like:
    """An in-memory dataset whose train batches depend on the rng (as augmentation does)."""

    def __init__(self, n):
        self.n_train = n

    def train_batch(self, indices, rng):
        return indices[:, None] + rng.random((len(indices), 3)), indices


# ----------------------------------------------------------------------------- CIFAR-10

def make_cifar(root: Path, per_file=4, test=3, seed=0):
    """Write the six CIFAR-10 .bin files; returns (train images, labels, test ...)."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    imgs, labels = [], []
    for i in range(1, 6):
        x = rng.integers(0, 256, (per_file, 3, 32, 32), dtype=np.uint8)
        y = rng.integers(0, 10, per_file)
        cifar10.write_bin(root / f"data_batch_{i}.bin", x, y)
        imgs.append(x)
        labels.append(y)
    xt = rng.integers(0, 256, (test, 3, 32, 32), dtype=np.uint8)
    yt = rng.integers(0, 10, test)
    cifar10.write_bin(root / "test_batch.bin", xt, yt)
    return np.concatenate(imgs), np.concatenate(labels), xt, yt


def cifar_cfg(path, **data):
    return parse_config({"model": {"name": "cifar_resnet20_v1"},
                         "data": {"dataset": "cifar10", "path": str(path), **data}})


def test_cifar_binary_format_is_read_exactly(tmp_path):
    # One hand-made record: label 7, red plane 255, green 0, blue rows = row index.
    rec = np.zeros(3073, np.uint8)
    rec[0] = 7
    rec[1:1025] = 255
    rec[2049:] = np.repeat(np.arange(32, dtype=np.uint8), 32)
    make_cifar(tmp_path)
    with open(tmp_path / "test_batch.bin", "wb") as f:
        f.write(rec.tobytes())
    x, y = cifar10.read_file(tmp_path / "test_batch.bin")
    assert y.tolist() == [7]
    assert x.shape == (1, 3, 32, 32)
    assert (x[0, 0] == 255).all() and (x[0, 1] == 0).all()
    assert (x[0, 2, :, 5] == np.arange(32)).all()       # rows first (CHW)
    ds = cifar10.Cifar10Dataset(tmp_path)
    (xv, yv), = list(ds.val_batches(10))
    expect_r = (1.0 - 0.4914) / 0.2023
    assert yv.tolist() == [7]
    assert np.allclose(xv[0, 0], expect_r, atol=1e-5)
    assert np.allclose(xv[0, 1], (0 - 0.4822) / 0.1994, atol=1e-5)


def test_cifar_dataset_and_augmentation(tmp_path):
    x, y, xt, yt = make_cifar(tmp_path)
    ds = open_dataset(cifar_cfg(tmp_path))
    assert (ds.n_train, ds.n_val, ds.num_classes) == (20, 3, 10)
    assert count_train(cifar_cfg(tmp_path)) == 20
    idx = np.array([3, 17, 0])
    xb, yb = ds.train_batch(idx, np.random.default_rng(1))
    assert xb.shape == (3, 3, 32, 32) and xb.dtype == np.float32
    assert yb.tolist() == y[idx].tolist()
    xb2, _ = ds.train_batch(idx, np.random.default_rng(1))
    assert np.array_equal(xb, xb2)                          # deterministic given the rng
    plain = cifar10.normalize(x[idx])
    assert not np.array_equal(xb, plain)                    # it did augment
    # every augmented image is a (possibly flipped) 32x32 window of the zero-padded one
    pad = np.zeros((3, 3, 40, 40), np.float32)
    pad[:, :, 4:36, 4:36] = plain
    for i in range(3):
        windows = [pad[i, :, a:a + 32, b:b + 32] for a in range(9) for b in range(9)]
        assert any(np.allclose(xb[i], w) or np.allclose(xb[i], w[:, :, ::-1])
                   for w in windows)
    off = open_dataset(cifar_cfg(tmp_path, augmentation=False))
    assert np.allclose(off.train_batch(idx, np.random.default_rng(1))[0], plain)


def test_cifar_accepts_the_tarball_directory(tmp_path):
    make_cifar(tmp_path / "cifar-10-batches-bin")
    assert open_dataset(cifar_cfg(tmp_path)).n_train == 20


def test_cifar_file_of_wrong_size(tmp_path):
    make_cifar(tmp_path)
    with open(tmp_path / "data_batch_3.bin", "ab") as f:
        f.write(b"\0" * 10)
    with pytest.raises(DataError) as info:
        open_dataset(cifar_cfg(tmp_path))
    msg = one_line(info)
    assert "data_batch_3.bin" in msg and "not a positive multiple" in msg and "3073" in msg


def test_cifar_missing_test_batch(tmp_path):
    make_cifar(tmp_path)
    os.remove(tmp_path / "test_batch.bin")
    with pytest.raises(DataError) as info:
        validate_data(cifar_cfg(tmp_path))
    assert "test_batch.bin: missing CIFAR-10 file" in one_line(info)


def test_cifar_bad_label_and_missing_dir(tmp_path):
    make_cifar(tmp_path)
    raw = bytearray((tmp_path / "data_batch_2.bin").read_bytes())
    raw[3073] = 42  # the second record's label
    (tmp_path / "data_batch_2.bin").write_bytes(bytes(raw))
    with pytest.raises(DataError) as info:
        open_dataset(cifar_cfg(tmp_path))
    assert "data_batch_2.bin: record 1 has label 42" in one_line(info)
    with pytest.raises(DataError) as info:
        open_dataset(cifar_cfg(tmp_path / "nowhere"))
    assert "nowhere: CIFAR-10 data directory not found" in one_line(info)


# ----------------------------------------------------------------------------- RecordIO

COLORS = [(200, 10, 10), (10, 200, 10), (10, 10, 200), (120, 120, 120), (0, 0, 0)]


def write_rec(root: Path, split: str, n: int, size=(20, 30), label_of=lambda i: i % 3):
    """n solid-colour PNG records (colour i % 5, RGB), labels label_of(i)."""
    root.mkdir(parents=True, exist_ok=True)
    w = mx.recordio.MXIndexedRecordIO(str(root / f"{split}.idx"), str(root / f"{split}.rec"),
                                      "w")
    for i in range(n):
        rgb = np.zeros((*size, 3), np.uint8)
        rgb[:] = COLORS[i % 5]
        header = mx.recordio.IRHeader(0, float(label_of(i)), i, 0)
        w.write_idx(i, mx.recordio.pack_img(header, rgb[:, :, ::-1], img_fmt=".png"))
    w.close()


def rec_cfg(path, **data):
    return parse_config({"model": {"name": "resnet50_v1"},
                         "data": {"dataset": "imagenet", "path": str(path), "crop_size": 8,
                                  "num_classes": 3, **data}})


def test_recordio_reader(tmp_path):
    write_rec(tmp_path, "train", 7)
    write_rec(tmp_path, "val", 5, size=(12, 9))
    cfg = rec_cfg(tmp_path)
    assert count_train(cfg) == 7
    ds = open_dataset(cfg)
    assert (ds.n_train, ds.n_val, ds.num_classes, ds.resize_size) == (7, 5, 3, 9)
    xb, yb = ds.train_batch(np.array([0, 1, 2, 6]), np.random.default_rng(0))
    assert xb.shape == (4, 3, 8, 8) and xb.dtype == np.float32
    assert yb.tolist() == [0, 1, 2, 0]
    # solid colours survive crop/resize/flip: channel c of image i is colour i normalized
    for j, i in enumerate([0, 1, 2, 6]):
        want = (np.array(COLORS[i % 5], np.float32) - imagenet.MEAN) / imagenet.STD
        assert np.allclose(xb[j].mean(axis=(1, 2)), want, atol=1e-3)
    vals = list(ds.val_batches(2))
    assert [len(y) for _, y in vals] == [2, 2, 1]
    x0 = vals[0][0]
    assert x0.shape == (2, 3, 8, 8)
    want = (np.array(COLORS[1], np.float32) - imagenet.MEAN) / imagenet.STD
    assert np.allclose(x0[1].mean(axis=(1, 2)), want, atol=1e-3)
    assert np.concatenate([y for _, y in vals]).tolist() == [0, 1, 2, 0, 1]
    loader = Loader(ds, seed=0, threads=2)  # one reader per thread
    batches = list(loader.epoch(0, 0, 1, 3))
    loader.close()
    assert len(batches) == 2 and all(x.shape == (3, 3, 8, 8) for _, (x, _) in batches)


def test_recordio_crop_geometry():
    rng = np.random.default_rng(0)
    img = np.arange(40 * 60 * 3, dtype=np.uint8).reshape(40, 60, 3)
    assert imagenet.random_resized_crop(img, 16, rng).shape == (16, 16, 3)
    short = imagenet.resize_short(img, 20)
    assert short.shape[:2] == (20, 30)
    assert imagenet.center_crop(short, 16).shape == (16, 16, 3)


def test_rec_without_idx(tmp_path):
    write_rec(tmp_path, "train", 3)
    write_rec(tmp_path, "val", 2)
    os.remove(tmp_path / "val.idx")
    with pytest.raises(DataError) as info:
        open_dataset(rec_cfg(tmp_path))
    assert "val.idx: missing index for val.rec" in one_line(info)
    with pytest.raises(DataError) as info:
        count_train(rec_cfg(tmp_path))
    assert "val.idx" in one_line(info)


def test_missing_rec(tmp_path):
    write_rec(tmp_path, "val", 2)
    with pytest.raises(DataError) as info:
        open_dataset(rec_cfg(tmp_path))
    assert "train.rec: missing RecordIO file" in one_line(info)


def _offsets(idx: Path):
    return [int(line.split("\t")[1]) for line in idx.read_text().splitlines()]


def test_corrupt_record(tmp_path):
    write_rec(tmp_path, "train", 4)
    write_rec(tmp_path, "val", 2)
    raw = bytearray((tmp_path / "train.rec").read_bytes())
    pos = _offsets(tmp_path / "train.idx")[2]
    raw[pos:pos + 4] = b"JUNK"                      # record 2's magic number
    (tmp_path / "train.rec").write_bytes(bytes(raw))
    ds = open_dataset(rec_cfg(tmp_path))            # record 0 is fine: opens
    with pytest.raises(DataError) as info:
        ds.train_batch(np.array([1, 2]), np.random.default_rng(0))
    msg = one_line(info)
    assert "train.rec: corrupt record 2" in msg and "Invalid RecordIO" in msg


def test_undecodable_image(tmp_path):
    write_rec(tmp_path, "train", 3)
    write_rec(tmp_path, "val", 2)
    raw = bytearray((tmp_path / "val.rec").read_bytes())
    pos = _offsets(tmp_path / "val.idx")[0]
    raw[pos + 8 + 24:pos + 8 + 60] = b"\0" * 36     # inside the PNG, after the IRHeader
    (tmp_path / "val.rec").write_bytes(bytes(raw))
    with pytest.raises(DataError) as info:
        open_dataset(rec_cfg(tmp_path))
    assert "val.rec: record 0 does not hold a decodable image" in one_line(info)


def test_malformed_index(tmp_path):
    write_rec(tmp_path, "train", 3)
    write_rec(tmp_path, "val", 2)
    (tmp_path / "train.idx").write_text("0\t0\nnot a line\n")
    with pytest.raises(DataError) as info:
        open_dataset(rec_cfg(tmp_path))
    assert "train.idx: line 2 is not 'key<TAB>offset'" in one_line(info)
    (tmp_path / "train.idx").write_text("0\t0\n1\t999999\n")
    with pytest.raises(DataError) as info:
        open_dataset(rec_cfg(tmp_path))
    assert "train.idx: line 2: offset 999999 is outside train.rec" in one_line(info)


def test_label_out_of_range(tmp_path):
    write_rec(tmp_path, "train", 3, label_of=lambda i: 5)
    write_rec(tmp_path, "val", 2)
    with pytest.raises(DataError) as info:
        open_dataset(rec_cfg(tmp_path))
    assert "train.rec: record 0 has label 5, expected 0-2" in one_line(info)
