"""Checkpoints and resume of a job that takes joiners (docs/spec/membership.md rule 11),
with the training program, real processes: checkpoints come where the chunks pass an
epoch end, a step every worker in the job computes alike. With no change of membership a
killed job resumed from one ends with the uninterrupted job's weights, bit for bit (ssd:
every worker's own state kept); after a join the resumed job starts again with its
first workers from the global model at the checkpoint's step and chunk, and trains the
rest of the budget once."""
import json

import pytest

import jobs
from conftest import DIGITS_STEPS as STEPS, digits_job
from ssdsgd.sync.membership import Membership
from test_e2e_configs import records, run_dir_of, sets
from test_recovery import (assert_same, final, kill_launcher, kill_once_with_a_restart,
                           kill_step, start, wait_for_step)

pytestmark = pytest.mark.system
ELASTIC = sets(cluster__max_workers=3)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The final weights of the ssd job below, run once without interruption."""
    root = tmp_path_factory.mktemp("elastic-reference")
    ref = jobs.run([*SSD, *sets(output__dir=root)], timeout=150)
    assert ref.returncode == 0, ref.stderr[-3000:]
    return final(run_dir_of(root))


SSD = ["configs/digits.yaml", *digits_job("ssd"), *ELASTIC]


def test_a_killed_ssd_job_that_takes_joiners_resumes_as_if_uninterrupted(tmp_path,
                                                                         reference):
    """ssd (T_w 29, k 5), 2 workers, cluster.max_workers 3, nobody joins: its first
    checkpoint is at step 44 (the chunks pass epoch 0's end), with both workers' states;
    SIGKILLed after it and resumed, it ends with the uninterrupted job's weights."""
    args = SSD
    root = tmp_path / "runs"
    with start([*args, *sets(output__dir=root)]) as job:
        run = wait_for_step(job, root, kill_step("join-resume"))
        kill_launcher(job)
    latest = json.loads((run / "checkpoints" / "latest.json").read_text())
    assert latest["step"] % STEPS == 0 and latest["chunks"] == 2 * latest["step"], latest
    assert latest["members"] == [0, 1] and latest["workers"] == 2, latest
    static = jobs.run([*args, *sets(output__dir=root, cluster__max_workers=2), "--resume",
                       run], timeout=120)
    assert static.returncode != 0
    assert ("its checkpoint is of a job that took joiners (its data followed the "
            "membership); resume it with the same cluster.max_workers") in static.stderr, \
        static.stderr[-3000:]
    resumed = jobs.run([*args, *sets(output__dir=root), "--resume", run,
                        *sets(debug__slowdown="none")], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same(run, reference)


def test_a_killed_worker_of_a_job_that_takes_joiners_is_restarted_as_if_uninterrupted(
        tmp_path, reference):
    """The same job with --max-restarts 1: worker 1 SIGKILLed after the first checkpoint;
    the launcher starts the job again from it, and it ends with the uninterrupted job's
    weights."""
    root = tmp_path / "runs"
    run, out = kill_once_with_a_restart([*SSD, *sets(output__dir=root)], root,
                                        kill_step("join-restart"), "worker", 1)
    assert "restart 1 of 1" in out, out[-3000:]
    assert_same(run, reference)


def _resumed_trains_the_rest_once(args, run, info):
    """Resume the killed 2-worker job ``args`` of ``run`` (unslowed) from its checkpoint
    ``info`` (latest.json): it must end (exit 0) with both first workers at the budget's
    end, having trained every chunk after the checkpoint's once, and reach 0.8. The
    resumed job's output."""
    resumed = jobs.run([*args, "--resume", run, *sets(debug__slowdown="none")], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    t, g = info["step"], info["chunks"]
    members = Membership(2, 2 * STEPS, 4 * 2 * STEPS, start_step=t, start_chunk=g)
    ends = [records(run, r, "end")[-1] for r in range(2)]
    assert [e["steps"] for e in ends] == [members.end()] * 2, (ends, t, g)
    trained = sum(d.get("batches", 0) for e in ends for d in e["data"].values())
    assert trained == members.first_chunk(members.end()) - g
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_accuracy"] > 0.8, summary
    return resumed


def test_a_job_resumed_after_a_join_trains_the_rest_of_the_budget_once(tmp_path):
    """ssgd, 2 workers and a third joining, checkpoints also every second by rank 0's
    clock (train.checkpoint_every_s: decided every 4 steps at a barrier of the workers in
    the job at that step, the joiner among them once it pushes): a checkpoint after the
    join names the three and keeps no worker state. SIGKILLed after it (the joiner's own
    launcher ends when the scheduler is gone) and resumed, the job starts again with its
    two first workers at the checkpoint's step and chunk: they train the rest of the
    budget once, and the schedule of chunks is the membership's that starts there."""
    root = tmp_path / "runs"
    args = ["configs/digits.yaml", *digits_job("ssgd"), *ELASTIC, *sets(
        train__epochs=4, train__checkpoint_every_s=1, cluster__heartbeat_interval=0.2,
        cluster__heartbeat_timeout=2.0,
        output__dir=root, debug__slowdown="delay:0=0.08")]
    with start(args) as job:
        job.wait_for(lambda: any(root.glob("*/join.json")), 60, "join.json")
        run = run_dir_of(root)
        job.wait_for("job started", 60)
        joiner = jobs.dist(["--join", run])
        with joiner:
            latest = run / "checkpoints" / "latest.json"
            job.wait_for(lambda: latest.exists() and json.loads(latest.read_text()).get(
                "members") == [0, 1, 2], 120, "a checkpoint after the join")
            kill_launcher(job)
            joiner.wait(60)
    info = json.loads(latest.read_text())
    # by the clock at a multiple of log_interval, or the first step whose chunks before it
    # pass an epoch's end (3 a step after the join)
    assert info["workers"] == 0, info
    assert info["step"] % 4 == 0 or info["chunks"] % (2 * STEPS) < 3, info
    _resumed_trains_the_rest_once(args, run, info)


def test_a_job_resumed_after_worker_0_left_starts_again_with_its_first_workers(tmp_path):
    """ssgd, 2 workers: worker 0 leaves (docs/spec/membership.md rule 8), and worker 1,
    the chief from then on, keeps the checkpoint clock (train.checkpoint_every_s) alone: a
    checkpoint after the departure names worker 1 only and keeps no worker state. The job
    SIGKILLed after it and resumed starts again with its two first workers, worker 0
    its chief again, at the checkpoint's step and chunk: they train the rest of the
    budget once and worker 0 writes the summary."""
    root = tmp_path / "runs"
    args = ["configs/digits.yaml", *digits_job("ssgd"), *ELASTIC, *sets(
        train__epochs=4, train__checkpoint_every_s=1, cluster__heartbeat_interval=0.2,
        cluster__heartbeat_timeout=2.0,
        output__dir=root, debug__slowdown="delay:0=0.08,1=0.08")]
    with start(args) as job:
        job.wait_for(lambda: any(root.glob("*/join.json")), 60, "join.json")
        run = run_dir_of(root)
        job.wait_for("job started", 60)
        leaver = jobs.dist(["--leave", run, "--rank", 0])
        with leaver:
            assert leaver.wait(60) == 0, leaver.tail()
        latest = run / "checkpoints" / "latest.json"
        job.wait_for(lambda: latest.exists() and json.loads(latest.read_text()).get(
            "members") == [1], 120, "a checkpoint after worker 0 left")
        kill_launcher(job)
    info = json.loads(latest.read_text())
    assert info["workers"] == 0, info
    assert [c for c in records(run, 1, "checkpoint")], "worker 1 took no checkpoint"
    resumed = _resumed_trains_the_rest_once(args, run, info)
    done = [line for line in (resumed.stdout + resumed.stderr).splitlines()
            if "done: test accuracy" in line]
    assert len(done) == 1 and done[0].startswith("[worker 0]"), done   # the chief again
