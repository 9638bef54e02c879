"""A scheduler that can be lost (cluster.scheduler_restarts; docs/reliability.md): the
scheduler SIGKILLed at a seeded step of a digits job, ssgd and ssd; the launcher starts it
again at the same port with the same keys, every server and worker re-registers, and the
job ends with exactly the weights of an uninterrupted run, no server or worker restarted
(their pids at the end are the pids at the kill). One case with 2 servers in secure
(CURVE) mode and relayed pulls, one with compressed pushes and staggered pulls, and
localsgd and diloco between their model syncs."""
import json
import os
import re
import signal
import time

import pytest

from test_e2e_configs import records, sets
from test_resume import after_resume
from conftest import COMPRESSED_STAGGERED, DIGITS_EPOCHS as EPOCHS, DIGITS_STEPS as STEPS
from test_recovery import assert_same, final, kill_step, role_of, start, wait_for_step
from test_replicas import FIRST_APPLY, REPLICAS

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


def kill_the_scheduler(job, timeout):
    """SIGKILL the job's scheduler and wait for the launcher's line that the restarted
    one has every node back."""
    os.kill(job.process("scheduler"), signal.SIGKILL)
    job.wait_for("re-registered and the job goes on", timeout,
                 "the launcher's line that the restarted scheduler has every node back")


def restart_took(text):
    """The launcher's line of scheduler restart 1, and the seconds it says every node
    took to come back after the scheduler died."""
    line, = [ln for ln in text.splitlines() if "scheduler restart 1:" in ln]
    return line, float(re.search(r"\(([\d.]+) s after the scheduler died", line).group(1))


# Each algorithm, number of servers and security mode once (2 jobs): ssgd-1-plain, and
# ssd-2-curve, whose restart rebuilds ssd's state on two servers over CURVE (the
# ssd-1-plain case it replaces checked nothing this one does not), its pulls relayed from
# worker 0 to worker 1 (a relay moves the same bytes: the same weights as without it).
@pytest.mark.parametrize("algorithm,servers,secure", [("ssgd", 1, False), ("ssd", 2, True)])
def test_a_killed_scheduler_is_restarted_and_the_job_ends_as_if_uninterrupted(
        tmp_path, uninterrupted, algorithm, servers, secure):
    reference = uninterrupted(algorithm)
    root = tmp_path / "runs"
    step = kill_step(f"scheduler-restart-{algorithm}")
    relay = "chain" if algorithm == "ssd" else "off"
    args = ["configs/digits.yaml", *JOBS[algorithm], *sets(
        output__dir=root, cluster__scheduler_restarts=1, cluster__servers=servers,
        sync__pull_relay=relay)]
    with start(args + (["--secure"] if secure else [])) as job:
        run = wait_for_step(job, root, step)
        before = nodes(job)
        assert len(before) == 2 + servers, before
        killed_at = time.monotonic()
        os.kill(job.process("scheduler"), signal.SIGKILL)
        job.wait_for(lambda: "re-registered and the job goes on" in job.text, 120,
                     "the launcher's line that the restarted scheduler has every node back")
        back = time.monotonic() - killed_at
        # nobody was started again: every node still runs as the same process, or has
        # ended (the workers may reach the job's end while the scheduler is down and finish
        # right after they re-registered; an abnormal end fails the job below)
        now = nodes(job)
        assert now.items() <= before.items(), (now, before)
        assert job.wait(timeout=300) == 0, job.text[-3000:]
    out = job.text
    line, took = restart_took(out)
    print(f"{algorithm}, {servers} server(s), {'curve' if secure else 'plain'}: {line}; "
          f"seen by the test {back:.1f} s after the kill")
    assert took < 30, line
    assert "restarting it at 127.0.0.1:" in out and "restart 1 of 1" in out
    for who, pid in before.items():    # each node says it rejoined, none restarted
        assert f"{who[0]} {who[1]}: rejoined the job with the restarted scheduler" in out, who
    assert_same(run, reference)
    relayed = records(run, 1, "end")[-1]["kv"]["replies_relayed_in"]
    assert (relayed > 0) == (relay == "chain"), relayed


