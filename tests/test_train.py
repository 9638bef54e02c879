"""ssdsgd.train (by hand, and once through the launcher), lr schedules, progress monitor."""
import io
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import mxnet as mx
import numpy as np
import pytest
import yaml

from ssdsgd.checkpoint import run_length
from ssdsgd.config import ConfigError, parse_config
from ssdsgd.metrics import read_records
from ssdsgd.progress import ProgressMonitor
from ssdsgd import recipe as R
from ssdsgd import train as T

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def digits_job(tmp_path, name="job", **sections):
    raw = {"model": {"name": "digits_mlp"},
           "data": {"dataset": "digits", "batch_size": 32, "loader_threads": 0},
           "optimizer": {"lr": 0.1, "momentum": 0.9},
           "train": {"epochs": 3, "log_interval": 10, "seed": 1},
           "output": {"dir": str(tmp_path / "runs")}}
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def events(path, kind):
    return [r for r in read_records(path) if r["event"] == kind]


@pytest.fixture
def no_role(monkeypatch):
    monkeypatch.delenv("SSDSGD_ROLE", raising=False)


def test_by_hand_training_writes_metrics_and_summary(tmp_path, no_role, caplog):
    cfg = digits_job(tmp_path)
    run = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="ssdsgd.train"):
        assert T.main([str(cfg), "--run-dir", str(run)]) == 0
    assert (run / "config.yaml").exists()
    mfile = run / "metrics" / "worker-0.jsonl"
    start, = events(mfile, "start")
    assert (start["steps_per_epoch"], start["total_steps"], start["num_workers"]) == (44, 132, 1)
    train = events(mfile, "train")
    assert [r["step"] for r in train][:4] == [10, 20, 30, 40]
    for r in train:
        for key in ("step", "epoch", "loss", "accuracy", "samples_per_sec", "stage",
                    "bytes_sent", "bytes_received", "time_blocked"):
            assert key in r
        assert r["stage"] == "local" and r["bytes_sent"] == 0 and r["samples_per_sec"] > 0
    assert train[-1]["loss"] < train[0]["loss"]
    val = events(mfile, "val")
    assert [v["epoch"] for v in val] == [1, 2, 3]
    end, = events(mfile, "end")
    assert end["steps"] == 132 and end["samples"] == 132 * 32
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_accuracy"] == val[-1]["accuracy"] > 0.9
    assert summary["steps"] == 132 and summary["num_workers"] == 1
    assert summary["samples_per_sec"] > 0 and summary["wall_time"] > 0
    assert summary["time_blocked"] == 0 and summary["bytes_sent"] == 0
    lines = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("Epoch[0] Batch[10] Speed: ") and "samples/sec accuracy=" in m
               for m in lines)
    assert any(m.startswith("Epoch[2] Validation accuracy=") for m in lines)


def test_by_hand_training_is_deterministic(tmp_path, no_role):
    cfg = digits_job(tmp_path, train={"epochs": 1})
    recs = []
    for name in ("a", "b"):
        assert T.main([str(cfg), "--run-dir", str(tmp_path / name)]) == 0
        recs.append([(r["step"], r["loss"]) for r in
                     events(tmp_path / name / "metrics/worker-0.jsonl", "train")])
    assert recs[0] == recs[1] and len(recs[0]) == 5


def test_max_steps_and_new_run_dir(tmp_path, no_role):
    cfg = digits_job(tmp_path, "capped", train={"max_steps": 7})
    assert T.main([str(cfg)]) == 0
    run, = (tmp_path / "runs").iterdir()
    assert run.name.startswith("capped-")
    end, = events(run / "metrics/worker-0.jsonl", "end")
    assert end["steps"] == 7
    assert len(events(run / "metrics/worker-0.jsonl", "val")) == 1


def stopped_after_epoch_0(full, part, states=None, state_keys=None):
    """RUN_DIR ``part``: the run ``full`` as if it had stopped after epoch 0, only its
    first checkpoint left (``states``: a replacement for its states file's bytes;
    ``state_keys``: for the record's list of whose state each key is, the full run's)."""
    ck = full / "checkpoints"
    (part / "checkpoints").mkdir(parents=True)
    for f in ("epoch-0000.params", "epoch-0000.states"):
        (part / "checkpoints" / f).write_bytes((ck / f).read_bytes())
    if states is not None:
        (part / "checkpoints/epoch-0000.states").write_bytes(states)
    keys = json.loads((ck / "latest.json").read_text())["state_keys"]
    (part / "checkpoints/latest.json").write_text(json.dumps(
        {"epoch": 0, "next_epoch": 1, "step": 44, "seed": 1, "params": "epoch-0000.params",
         "states": "epoch-0000.states", "state_keys": state_keys or keys}))
    (part / "config.yaml").write_text((full / "config.yaml").read_text())


