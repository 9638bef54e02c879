"""The local launcher leaves nothing behind (issue 12, defect 5): after SIGKILL of
``launch/dist.py`` every process it started exits within 30 s, although the job's
scheduler, server and workers were healthy and heartbeating each other."""
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from test_e2e_configs import PY, ROOT, clean_env, sets

pytestmark = pytest.mark.system


def children(pid):
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"     # a zombie has exited
    except OSError:
        return False


def wait_gone(pids, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


def test_sigkill_of_the_launcher_ends_every_child(tmp_path):
    log = open(tmp_path / "launcher.log", "w+")
    proc = subprocess.Popen([PY, "launch/dist.py", "configs/digits.yaml", *sets(
        train__epochs=500, output__dir=tmp_path / "runs")], cwd=ROOT, env=clean_env(),
        stdout=log, stderr=subprocess.STDOUT)
    kids = []
    try:
        deadline = time.monotonic() + 90
        while True:     # every node registered: the job is under way
            log.seek(0)
            if "job started" in log.read():
                break
            assert proc.poll() is None, open(tmp_path / "launcher.log").read()[-3000:]
            assert time.monotonic() < deadline, "the job did not start training in time"
            time.sleep(0.2)
        kids = children(proc.pid)
        assert len(kids) == 5   # scheduler, server, 2 workers, the key directory's janitor
        proc.kill()
        proc.wait(timeout=10)
        t0 = time.monotonic()
        left = wait_gone(kids, 30)
        assert left == [], f"still running {time.monotonic() - t0:.0f} s after the " \
                           f"launcher's SIGKILL: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in kids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        log.close()