def test_a_compressed_staggered_job_survives_its_schedulers_death(
        tmp_path, uninterrupted_digits):
    """ssd with 2bit pushes and staggered pulls: the scheduler SIGKILLed in the
    steps-delay stage is restarted in place, and the job ends with the weights of the
    same job run without interruption (a worker's residuals and pull phase are its own,
    never the scheduler's)."""
    reference = final(uninterrupted_digits("ssd", **COMPRESSED_STAGGERED))
    run = _killed_once(tmp_path, "ssd", COMPRESSED_STAGGERED, "scheduler-restart-compressed")
    assert_same(run, reference)


def _killed_once(tmp_path, job, settings, seed):
    """The run of digits job ``job`` (JOBS) with ``settings``, its scheduler SIGKILLed
    at the step ``seed`` picks and restarted in place, no server or worker restarted."""
    root = tmp_path / "runs"
    with start(["configs/digits.yaml", *JOBS[job], *sets(
            **settings, output__dir=root, cluster__scheduler_restarts=1)]) as running:
        run = wait_for_step(running, root, kill_step(seed))
        before = nodes(running)
        os.kill(running.process("scheduler"), signal.SIGKILL)
        running.wait_for("re-registered and the job goes on", 120)
        assert nodes(running) == before        # nobody restarted
        assert running.wait(timeout=300) == 0, running.text[-3000:]
    return run


#: localsgd and diloco on the digits job: ssd's warm-up, then a model sync every 4 steps
PERIODIC = {"sync__warmup_steps": 29, "sync__sync_period": 4}


@pytest.mark.parametrize("algorithm", ["localsgd", "diloco"])
def test_a_model_averaging_job_survives_its_schedulers_death(
        tmp_path, uninterrupted_digits, algorithm):
    """localsgd and diloco: the scheduler SIGKILLed after the warm-up, between model syncs
    or in one, is restarted in place; the workers keep their own optimizer and the servers
    their outer one, and the job ends with the weights of the same job run without
    interruption."""
    settings = dict(PERIODIC, sync__algorithm=algorithm)
    reference = final(uninterrupted_digits("ssgd", **settings))
    run = _killed_once(tmp_path, "ssgd", settings, f"scheduler-restart-{algorithm}")
    assert_same(run, reference)
    assert json.loads((run / "summary.json").read_text())["algorithm"] == algorithm


def test_an_asynchronous_job_survives_its_schedulers_death(tmp_path, uninterrupted_digits):
    """asgd: each push applied as it arrives, no round for the scheduler to rebuild; the
    scheduler SIGKILLed mid-run is restarted in place. With one worker the order of
    arrival is fixed, so the job ends with the weights of the same job run without
    interruption: no push lost or applied twice across the restart."""
    settings = {"sync__algorithm": "asgd", "cluster__workers": 1}
    reference = final(uninterrupted_digits("ssgd", **settings))
    run = _killed_once(tmp_path, "ssgd", settings, "scheduler-restart-asgd")
    assert_same(run, reference)
    assert json.loads((run / "summary.json").read_text())["algorithm"] == "asgd"


