"""cluster.server_replicas: 1 with real processes (docs/reliability.md): a server of a
2-server, 2-worker digits job SIGKILLed at a seeded step, ssgd and ssd; its backup owns
its keys within seconds, no process is restarted, and the job ends with the weights of
the uninterrupted job. In process: what a server and the scheduler refuse of the
replicas' messages."""
import os
import random
import re
import signal
import time

import numpy as np
import pytest

from conftest import DIGITS_EPOCHS as EPOCHS, DIGITS_STEPS as STEPS, digits_job
from test_e2e_configs import sets
from test_recovery import (assert_same, final, kill_once_with_a_restart, kill_step, role_of,
                           start, wait_for_step)

FIRST_APPLY = re.compile(r"\[server (\d)\] .*first step applied as the owner of server (\d)'s "
                         r"keys: key \d+ step (\d+), at ([\d.]+)")
REPLICAS = sets(cluster__servers=2, cluster__server_replicas=1,
                cluster__heartbeat_interval=0.2, cluster__heartbeat_timeout=1.0)


def roles(job):
    return {role_of(pid): pid for pid in job.processes() if role_of(pid) and role_of(pid)[0]}


@pytest.mark.system
@pytest.mark.parametrize("algorithm", ["ssgd", "ssd"])
def test_a_killed_server_is_replaced_by_its_backup_and_the_job_ends_as_if_uninterrupted(
        tmp_path, uninterrupted_digits, algorithm):
    reference = final(uninterrupted_digits(algorithm))     # 1 server, no replicas
    rng = random.Random(f"replicas-{algorithm}")
    step, victim = kill_step(f"replicas-{algorithm}"), rng.choice([0, 1])
    root = tmp_path / "runs"
    with start(["configs/digits.yaml", *digits_job(algorithm), *REPLICAS,
                *sets(output__dir=root)]) as job:
        run = wait_for_step(job, root, step)
        before = roles(job)
        assert len(before) == 5, before      # scheduler, 2 servers, 2 workers
        os.kill(before[("server", victim)], signal.SIGKILL)
        killed_at = time.time()
        line = job.wait_for(lambda: FIRST_APPLY.search(job.text), 60,
                            "the new owner's first step")
        after = roles(job)
        assert job.wait(timeout=300) == 0, job.stdout[-3000:]
    owner, dead, first_step, applied_at = line.groups()
    assert (int(dead), int(owner)) == (victim, 1 - victim)
    recovery = float(applied_at) - killed_at
    print(f"{algorithm}: server {victim} killed after step {step}; server {owner} applied "
          f"step {first_step} as its keys' owner {recovery:.2f} s after the kill")
    assert 0 < recovery <= 5.0
    # nothing restarted: every process but the victim is the one that was there before
    assert after == {r: p for r, p in before.items() if r != ("server", victim)}
    out = job.stdout
    assert "restart" not in out
    assert re.search(rf"server {victim} \(pid \d+\) was killed by SIGKILL; its backup takes "
                     "its keys and the job continues", out), out[-3000:]
    assert f"server {owner} owns its keys from now on, and the job goes on with no replica " \
           "left" in out
    (pa, sa), (pb, sb) = reference, final(run)
    assert pa.keys() == pb.keys() and len(pa) == 6
    for key in pa:     # the same sums in the same order, the same optimizer: bit for bit
        assert (pa[key] == pb[key]).all(), (key, np.abs(pa[key] - pb[key]).max())
    assert sb["steps"] == sa["steps"] == EPOCHS * STEPS
    assert abs(sb["final_accuracy"] - sa["final_accuracy"]) <= 0.01


@pytest.mark.system
def test_a_replicas_job_is_restarted_from_its_checkpoint_as_if_uninterrupted(
        tmp_path, uninterrupted_digits):
    """--max-restarts with replicas: the scheduler (which no replica replaces) SIGKILLed;
    the job restarts from its checkpoint, every server loads the optimizer state of the
    keys it owns and of those it backs up (COMMAND set_state), and ends bit for bit."""
    reference = final(uninterrupted_digits("ssd"))
    root = tmp_path / "runs"
    run, out = kill_once_with_a_restart(["configs/digits.yaml", *digits_job("ssd"),
                                         *REPLICAS[:4], *sets(output__dir=root)],
                                        root, kill_step("replicas-restart"), "scheduler", 0)
    assert "restart 1 of 1: scheduler on " in out and "resuming from the checkpoint" in out
    assert_same(run, reference)