def assert_same_params(a_path, b_path):
    a, b = mx.nd.load(str(a_path)), mx.nd.load(str(b_path))
    assert a.keys() == b.keys()
    for k in a:
        assert np.allclose(a[k].asnumpy(), b[k].asnumpy(), atol=1e-6), k


def test_checkpoint_and_resume_continue_exactly(tmp_path, no_role):
    cfg = digits_job(tmp_path, train={"epochs": 3, "checkpoint_every": 1})
    full, part = tmp_path / "full", tmp_path / "part"
    assert T.main([str(cfg), "--run-dir", str(full)]) == 0
    ck = full / "checkpoints"
    assert {p.name for p in ck.iterdir()} >= {"epoch-0000.params", "epoch-0000.states",
                                              "epoch-0002.params", "latest.json"}
    latest = json.loads((ck / "latest.json").read_text())
    assert (latest["next_epoch"], latest["step"]) == (3, 132)
    stopped_after_epoch_0(full, part)
    assert T.main(["--resume", str(part)]) == 0
    assert_same_params(ck / "epoch-0002.params", part / "checkpoints/epoch-0002.params")
    start, = events(part / "metrics/worker-0.jsonl", "start")
    assert (start["start_epoch"], start["start_step"]) == (1, 44)


def _dense_number():
    """The number MXNet gives the Dense block built now (it builds one)."""
    from mxnet.gluon import nn
    return int(nn.Dense(1).prefix[len("dense"):-1])


def test_resume_in_a_process_that_built_other_models_restores_each_states_own_key(
        tmp_path, no_role):
    """MXNet's Trainer orders parameters by their names, which count every block the
    process built: a job run after others (dense8..dense10, sorted 10, 8, 9) and its
    resume (dense11..dense13) numbered the same parameters differently, and the resumed
    job loaded the momentum of one into another (CI: 'expected [10], got [128]')."""
    number, boundary = _dense_number(), 10
    while boundary - 3 < number:
        boundary *= 10
    while number < boundary - 3:    # the full run's three Dense layers: 8, 9, 10 (or 98..)
        number = _dense_number()
    cfg = digits_job(tmp_path, train={"epochs": 2, "checkpoint_every": 1})
    full, part = tmp_path / "full", tmp_path / "part"
    assert T.main([str(cfg), "--run-dir", str(full)]) == 0
    stopped_after_epoch_0(full, part)
    assert T.main(["--resume", str(part)]) == 0
    assert_same_params(full / "checkpoints/epoch-0001.params",
                       part / "checkpoints/epoch-0001.params")


def test_a_states_file_whose_states_do_not_fit_the_parameters_is_refused_by_key(
        tmp_path, no_role):
    """States of other shapes than their keys' weights (another model, another order of
    parameters) are refused at --resume with the key, not at the first update with an
    MXNet traceback."""
    from ssdsgd.mxglue import state_file
    cfg = digits_job(tmp_path, train={"epochs": 2, "checkpoint_every": 1})
    full, part = tmp_path / "full", tmp_path / "part"
    assert T.main([str(cfg), "--run-dir", str(full)]) == 0
    spec, states = state_file.load(str(full / "checkpoints/epoch-0000.states"))
    keys = sorted(states)
    first = keys[0]
    other = next(k for k in keys if states[k][0].shape != states[first][0].shape)
    states[first], states[other] = states[other], states[first]
    state_file.save(str(tmp_path / "swapped.states"), spec, states)
    stopped_after_epoch_0(full, part, states=(tmp_path / "swapped.states").read_bytes())
    with pytest.raises(T.DataError) as e:
        T.train(parse_config(yaml.safe_load((part / "config.yaml").read_text())), part,
                resume=True)
    assert f"key {first}" in str(e.value) and "\n" not in str(e.value), e.value


