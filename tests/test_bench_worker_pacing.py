"""bench/cluster_worker.py's digits steps under dynamic data, in a real 4-worker job: the
worker takes its batches as fast as it trains them, not as fast as its thread can queue
steps on MXNet's engine. Its loop used to read nothing of a step, so the thread queued
steps unbounded and asked the scheduler for chunks at that pace: with no worker slowed,
one worker took 116 of a budget of 880 batches and another 384, and the ones that took
the most trained the last of them while the others had finished (the heterogeneity
benchmark's tolerant rows, docs/benchmarks/heterogeneity.md)."""
import json

import pytest

from ssdsgd.testing import run_dist

pytestmark = pytest.mark.system

WORKERS, EPOCHS = 4, 10


def test_equal_workers_under_dynamic_data_take_about_equal_shares(tmp_path):
    out = tmp_path / "out"
    done = run_dist(["-n", WORKERS, "-s", 1, "--env", "SSDSGD_ALGORITHM=ssd",
                     "--env", "SSDSGD_DELAY_STEPS=5", "--env", "SSDSGD_WARMUP_STEPS=10",
                     "--env", "SSDSGD_QUORUM=auto", "--env", "OMP_NUM_THREADS=1", "--",
                     "python", "bench/cluster_worker.py", "--kvstore", "ssd_sync",
                     "--out", out, "--workload", "digits", "--epochs", EPOCHS,
                     "--batch", 32, "--lr", 0.1, "--seed", 0, "--eval-every", 0],
                    timeout=240, merge_output=True)
    assert done.returncode == 0, done.stdout[-3000:]
    steps = [json.loads((out / f"result-rank{r}.json").read_text())["steps"]
             for r in range(WORKERS)]
    # the budget, each batch once: 11 steps an epoch (1437 samples / (32 x 4 workers))
    assert sum(steps) == EPOCHS * 11 * WORKERS, steps
    # equal workers in lockstep rounds: apart by the steps ssd lets one run ahead (k + 2)
    # and the chunks in flight, not by how fast each thread queues
    assert max(steps) - min(steps) <= 30, steps