def test_a_job_restarted_from_its_checkpoint_survives_its_schedulers_death(
        tmp_path, uninterrupted):
    """--max-restarts 1 and cluster.scheduler_restarts 1 together: worker 1 SIGKILLed,
    the launcher restarts the job from its checkpoint (a resumed job: SSDSGD_START_STEP >
    0); then that job's scheduler SIGKILLed: restarted in place, and the job ends with the
    uninterrupted weights."""
    reference = uninterrupted("ssd")
    root = tmp_path / "runs"
    args = ["configs/digits.yaml", *JOBS["ssd"], "--max-restarts", 1, *sets(
        output__dir=root, cluster__scheduler_restarts=1, debug__slowdown="delay:0=0.04")]
    with start(args) as job:
        run = wait_for_step(job, root, kill_step("scheduler-restart-resumed"))
        os.kill(job.process("worker", 1), signal.SIGKILL)
        job.wait_for("resuming from the checkpoint at step", 60)
        job.wait_for(lambda: len(records(run, 0, "start")) == 2 and after_resume(run), 120,
                     "a step of the resumed job")
        os.kill(job.process("scheduler"), signal.SIGKILL)
        job.wait_for("re-registered and the job goes on", 120)
        assert job.wait(timeout=300) == 0, job.text[-3000:]
    assert "restart 1 of 1: worker 1 on " in job.text
    assert "restarting it at 127.0.0.1:" in job.text
    assert_same(run, reference)


def test_a_scheduler_lost_during_registration_is_restarted_and_the_nodes_register_again(
        tmp_path, uninterrupted):
    """The scheduler SIGKILLed as soon as it listens, before every node registered: the
    restarted one has no job to rebuild; the nodes that had registered register again
    (their connection closed while they waited for the topology), the others for the
    first time, and the job runs as if nothing happened."""
    reference = uninterrupted("ssgd")
    root = tmp_path / "runs"
    with start(["configs/digits.yaml", *JOBS["ssgd"], *sets(
            output__dir=root, cluster__scheduler_restarts=1)]) as job:
        job.wait_for(lambda: re.search(r"\[scheduler\] .*listening on", job.text), 60)
        os.kill(job.process("scheduler"), signal.SIGKILL)
        job.wait_for("re-registered and the job goes on", 120)
        assert job.wait(timeout=300) == 0, job.text[-3000:]
    assert "restart 1: the lost scheduler had not started the job; the nodes register " \
           "again" in job.text
    run, = [d for d in root.iterdir() if d.is_dir()]
    assert_same(run, reference)


def test_after_a_scheduler_restart_a_stuck_worker_is_still_named(tmp_path):
    """Worker 1's training thread sleeps an hour before its first push (its I/O thread
    heartbeating) while worker 0 waits for it at the set-up barrier; the scheduler is
    SIGKILLed then. Worker 0 waits at the barrier again with the restarted scheduler,
    whose stall watch fails worker 1 within cluster.stall_timeout: the job ends naming it
    (on_worker_failure abort), not hangs."""
    root = tmp_path / "runs"
    with start(["configs/digits.yaml", *JOBS["ssgd"], *sets(
            output__dir=root, cluster__scheduler_restarts=1, debug__slowdown="delay:1=3600",
            cluster__stall_timeout=6, cluster__heartbeat_interval=0.2)]) as job:
        job.wait_for("every server listens", 90)
        time.sleep(1.0)     # worker 0 reaches the set-up barrier (or will, after the restart)
        os.kill(job.process("scheduler"), signal.SIGKILL)
        job.wait_for("re-registered and the job goes on", 60)
        t0 = time.monotonic()
        assert job.wait(timeout=60) == 1, job.text[-3000:]
        took = time.monotonic() - t0
    assert re.search(r"the scheduler aborted the job: worker 1 made no progress for \d+ s "
                     r"\(its pushes stayed at 0 while worker 0 waited for it at a barrier",
                     job.text), job.text[-3000:]
    assert took < 30, took


def _continue_job(root, algorithm, paced):
    """The digits job with cluster.on_worker_failure: continue (heartbeat timeout 1 s)
    and one scheduler restart, worker ``paced`` slowed 0.1 s a step (timing only),
    started."""
    return start(["configs/digits.yaml", *JOBS[algorithm], *sets(
        output__dir=root, cluster__scheduler_restarts=1,
        cluster__on_worker_failure="continue", cluster__heartbeat_interval=0.2,
        cluster__heartbeat_timeout=1.0, debug__slowdown=f"delay:{paced}=0.1")])


