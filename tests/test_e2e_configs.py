"""The shipped configs end to end through ``launch/dist.py``: scheduler, servers and two
workers on small files in the real formats (CIFAR-10 binary, im2rec RecordIO), and the
digits demo's main command, shortened. Each job is checked through what it leaves in its
run directory (metrics JSON lines, summary.json, plots) and what the launcher prints."""
import json
import sys
from pathlib import Path

import mxnet as mx
import pytest

import jobs
from ssdsgd.metrics import read_records
from test_data import make_cifar, write_rec

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def dist(args, timeout=150):
    """``python launch/dist.py ARGS`` from the repository root, run to its end (tests/jobs.py:
    stdout and stderr apart, nothing left running, the test failed after ``timeout`` s)."""
    return jobs.run(args, timeout=timeout)


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
    # not on a terminal: plain progress lines, the last one with the job's throughput
    progress = [ln for ln in p.stderr.splitlines() if ln.startswith("progress: ")]
    assert progress[-1].startswith(f"progress: step {steps}/{steps} (100%) | epoch ")
    speed = float(progress[-1].split(" samples/s")[0].rsplit("| ", 1)[1])
    assert speed == pytest.approx(summary["samples_per_sec"], abs=1) and speed > 0
    # the launcher ends with the accuracy and the plots of the run
    tail = p.stdout.strip().splitlines()[-3:]
    assert tail[0].startswith(f"[launcher] test accuracy {summary['final_accuracy']:.4f}")
    for line, name in zip(tail[1:], ("accuracy_vs_time.png", "accuracy_vs_epoch.png")):
        assert line == f"[launcher] plot: {run / 'plots' / name}"
        assert (run / "plots" / name).read_bytes()[:4] == b"\x89PNG"
    return summary


@pytest.mark.system
def test_cifar10_resnet20_config(tmp_path):
    data = tmp_path / "cifar"
    make_cifar(data / "cifar-10-batches-bin", per_file=8, test=6)   # 40 train, 6 test
    p = dist(["configs/cifar10_resnet20_ssd.yaml", *sets(
        cluster__workers=2, data__path=data, data__batch_size=4, train__epochs=2,
        train__log_interval=1, train__checkpoint_every=1, sync__warmup_steps=3,
        sync__delay_steps=2, output__dir=tmp_path / "runs")])
    run = run_dir_of(tmp_path / "runs")
    # 40 images / (2 workers x 4) = 5 steps per epoch, 2 epochs
    summary = check_job(p, run, 10, ["warmup"] * 3 + ["steps_delay"] * 7)
    assert summary["model"] == "cifar_resnet20_v1" and summary["algorithm"] == "ssd"
    assert [v["epoch"] for v in records(run, 0, "val")] == [1, 2]
    ck = json.loads((run / "checkpoints" / "latest.json").read_text())
    assert (ck["next_epoch"], ck["step"]) == (2, 10)      # the last epoch is checkpointed
    # epoch 0 ended in the steps-delay stage: its checkpoint holds the pulled global
    # weights and rank 0's BatchNorm statistics, under the same names
    first = mx.nd.load(str(run / "checkpoints" / "epoch-0000.params"))
    last = mx.nd.load(str(run / "checkpoints" / "epoch-0001.params"))
    assert first.keys() == last.keys() and any("running_mean" in k for k in first)
    assert all(first[k].shape == last[k].shape for k in first)


@pytest.mark.system
def test_imagenet_resnet50_config(tmp_path):
    data = tmp_path / "rec"
    ten = lambda i: i % 10                                   # noqa: E731
    write_rec(data, "train", 12, size=(40, 48), label_of=ten)
    write_rec(data, "val", 6, size=(36, 30), label_of=ten)
    p = dist(["configs/imagenet_resnet50_ssd.yaml", *sets(
        cluster__workers=2, cluster__servers=1, data__path=data, data__batch_size=2,
        data__crop_size=32,
        data__resize_size=36, data__num_classes=10, data__loader_threads=1,
        train__max_steps=3, train__log_interval=1, sync__warmup_steps=1,
        sync__delay_steps=2, output__dir=tmp_path / "runs")], timeout=240)
    run = run_dir_of(tmp_path / "runs")
    # 12 images / (2 x 2) = 3 steps per epoch
    summary = check_job(p, run, 3, ["warmup", "steps_delay", "steps_delay"], top5=True)
    assert summary["model"] == "resnet50_v1" and summary["num_servers"] == 1
    start, = records(run, 0, "start")
    assert start["total_steps"] == 3 and start["warmup_steps"] == 1
    lrs = [r["lr"] for r in records(run, 0, "train")]
    assert lrs == sorted(lrs) and lrs[-1] < 0.15            # 5-epoch linear lr warm-up


def screen(raw: str) -> list[str]:
    """The lines a terminal shows for ``raw`` (carriage returns overwrite)."""
    lines, cur, col = [], [], 0
    for ch in raw:
        if ch == "\r":
            col = 0
        elif ch == "\n":
            lines.append("".join(cur).rstrip())
            cur, col = [], 0
        else:
            if col < len(cur):
                cur[col] = ch
            else:
                cur.append(ch)
            col += 1
    if cur:
        lines.append("".join(cur).rstrip())
    return lines


