"""Automatic restart (launch/dist.py --max-restarts) with real processes: a worker, a
server or the scheduler SIGKILLed at a random (seeded) step of a digits job, ssgd and ssd;
the launcher restarts the job from its last checkpoint and it ends with exactly the
weights of an uninterrupted run. The launcher itself SIGKILLed: every process exits, and
the same command with --resume finishes with the uninterrupted weights."""
import json
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest

from conftest import DIGITS_EPOCHS as EPOCHS, DIGITS_STEPS as STEPS, digits_job
import jobs
from test_e2e_configs import PY, dist, records, sets
from test_resume import params

pytestmark = pytest.mark.system

JOBS = {"ssd": digits_job("ssd"), "ssgd": digits_job("ssgd")}


@pytest.fixture
def uninterrupted(uninterrupted_digits):
    """The final weights and summary of each algorithm's job (run once per session)."""
    return lambda algorithm: final(uninterrupted_digits(algorithm))


def final(run: Path) -> tuple[dict, dict]:
    return (params(run / "checkpoints" / f"epoch-{EPOCHS - 1:04d}.params"),
            json.loads((run / "summary.json").read_text()))


def assert_same(run: Path, reference):
    (pa, sa), (pb, sb) = reference, final(run)
    assert pa.keys() == pb.keys() and len(pa) == 6
    for key in pa:
        assert (pa[key] == pb[key]).all(), key      # bit-identical
    assert (sb["final_accuracy"], sb["steps"]) == (sa["final_accuracy"], sa["steps"])


def role_of(pid: int) -> tuple[str, int] | None:
    try:
        env = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text()
                   .split("\0") if "=" in item)
    except OSError:
        return None
    return env.get("SSDSGD_ROLE"), int(env.get("SSDSGD_RANK", -1))


# Rank 0 slowed by 10 ms a step (timing only: no weight depends on it) in the jobs to be
# killed, and the kill step drawn from the first 16 of the second epoch, so that the kill
# lands before the end: at full speed the 8 steps between the step seen in the metrics and
# the end took less than the kill did (seen in CI: the scheduler killed after step 88, the
# run finished, nothing to restart). Now >= 28 steps x >= 10 ms are left (0.28 s, more
# than the 8 x 30 ms before), and the pace, paid by every step before and after the
# restart, costs ~1 s a test instead of ~3 s.
PACE = sets(debug__slowdown="delay:0=0.01")


def kill_step(seed) -> int:
    """A seeded step after the first checkpoint (step STEPS), >= 28 steps before the end."""
    return random.Random(seed).randint(STEPS + 2, STEPS + 16)


def start(args):
    """``launch/dist.py ARGS``, started, its output merged; paced unless it resumes or
    has a slowdown of its own (which is kept)."""
    paced = "--resume" in args or any(str(a).startswith("debug.slowdown=") for a in args)
    args = args if paced else [*args, *PACE]
    return jobs.dist(args, merge=True)


def wait_for_step(job, root: Path, step: int, timeout=240) -> Path:
    """The run directory, once rank 0 has logged a step >= ``step``."""
    def reached():
        runs = [d for d in root.iterdir() if d.is_dir()] if root.exists() else []
        if runs and (runs[0] / "metrics" / "worker-0.jsonl").exists():
            steps = [r["step"] for r in records(runs[0], 0, "train")]
            if steps and max(steps) >= step:
                return runs[0]
    return job.wait_for(reached, timeout, f"rank 0 logging step {step} (the kill)")


def kill_launcher(job):
    """SIGKILL the launcher; every process of the job ends (bounded: its parent-death
    signal)."""
    kids = job.processes()
    os.kill(job.pid, signal.SIGKILL)
    job.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{k}").exists() and role_of(k) for k in kids):
        assert time.monotonic() < deadline, "a process outlived its launcher by 30 s"
        time.sleep(0.1)


def kill_once_with_a_restart(args, root, step, role, rank):
    """Run ``launch/dist.py ARGS --max-restarts 1``, SIGKILL process (role, rank) once
    rank 0 has logged ``step``, wait for the job to end by itself (exit 0); returns (its
    run directory, the launcher's output)."""
    with start([*args, "--max-restarts", 1]) as job:
        run = wait_for_step(job, root, step)
        victim, = [c for c in job.processes() if role_of(c) == (role, rank)]
        os.kill(victim, signal.SIGKILL)
        assert job.wait(timeout=300) == 0
    return run, job.stdout


# Each role killed once, each algorithm at least once (3 jobs, not the 6 of every pair):
# the role decides how the launcher sees the loss (a worker's, a server's or the
# scheduler's exit, then the same stop-and-restart-from-the-checkpoint path), the
# algorithm what the restarted job restores (ssd: every worker's own state as well).
# worker-ssd covers a worker's loss and ssd's restore, server-ssgd a server's and ssgd's,
# scheduler-ssgd the scheduler's; the scheduler of an ssd job killed and the job
# restarted from its checkpoint is tests/test_replicas.py's
# test_a_replicas_job_is_restarted_from_its_checkpoint_as_if_uninterrupted.
@pytest.mark.parametrize("algorithm,role", [("ssd", "worker"), ("ssgd", "server"),
                                            ("ssgd", "scheduler")])