def test_a_checkpoint_of_a_model_whose_parameters_changed_order_is_refused(tmp_path,
                                                                          no_role):
    """The optimizer states are stored by key (the Trainer's parameter order), the
    parameters by their place in the model: after a change of the model's code that
    moves two parameters of the same shape, the states would be loaded into each other's
    place and pass every shape check. The record names whose state each key is (the
    parameter's name in ``save_parameters``' file), and a resume whose model disagrees is
    refused naming both. (Here the record says two keys the other way round while the
    states file is the run's own, so every state fits its key: only the names differ.)"""
    cfg = digits_job(tmp_path, train={"epochs": 2, "checkpoint_every": 1})
    full, part = tmp_path / "full", tmp_path / "part"
    assert T.main([str(cfg), "--run-dir", str(full)]) == 0
    keys = json.loads((full / "checkpoints/latest.json").read_text())["state_keys"]
    params = mx.nd.load(str(full / "checkpoints/epoch-0000.params"))
    assert sorted(keys) == sorted(params)     # every trained parameter, by its file name
    i, j = 1, 3
    moved = list(keys)
    moved[i], moved[j] = keys[j], keys[i]
    stopped_after_epoch_0(full, part, state_keys=moved)
    with pytest.raises(T.DataError) as e:
        T.train(parse_config(yaml.safe_load((part / "config.yaml").read_text())), part,
                resume=True)
    text = str(e.value)
    assert f"key {i}" in text and keys[j] in text and keys[i] in text, text
    assert "\n" not in text, text


def test_cifar_pipeline_smoke(tmp_path, no_role):
    from test_data import make_cifar
    make_cifar(tmp_path / "cifar", per_file=4, test=3)
    cfg = digits_job(tmp_path, model={"name": "cifar_resnet20_v1"},
                     data={"dataset": "cifar10", "path": str(tmp_path / "cifar"),
                           "batch_size": 4, "loader_threads": 1},
                     train={"epochs": 1, "max_steps": 2, "log_interval": 1})
    assert T.main([str(cfg), "--run-dir", str(tmp_path / "run")]) == 0
    summary = json.loads((tmp_path / "run/summary.json").read_text())
    assert summary["steps"] == 2 and summary["steps_per_epoch"] == 5
    assert summary["final_accuracy"] is not None


@pytest.mark.system
def test_cli_errors_are_one_line_with_exit_code_2(tmp_path):
    bad = digits_job(tmp_path, "bad", sync={"delay_steps": 0})
    nodata = digits_job(tmp_path, "nodata", model={"name": "cifar_resnet20_v1"},
                        data={"dataset": "cifar10", "path": str(tmp_path / "absent")})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SSDSGD_", "DMLC_"))}
    # both at once: each spends seconds importing MXNet before it reads its config
    bad_p, nodata_p = (subprocess.Popen([PY, "-m", "ssdsgd.train", *args], cwd=ROOT, env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
                       for args in ([str(bad)], [str(nodata), "--run-dir", str(tmp_path / "r")]))
    try:
        _, bad_err = bad_p.communicate(timeout=120)
        _, nodata_err = nodata_p.communicate(timeout=120)
    finally:
        for p in (bad_p, nodata_p):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert bad_p.returncode == 2
    assert bad_err.strip().splitlines() == [
        f"error: sync.delay_steps: expected auto or an integer >= 1, got 0 ({bad})"]
    assert nodata_p.returncode == 2
    assert nodata_err.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'absent'}: CIFAR-10 data directory not found (data.path)")


# ----------------------------------------------------------------------------- pieces

def cfg_with(**sections):
    raw = {"model": {"name": "digits_mlp"}, "data": {"dataset": "digits"}}
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value)
    return parse_config(raw)


def test_lr_schedules_use_mxnet_schedulers():
    step = R.build_lr_scheduler(cfg_with(
        optimizer={"lr": 0.4, "lr_schedule": {"type": "step", "step_epochs": [2, 3]}},
        train={"epochs": 4}), spe=10)
    assert isinstance(step, mx.lr_scheduler.MultiFactorScheduler)
    assert [round(step(n), 6) for n in (1, 20, 21, 30, 31)] == [0.4, 0.4, 0.04, 0.04, 0.004]
    cos = R.build_lr_scheduler(cfg_with(
        optimizer={"lr": 1.0, "lr_schedule": {"type": "cosine", "warmup_epochs": 1}},
        train={"epochs": 3}), spe=10)
    assert isinstance(cos, mx.lr_scheduler.CosineScheduler)
    assert cos(5) == pytest.approx(0.5) and cos(10) == pytest.approx(1.0)
    assert cos(30) == pytest.approx(0.0, abs=1e-9)
    poly = R.build_lr_scheduler(cfg_with(optimizer={"lr_schedule": {"type": "poly"}}), spe=5)
    assert isinstance(poly, mx.lr_scheduler.PolyScheduler)
    assert R.build_lr_scheduler(cfg_with(), spe=10) is None
    warm = R.build_lr_scheduler(cfg_with(optimizer={"lr": 0.2, "lr_schedule": {
        "warmup_epochs": 2}}, train={"epochs": 5}), spe=10)
    assert warm(10) == pytest.approx(0.1) and warm(40) == pytest.approx(0.2)


