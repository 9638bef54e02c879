"""kv.pushpull key by key (no Trainer) is an asynchronous operation on MXNet's engine, as
ps-lite's is: it returns at once, every key is in flight together, and the outputs are
pending until their replies are written (issue 10, small steps). Real scheduler, server
and worker processes."""
import os
import signal
import subprocess
import time

import pytest

import jobs
from conftest import PY, SCRIPTS
from test_hardening import job_factory  # noqa: F401 - a fixture: closes each job

pytestmark = pytest.mark.system

SCRIPT = str(SCRIPTS / "keys_pushpull.py")


def workers(job, *args):
    env = dict(job.env, SSDSGD_ROLE="worker")
    return [jobs.start([PY, SCRIPT, *map(str, args)], environ=env) for _ in range(2)]


def finish(ps, timeout=60):
    outs = []
    for p in ps:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            raise AssertionError(f"a worker hung:\n{out}\n{err[-3000:]}")
        outs.append((p.returncode, out, err))
    return outs


def test_many_keys_pushed_and_pulled_one_by_one_get_the_sums(job_factory):
    job = job_factory(workers=2, start_workers=False)
    results = finish(workers(job, "--keys", 300, "--rounds", 3))
    for code, out, err in results:
        assert code == 0, out + err[-3000:]
        assert out.count("300 sums ok") == 3, out
        assert "900 ssgd steps" in out, out      # one step per call, as before


def test_outputs_and_gradients_may_change_between_rounds(job_factory):
    """The worker keeps a key's engine operation while the script passes the same arrays:
    new arrays, and a pull into the gradient itself (no out=), must still get the sums."""
    job = job_factory(workers=2, start_workers=False)
    results = finish(workers(job, "--keys", 30, "--rounds", 4, "--vary"))
    for code, out, err in results:
        assert code == 0, out + err[-3000:]
        assert out.count("30 sums ok") == 4, out


def test_pushpull_returns_before_the_reply_exists(job_factory, tmp_path):
    """Rank 1 pushes a round only after rank 0's pushpull calls of that round have
    returned, so no reply can exist when they return: a synchronous pushpull would wait
    for rank 1 forever (rank 1 gives up after 20 s, exit 4)."""
    job = job_factory(workers=2, start_workers=False)
    hold = tmp_path / "hold"
    hold.mkdir()
    results = finish(workers(job, "--keys", 50, "--rounds", 2, "--hold", hold))
    for code, out, err in results:
        assert code == 0, out + err[-3000:]
        assert out.count("50 sums ok") == 2, out
    assert sum(out.count("returned before any reply") for _, out, _ in results) == 2


def test_a_dead_server_fails_pending_pushpulls_with_a_clear_error(job_factory, tmp_path):
    """Rank 0 has 100 pushpulls pending (rank 1 never pushes) when the server is killed:
    its wait ends and its next kvstore call raises, naming the dead server."""
    job = job_factory(workers=2, start_workers=False,
              SSDSGD_HEARTBEAT_INTERVAL=0.5, SSDSGD_HEARTBEAT_TIMEOUT=2)
    die = tmp_path / "die"
    die.mkdir()
    ps = workers(job, "--keys", 100, "--die", die)
    deadline = time.monotonic() + 60
    while not (die / "pending").exists():
        assert time.monotonic() < deadline and all(p.poll() is None for p in ps), \
            [p.communicate() for p in ps if p.poll() is not None]
        time.sleep(0.05)
    killed = time.monotonic()
    os.kill(job.server.pid, signal.SIGKILL)
    results = finish(ps, timeout=30)
    assert time.monotonic() - killed < 30
    rank0 = [(code, out, err) for code, out, err in results if "rank 0 error" in out]
    assert rank0, results
    code, out, err = rank0[0]
    assert code == 3, out + err[-3000:]
    assert "waitall returned" in out
    assert "rank 0 error: JobAborted" in out and "server 0" in out, out
