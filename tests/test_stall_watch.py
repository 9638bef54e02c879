"""cluster.stall_timeout (ssdsgd/kvstore/liveness.py): a worker whose heartbeats go on
while its training thread is stuck is treated as failed, so cluster.on_worker_failure
applies. The rule in process, then real digits jobs whose worker 1 sleeps an hour before
its first push (debug.slowdown) with its I/O thread heartbeating."""
import contextlib
import json
import os
import re
import signal
import time

import pytest

from conftest import digits_job
from types import SimpleNamespace

from ssdsgd.kvstore.liveness import StallWatch, failed
from test_e2e_configs import dist, run_dir_of, sets


def test_a_worker_behind_the_others_without_progress_is_stalled_after_the_timeout():
    w = StallWatch(5.0)
    w.report(0, 3, False, 0.0)
    w.report(1, 2, False, 0.0)
    assert w.stalled(4.0) == []                     # not yet
    w.report(0, 4, False, 4.0)                      # 0 goes on, 1 does not
    w.report(1, 2, False, 4.0)
    (stall,) = w.stalled(5.5)
    assert (stall.rank, stall.progress, stall.seconds) == (1, 2, 5.5)
    assert ("worker 1 made no progress for 6 s (its pushes stayed at 2 while another "
            "worker's reached 4;") in stall.describe(5.0)
    assert "SSDSGD_STALL_TIMEOUT=5" in stall.describe(5.0)
    w.report(1, 3, False, 6.0)                      # it moved: the clock starts again
    assert w.stalled(10.0) == []


def test_workers_standing_still_together_are_not_stalled():
    """All waiting for the same thing (a server, a barrier): none of them is the cause."""
    w = StallWatch(1.0)
    for rank in range(3):
        w.report(rank, 7, False, 0.0)
    assert w.stalled(100.0) == []


def test_a_worker_that_others_wait_for_at_a_barrier_is_stalled_and_they_are_not():
    """Before the first step every worker waits at the set-up barrier for the slowest."""
    w = StallWatch(1.0)
    for rank in range(3):
        w.report(rank, 0, False, 0.0)
    (stall,) = w.stalled(2.0, waiting={0, 2})
    assert stall.rank == 1
    assert "while worker 0, 2 waited for it at a barrier" in stall.describe(1.0)
    assert w.stalled(2.0, waiting={0, 1, 2}) == []


def test_busy_time_does_not_count_and_a_leaver_is_forgotten():
    w = StallWatch(2.0)
    w.report(0, 9, False, 0.0)
    w.report(1, 5, True, 0.0)                       # rank 1 validates
    w.report(1, 5, True, 10.0)
    assert w.stalled(11.0) == []                    # 1 s since it was last busy
    assert [s.rank for s in w.stalled(12.5)] == [1]
    w.leave(0)                                      # the one ahead finished
    assert w.stalled(100.0) == []


def test_a_timeout_of_zero_turns_the_watch_off():
    w = StallWatch(0.0)
    w.report(0, 9, False, 0.0)
    w.report(1, 0, False, 0.0)
    assert w.stalled(1e9) == []


def test_failed_names_the_dead_and_the_stuck_once_each():
    env = SimpleNamespace(heartbeat_timeout=30.0, stall_timeout=5.0)
    node = dict(finished=False, pid=7, hostname="h")
    nodes = {b"a": dict(node, role="worker", rank=0, last_seen=100.0),
             b"b": dict(node, role="worker", rank=1, last_seen=100.0),
             b"s": dict(node, role="server", rank=0, last_seen=60.0),
             b"f": dict(node, role="worker", rank=2, last_seen=0.0, finished=True)}
    w = StallWatch(env.stall_timeout)
    w.report(0, 0, False, 90.0)
    w.report(1, 0, False, 90.0)
    assert failed(nodes, {}, w, env, 100.0) == [
        (b"s", "server 0 (pid 7 on h) sent no heartbeat for 40.0 s "
               "(SSDSGD_HEARTBEAT_TIMEOUT=30); presumed dead")]
    (ident, why), = failed(nodes, {"worker": {b"a"}}, w, env, 91.0 + 5)[1:]
    assert ident == b"b" and why.startswith("worker 1 made no progress for 6 s")


def test_workers_standing_still_on_a_servers_reply_name_that_server_after_the_timeout():
    """Every worker's progress stands still, none at a barrier, and one has waited longer
    than the timeout for a server's reply: that server is not answering (alive or not:
    its heartbeats may still come, or their timeout be long). The worker rule comes first:
    a worker behind the others is the cause, not the server that waits for it."""
    w = StallWatch(2.0)
    w.report(0, 7, False, 0.0, oldest=(1, 0.5))
    w.report(1, 7, False, 0.0, oldest=(0, 0.1))
    assert w.stalled(1.5) == [] and w.stuck_server(1.5) is None        # not yet
    w.report(0, 7, False, 2.0, oldest=(1, 2.5))
    w.report(1, 7, False, 2.0, oldest=(0, 2.1))
    stuck = w.stuck_server(2.5)
    assert (stuck.server, stuck.rank, stuck.seconds) == (1, 0, 3.0)
    assert stuck.describe(2.0) == (
        "server 1 has not answered worker 0's request for 3 s while no worker made "
        "progress (their pushes stayed at 7; none waits at a barrier): presumed stuck, "
        "SSDSGD_STALL_TIMEOUT=2")
    assert w.stuck_server(2.5, waiting={1}) is None         # a worker at a barrier
    w.report(1, 7, True, 2.4, oldest=(0, 2.5))             # one is busy (validation)
    assert w.stuck_server(2.5) is None
    w.report(1, 8, False, 3.0)                              # one moved: no server is stuck
    assert w.stuck_server(3.5) is None
    w.report(0, 7, False, 0.0)
    w.report(1, 7, False, 0.0)
    assert w.stuck_server(100.0) is None                    # nobody waits for a server
    w = StallWatch(2.0)
    w.report(0, 9, False, 0.0, oldest=(0, 5.0))
    w.report(1, 5, False, 0.0, oldest=(0, 5.0))
    assert [s.rank for s in w.stalled(3.0)] == [1] and w.stuck_server(3.0) is None
    w = StallWatch(0.0)                                     # off
    w.report(0, 7, False, 0.0, oldest=(0, 100.0))
    assert w.stuck_server(1e9) is None
    w = StallWatch(2.0)                                     # one worker is enough
    w.report(0, 3, False, 0.0, oldest=(0, 0.0))
    assert w.stuck_server(2.5).server == 0