def test_gradient_batch_and_optimizer_params():
    sync = cfg_with(data={"batch_size": 32})
    assert R.gradient_batch(sync, None, 1) == 32
    assert R.gradient_batch(sync, object(), 4) == 128   # servers sum N gradients
    asgd = cfg_with(data={"batch_size": 32}, sync={"algorithm": "asgd"})
    assert R.gradient_batch(asgd, object(), 4) == 32
    p = R.optimizer_params(cfg_with(optimizer={"name": "adam", "lr": 0.01}, sync={
        "glu_state": "exact"}), None)
    assert p == {"learning_rate": 0.01, "wd": 0.0}
    assert R.optimizer_params(cfg_with(), None)["momentum"] == 0.9


def test_total_steps():
    cfg = cfg_with(cluster={"workers": 2}, data={"batch_size": 32}, train={"epochs": 20})
    assert run_length(cfg).total_steps == 440
    assert run_length(cfg, num_workers=1).total_steps == 880
    capped = cfg_with(data={"batch_size": 32}, train={"epochs": 20, "max_steps": 100})
    assert run_length(capped).total_steps == 100


def test_worker_mode_environment_checks(monkeypatch):
    cfg = cfg_with(cluster={"workers": 2}, sync={"delay_steps": 7, "warmup_steps": 500})
    monkeypatch.setenv("SSDSGD_ROLE", "server")
    with pytest.raises(ConfigError, match="SSDSGD_ROLE=server"):
        R.create_kvstore(cfg, 22)
    for key in ("SSDSGD_DELAY_STEPS", "SSDSGD_ALGORITHM", "SSDSGD_NUM_WORKERS",
                "SSDSGD_START_STEP"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SSDSGD_WARMUP_STEPS", "500.0")
    R.check_environment(cfg, 22)
    assert os.environ["SSDSGD_DELAY_STEPS"] == "7" and os.environ["SSDSGD_NUM_WORKERS"] == "2"
    assert os.environ["SSDSGD_START_STEP"] == "0"      # a new run starts at step 0
    monkeypatch.setenv("SSDSGD_START_STEP", "44")
    with pytest.raises(ConfigError, match="SSDSGD_START_STEP=44 in the environment"):
        R.check_environment(cfg, 22)
    R.check_environment(cfg, 22, start_step=44)           # resuming after step 44
    monkeypatch.setenv("SSDSGD_DELAY_STEPS", "3")
    with pytest.raises(ConfigError, match="SSDSGD_DELAY_STEPS=3 in the environment"):
        R.check_environment(cfg, 22)


def test_launcher_mode_requires_run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SSDSGD_ROLE", "worker")
    assert T.main([str(digits_job(tmp_path))]) == 2


# ----------------------------------------------------------------------------- progress

def test_progress_monitor_follows_the_metrics_files(tmp_path):
    mdir = tmp_path / "metrics"
    mdir.mkdir()
    f0, f1 = (open(mdir / f"worker-{r}.jsonl", "w") for r in (0, 1))
    for r, f in enumerate((f0, f1)):
        f.write(json.dumps({"event": "start", "rank": r, "num_workers": 2,
                            "total_steps": 100, "batch_size": 32}) + "\n")
        f.flush()
    out = io.StringIO()
    mon = ProgressMonitor(tmp_path, None, tty=False, interval=0, stream=out)
    s = mon.poll()
    assert (s["step"], s["total_steps"]) == (0, 100)
    f0.write(json.dumps({"event": "train", "step": 40, "epoch": 1, "accuracy": 0.8,
                         "samples_per_sec": 100.0, "stage": "warmup",
                         "elapsed": 4.0}) + "\n")
    f1.write(json.dumps({"event": "train", "step": 30, "epoch": 1, "accuracy": 0.6,
                         "samples_per_sec": 50.0, "elapsed": 5.0}) + "\n")
    f1.write('{"event": "train", "step": 4')        # torn line: not read yet
    f0.flush()
    f1.flush()
    s = mon.poll()
    # the job's samples so far over its wall time (70 steps x 32 in 5 s), never the
    # workers' interval rates summed (150)
    assert s["step"] == 30 and s["samples_per_sec"] == pytest.approx(70 * 32 / 5.0)
    assert s["train_accuracy"] == pytest.approx(0.7)
    f1.write('1, "epoch": 1, "samples_per_sec": 50.0, "elapsed": 6.4}\n')
    f0.write(json.dumps({"event": "val", "epoch": 1, "accuracy": 0.91}) + "\n")
    f0.flush()
    f1.flush()
    s = mon.poll()
    assert s["step"] == 40 and s["val_accuracy"] == 0.91
    assert s["samples_per_sec"] == pytest.approx(81 * 32 / 6.4)
    mon.close()
    text = out.getvalue()
    assert "progress: step 0/100 (0%)" in text
    assert "progress: step 40/100 (40%) | epoch 1 | 405 samples/s | val acc 0.9100" in text
    f0.close()
    f1.close()


def test_progress_ends_with_the_jobs_throughput_not_the_workers_rates_summed(tmp_path):
    """Once every worker ended, the line shows the summary's figure: the samples applied
    over the longest wall time (a slow worker's 80 samples/s does not add to the rest)."""
    (tmp_path / "metrics").mkdir()
    for rank, (steps, wall) in enumerate([(30, 3.0), (10, 4.0)]):
        (tmp_path / f"metrics/worker-{rank}.jsonl").write_text(
            json.dumps({"event": "start", "num_workers": 2, "total_steps": 30}) + "\n" +
            json.dumps({"event": "end", "steps": steps, "samples": steps * 32,
                        "wall_time": wall, "samples_per_sec": steps * 32 / wall}) + "\n")
    mon = ProgressMonitor(tmp_path, None, tty=False, interval=0, stream=io.StringIO())
    assert mon.poll()["samples_per_sec"] == pytest.approx(40 * 32 / 4.0)     # not 400
    mon.close()


@pytest.mark.parametrize("rate, shown", [(405.0, "405"), (12.345, "12.3"),
                                          (0.42446, "0.424"), (0.0, "0")])
def test_the_progress_line_shows_a_slow_jobs_rate_not_zero(rate, shown):
    """A job of big images on a busy machine trains under 1 sample a second; its progress
    line said "0 samples/s" (seen in a CI run of the ImageNet config: 0.42), as if nothing
    were trained. Three significant digits below 100, whole numbers above."""
    from ssdsgd.progress import rate_text
    assert rate_text(rate) == shown


def test_progress_monitor_tty_bar(tmp_path):
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics/worker-0.jsonl").write_text(
        json.dumps({"event": "start", "num_workers": 1, "total_steps": 10}) + "\n" +
        json.dumps({"event": "train", "step": 5, "epoch": 0, "accuracy": 0.5,
                    "samples_per_sec": 10.0}) + "\n")
    out = io.StringIO()
    mon = ProgressMonitor(tmp_path, 10, tty=True, stream=out)
    mon.poll()
    mon.close()
    assert "5/10" in out.getvalue() and "train acc 0.5000" in out.getvalue()