@pytest.mark.system
def test_digits_main_command_on_a_terminal(digits_demo_on_a_terminal):
    """The README's main command, shortened, at a terminal: it trains through scheduler,
    server and two workers under one progress bar (the processes' lines scroll above
    it), and ends with the test accuracy and the paths of its plots."""
    code, raw, out = digits_demo_on_a_terminal     # train.epochs=6, sync.warmup_steps=44
    lines = screen(raw)
    assert code == 0, "\n".join(lines[-40:])
    assert "Traceback" not in raw
    run = run_dir_of(out)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_accuracy"] >= 0.95 and summary["steps"] == 132
    assert summary["algorithm"] == "ssd" and summary["workers_reporting"] == 2
    assert summary["bytes_sent"] > 0 and summary["bytes_received"] > 0
    train = records(run, 0, "train")   # log_interval 20 of 22 steps, and the last step
    assert [r["step"] for r in train] == [22 * e + 20 for e in range(6)] + [132]
    assert [r["stage"] for r in train] == ["warmup"] * 2 + ["steps_delay"] * 5
    # one bar, kept below the scrolling lines of the processes: every line on the screen
    # is a prefixed line or the bar, never both
    bars = [ln for ln in lines if ln.startswith("training:")]
    assert len(bars) == 1, "\n".join(lines)
    assert all(ln.startswith("[") and "training:" not in ln
               for ln in lines if ln and ln is not bars[0]), "\n".join(lines)
    assert any(ln.startswith("[worker 1] ") and "Epoch[5] Train-accuracy=" in ln
               for ln in lines)
    bar = bars[0]
    assert "100%" in bar and "132/132" in bar and "epoch 5" in bar
    assert f"val acc {summary['final_accuracy']:.4f}" in bar
    speed = float(bar.split(" samples/s")[0].rsplit("epoch 5 | ", 1)[1])
    assert speed == pytest.approx(summary["samples_per_sec"], abs=1) and speed > 0
    tail = [ln for ln in lines if ln][-3:]
    assert lines.index(bar) < lines.index(tail[0])
    assert tail[0].startswith(f"[launcher] test accuracy {summary['final_accuracy']:.4f}")
    assert tail[1:] == [f"[launcher] plot: {run / 'plots' / 'accuracy_vs_time.png'}",
                        f"[launcher] plot: {run / 'plots' / 'accuracy_vs_epoch.png'}"]
    assert all((run / "plots" / n).stat().st_size > 5000
               for n in ("accuracy_vs_time.png", "accuracy_vs_epoch.png"))


# ------------------------------------------------------------ bad config and data

def _write(path, text):
    path.write_text(text)
    return path


def _cifar(tmp_path, **edit):
    root = tmp_path / "cifar"
    make_cifar(root, per_file=8, test=6)
    if "truncate" in edit:
        f = root / edit["truncate"]
        f.write_bytes(f.read_bytes()[:-100])
    if "label" in edit:
        f = root / "data_batch_4.bin"
        raw = bytearray(f.read_bytes())
        raw[3073 * 2] = edit["label"]                 # the third record's label byte
        f.write_bytes(bytes(raw))
    return ["configs/cifar10_resnet20_ssd.yaml", *sets(data__path=root, cluster__workers=2,
                                                       data__batch_size=4)]


def _rec(tmp_path, *more, **kw):
    root = tmp_path / "rec"
    write_rec(root, "train", 8, **kw)
    write_rec(root, "val", 4)
    return ["configs/imagenet_resnet50_ssd.yaml", *sets(data__path=root, cluster__workers=2,
                                                        data__batch_size=2, data__num_classes=3,
                                                        data__crop_size=16), *more]


def _no_idx(tmp_path):
    args = _rec(tmp_path)
    (tmp_path / "rec" / "val.idx").unlink()
    return args


def _bad_idx(tmp_path):
    args = _rec(tmp_path)
    (tmp_path / "rec" / "train.idx").write_text("0\t0\n1\tx\n")
    return args


def _no_checkpoint(tmp_path):
    run = tmp_path / "runs" / "old"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text((ROOT / "configs" / "digits.yaml").read_text())
    return ["--resume", run]


