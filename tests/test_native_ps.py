"""MXNet's native parameter server (ps-lite) as the reference for ssdsgd.

* run_native itself: a failing worker is named, a hanging job times out.
* native dist_sync (2 workers, 1 server): both workers end with the same weights, and
  those moved away from the initial ones.
* the oracle: ssd_sync with SSDSGD_ALGORITHM=ssgd, started by launch/dist.py with 1 and 2
  servers, ends with the weights native dist_sync ends with (rtol 1e-5, atol 1e-6), rank
  by rank.  Skipped until launch/dist.py exists.
"""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import jobs  # noqa: E402
from ssdsgd.launch.job import free_port  # noqa: E402
from ssdsgd.testing import NativePSError, run_native  # noqa: E402

pytestmark = pytest.mark.system

TRAIN = REPO / 'tests' / 'scripts' / 'train_small.py'
DIST = REPO / 'launch' / 'dist.py'
STEPS = 20
NUM_WORKERS = 2
RTOL, ATOL = 1e-5, 1e-6
# Same environment for the native and the ssd_sync runs; one OpenMP thread keeps the
# jobs light on a small machine and the arithmetic comparable.
JOB_ENV = {'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(REPO)}

needs_dist = pytest.mark.skipif(not DIST.exists(),
                                reason='launch/dist.py (the ssd_sync launcher) does not exist yet')


def train_cmd(kvstore, out, bn):
    cmd = [sys.executable, str(TRAIN), '--kvstore', kvstore, '--steps', str(STEPS),
           '--out', str(out)]
    return cmd + (['--bn'] if bn else [])


def load_run(out, num_workers=NUM_WORKERS):
    """{rank: (final arrays, initial arrays, meta)} of one job's output directory."""
    runs = {}
    for rank in range(num_workers):
        meta = json.loads((out / f'meta-rank{rank}.json').read_text())
        with np.load(out / f'weights-rank{rank}.npz') as w, \
                np.load(out / f'init-rank{rank}.npz') as i:
            runs[rank] = (dict(w), dict(i), meta)
    return runs


def trainable(meta):
    return [p['key'] for p in meta['params'] if p['grad_req'] != 'null']


@pytest.fixture(scope='module')
def native_runs(tmp_path_factory):
    """Native dist_sync results, run once per BatchNorm setting and shared."""
    cache = {}

    def get(bn):
        if bn not in cache:
            out = tmp_path_factory.mktemp(f'native-bn{int(bn)}')
            run_native(train_cmd('{mode}', out, bn), NUM_WORKERS, num_servers=1,
                       mode='dist_sync', env=JOB_ENV, timeout=120, cwd=REPO)
            cache[bn] = load_run(out)
        return cache[bn]
    return get


# --- run_native itself -------------------------------------------------------------

def test_free_port_is_bindable():
    import socket
    port = free_port()
    with socket.socket() as s:
        s.bind(('127.0.0.1', port))


def test_failing_worker_is_named():
    cmd = [sys.executable, '-c', 'import sys; print("boom", file=sys.stderr); sys.exit(3)']
    with pytest.raises(NativePSError, match=r'(?s)worker \d .*exit code 3.*boom'):
        run_native(cmd, 2, timeout=60, env=JOB_ENV)


def test_timeout_kills_the_job():
    cmd = [sys.executable, '-c', 'import time; time.sleep(600)']
    with pytest.raises(NativePSError, match='timed out after 3 s'):
        run_native(cmd, 1, timeout=3, env=JOB_ENV)


# --- native dist_sync ---------------------------------------------------------------

@pytest.mark.parametrize('bn', [False, True], ids=['plain', 'bn'])
def test_native_dist_sync_workers_agree(native_runs, bn):
    runs = native_runs(bn)
    assert sorted(m['rank'] for _, _, m in runs.values()) == [0, 1]
    assert all(m['num_workers'] == NUM_WORKERS and m['update_on_kvstore']
               for _, _, m in runs.values())
    final0, init0, meta0 = runs[0]
    final1, init1, _ = runs[1]
    # Same seed, so the initial weights agree even before the kvstore's broadcast.
    for key in final0:
        np.testing.assert_array_equal(init0[key], init1[key], err_msg=key)
    for key in trainable(meta0):
        np.testing.assert_array_equal(final0[key], final1[key], err_msg=key)
        assert not np.allclose(final0[key], init0[key]), f'{key} did not change'
    # BatchNorm running statistics are never pushed: each worker's follow its own shard.
    for key in set(final0) - set(trainable(meta0)):
        assert not np.allclose(final0[key], final1[key]), key


# --- the oracle: ssd_sync (ssgd) == native dist_sync ----------------------------------

def run_dist(num_servers, out, bn, timeout=120):
    args = ['-n', NUM_WORKERS, '-s', num_servers, '--env', 'SSDSGD_ALGORITHM=ssgd']
    for k, v in JOB_ENV.items():
        args += ['--env', f'{k}={v}']
    args += ['--', *train_cmd('ssd_sync', out, bn)]
    proc = jobs.run(args, env=JOB_ENV, timeout=timeout, merge=True)
    output = proc.stdout
    assert proc.returncode == 0, f'launch/dist.py exited {proc.returncode}:\n{output[-4000:]}'


# Each number of servers and each net once (2 jobs, not 4): 1 server and the plain net;
# 2 servers (the keys placed over both) and the BatchNorm net
# (statistics that are never pushed, on top of the same keys).
@needs_dist
@pytest.mark.parametrize('num_servers,bn', [(1, False), (2, True)], ids=['1-plain', '2-bn'])
def test_ssd_sync_ssgd_matches_native_dist_sync(native_runs, tmp_path, num_servers, bn):
    native = native_runs(bn)
    run_dist(num_servers, tmp_path, bn)
    ssd = load_run(tmp_path)
    for rank in range(NUM_WORKERS):
        ref_final, _, ref_meta = native[rank]
        got_final, _, got_meta = ssd[rank]
        assert got_meta['num_workers'] == NUM_WORKERS
        assert sorted(got_final) == sorted(ref_final)
        # All parameters, rank by rank: a worker's BatchNorm statistics depend on its
        # shard (the same rank -> the same shard) and on the synchronized weights.
        for key in ref_final:
            np.testing.assert_allclose(got_final[key], ref_final[key], rtol=RTOL, atol=ATOL,
                                       err_msg=f'rank {rank} {key} ({num_servers} servers)')