class _SlowStream(io.StringIO):
    """stderr as another thread sees it: each write call may be overtaken by another's."""

    def write(self, text):
        n = super().write(text)
        time.sleep(0.0005)
        return n


def test_progress_lines_and_the_workers_lines_never_share_a_line_without_a_tty(tmp_path):
    """The CI defect: "progress: step 0/180 ... | 3s[worker 1] error: ..." when a
    worker's line came between the progress line and its newline (print writes them
    apart). Both go through the monitor: whole lines, one at a time."""
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics/worker-0.jsonl").write_text(
        json.dumps({"event": "start", "num_workers": 1, "total_steps": 10}) + "\n")
    out = _SlowStream()
    mon = ProgressMonitor(tmp_path, 10, tty=False, interval=0, stream=out)
    sink = mon.sink(out)
    stop = threading.Event()

    def worker_lines():
        deadline = time.monotonic() + 10
        while not stop.is_set() and time.monotonic() < deadline:
            print("[worker 1] error: a line of its own", file=sink, flush=True)

    t = threading.Thread(target=worker_lines)
    t.start()
    try:
        for _ in range(200):
            mon.poll()
    finally:
        stop.set()
        t.join(15)
    mon.close()
    lines = out.getvalue().splitlines()
    assert sum(ln.startswith("progress: ") for ln in lines) >= 200
    assert sum(ln.startswith("[worker 1] ") for ln in lines) > 0
    torn = [ln for ln in lines
            if ln not in ("[worker 1] error: a line of its own", "")
            and not (ln.startswith("progress: ") and ln.count("progress") == 1
                     and "[worker" not in ln)]
    assert not torn, torn[:3]
