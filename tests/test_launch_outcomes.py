"""The launcher's exit code tells the truth (issues 24 and 30): a worker that never joined
the job fails it, naming the rank; a worker killed after it finished does not; after a
heartbeat timeout the launcher blames the process the scheduler named, not the first to
exit; a server or scheduler that does not end cleanly fails the job."""
import os
import signal
import time

import pytest

import jobs
from conftest import PY, SCRIPTS

pytestmark = pytest.mark.system


def _launcher_lines(stderr):
    return [ln for ln in stderr.splitlines() if ln.startswith("[launcher]")]


def test_workers_that_never_joined_fail_the_job_naming_their_ranks():
    started = time.monotonic()
    res = jobs.run(["-n", "2", "-s", "1", "--", PY, SCRIPTS / "no_import.py"], timeout=120)
    lines = _launcher_lines(res.stderr)
    assert res.returncode == 1, res.stderr[-2000:]
    assert "trained alone" in res.stdout      # the script did run, on a local store
    for rank in (0, 1):
        assert any(f"worker {rank} exited 0 without joining the job" in ln
                   and "import ssdsgd" in ln for ln in lines), lines
    assert time.monotonic() - started < 60     # not the scheduler's 60 s register timeout


def test_a_script_whose_ssdsgd_is_an_empty_namespace_package_fails_the_job(tmp_path):
    """``import ssdsgd`` succeeds but finds an empty folder next to the script (a namespace
    package): nothing registers ssd_sync, and each worker would train alone, exit 0."""
    (tmp_path / "ssdsgd").mkdir()
    script = tmp_path / "train.py"
    script.write_text("import ssdsgd  # an empty folder beside this script\n"
                      + (SCRIPTS / "no_import.py").read_text())
    res = jobs.run(["-n", "2", "-s", "1", "--", PY, script], timeout=120)
    assert res.returncode == 1, res.stderr[-2000:]
    assert "trained alone" in res.stdout
    lines = _launcher_lines(res.stderr)
    for rank in (0, 1):
        assert any(f"worker {rank} exited 0 without joining the job" in ln for ln in lines), \
            lines


def test_a_worker_killed_after_it_finished_leaves_the_job_a_success(tmp_path):
    with jobs.dist(["-n", "2", "-s", "1", "--", PY, SCRIPTS / "finish_then_wait.py",
                    tmp_path]) as job:
        marker = tmp_path / "finished-rank1"
        job.wait_for(marker.exists, 90, "rank 1 finishing")
        os.kill(int(marker.read_text()), signal.SIGKILL)     # alive: it sleeps 120 s
        out, err = job.communicate(timeout=60)
    assert any("worker 1" in ln and "killed by SIGKILL after it finished" in ln
               for ln in _launcher_lines(err)), err[-2000:]
    assert job.returncode == 0, err[-2000:]
