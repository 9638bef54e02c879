"""A scheduler that can be lost (cluster.scheduler_restarts; docs/reliability.md): the
scheduler SIGKILLed at a seeded step of a digits job, ssgd and ssd; the launcher starts it
again at the same port with the same keys, every server and worker re-registers, and the
job ends with exactly the weights of an uninterrupted run, no server or worker restarted
(their pids at the end are the pids at the kill). One case with 2 servers in secure
(CURVE) mode."""
import os
import re
import signal
import time

import pytest

from test_e2e_configs import sets
from test_recovery import assert_same, kill_step, role_of, start, wait_for_step

pytestmark = pytest.mark.system

from test_recovery import JOBS, uninterrupted  # noqa: E402,F401  (the fixture)


def nodes(job):
    """(role, rank) -> pid of the job's servers and workers now."""
    out = {}
    for pid in job.processes():
        who = role_of(pid)
        if who and who[0] in ("server", "worker"):
            out[who] = pid
    return out


@pytest.mark.parametrize("algorithm,servers,secure", [
    ("ssgd", 1, False), ("ssd", 1, False), ("ssd", 2, True)])
def test_a_killed_scheduler_is_restarted_and_the_job_ends_as_if_uninterrupted(
        tmp_path, uninterrupted, algorithm, servers, secure):
    reference = uninterrupted(algorithm)
    root = tmp_path / "runs"
    step = kill_step(f"scheduler-restart-{algorithm}")
    args = ["configs/digits.yaml", *JOBS[algorithm], *sets(
        output__dir=root, cluster__scheduler_restarts=1, cluster__servers=servers)]
    with start(args + (["--secure"] if secure else [])) as job:
        run = wait_for_step(job, root, step)
        before = nodes(job)
        assert len(before) == 2 + servers, before
        killed_at = time.monotonic()
        os.kill(job.process("scheduler"), signal.SIGKILL)
        job.wait_for(lambda: "re-registered and the job goes on" in job.text, 120,
                     "the launcher's line that the restarted scheduler has every node back")
        back = time.monotonic() - killed_at
        assert nodes(job) == before        # nobody restarted: the same pids, all alive
        assert job.wait(timeout=300) == 0, job.text[-3000:]
    out = job.text
    line, = [ln for ln in out.splitlines() if "scheduler restart 1:" in ln]
    took = float(re.search(r"\(([\d.]+) s after the scheduler died", line).group(1))
    print(f"{algorithm}, {servers} server(s), {'curve' if secure else 'plain'}: {line}; "
          f"seen by the test {back:.1f} s after the kill")
    assert took < 30, line
    assert "restarting it at 127.0.0.1:" in out and "restart 1 of 1" in out
    for who, pid in before.items():    # each node says it rejoined, none restarted
        assert f"{who[0]} {who[1]}: rejoined the job with the restarted scheduler" in out, who
    assert_same(run, reference)