@pytest.mark.parametrize("algorithm", ["ssgd"])
def test_after_a_scheduler_restart_a_killed_worker_leaves_with_continue(tmp_path, algorithm):
    """cluster.on_worker_failure: continue after a restarted scheduler: worker 1
    SIGKILLed once every node is back; the restarted scheduler removes it and the job
    finishes with worker 0, summary.json naming who left."""
    root = tmp_path / "runs"
    with _continue_job(root, algorithm, paced=0) as job:
        # early and paced (0.1 s a step: timing only), so that worker 1 is killed
        # mid-run whatever the restart takes on a loaded machine
        run = wait_for_step(job, root, 8)
        os.kill(job.process("scheduler"), signal.SIGKILL)
        job.wait_for("re-registered and the job goes on", 60)
        os.kill(job.process("worker", 1), signal.SIGKILL)
        assert job.wait(timeout=120) == 0, job.text[-3000:]
    assert re.search(r"worker 1 left the job; the servers aggregate the remaining 1 "
                     r"workers from step \d+", job.text), job.text[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    (left,) = summary["workers_left"]
    assert left["rank"] == 1 and summary["workers_reporting"] == 1


@pytest.mark.parametrize("algorithm", ["ssgd"])
def test_after_worker_0_was_removed_a_killed_scheduler_is_restarted(tmp_path, algorithm):
    """cluster.on_worker_failure: continue: worker 0 (the chief) SIGKILLed and removed,
    then the scheduler SIGKILLed: the restarted scheduler takes worker 1 back without
    waiting for worker 0, and worker 1 finishes the job as the chief (its validation,
    summary.json naming worker 0 removed)."""
    root = tmp_path / "runs"
    with _continue_job(root, algorithm, paced=1) as job:
        # paced on worker 1 (timing only), the one that lives to the end
        run = wait_for_step(job, root, 8)
        os.kill(job.process("worker", 0), signal.SIGKILL)
        job.wait_for("worker 0 left the job", 60)
        os.kill(job.process("scheduler"), signal.SIGKILL)
        job.wait_for("re-registered and the job goes on", 60)
        assert job.wait(timeout=150) == 0, job.text[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    (left,) = summary["workers_left"]
    assert left["rank"] == 0 and left["how"] == "removed", summary
    assert summary["steps"] == EPOCHS * STEPS and summary["workers_reporting"] == 1, summary
    done = [line for line in job.text.splitlines() if "done: test accuracy" in line]
    assert len(done) == 1 and "[worker 1]" in done[0], done
    line, took = restart_took(job.text)
    assert took < 15, line      # worker 0 was not waited for (30 s at least)


def test_a_scheduler_that_dies_past_its_restarts_fails_the_job_naming_it(tmp_path):
    """cluster.scheduler_restarts 1 and the scheduler SIGKILLed twice: the second death
    is past the bound, and the job fails in one line saying so."""
    root = tmp_path / "runs"
    with start(["configs/digits.yaml", *JOBS["ssgd"], *sets(
            output__dir=root, cluster__scheduler_restarts=1,
            debug__slowdown="delay:0=0.1")]) as job:
        wait_for_step(job, root, 4)
        os.kill(job.process("scheduler"), signal.SIGKILL)
        job.wait_for("re-registered and the job goes on", 60)
        os.kill(job.process("scheduler"), signal.SIGKILL)
        assert job.wait(timeout=60) == 1, job.text[-3000:]
    assert ("the scheduler died again after 1 restart(s) (cluster.scheduler_restarts=1); "
            "giving up") in job.text, job.text[-3000:]
    assert re.search(r"scheduler \(pid \d+\) was killed by SIGKILL; stopping the job",
                     job.text), job.text[-3000:]


def test_a_scheduler_lost_while_the_workers_wait_for_it_at_the_end_is_restarted(
        tmp_path, uninterrupted):
    """The scheduler stopped (SIGSTOP) near the end, so that the workers reach the last
    epoch's checkpoint barrier and their FINISH and wait for it there, then SIGKILLed:
    each worker re-sends what it waits for to the restarted scheduler, the barrier is
    released once, the FINISHes are answered, the servers shut down; the same weights."""
    reference = uninterrupted("ssgd")
    root = tmp_path / "runs"
    with start(["configs/digits.yaml", *JOBS["ssgd"], *sets(
            output__dir=root, cluster__scheduler_restarts=1)]) as job:
        run = wait_for_step(job, root, 80)
        scheduler = job.process("scheduler")
        os.kill(scheduler, signal.SIGSTOP)
        stopped = time.monotonic()
        job.wait_for(lambda: time.monotonic() - stopped > 4, 10)   # they reach the end
        assert len(nodes(job)) == 3      # every worker alive: it waits for the scheduler
        os.kill(scheduler, signal.SIGKILL)
        job.wait_for("re-registered and the job goes on", 60)
        assert job.wait(timeout=120) == 0, job.text[-3000:]
    text = job.text      # the job's end was the restarted scheduler's
    assert text.count("all workers finished; job done") == 1
    assert text.index("re-registered and the job goes on") < text.index("job done")
    assert_same(run, reference)


def test_a_scheduler_lost_the_moment_the_job_starts_recovers_or_fails_naming_the_set_up(
        tmp_path, uninterrupted):
    """SIGKILLed as soon as it says every node registered, the scheduler is lost either
    before every node had its rank or every worker heard where the servers listen (the new
    scheduler fails the job naming the set-up, and the launcher quotes it) or after (the
    job recovers and ends with the uninterrupted weights). Either is a clear outcome
    within bounded time; which one depends on the moment the kill lands."""
    reference = uninterrupted("ssgd")
    root = tmp_path / "runs"
    with start(["configs/digits.yaml", *JOBS["ssgd"], *sets(
            output__dir=root, cluster__scheduler_restarts=1)]) as job:
        pid = job.process("scheduler")
        deadline = time.monotonic() + 90
        while "job started" not in job.text:      # polled tightly: the window is short
            assert time.monotonic() < deadline and job.poll() is None, job.text[-3000:]
            time.sleep(0.002)
        os.kill(pid, signal.SIGKILL)
        code = job.wait(timeout=120)
    if code == 1:
        assert re.search(r"\[launcher\] the scheduler aborted the job: restart 1: the "
                         r"scheduler was lost during the job's set-up: (worker \d+ had not "
                         r"heard where the servers listen|server \d+ had not bound its "
                         r"port|(a worker|worker \d+|server \d+) had not received its "
                         r"rank); a restarted scheduler rebuilds only a job that was set up",
                         job.text), job.text[-3000:]
    else:
        assert code == 0 and "re-registered and the job goes on" in job.text, job.text[-3000:]
        run, = [d for d in root.iterdir() if d.is_dir()]
        assert_same(run, reference)
    print(f"the set-up kill: exit {code}")


@pytest.mark.parametrize("dead", [1, 0])
def test_a_worker_that_dies_with_the_scheduler_leaves_with_continue(tmp_path, dead):
    """Worker ``dead`` (1, or 0, the chief) and the scheduler SIGKILLed together,
    cluster.on_worker_failure: continue: the launcher tells the restarted scheduler that
    it saw the worker die (at the restart, or while the new one rebuilds), so it does not
    wait for it (it once waited max(30 s, 2 x the heartbeat timeout)): it removes it once
    the others are back (worker 0 too: the lost scheduler's status file says it had
    pushed), and the other worker finishes the job."""
    root = tmp_path / "runs"
    alive = 1 - dead
    with _continue_job(root, "ssgd", paced=alive) as job:
        run = wait_for_step(job, root, 8)
        victims = [job.process("worker", dead), job.process("scheduler")]
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        job.wait_for(f"worker {dead} left the job", 60)
        took = time.monotonic() - killed_at
        assert job.wait(timeout=150) == 0, job.text[-3000:]
    assert re.search(rf"worker {dead} died while the scheduler was down \(its launcher saw "
                     r"it\); removing it from the job \(cluster.on_worker_failure: "
                     r"continue\)", job.text), job.text[-3000:]
    assert took < 15, took
    assert re.search(rf"worker {dead} left the job; the servers aggregate the remaining 1 "
                     r"workers from step \d+", job.text), job.text[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert [w["rank"] for w in summary["workers_left"]] == [dead]
    done = [line for line in job.text.splitlines() if "done: test accuracy" in line]
    assert len(done) == 1 and f"[worker {alive}]" in done[0], done


def test_after_a_server_was_replaced_by_its_backup_a_killed_scheduler_is_restarted(
        tmp_path, uninterrupted):
    """cluster.server_replicas 1 and cluster.scheduler_restarts 1, ssd: server 0
    SIGKILLed, its backup (server 1) owns its keys; then the scheduler SIGKILLed. The
    restarted one learns from the lost one's status file that server 0 was replaced, so
    it waits for the 3 nodes left, not for server 0, and the job ends with the weights of
    the uninterrupted 1-server job (a replaced server's keys are its backup's, bit for
    bit)."""
    reference = uninterrupted("ssd")
    root = tmp_path / "runs"
    with start(["configs/digits.yaml", *JOBS["ssd"], *REPLICAS, *sets(
            output__dir=root, cluster__scheduler_restarts=1)]) as job:
        wait_for_step(job, root, kill_step("scheduler-restart-replicas"))
        os.kill(job.process("server", 0), signal.SIGKILL)
        job.wait_for(lambda: FIRST_APPLY.search(job.text), 60, "the new owner's first step")
        before = nodes(job)
        assert sorted(before) == [("server", 1), ("worker", 0), ("worker", 1)], before
        os.kill(job.process("scheduler"), signal.SIGKILL)
        job.wait_for("re-registered and the job goes on", 60)
        # nobody was started again: every node still runs as the same process, or has
        # ended (an unslowed worker 1 may finish its last steps right after it re-registered
        # on a loaded machine: seen in a run at load average 14; an abnormal end fails the
        # job below)
        now = nodes(job)
        assert now.items() <= before.items(), (now, before)
        assert job.wait(timeout=300) == 0, job.text[-3000:]
    run, = [d for d in root.iterdir() if d.is_dir()]
    assert "restart 1: rebuilding the job from the nodes that re-register (3 expected; " \
           "server 0 replaced by server 1" in job.text, job.text[-3000:]
    assert_same(run, reference)


def test_a_server_that_dies_with_the_scheduler_is_replaced_by_its_backup(
        tmp_path, uninterrupted):
    """cluster.server_replicas 1: server 0 and the scheduler SIGKILLed together (a host
    that ran both, lost). The launcher saw server 0 die and tells the scheduler it
    restarts (SSDSGD_SERVERS_LOST), which does not wait for it: once the others are back
    it hands its keys to its backup, as the lost one would have, within seconds (before,
    it waited max(30 s, 2 x the heartbeat timeout) for server 0), and the job ends with
    the uninterrupted weights."""
    reference = uninterrupted("ssd")

    def kill(job):
        for pid in (job.process("server", 0), job.process("scheduler")):
            os.kill(pid, signal.SIGKILL)
    text, run, took = _server_0_replaced(tmp_path, "scheduler-restart-server-too", kill)
    # the launcher names server 0 when it restarts the scheduler, or, if it saw the
    # server's exit only after that (CI: its teardown outlasted the scheduler's), while
    # the new scheduler rebuilds
    assert re.search(r"restart 1: rebuilding the job from the nodes that re-register \(3 "
                     r"expected; server 0 lost \(its launcher saw it die\);", text) \
        or re.search(r"restart 1: server 0 lost \(its launcher saw it die while this "
                     r"scheduler rebuilt the job\)", text), text[-3000:]
    assert re.search(r"server 0 died while the scheduler was down \(its launcher saw it\); "
                     r"server 1 owns its keys from now on, and the job goes on with no "
                     r"replica left", text), text[-3000:]
    assert took < 20, took
    assert_same(run, reference)


def _server_0_replaced(tmp_path, seed, kill):
    """The replicas job (ssd, 2 servers) with cluster.scheduler_restarts 1, ``kill(job)``
    called at the step ``seed`` picks: (its output, its run, seconds from the end of the
    kill until server 1 owned server 0's keys), once it ended with exit 0."""
    root = tmp_path / "runs"
    with start(["configs/digits.yaml", *JOBS["ssd"], *REPLICAS, *sets(
            output__dir=root, cluster__scheduler_restarts=1)]) as job:
        wait_for_step(job, root, kill_step(seed))
        kill(job)
        killed_at = time.monotonic()
        job.wait_for("server 1 owns its keys from now on", 60)
        took = time.monotonic() - killed_at
        assert job.wait(timeout=150) == 0, job.text[-3000:]
    run, = [d for d in root.iterdir() if d.is_dir()]
    return job.text, run, took


def test_a_server_the_launcher_sees_die_after_the_scheduler_restarted_is_replaced_at_once(
        tmp_path, uninterrupted):
    """cluster.server_replicas 1: the launcher may see a server's death only after it has
    restarted the scheduler (the two died together but the server's exit came later, as
    in CI, or a remote host's connection dropped later). Server 0 is stopped (SIGSTOP),
    so it cannot re-register, the scheduler SIGKILLed, and once the launcher has
    restarted it server 0 SIGKILLed: the launcher tells the rebuilding scheduler, which
    hands its keys to its backup within seconds instead of waiting max(30 s, 2 x the
    heartbeat timeout) for it, and the job ends with the uninterrupted weights."""
    reference = uninterrupted("ssd")

    def kill(job):
        server0 = job.process("server", 0)
        os.kill(server0, signal.SIGSTOP)
        os.kill(job.process("scheduler"), signal.SIGKILL)
        job.wait_for("restarting it at 127.0.0.1:", 30)
        os.kill(server0, signal.SIGKILL)
    text, run, took = _server_0_replaced(tmp_path, "scheduler-restart-server-later", kill)
    assert re.search(r"restart 1: server 0 lost \(its launcher saw it die while this "
                     r"scheduler rebuilt the job\)", text), text[-3000:]
    assert took < 15, took
    assert_same(run, reference)


def test_after_a_scheduler_restart_a_killed_server_is_replaced_by_its_backup(
        tmp_path, uninterrupted):
    """cluster.server_replicas 1, ssd: the scheduler SIGKILLed and restarted, then server
    0 SIGKILLed. The rebuilt scheduler hands its keys to its backup as a first one would
    (it once refused, saying the server died before every server listened: a rebuilt
    scheduler keeps no record of the start-up), and the job ends bit-identical."""
    reference = uninterrupted("ssd")
    root = tmp_path / "runs"
    with start(["configs/digits.yaml", *JOBS["ssd"], *REPLICAS, *sets(
            output__dir=root, cluster__scheduler_restarts=1,
            debug__slowdown="delay:0=0.1")]) as job:
        # paced (0.1 s a step, timing only), so that server 0 dies well before the end
        wait_for_step(job, root, kill_step("scheduler-restart-then-server"))
        os.kill(job.process("scheduler"), signal.SIGKILL)
        job.wait_for("re-registered and the job goes on", 60)
        os.kill(job.process("server", 0), signal.SIGKILL)
        job.wait_for(lambda: FIRST_APPLY.search(job.text), 60, "the new owner's first step")
        assert job.wait(timeout=300) == 0, job.text[-3000:]
    run, = [d for d in root.iterdir() if d.is_dir()]
    assert_same(run, reference)
