"""The launcher's exit code tells the truth (issues 24 and 30): a worker that never joined
the job fails it, naming the rank; a worker killed after it finished does not; after a
heartbeat timeout the launcher blames the process the scheduler named, not the first to
exit; a server or scheduler that does not end cleanly fails the job."""
import os
import signal
import subprocess
import time

import pytest

from conftest import PY, ROOT, SCRIPTS
from test_e2e_configs import clean_env

pytestmark = pytest.mark.system


def _launcher_lines(stderr):
    return [ln for ln in stderr.splitlines() if ln.startswith("[launcher]")]


def test_workers_that_never_joined_fail_the_job_naming_their_ranks():
    started = time.monotonic()
    res = subprocess.run([PY, "launch/dist.py", "-n", "2", "-s", "1", "--", PY,
                          str(SCRIPTS / "no_import.py")], capture_output=True, text=True,
                         cwd=ROOT, env=clean_env(), timeout=120)
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
    res = subprocess.run([PY, "launch/dist.py", "-n", "2", "-s", "1", "--", PY, str(script)],
                         capture_output=True, text=True, cwd=ROOT, env=clean_env(),
                         timeout=120)
    assert res.returncode == 1, res.stderr[-2000:]
    assert "trained alone" in res.stdout
    lines = _launcher_lines(res.stderr)
    for rank in (0, 1):
        assert any(f"worker {rank} exited 0 without joining the job" in ln for ln in lines), \
            lines


def test_a_worker_killed_after_it_finished_leaves_the_job_a_success(tmp_path):
    job = subprocess.Popen([PY, "launch/dist.py", "-n", "2", "-s", "1", "--", PY,
                            str(SCRIPTS / "finish_then_wait.py"), str(tmp_path)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           cwd=ROOT, env=clean_env(), start_new_session=True)
    try:
        marker, deadline = tmp_path / "finished-rank1", time.monotonic() + 90
        while not marker.exists():
            assert job.poll() is None and time.monotonic() < deadline, "rank 1 never finished"
            time.sleep(0.1)
        os.kill(int(marker.read_text()), signal.SIGKILL)     # alive: it sleeps 120 s
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    assert any("worker 1" in ln and "killed by SIGKILL after it finished" in ln
               for ln in _launcher_lines(err)), err[-2000:]
    assert job.returncode == 0, err[-2000:]
