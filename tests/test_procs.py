"""Stopping process groups (ssdsgd.testing.stop_groups, LocalProcess.signal): what a job
left behind is killed, and nobody else's processes are.

A leader that has exited and been reaped frees its pid; on a busy machine the kernel soon
hands that pid to a new process, which may lead a session of its own (every job process
here does). Signalling the old group then hits that stranger (other tests, other jobs,
even the pytest run). The tests emulate the reuse by pointing a reaped Popen at a live
session leader.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from ssdsgd.launch.local import LocalProcess
from ssdsgd.testing import stop_groups

pytestmark = pytest.mark.system

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def _gone(pid, timeout=10.0):
    """The process has exited (gone, or a zombie nobody reaps)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def stranger():
    """A live session leader that is not ours to stop."""
    p = subprocess.Popen(SLEEP, start_new_session=True)
    yield p
    p.kill()
    p.wait()


def reaped_with_pid_of(stranger):
    ours = subprocess.Popen(["true"], start_new_session=True)
    ours.wait()
    ours.pid = stranger.pid      # the kernel reused the reaped leader's pid
    return ours


def test_stop_groups_leaves_a_reused_pid_alone(stranger):
    # the control, a live group of ours in the same call, shows that a group the call
    # kills is gone within the 0.3 s the stranger is then given
    control = subprocess.Popen(SLEEP, start_new_session=True)
    stop_groups([reaped_with_pid_of(stranger), control], grace=0)
    assert _gone(control.pid, timeout=0.3), "the control group was not killed"
    time.sleep(0.3)
    assert stranger.poll() is None, "the stranger's group was killed"


def test_local_process_signal_leaves_a_reused_pid_alone(stranger):
    control = subprocess.Popen(SLEEP, start_new_session=True)   # as above
    try:
        LocalProcess("worker", 1, control).signal(signal.SIGKILL)
        assert _gone(control.pid, timeout=0.3), "the control group was not killed"
    finally:
        control.kill()
        control.wait()
    LocalProcess("worker", 0, reaped_with_pid_of(stranger)).signal(signal.SIGKILL)
    time.sleep(0.3)
    assert stranger.poll() is None, "the stranger's group was killed"


def test_a_child_left_by_an_exited_leader_is_still_killed():
    code = ("import subprocess, sys; "
            f"p = subprocess.Popen({SLEEP!r}); print(p.pid, flush=True)")
    leader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    child = int(leader.stdout.readline())
    leader.wait()
    leader.stdout.close()
    try:
        assert not _gone(child, timeout=0.5), "the child should outlive its leader"
        stop_groups([leader], grace=0)
        assert _gone(child), f"the leader's child {child} was left running"
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