def test_failed_names_a_server_that_answers_nobody():
    env = SimpleNamespace(heartbeat_timeout=600.0, stall_timeout=2.0)
    node = dict(finished=False, pid=7, hostname="h", last_seen=100.0)
    nodes = {b"a": dict(node, role="worker", rank=0), b"b": dict(node, role="worker", rank=1),
             b"s": dict(node, role="server", rank=0), b"t": dict(node, role="server", rank=1)}
    w = StallWatch(env.stall_timeout)
    w.report(0, 4, False, 95.0, oldest=(1, 1.0))
    w.report(1, 4, False, 95.0)
    (ident, why), = failed(nodes, {}, w, env, 100.0)
    assert ident == b"t" and why.startswith("server 1 (pid 7 on h) has not answered worker "
                                            "0's request for 6 s")


STUCK = [*sets(debug__slowdown="delay:1=3600", cluster__stall_timeout=3,
               cluster__heartbeat_interval=0.2, output__plots="false")]


@pytest.mark.system
def test_a_stuck_worker_aborts_the_job_naming_it(tmp_path):
    """on_worker_failure abort (the default): the job fails within the bound, and the
    launcher's line quotes the scheduler's reason."""
    t0 = time.monotonic()
    p = dist(["configs/digits.yaml", *digits_job("ssgd"), *STUCK,
              *sets(output__dir=tmp_path)], timeout=120)
    took = time.monotonic() - t0
    out = p.stdout + p.stderr
    assert p.returncode == 1, out[-3000:]
    assert re.search(r"the scheduler aborted the job: worker 1 made no progress for \d+ s "
                     r"\(its pushes stayed at 0 while worker 0 waited for it at a "
                     r"barrier; heartbeats still came: presumed stuck, "
                     r"SSDSGD_STALL_TIMEOUT=3\)", out), out[-3000:]
    assert took < 60, took          # the hour's sleep was not waited for


@pytest.mark.system
def test_with_continue_a_stuck_worker_leaves_and_the_job_finishes(tmp_path):
    """on_worker_failure continue: worker 1 is removed, told to leave, and (its training
    thread never ending) its process exits; rank 0 finishes the job alone."""
    p = dist(["configs/digits.yaml", *digits_job("ssgd"), *STUCK,
              *sets(output__dir=tmp_path, cluster__on_worker_failure="continue")],
             timeout=150)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert re.search(r"worker 1 made no progress for \d+ s .*; removing it from the job "
                     r"\(cluster.on_worker_failure: continue\)", out), out[-3000:]
    assert "the training thread did not end within 10 s of the abort; exiting" in out
    assert re.search(r"worker 1 \(pid \d+\) exited with code 1; the job continues without "
                     r"it", out), out[-3000:]
    summary = json.loads((run_dir_of(tmp_path) / "summary.json").read_text())
    (left,) = summary["workers_left"]
    assert left["rank"] == 1 and summary["workers_reporting"] == 1


@pytest.mark.system
def test_a_server_that_answers_nobody_ends_the_job_naming_it(tmp_path):
    """Server 0 SIGSTOPped mid-run while the heartbeat timeout is 10 minutes: its
    process lives but answers nothing, and both workers wait on it at the same count.
    Before, nothing was named until the heartbeat timeout (and for a server whose loop
    runs but never answers, e.g. a quorum follower without a round's decision, never);
    now the scheduler names it within the stall bound, and the job ends."""
    from test_recovery import start, wait_for_step
    root = tmp_path / "runs"
    args = ["configs/digits.yaml", *digits_job("ssgd"), *sets(
        cluster__stall_timeout=3, cluster__heartbeat_interval=0.2,
        cluster__heartbeat_timeout=600, output__dir=root)]
    with start(args) as job:
        wait_for_step(job, root, 8)
        server = job.process("server", 0)
        os.kill(server, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            assert job.wait(timeout=90) == 1, job.text[-3000:]
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(server, signal.SIGCONT)
        took = time.monotonic() - stopped
    assert re.search(r"the scheduler aborted the job: server 0 \(pid \d+ on [^)]+\) has not "
                     r"answered worker [01]'s request for \d+ s while no worker made "
                     r"progress \(their pushes stayed at \d+; none waits at a barrier\): "
                     r"presumed stuck, SSDSGD_STALL_TIMEOUT=3", job.text), job.text[-3000:]
    assert took < 45, took          # not the heartbeat timeout's 600 s
