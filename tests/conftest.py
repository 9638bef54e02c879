"""Shared helpers for tests that start real processes (always cleaned up)."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ssdsgd.testing import clean_env, run_dist, stop_groups

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
PY = sys.executable
sys.path.insert(0, str(SCRIPTS))


def launch(n, s, script_args, env=None, timeout=180, script="ssd_worker.py"):
    """Run ``launch/dist.py -n N -s S -- python tests/scripts/SCRIPT ...``."""
    args = ["-n", n, "-s", s]
    for k, v in (env or {}).items():
        args += ["--env", f"{k}={v}"]
    args += ["--", PY, SCRIPTS / script, *script_args]
    return run_dist(args, timeout=timeout)


def load_npz(path):
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


class Procs:
    """Processes a test started; all killed (process group) at teardown."""

    def __init__(self):
        self.items = []

    def start(self, cmd, env, **kw):
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True, **kw)
        self.items.append(p)
        return p

    def close(self):
        stop_groups(self.items, grace=0)


@pytest.fixture
def procs():
    ps = Procs()
    yield ps
    ps.close()


def node_env(port, num_workers=1, num_servers=1, **extra):
    return clean_env(SSDSGD_SCHEDULER_PORT=port, SSDSGD_NUM_WORKERS=num_workers,
                     SSDSGD_NUM_SERVERS=num_servers, **extra)
