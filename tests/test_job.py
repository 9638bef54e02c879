"""ssdsgd.launch.job.run_job's edges that the whole-job tests do not reach: an unknown
launcher, a process that cannot be started (everything already started is stopped)."""
import io
import signal
import sys

import pytest

from ssdsgd.launch.job import job_plan, run_job
from ssdsgd.launch.local import LocalLauncher


class RecordingLauncher(LocalLauncher):
    """The local launcher, keeping what it started so the test can check it is gone."""

    def __init__(self):
        self.started = []

    def start(self, role, rank, cmd, env):
        proc = super().start(role, rank, cmd, env)
        self.started.append(proc)
        return proc


def test_job_plan_starts_scheduler_then_servers_then_workers():
    plan = job_plan(2, 2, ["python", "w.py"])
    assert [(role, rank) for role, rank, _ in plan] == [
        ("scheduler", 0), ("server", 0), ("server", 1), ("worker", 0), ("worker", 1)]
    assert plan[0][2] == [sys.executable, "-m", "ssdsgd.node"] == plan[1][2]
    assert plan[3][2] == ["python", "w.py"]


def test_unknown_launcher_is_one_line_and_exit_2():
    lines = []
    assert run_job(1, 1, ["true"], launcher="nope", log=lines.append) == 2
    assert lines == ["unknown launcher 'nope'; available: local"]


@pytest.mark.system
def test_a_worker_that_cannot_start_stops_what_was_started():
    lines, out = [], io.StringIO()
    runner = RecordingLauncher()
    before = signal.getsignal(signal.SIGINT)
    code = run_job(1, 1, ["/nonexistent/ssdsgd-worker"], launcher=runner, log=lines.append,
                   stdout=out, stderr=out)
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith(
        "cannot start worker 0 (/nonexistent/ssdsgd-worker): ")
    assert [p.name for p in runner.started] == ["scheduler", "server 0"]
    assert all(p.poll() is not None for p in runner.started)     # none left running
    assert signal.getsignal(signal.SIGINT) is before              # handlers restored
