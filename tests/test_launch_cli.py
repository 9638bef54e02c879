"""launch/dist.py's command line as a newcomer meets it (issue 24's launcher polish, issue
30 item 6): help that shows both forms, errors found before anything starts (exit 2, one
line, no run directory), Ctrl-C that says how to continue, a bare `python` that is the
launcher's own, a resumed run's progress, and keys that outlive no launcher."""
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

import jobs
from conftest import PY, SCRIPTS
from ssdsgd.launch.cli import resolve_python
from ssdsgd.progress import ProgressMonitor
from test_e2e_configs import dist, records, sets


def test_help_shows_both_forms_as_plain_text():
    p = dist(["--help"], timeout=60)
    assert p.returncode == 0
    assert "launch/dist.py CONFIG.yaml" in p.stdout
    assert "launch/dist.py -n N [-s S]" in p.stdout and "-- COMMAND" in p.stdout
    assert "``" not in p.stdout                       # no raw reST


def test_a_bare_python_is_the_launchers_interpreter():
    assert resolve_python(["python", "t.py"]) == [sys.executable, "t.py"]
    assert resolve_python(["python3.11", "-c", "1"]) == [sys.executable, "-c", "1"]
    assert resolve_python(["/usr/bin/python3", "t.py"]) == ["/usr/bin/python3", "t.py"]
    assert resolve_python(["./python", "t.py"]) == ["./python", "t.py"]
    assert resolve_python(["pythonista"]) == ["pythonista"]


def test_a_resumed_runs_progress_starts_at_its_checkpoint(tmp_path):
    """The interrupted run's records (up to step 30) are in the file; the resumed run
    starts at the checkpoint, step 20, and shows that until it writes records of its own."""
    (tmp_path / "metrics").mkdir()
    for rank in (0, 1):
        with open(tmp_path / "metrics" / f"worker-{rank}.jsonl", "w") as f:
            for step in (10, 20, 30):
                f.write(json.dumps({"event": "train", "step": step, "epoch": 0}) + "\n")
    assert ProgressMonitor(tmp_path, 100).poll(display=False)["step"] == 30   # as before
    mon = ProgressMonitor(tmp_path, 100, start_step=20)
    assert mon.poll(display=False)["step"] == 20
    with open(tmp_path / "metrics" / "worker-0.jsonl", "a") as f:
        f.write(json.dumps({"event": "train", "step": 24, "epoch": 1}) + "\n")
    with open(tmp_path / "metrics" / "worker-1.jsonl", "a") as f:
        f.write(json.dumps({"event": "train", "step": 25, "epoch": 1}) + "\n")
    assert mon.poll(display=False)["step"] == 24


@pytest.mark.system
def test_a_port_in_use_is_found_before_anything_starts(tmp_path):
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = dist(["configs/digits.yaml", "--port", port, *sets(output__dir=tmp_path)],
                 timeout=60)
        q = dist(["-n", "1", "--port", port, "--", PY, "-c", "pass"], timeout=60)
    for res in (p, q):
        assert res.returncode == 2, res.stderr[-2000:]
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and f"--port {port}" in lines[0] and "in use" in lines[0]
        assert "[scheduler]" not in res.stdout + res.stderr      # nothing started
    assert not any(tmp_path.iterdir())                           # no empty run directory


@pytest.mark.system
def test_a_read_only_output_dir_is_one_line_and_exit_2(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):     # root writes anyway: a path under a file instead
            target = tmp_path / "afile" / "runs"
            (tmp_path / "afile").write_text("")
        else:
            target = ro / "runs"
        p = dist(["configs/digits.yaml", *sets(output__dir=target)], timeout=60)
    finally:
        ro.chmod(0o700)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot write the run directory under output.dir=" in lines[0]
    assert "Traceback" not in p.stderr


