"""Shared helpers for tests that start real processes (always cleaned up)."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
PY = sys.executable
sys.path.insert(0, str(SCRIPTS))


def launch(n, s, script_args, env=None, timeout=180, script="ssd_worker.py"):
    """Run ``launch/dist.py -n N -s S -- python tests/scripts/SCRIPT ...``."""
    cmd = [PY, str(ROOT / "launch" / "dist.py"), "-n", str(n), "-s", str(s)]
    for k, v in (env or {}).items():
        cmd += ["--env", f"{k}={v}"]
    cmd += ["--", PY, str(SCRIPTS / script)] + [str(a) for a in script_args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


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
        for p in self.items:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait(timeout=10)


@pytest.fixture
def procs():
    ps = Procs()
    yield ps
    ps.close()


def node_env(port, num_workers=1, num_servers=1, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DMLC_", "SSDSGD_"))}
    env.update({"SSDSGD_SCHEDULER_PORT": str(port), "SSDSGD_NUM_WORKERS": str(num_workers),
                "SSDSGD_NUM_SERVERS": str(num_servers)})
    env.update({k: str(v) for k, v in extra.items()})
    return env
