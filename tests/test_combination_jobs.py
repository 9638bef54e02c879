"""Real digits jobs for the combinations of ssdsgd/sync/registry.py that no other test ran
(tests/test_combinations.py checks that the registry names these tests): an ssd job with
every feature that goes with continue (compression, staggered pulls, checkpoints) whose
rank 0 is killed and restarted; a relayed job restarted; an asgd job writing
checkpoints."""
import json

import numpy as np
import pytest

from conftest import (COMPRESSED_STAGGERED, DIGITS_EPOCHS as EPOCHS, DIGITS_STEPS as STEPS,
                      digits_job)
from test_e2e_configs import dist, records, run_dir_of, sets
from test_recovery import assert_same, final, kill_once_with_a_restart, kill_step
from test_resume import assert_same_final_weights

pytestmark = pytest.mark.system


def restarted(args, root, rank, step, role="worker"):
    """Run ``launch/dist.py ARGS --max-restarts 1``, SIGKILL ``role`` ``rank`` once rank 0
    has logged ``step``, and wait for the job to end by itself; returns its run directory
    once the launcher has said it restarted the job from the checkpoint."""
    run, out = kill_once_with_a_restart(args, root, step, role, rank)
    restarts = [ln for ln in out.splitlines() if "restart 1 of 1" in ln]
    assert len(restarts) == 1 and f"restart 1 of 1: {role} {rank} on " in restarts[0], \
        out[-3000:]
    assert "resuming from the checkpoint at step" in restarts[0], restarts[0]
    return run


def test_a_compressed_staggered_continue_job_is_restarted_as_if_uninterrupted(
        tmp_path, uninterrupted_digits):
    """ssd with 2bit pushes, staggered pulls, cluster.on_worker_failure continue and
    --max-restarts 1: server 0 (which continue never leaves behind; a dead worker, worker
    0 too, is removed instead) SIGKILLed in the steps-delay stage; the launcher restarts
    the job from its checkpoint and it ends with exactly the weights of the same job run
    without interruption (and without continue): each worker's residuals (what its
    compressed pushes have not sent yet) are saved with its state and restored, and each
    worker keeps its pull phase."""
    a = uninterrupted_digits("ssd", **COMPRESSED_STAGGERED)
    job = ["configs/digits.yaml", *digits_job("ssd"), *sets(**COMPRESSED_STAGGERED)]
    root = tmp_path / "b"
    b = restarted([*job, *sets(cluster__on_worker_failure="continue", output__dir=root)],
                  root, 0, kill_step("many"), role="server")
    for rank in (0, 1):
        starts = records(b, rank, "start")
        assert len(starts) == 2 and 29 < starts[1]["start_step"] < EPOCHS * STEPS  # delay
    with np.load(b / "checkpoints" / "epoch-0000.worker-1.npz") as state:
        meta = json.loads(state["__meta__"].tobytes().decode())
        assert meta["residuals"] and all(f"c{k}" in state.files for k in meta["residuals"])
        assert any(np.abs(state[f"c{k}"]).max() > 0 for k in meta["residuals"])
    assert_same_final_weights(a, b)


def test_a_killed_worker_of_a_relayed_job_is_restarted_as_if_uninterrupted(
        tmp_path, uninterrupted_digits):
    """sync.pull_relay chain (rank 0 passes each pulled reply on to rank 1), ssd: rank 0
    SIGKILLed mid-run; the launcher restarts the job from its checkpoint, the chain is
    built again, and the job ends bit-identical to the same job without relay and
    without interruption (a relay moves the same bytes)."""
    reference = final(uninterrupted_digits("ssd"))
    root = tmp_path / "runs"
    run = restarted(["configs/digits.yaml", *digits_job("ssd"),
                     *sets(sync__pull_relay="chain", output__dir=root)], root, 0,
                    kill_step("relay"))
    assert_same(run, reference)
    assert len(records(run, 1, "start")) == 2
    relayed = records(run, 1, "end")[-1]["kv"]["replies_relayed_in"]
    assert relayed > 0, "after the restart no reply came through the chain"


def test_an_asgd_job_writes_its_checkpoints_and_finishes(tmp_path):
    """asgd with per-epoch checkpoints: each epoch's global model and optimizer state are
    written (rank 0 pulls the servers' weights at each one) and the job ends with a
    digits model. (Resuming an asgd job is refused: resumed with workers of different
    speeds it diverged, see ssdsgd/sync/registry.py.) At lr 0.05: at the demo's 0.1 each
    worker's push is a whole step of the global batch's lr, and the final accuracy spread
    0.30-0.79 over 7 runs (a fresh-clone suite failed at 0.30); at 0.05, 0.86-0.92 over 6."""
    p = dist(["configs/digits.yaml", *digits_job("ssgd"),
              *sets(sync__algorithm="asgd", optimizer__lr=0.05, output__dir=tmp_path)])
    assert p.returncode == 0, p.stderr[-3000:]
    run = run_dir_of(tmp_path)
    latest = json.loads((run / "checkpoints" / "latest.json").read_text())
    assert latest["step"] == EPOCHS * STEPS
    for epoch in range(EPOCHS):
        for suffix in ("params", "states"):
            assert (run / "checkpoints" / f"epoch-{epoch:04d}.{suffix}").stat().st_size > 0
    assert [r["step"] for r in records(run, 0, "checkpoint")] == [STEPS, EPOCHS * STEPS]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["algorithm"] == "asgd" and summary["steps"] == EPOCHS * STEPS
    assert summary["final_accuracy"] > 0.5, summary