def test_a_killed_process_is_restarted_and_the_job_ends_as_if_uninterrupted(
        tmp_path, uninterrupted, role, algorithm):
    rng = random.Random(f"{role}-{algorithm}")
    step = kill_step(f"{role}-{algorithm}")
    rank = rng.choice([0, 1]) if role == "worker" else 0
    reference = uninterrupted(algorithm)
    root = tmp_path / "runs"
    run, out = kill_once_with_a_restart(["configs/digits.yaml", *JOBS[algorithm],
                                         *sets(output__dir=root)], root, step, role, rank)
    name = "scheduler" if role == "scheduler" else f"{role} {rank}"
    restarts = [ln for ln in out.splitlines() if "restart 1 of 1" in ln]
    assert len(restarts) == 1, out[-3000:]
    assert f"restart 1 of 1: {name} on " in restarts[0] and "killed by SIGKILL" in restarts[0]
    assert "resuming from the checkpoint at step" in restarts[0], restarts[0]
    assert_same(run, reference)


def test_a_job_that_keeps_failing_gives_up_after_its_restarts(tmp_path):
    """--max-restarts 1 and a worker program that always fails: one restart line, then
    the launcher gives up, non-zero."""
    p = dist(["-n", "1", "-s", "1", "--max-restarts", "1", "--", PY, "-c",
              "import sys; sys.exit(3)"], timeout=120)
    assert p.returncode == 1
    lines = [ln for ln in p.stderr.splitlines() if "restart" in ln]
    assert len(lines) == 2 and "restart 1 of 1: worker 0 on " in lines[0], p.stderr[-2000:]
    assert "exited with code 3" in lines[0] and "giving up" in lines[1]


def test_a_killed_launcher_leaves_nothing_and_resume_ends_as_if_uninterrupted(
        tmp_path, uninterrupted):
    reference = uninterrupted("ssd")
    root = tmp_path / "runs"
    args = ["configs/digits.yaml", *JOBS["ssd"], *sets(output__dir=root)]
    with start(args) as job:
        run = wait_for_step(job, root, kill_step("launcher"))
        kill_launcher(job)
    # the resumed run unpaced: the pace only had to let the kill land before the end
    resumed = dist([*args, "--resume", run, *sets(debug__slowdown="none")], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same(run, reference)


def _killed_with_continue(tmp_path, algorithm, rank, step):
    """The digits job with cluster.on_worker_failure: continue (heartbeat timeout 1 s),
    worker ``rank`` SIGKILLed once rank 0 logged ``step``; the job must finish (exit 0),
    say it went on without it and that it left. (run dir, output, summary.json, its one
    ``workers_left`` entry)."""
    root = tmp_path / "runs"
    with start(["configs/digits.yaml", *JOBS[algorithm], *sets(
            output__dir=root, cluster__on_worker_failure="continue",
            cluster__heartbeat_interval=0.2, cluster__heartbeat_timeout=1.0)]) as job:
        run = wait_for_step(job, root, step)
        victim, = [c for c in job.processes() if role_of(c) == ("worker", rank)]
        os.kill(victim, signal.SIGKILL)
        assert job.wait(timeout=300) == 0, job.stdout[-3000:]
    out = job.stdout
    assert re.search(rf"worker {rank} \(pid \d+\) was killed by SIGKILL; the job continues "
                     "without it", out), out[-3000:]
    assert f"worker {rank} left the job" in out, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    left, = summary["workers_left"]
    return run, out, summary, left


@pytest.mark.parametrize("algorithm", ["ssd", "ssgd"])
def test_with_continue_a_killed_worker_leaves_and_the_job_finishes(tmp_path, algorithm):
    """cluster.on_worker_failure: continue: worker 1 SIGKILLed mid-run; the scheduler
    removes it (heartbeat timeout 1 s here), every server aggregates rank 0 alone from the
    step it names, the job finishes all its steps with one worker, and summary.json says
    who left and from which step."""
    step = kill_step(f"continue-{algorithm}")
    run, out, summary, left = _killed_with_continue(tmp_path, algorithm, 1, step)
    assert left["rank"] == 1 and step <= left["from_step"] <= 2 * STEPS
    assert summary["steps"] == EPOCHS * STEPS and summary["workers_reporting"] == 1
    assert summary["final_accuracy"] > 0.8
    latest = json.loads((run / "checkpoints" / "latest.json").read_text())
    assert latest["step"] == EPOCHS * STEPS


@pytest.mark.parametrize("algorithm", ["ssgd", "ssd"])
def test_with_continue_a_killed_worker_0_leaves_and_worker_1_becomes_the_chief(tmp_path,
                                                                              algorithm):
    """cluster.on_worker_failure: continue, 2 workers (ssd: k pinned, the kill after the
    warm-up): worker 0 (the chief) SIGKILLed mid-run is removed like any rank; worker 1,
    the lowest rank left, takes the chief's part from when it hears of the removal: it
    validates, writes the job's last checkpoint (latest.json) and summary.json, which
    names worker 0 removed from step E."""
    from test_e2e_configs import records
    step = kill_step(f"continue-chief-{algorithm}")
    run, out, summary, left = _killed_with_continue(tmp_path, algorithm, 0, step)
    e = left["from_step"]
    assert left["rank"] == 0 and left["how"] == "removed" and step <= e <= 2 * STEPS, summary
    assert summary["steps"] == EPOCHS * STEPS and summary["workers_reporting"] == 1, summary
    # the chief's part after the removal is worker 1's: its validation, its summary
    vals = records(run, 1, "val")
    assert vals and summary["final_accuracy"] == vals[-1]["accuracy"] > 0.8, summary
    done = [line for line in out.splitlines() if "done: test accuracy" in line]
    assert len(done) == 1 and "[worker 1]" in done[0], done
    latest = json.loads((run / "checkpoints" / "latest.json").read_text())
    assert latest["step"] == EPOCHS * STEPS and latest["workers"] == 0, latest
    assert records(run, 1, "checkpoint")[-1]["path"].endswith(latest["params"]), latest
