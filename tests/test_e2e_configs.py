"""The shipped configs end to end through ``launch/dist.py``: scheduler, servers and two
workers on small files in the real formats (CIFAR-10 binary, im2rec RecordIO), and the
digits demo's main command, shortened. Each job is checked through what it leaves in its
run directory (metrics JSON lines, summary.json, plots) and what the launcher prints."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ssdsgd.metrics import read_records
from test_data import make_cifar, write_rec

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def clean_env():
    return {k: v for k, v in os.environ.items() if not k.startswith(("SSDSGD_", "DMLC_"))}


def dist(args, timeout=150):
    """``python launch/dist.py ARGS`` from the repository root, output captured."""
    return subprocess.run([PY, "launch/dist.py", *map(str, args)], capture_output=True,
                          text=True, cwd=ROOT, env=clean_env(), timeout=timeout)


def sets(**overrides):
    out = []
    for key, value in overrides.items():
        out += ["--set", f"{key.replace('__', '.')}={value}"]
    return out


def run_dir_of(root: Path) -> Path:
    run, = [d for d in root.iterdir() if d.is_dir()]
    return run


def records(run: Path, rank: int, event: str):
    return [r for r in read_records(run / "metrics" / f"worker-{rank}.jsonl")
            if r["event"] == event]


def check_job(p, run: Path, steps: int, stages: list[str], top5: bool = False) -> dict:
    """What every finished 2-worker job must leave behind; returns summary.json."""
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    for rank in (0, 1):
        start, = records(run, rank, "start")
        assert start["num_workers"] == 2 and start["kvstore"] is True
        train = records(run, rank, "train")
        assert [r["step"] for r in train] == list(range(1, steps + 1))
        assert [r["stage"] for r in train] == stages
        for r in train:
            assert r["samples_per_sec"] > 0 and r["loss"] is not None
            assert r["time_blocked"] >= 0
        sent = [r["bytes_sent"] for r in train]
        received = [r["bytes_received"] for r in train]
        assert sent == sorted(sent) and sent[0] > 0          # cumulative
        assert received == sorted(received) and received[0] > 0
        end, = records(run, rank, "end")
        assert end["steps"] == steps and end["bytes_sent"] >= sent[-1]
    val = records(run, 0, "val")
    assert val and records(run, 1, "val") == []              # rank 0 validates
    assert 0 <= val[-1]["accuracy"] <= 1
    if top5:
        assert val[-1]["accuracy"] <= val[-1]["top5"] <= 1
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == steps and summary["num_workers"] == 2
    assert summary["workers_reporting"] == 2
    assert summary["final_accuracy"] == val[-1]["accuracy"]
    assert summary["bytes_sent"] == sum(records(run, r, "end")[0]["bytes_sent"] for r in (0, 1))
    assert summary["samples_per_sec"] > 0 and summary["time_blocked"] is not None
    assert ("final_top5" in summary) == top5
    # the launcher ends with the accuracy and the plots of the run
    tail = p.stdout.strip().splitlines()[-3:]
    assert tail[0].startswith(f"[launcher] test accuracy {summary['final_accuracy']:.4f}")
    for line, name in zip(tail[1:], ("accuracy_vs_time.png", "accuracy_vs_epoch.png")):
        assert line == f"[launcher] plot: {run / 'plots' / name}"
        assert (run / "plots" / name).read_bytes()[:4] == b"\x89PNG"
    return summary


def test_cifar10_resnet20_config(tmp_path):
    data = tmp_path / "cifar"
    make_cifar(data / "cifar-10-batches-bin", per_file=8, test=6)   # 40 train, 6 test
    p = dist(["configs/cifar10_resnet20_ssd.yaml", *sets(
        cluster__workers=2, data__path=data, data__batch_size=4, train__epochs=2,
        train__log_interval=1, sync__warmup_steps=3, sync__delay_steps=2,
        output__dir=tmp_path / "runs")])
    run = run_dir_of(tmp_path / "runs")
    # 40 images / (2 workers x 4) = 5 steps per epoch, 2 epochs
    summary = check_job(p, run, 10, ["warmup"] * 3 + ["steps_delay"] * 7)
    assert summary["model"] == "cifar_resnet20_v1" and summary["algorithm"] == "ssd"
    assert [v["epoch"] for v in records(run, 0, "val")] == [1, 2]
    ck = json.loads((run / "checkpoints" / "latest.json").read_text())
    assert (ck["next_epoch"], ck["step"]) == (2, 10)      # the last epoch is checkpointed


def test_imagenet_resnet50_config(tmp_path):
    data = tmp_path / "rec"
    ten = lambda i: i % 10                                   # noqa: E731
    write_rec(data, "train", 12, size=(40, 48), label_of=ten)
    write_rec(data, "val", 6, size=(36, 30), label_of=ten)
    p = dist(["configs/imagenet_resnet50_ssd.yaml", *sets(
        cluster__workers=2, data__path=data, data__batch_size=2, data__crop_size=32,
        data__resize_size=36, data__num_classes=10, data__loader_threads=1,
        train__max_steps=3, train__log_interval=1, sync__warmup_steps=1,
        sync__delay_steps=2, output__dir=tmp_path / "runs")], timeout=240)
    run = run_dir_of(tmp_path / "runs")
    # 12 images / (2 x 2) = 3 steps per epoch; 3 servers share resnet50's big arrays
    summary = check_job(p, run, 3, ["warmup", "steps_delay", "steps_delay"], top5=True)
    assert summary["model"] == "resnet50_v1" and summary["num_servers"] == 3
    start, = records(run, 0, "start")
    assert start["total_steps"] == 3 and start["warmup_steps"] == 1
    lrs = [r["lr"] for r in records(run, 0, "train")]
    assert lrs == sorted(lrs) and lrs[-1] < 0.15            # 5-epoch linear lr warm-up


def test_digits_main_command(tmp_path):
    """The README's main command, shortened: it trains through scheduler, server and two
    workers, shows progress, and ends with the test accuracy and its plots."""
    p = dist(["configs/digits.yaml", *sets(train__epochs=6, sync__warmup_steps=44,
                                           output__dir=tmp_path)])
    run = run_dir_of(tmp_path)
    # log_interval 20 of 22 steps per epoch: records at batch 20 of every epoch, and at the
    # very last step
    train = records(run, 0, "train")
    steps = [r["step"] for r in train]
    assert steps == [22 * e + 20 for e in range(6)] + [132]
    assert [r["stage"] for r in train] == ["warmup"] * 2 + ["steps_delay"] * 5
    summary = json.loads((run / "summary.json").read_text())
    assert p.returncode == 0, p.stderr[-3000:]
    assert summary["final_accuracy"] >= 0.95 and summary["steps"] == 132
    assert summary["algorithm"] == "ssd" and summary["workers_reporting"] == 2
    assert summary["bytes_sent"] > 0 and summary["bytes_received"] > 0
    assert "Traceback" not in p.stdout + p.stderr
    # progress (not a tty here: plain lines), the final one with the job's throughput
    progress = [ln for ln in p.stderr.splitlines() if ln.startswith("progress: ")]
    assert progress and progress[-1].startswith("progress: step 132/132 (100%)")
    speed = float(progress[-1].split(" samples/s")[0].rsplit("| ", 1)[1])
    assert speed == pytest.approx(summary["samples_per_sec"], abs=1) and speed > 0
    tail = p.stdout.strip().splitlines()[-3:]
    assert tail[0].startswith(f"[launcher] test accuracy {summary['final_accuracy']:.4f}")
    assert tail[1:] == [f"[launcher] plot: {run / 'plots' / 'accuracy_vs_time.png'}",
                        f"[launcher] plot: {run / 'plots' / 'accuracy_vs_epoch.png'}"]
    assert all((run / "plots" / n).stat().st_size > 5000
               for n in ("accuracy_vs_time.png", "accuracy_vs_epoch.png"))
