"""Shared helpers for tests that start real processes. Every job is started through
tests/jobs.py, and whatever a test started is stopped when it ends, passed or failed."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))

import jobs  # noqa: E402
from jobs import PY, ROOT, SCRIPTS  # noqa: E402,F401 - the tests' imports
from ssdsgd.testing import clean_env  # noqa: E402


def pytest_configure(config):
    """Byte-compile the source tree once, before any process starts: where bytecode is not
    written (PYTHONDONTWRITEBYTECODE, as on CI machines) every one of the suite's
    processes would otherwise compile ssdsgd's modules again (about 0.1 s of CPU each)."""
    if not hasattr(config, "workerinput"):          # xdist's controller, or no xdist
        import compileall
        for tree in ("ssdsgd", "bench", "launch"):
            compileall.compile_dir(str(ROOT / tree), quiet=2)


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test():
    """Every job a test started and did not close is stopped at its end."""
    before = jobs.open_jobs()
    yield
    jobs.close_jobs_started_since(before)


def load_npz(path):
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def node_env(port, num_workers=1, num_servers=1, **extra):
    return clean_env(SSDSGD_SCHEDULER_PORT=port, SSDSGD_NUM_WORKERS=num_workers,
                     SSDSGD_NUM_SERVERS=num_servers, **extra)


# The digits job of the checkpoint tests (tests/test_resume.py, tests/test_recovery.py):
# 2 workers x batch 16 (44 steps an epoch), 2 epochs, a checkpoint every epoch. Its
# uninterrupted run is made once per session and algorithm and shared by both modules.
DIGITS_EPOCHS = 2
DIGITS_STEPS = 1437 // (2 * 16)


def digits_job(algorithm):
    """``--set`` arguments of the checkpoint tests' digits job (ssd: warm-up 29 steps,
    k = 5)."""
    overrides = {"data.batch_size": 16, "train.epochs": DIGITS_EPOCHS,
                 "train.checkpoint_every": 1, "train.log_interval": 4,
                 "output.plots": "false"}       # no test of theirs looks at the plots
    # k pinned: a restarted job must choose what the uninterrupted one did (docs/auto.md)
    overrides.update({"sync.warmup_steps": 29, "sync.delay_steps": 5} if algorithm == "ssd"
                     else {"sync.algorithm": "ssgd"})
    return [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]


#: the ssd job's 2bit pushes and staggered pulls, whose uninterrupted run two tests compare
#: with (tests/test_combination_jobs.py, tests/test_scheduler_restart.py)
COMPRESSED_STAGGERED = {"sync__compression": "2bit", "sync__pull_schedule": "staggered"}


@pytest.fixture(scope="session")
def uninterrupted_digits(tmp_path_factory):
    """(algorithm, settings) -> the run directory of that job run once without
    interruption; ``settings`` (config keys spelled as ``sets`` does: sync__compression)
    are set on top of digits_job's."""
    from test_e2e_configs import run_dir_of
    done = {}

    def get(algorithm, **settings):
        key = (algorithm, *sorted(settings.items()))
        if key not in done:
            root = tmp_path_factory.mktemp(f"uninterrupted-{algorithm}")
            extra = [a for k, v in settings.items()
                     for a in ("--set", f"{k.replace('__', '.')}={v}")]
            p = jobs.run(["configs/digits.yaml", *digits_job(algorithm), *extra, "--set",
                          f"output.dir={root}"], timeout=150)
            assert p.returncode == 0, p.stderr[-3000:]
            done[key] = run_dir_of(root)
        return done[key]
    return get


# The README's main command, shortened (digits, ssd, 6 epochs, warm-up 44), run once at a
# terminal: tests/test_e2e_configs.py checks its screen and run, and
# tests/test_compression_oracle.py compares the bytes of the same job compressed to it.
DIGITS_DEMO = {"train.epochs": 6, "sync.warmup_steps": 44}


@pytest.fixture(scope="session")
def digits_demo_on_a_terminal(tmp_path_factory):
    """(exit code, everything it wrote, output.dir) of the shortened main command."""
    out = tmp_path_factory.mktemp("digits-demo")
    args = [a for k, v in DIGITS_DEMO.items() for a in ("--set", f"{k}={v}")]
    job = jobs.run(["configs/digits.yaml", *args, "--set", f"output.dir={out}"], timeout=150,
                   tty=120)
    return job.returncode, job.stdout, out
