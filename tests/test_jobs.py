"""tests/jobs.py itself: a job's processes are found by its tag wherever they run (a
session of their own, orphaned by a killed leader) and close() leaves none of them; a
wait past its deadline fails the test and stops the job."""
import subprocess
import time

import pytest

import jobs
from conftest import PY

pytestmark = pytest.mark.system

# a leader that starts a child in a session of its own (as the launcher starts its nodes),
# prints the child's pid and sleeps
LEADER = ("import subprocess, sys, time; "
          "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], "
          "start_new_session=True); print(c.pid, flush=True); time.sleep(120)")


def _child(job):
    job.wait_for(lambda: job.lines, 30, "the child's pid")
    return int(job.lines[0])


def _gone(pid):
    return not jobs._alive(pid)


def test_close_stops_a_child_in_a_session_of_its_own():
    job = jobs.start([PY, "-c", LEADER])
    child = _child(job)
    assert job.processes() == [child]
    job.close()
    assert job.poll() is not None and _gone(child)
    assert job not in jobs.open_jobs()


def test_close_stops_what_a_killed_leader_left():
    job = jobs.start([PY, "-c", LEADER])
    child = _child(job)
    job.proc.kill()                         # the leader alone: its child is orphaned
    job.proc.wait(timeout=10)
    assert not _gone(child) and job.processes() == [child]
    job.close()
    assert _gone(child)


def test_a_wait_past_its_deadline_fails_and_stops_the_job():
    job = jobs.start([PY, "-c", LEADER])
    child = _child(job)
    started = time.monotonic()
    with pytest.raises(AssertionError, match="did not end within 1 s"):
        job.wait(timeout=1)
    assert time.monotonic() - started < 10
    assert job.poll() is not None and _gone(child)


def test_a_job_the_test_left_open_is_closed_when_it_ends():
    before = jobs.open_jobs()
    job = jobs.start([PY, "-c", LEADER])
    child = _child(job)
    assert jobs.close_jobs_started_since(before) == 1      # what the autouse fixture does
    assert _gone(child)


def test_run_gives_the_outcome_and_stdout_and_stderr_apart():
    job = jobs.run(["--help"], timeout=60)
    assert job.returncode == 0 and "launch/dist.py" in job.stdout
    p = jobs.start([PY, "-c", "import sys; print('out'); print('err', file=sys.stderr)"])
    out, err = p.communicate(timeout=30)
    assert (out, err, p.returncode) == ("out\n", "err\n", 0)
    with pytest.raises(subprocess.TimeoutExpired):
        jobs.start([PY, "-c", "import time; time.sleep(60)"]).communicate(timeout=0.5)
