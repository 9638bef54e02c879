"""The local launcher leaves nothing behind (issue 12, defect 5): after SIGKILL of
``launch/dist.py`` every process it started exits within 30 s, although the job's
scheduler, server and workers were healthy and heartbeating each other."""
import time
from pathlib import Path

import pytest

import jobs
from test_e2e_configs import sets

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
    with jobs.dist(["configs/digits.yaml", *sets(train__epochs=500,
                                                 output__dir=tmp_path / "runs")],
                   merge=True) as job:
        # every node registered: the job is under way
        job.wait_for("job started", 90, "the job starting to train")
        kids = children(job.pid)
        assert len(kids) == 5   # scheduler, server, 2 workers, the key directory's janitor
        job.proc.kill()
        job.wait(timeout=10)
        t0 = time.monotonic()
        left = wait_gone(kids, 30)
        assert left == [], f"still running {time.monotonic() - t0:.0f} s after the " \
                           f"launcher's SIGKILL: {left}"


def test_the_key_directory_goes_even_when_every_process_of_the_job_is_killed(tmp_path):
    # A tool that kills a job's processes by its environment (as tests/jobs.py does, by
    # its tag) used to kill the janitor too, before it removed the keys: 100 key
    # directories were left in /tmp by one day of test runs. The janitor now carries none
    # of the launcher's environment.
    with jobs.dist(["configs/digits.yaml", *sets(train__epochs=500,
                                                 output__dir=tmp_path / "runs")],
                   merge=True) as job:
        job.wait_for("job started", 90, "the job starting to train")
        env = dict(v.split(b"=", 1) for v in jobs._environ(job.process("worker", 0)) if b"=" in v)
        keydir = Path(env[b"SSDSGD_SECRET_FILE"].decode()).parent
        assert keydir.is_dir()
        janitor = [p for p in children(job.pid)
                   if b"sys.stdin.buffer.read()" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(janitor) == 1, children(job.pid)
        shared = set(jobs._environ(janitor[0])) & set(jobs._environ(job.pid)) - {b""}
        assert not shared, f"the janitor carries {len(shared)} of the launcher's variables"
        job.close()
    deadline = time.monotonic() + 30
    while keydir.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not keydir.exists(), f"{keydir} still there 30 s after the job was killed"