@pytest.mark.system
def test_an_epoch_shorter_than_log_interval_still_moves_and_a_whole_warmup_is_warned(tmp_path):
    p = dist(["configs/digits.yaml", *sets(output__dir=tmp_path, train__epochs=2,
                                           train__log_interval=1000, sync__warmup_steps=500,
                                           train__checkpoint_every=0, output__plots="false")],
             timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    assert any(ln.startswith("[launcher] warning: the warm-up (500 steps")
               and "covers the whole run (44 steps)" in ln for ln in p.stderr.splitlines())
    run = next(d for d in tmp_path.iterdir() if d.is_dir())
    assert [r["step"] for r in records(run, 0, "train")] == [22, 44]    # once an epoch


def _key_dir_of(pid_file: Path, timeout=60) -> Path:
    deadline = time.monotonic() + timeout
    while not pid_file.exists():
        assert time.monotonic() < deadline, "the worker never started"
        time.sleep(0.1)
    time.sleep(0.2)
    env = dict(item.split("=", 1) for item in Path(
        f"/proc/{int(pid_file.read_text())}/environ").read_text().split("\0") if "=" in item)
    return Path(env["SSDSGD_SECRET_FILE"]).parent


@pytest.mark.system
def test_a_sigkilled_launcher_leaves_no_key_directory(tmp_path):
    with jobs.dist(["-n", "1", "-s", "1", "--", PY, SCRIPTS / "ssd_worker.py", "--out",
                    tmp_path, "--steps", "1000000"]) as job:
        keys = _key_dir_of(tmp_path / "pid-rank0")
        assert keys.is_dir() and any(keys.iterdir())
        job.proc.kill()                     # the launcher alone, by SIGKILL
        job.wait(timeout=10)
        deadline = time.monotonic() + 20
        while keys.exists():
            assert time.monotonic() < deadline, f"{keys} outlived the launcher"
            time.sleep(0.1)


@pytest.mark.system
def test_ctrl_c_says_where_the_run_is_and_how_to_resume_it(tmp_path):
    with jobs.dist(["configs/digits.yaml", *sets(output__dir=tmp_path, train__epochs=200,
                                                 debug__slowdown="delay:0=0.02",
                                                 output__plots="false")]) as job:
        def checkpointed():    # the first epoch's checkpoint, so there is something to resume
            runs = [d for d in tmp_path.iterdir() if d.is_dir()]
            return runs if runs and (runs[0] / "checkpoints" / "latest.json").exists() else None
        runs = job.wait_for(checkpointed, 120, "a checkpoint")
        job.send_signal(signal.SIGINT)
        out, err = job.communicate(timeout=60)
    assert job.returncode == 130
    assert f"[launcher] stopped; the run directory is {runs[0]}; continue it with: python " \
           f"launch/dist.py --resume {runs[0]}" in err, err[-2000:]


def test_max_restarts_on_the_command_line_is_checked_against_the_algorithm(tmp_path):
    """--max-restarts is a restart the config's own check cannot see: an algorithm that
    does not take restarts is refused in one line before anything starts, nothing written."""
    p = dist(["configs/digits.yaml", "--max-restarts", "2",
              *sets(sync__algorithm="asgd", output__dir=tmp_path / "runs")], timeout=60)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "sync.algorithm: asgd" in lines[0] \
        and "--max-restarts" in lines[0], lines
    assert not (tmp_path / "runs").exists()


def test_asgd_with_several_workers_is_warned_of_its_lr_convention(capsys):
    """asgd applies each worker's push as an update of its own at optimizer.lr (as
    dist_async under Module): with N workers a round moves the weights about N times as
    far as an ssgd step. The demo's lr 0.1 with 2 workers ended at 0.10-0.20 accuracy,
    exit 0, with nothing said; now the launcher says so before the job starts."""
    from ssdsgd.config import parse_config
    from ssdsgd.launch.cli import _warn_async_lr

    def config(algorithm, workers):
        return parse_config({"cluster": {"workers": workers}, "sync": {"algorithm": algorithm},
                             "model": {"name": "digits_mlp"}, "data": {"dataset": "digits"},
                             "optimizer": {"name": "sgd", "lr": 0.1}})
    _warn_async_lr(config("asgd", 2))
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("[launcher] warning: sync.algorithm asgd applies each of the 2 "
                           "workers' pushes as its own update at optimizer.lr 0.1"), line
    assert "0.05" in line and "docs/training.md" in line, line
    for algorithm, workers in (("asgd", 1), ("ssgd", 2), ("ssd", 4)):
        _warn_async_lr(config(algorithm, workers))
        assert capsys.readouterr().err == ""


def test_the_command_forms_watch_follows_continue_and_replicas_from_its_env():
    """``--env SSDSGD_ON_WORKER_FAILURE=continue`` (or SSDSGD_SERVER_REPLICAS=1) in the
    command form: the launcher leaves a dead worker behind (or lets a backup take a dead
    server's keys), as the config form does, instead of stopping a job its scheduler
    would carry on (tests/test_leave_jobs.py runs a dead worker in the command form)."""
    from ssdsgd.launch.cli import _watch_settings
    assert _watch_settings({}) == {"max_workers": None, "continue_without_workers": False,
                                   "server_replicas": 0}
    assert _watch_settings({"SSDSGD_ON_WORKER_FAILURE": "continue",
                            "SSDSGD_SERVER_REPLICAS": "1", "SSDSGD_MAX_WORKERS": "4"}) == {
        "max_workers": 4, "continue_without_workers": True, "server_replicas": 1}