LAUNCHER_ERRORS = {
    # kind: (argv for launch/dist.py given tmp_path, substrings of the one-line error)
    "unknown key": (lambda t: ["configs/digits.yaml", "--set", "sync.delay=3"],
                    ["sync.delay: unknown key (did you mean 'delay_steps'?"]),
    "wrong type": (lambda t: ["configs/digits.yaml", "--set", "cluster.workers=two"],
                   ["cluster.workers: expected an integer >= 1, got 'two'"]),
    "impossible value": (lambda t: ["configs/digits.yaml", "--set", "sync.delay_steps=0"],
                         ["sync.delay_steps: expected auto or an integer >= 1, got 0",
                          "configs/digits.yaml"]),
    "bad --set": (lambda t: ["configs/digits.yaml", "--set", "sync.delay_steps"],
                  ["--set 'sync.delay_steps': expected KEY=VALUE"]),
    "missing config file": (lambda t: [t / "nope.yaml"], ["nope.yaml: cannot read config file"]),
    "invalid YAML": (lambda t: [_write(t / "x.yaml", "a: [\n")],
                     ["x.yaml: not valid YAML at line"]),
    "model does not fit data": (lambda t: ["configs/digits.yaml", "--set",
                                           "model.name=resnet50_v1"],
                                ["model.name: 'resnet50_v1' does not fit dataset 'digits'"]),
    "glu estimate without momentum": (
        lambda t: ["configs/digits.yaml", "--set", "optimizer.name=adam", "--set",
                   "sync.glu_state=estimate"],
        ["sync.glu_state: 'estimate' needs optimizer sgd or nag with momentum > 0"]),
    "glu corrected without momentum": (
        lambda t: ["configs/digits.yaml", "--set", "optimizer.momentum=0", "--set",
                   "sync.glu_state=corrected"],
        ["sync.glu_state: 'corrected' needs optimizer sgd or nag with momentum > 0"]),
    "batch larger than the data": (lambda t: ["configs/digits.yaml", "--set",
                                              "data.batch_size=1000"],
                                   ["data.batch_size: 2 worker(s) x batch 1000 = 2000 exceeds "
                                    "the 1437 training samples"]),
    "no CIFAR directory": (lambda t: ["configs/cifar10_resnet20_ssd.yaml", "--set",
                                      f"data.path={t / 'absent'}"],
                           ["absent: CIFAR-10 data directory not found (data.path)"]),
    "truncated CIFAR .bin": (lambda t: _cifar(t, truncate="data_batch_2.bin"),
                             ["data_batch_2.bin: size 24484 bytes is not a positive multiple "
                              "of the 3073-byte CIFAR-10 record"]),
    "CIFAR label out of range": (lambda t: _cifar(t, label=77),
                                 ["data_batch_4.bin: record 2 has label 77, expected 0-9"]),
    "RecordIO without index": (_no_idx, ["val.idx: missing index for val.rec"]),
    "malformed index": (_bad_idx, ["train.idx: line 2 is not 'key<TAB>offset'"]),
    "label >= num_classes": (lambda t: _rec(t, label_of=lambda i: 7),
                             ["train.rec: record 0 has label 7, expected 0-2"]),
    "resume without checkpoint": (_no_checkpoint, ["checkpoints/latest.json: no checkpoint to "
                                                   "resume from"]),
}


@pytest.mark.parametrize("kind", list(LAUNCHER_ERRORS))
def test_launcher_bad_config_and_data_one_line(kind, tmp_path, capsys, monkeypatch):
    """Found by launch/dist.py before any process starts (its config form, in process):
    exit code 2, one line naming the cause, no run directory."""
    from ssdsgd.launch.cli import main
    monkeypatch.chdir(ROOT)
    make_args, expected = LAUNCHER_ERRORS[kind]
    args = [str(a) for a in make_args(tmp_path)]
    if not args[0].startswith("--resume"):
        args += ["--set", f"output.dir={tmp_path / 'runs'}"]
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("launch/dist.py: error: "), err
    for part in expected:
        assert part in lines[0], (part, lines[0])
    if not args[0].startswith("--resume"):
        assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.mark.system
def test_launcher_script_config_error(tmp_path):
    """The same through the real script: one line on stderr, exit code 2, nothing started."""
    p = dist(["configs/digits.yaml", "--set", "sync.local_rule=glue"], timeout=60)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        "launch/dist.py: error: sync.local_rule: expected one of glu, sgd, none, got 'glue' "
        "(configs/digits.yaml)"]


@pytest.mark.system
def test_bad_data_found_by_the_workers(tmp_path):
    """A corrupt record the launcher's check (which decodes record 0) cannot see: the
    worker that reads it exits with one line naming the file and record, the launcher
    stops the job; no traceback anywhere."""
    root = tmp_path / "rec"
    write_rec(root, "train", 8, size=(24, 24))
    write_rec(root, "val", 4)
    raw = bytearray((root / "train.rec").read_bytes())
    offsets = [int(ln.split("\t")[1]) for ln in (root / "train.idx").read_text().splitlines()]
    for k in range(1, 8):
        raw[offsets[k]:offsets[k] + 4] = b"JUNK"          # every record but the first
    (root / "train.rec").write_bytes(bytes(raw))
    p = dist(["configs/imagenet_resnet50_ssd.yaml", *sets(
        model__name="cifar_resnet20_v1", cluster__workers=2, cluster__servers=1,
        data__path=root, data__batch_size=2, data__num_classes=3, data__crop_size=16,
        data__loader_threads=0, output__dir=tmp_path / "runs")], timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 1, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    causes = [ln for ln in p.stderr.splitlines() if "] error: " in ln]
    assert causes, out[-3000:]
    for line in causes:
        assert line.startswith("[worker ") and f"{root / 'train.rec'}: corrupt record " in line
        assert "Invalid RecordIO" in line
    assert "exited with code 2; stopping the job" in p.stderr
