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


# The digits job of the checkpoint tests (tests/test_resume.py, tests/test_recovery.py):
# 2 workers x batch 16 (44 steps an epoch), 2 epochs, a checkpoint every epoch. Its
# uninterrupted run is made once per session and algorithm and shared by both modules.
DIGITS_EPOCHS = 2
DIGITS_STEPS = 1437 // (2 * 16)


def digits_job(algorithm):
    """``--set`` arguments of the checkpoint tests' digits job (ssd: warm-up 29 steps)."""
    overrides = {"data.batch_size": 16, "train.epochs": DIGITS_EPOCHS,
                 "train.checkpoint_every": 1, "train.log_interval": 4,
                 "output.plots": "false"}       # no test of theirs looks at the plots
    overrides.update({"sync.warmup_steps": 29} if algorithm == "ssd" else
                     {"sync.algorithm": "ssgd"})
    return [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]


@pytest.fixture(scope="session")
def uninterrupted_digits(tmp_path_factory):
    """algorithm -> the run directory of that job run once without interruption."""
    from test_e2e_configs import dist, run_dir_of
    done = {}

    def get(algorithm):
        if algorithm not in done:
            root = tmp_path_factory.mktemp(f"uninterrupted-{algorithm}")
            p = dist(["configs/digits.yaml", *digits_job(algorithm), "--set",
                      f"output.dir={root}"])
            assert p.returncode == 0, p.stderr[-3000:]
            done[algorithm] = run_dir_of(root)
        return done[algorithm]
    return get


# The README's main command, shortened (digits, ssd, 6 epochs, warm-up 44), run once at a
# terminal: tests/test_e2e_configs.py checks its screen and run, and
# tests/test_compression_oracle.py compares the bytes of the same job compressed to it.
DIGITS_DEMO = {"train.epochs": 6, "sync.warmup_steps": 44}


@pytest.fixture(scope="session")
def digits_demo_on_a_terminal(tmp_path_factory):
    """(exit code, everything it wrote, output.dir) of the shortened main command."""
    from test_e2e_configs import dist_on_a_terminal
    out = tmp_path_factory.mktemp("digits-demo")
    args = [a for k, v in DIGITS_DEMO.items() for a in ("--set", f"{k}={v}")]
    code, raw = dist_on_a_terminal(["configs/digits.yaml", *args, "--set", f"output.dir={out}"])
    return code, raw, out
