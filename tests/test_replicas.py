"""cluster.server_replicas: 1 with real processes (docs/reliability.md): a server of a
2-server, 2-worker digits job SIGKILLed at a seeded step, ssgd and ssd; its backup owns
its keys within seconds, no process is restarted, and the job ends with the weights of
the uninterrupted job. In process: what a server and the scheduler refuse of the
replicas' messages."""
import json
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


def kill_a_server(root, name, args, servers=2):
    """Start the digits job ``args`` with ``servers`` servers and replicas, SIGKILL a server
    chosen by ``name`` at a step chosen by ``name``, and wait for the job's end: (the run
    directory, its output, the victim), once nothing restarted (every process but the
    victim is the one that was there before)."""
    step, victim = kill_step(name), random.Random(name).choice(range(servers))
    with start(["configs/digits.yaml", *args, *REPLICAS,
                *sets(cluster__servers=servers, output__dir=root)]) as job:
        run = wait_for_step(job, root, step)
        before = roles(job)
        os.kill(before[("server", victim)], signal.SIGKILL)
        job.wait_for(lambda: FIRST_APPLY.search(job.text), 60, "the new owner's first step")
        after = roles(job)
        assert job.wait(timeout=300) == 0, job.stdout[-3000:]
    assert after == {r: p for r, p in before.items() if r != ("server", victim)}
    assert "restart" not in job.stdout
    return run, job.stdout, victim


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
def test_a_server_its_launcher_saw_die_is_replaced_without_waiting_for_heartbeats(
        tmp_path, uninterrupted_digits):
    """With the default heartbeat timeout (30 s) the scheduler does not wait for a
    SIGKILLed server's heartbeats to stop: the launcher saw its process exit and says so
    (job_status.write_lost), and its backup owns its keys within seconds. Before, the
    job stood still for the heartbeat timeout."""
    reference = final(uninterrupted_digits("ssgd"))
    step, victim = kill_step("replicas-launcher-saw"), 1
    root = tmp_path / "runs"
    with start(["configs/digits.yaml", *digits_job("ssgd"),
                *sets(cluster__servers=2, cluster__server_replicas=1, output__dir=root)]) as job:
        run = wait_for_step(job, root, step)
        os.kill(roles(job)[("server", victim)], signal.SIGKILL)
        killed_at = time.time()
        line = job.wait_for(lambda: FIRST_APPLY.search(job.text), 60,
                            "the new owner's first step")
        assert job.wait(timeout=300) == 0, job.stdout[-3000:]
    recovery = float(line.group(4)) - killed_at
    print(f"server {victim} killed after step {step}; its backup applied a step as the "
          f"owner {recovery:.2f} s later (heartbeat timeout 30 s)")
    assert 0 < recovery <= 5.0
    assert re.search(rf"server {victim} \(pid \d+ on [^)]*\): its process exited \(its "
                     r"launcher saw it\); server 0 owns its keys from now on", job.stdout), \
        job.stdout[-3000:]
    assert "presumed dead" not in job.stdout
    assert_same(run, reference)


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


# ---- in process: a server that backs up server 1 (2 servers), real sockets --------------

def backup_job(**settings):
    from test_server_in_process import InProcessJob
    return InProcessJob(num_servers=2, **settings)


def test_a_backup_holds_its_replies_until_promoted_then_sends_them_and_takeover():
    from ssdsgd.kvstore import protocol as P
    from test_server_in_process import SIZES, init, push
    job = backup_job(SSDSGD_SERVER_REPLICAS=1)
    try:
        w0, w1 = job.workers
        values = {k: np.ones(n, np.float32) for k, n in SIZES.items()}
        init(job, values)     # INITs as the owner's (the backup's own keys are answered)
        copy = P.Flag.PULL | P.Flag.BACKUP
        grads = {k: np.full(n, 0.25, np.float32) for k, n in SIZES.items()}
        for rank in (0, 1):
            push(job, rank, 0, grads, flags=copy)
        assert job.replies(w0) == [] and job.replies(w1) == []    # held, not sent
        held = {id(r): r.req for r in job.server.backup.held}
        assert len(held) == 2
        # a checkpoint's get_state: the owner's reply leaves the backed-up keys out (none
        # here: every key was copied), the copy's holds them, and is held
        job.send(w0, P.Message(P.Kind.COMMAND, sender=0, meta={"command": "get_state"}))
        (own,) = job.replies(w0)
        assert own.kind == P.Kind.REPLY and len(own.records) == 0
        job.send(w0, P.Message(P.Kind.COMMAND, sender=0, req=77, flags=P.Flag.BACKUP,
                               meta={"command": "get_state"}))
        assert job.replies(w0) == []
        # a PROMOTE naming another owner than the dead server's backup stops this server
        from ssdsgd.kvstore.replies import Fatal
        with pytest.raises(Fatal, match="its backup is server 0"):
            job.server.on_scheduler(P.Message(P.Kind.PROMOTE, meta={"dead": 1, "owner": 1}))
        job.server.backup.map.dead.clear()
        job.server.on_scheduler(P.Message(P.Kind.PROMOTE, meta={"dead": 1, "owner": 0}))
        got = [job.replies(w0), job.replies(w1)]
        (state,) = [m for m in got[0] if m.req == 77]     # the held get_state, sent
        assert sorted(state.records["key"].tolist()) == sorted(SIZES)
        for rank in (0, 1):
            reply, takeover = [m for m in got[rank] if m.req != 77]
            assert reply.kind == P.Kind.REPLY and reply.req in held.values()
            for arrays in reply.tensors:       # no optimizer: the store keeps the sum
                np.testing.assert_array_equal(arrays[0], np.full_like(arrays[0], 0.5))
            assert takeover.kind == P.Kind.TAKEOVER and takeover.meta == {"dead": 1, "owner": 0}
        assert any("owns its 2 keys from now on" in line for line in job.logged)
        # after the takeover a copy is answered at once: this server owns those keys
        push(job, 0, 1, grads, flags=copy)
        push(job, 1, 1, grads, flags=copy)
        assert [m.kind for m in job.replies(w0)] == [P.Kind.REPLY]
        assert any("first step applied as the owner of server 1's keys" in line
                   for line in job.logged), job.logged
    finally:
        job.close()


def test_a_copy_whose_step_completes_after_the_takeover_is_answered():
    """Worker 0's copy of step 0 (a push that pulls) reached the backup, worker 1's had
    not when the owner died: the backup took over with that reply incomplete. Worker 1's
    push then completes the step; the reply must go to worker 0 (before, it was held for
    an owner that was gone, and worker 0 waited forever: seen with a joiner whose first
    pull waited for a step the others had not pushed)."""
    from ssdsgd.kvstore import protocol as P
    from test_server_in_process import SIZES, init, push
    job = backup_job(SSDSGD_SERVER_REPLICAS=1)
    try:
        w0, w1 = job.workers
        init(job, {k: np.ones(n, np.float32) for k, n in SIZES.items()})
        grads = {k: np.full(n, 0.25, np.float32) for k, n in SIZES.items()}
        push(job, 0, 0, grads, flags=P.Flag.PULL | P.Flag.BACKUP)
        assert job.replies(w0) == []
        job.server.on_scheduler(P.Message(P.Kind.PROMOTE, meta={"dead": 1, "owner": 0}))
        assert [m.kind for m in job.replies(w0)] == [P.Kind.TAKEOVER]
        push(job, 1, 0, grads)                   # sent after the takeover: to the owner
        kinds = {rank: [m.kind for m in job.replies(w)] for rank, w in ((0, w0), (1, w1))}
        assert kinds[0] == [P.Kind.REPLY], kinds
        assert kinds[1] == [P.Kind.TAKEOVER, P.Kind.REPLY], kinds
    finally:
        job.close()


def test_a_copy_that_overtakes_worker_0s_init_waits_for_it():
    """Worker 1's copies reach the backup in order (its INIT, then its push), but worker
    0's INIT copy travels on another connection: worker 1 may have its INIT answered by
    the owner and push before worker 0's copy reaches the backup. Before, the backup
    refused that push ("key 5 was never initialized on server 0") and the job ended; now
    it waits, bounded, for the INIT worker 1 is itself waiting for."""
    from ssdsgd.kvstore import protocol as P
    from test_server_in_process import SIZES, records
    job = backup_job(SSDSGD_SERVER_REPLICAS=1)
    try:
        w0, w1 = job.workers
        copy = P.Flag.BACKUP
        values = {k: np.ones(n, np.float32) for k, n in SIZES.items()}
        grads = {k: np.full(n, 0.25, np.float32) for k, n in SIZES.items()}
        job.send(w1, P.Message(P.Kind.INIT, sender=1, flags=copy,
                               records=records(SIZES, ntensors=0), tensors=[[] for _ in SIZES]))
        job.send(w1, P.Message(P.Kind.PUSH, sender=1, flags=copy | P.Flag.PULL,
                               records=records(SIZES, step=0),
                               tensors=[[grads[k]] for k in SIZES]))
        assert job.replies(w1) == [], "the early copy was refused, not kept for the INIT"
        job.send(w0, P.Message(P.Kind.INIT, sender=0, flags=copy, records=records(SIZES),
                               tensors=[[values[k]] for k in SIZES]))
        job.send(w0, P.Message(P.Kind.PUSH, sender=0, flags=copy | P.Flag.PULL,
                               records=records(SIZES, step=0),
                               tensors=[[grads[k]] for k in SIZES]))
        assert job.replies(w0) == [] and job.replies(w1) == []    # all held, none refused
        held = job.server.backup.held           # both INITs' replies, then both pushes'
        assert [r.peer.rank for r in held] == [1, 0, 1, 0] and job.server.backup.early == []
        for reply in held[2:]:                  # no optimizer: the store keeps the sum
            for arrays in reply.parts:
                np.testing.assert_array_equal(arrays[0], np.full_like(arrays[0], 0.5))
        # a push of a key no INIT of its worker waits for is still refused at once
        job.send(w1, P.Message(P.Kind.PUSH, sender=1, flags=copy,
                               records=P.make_records([(9, 0, 0, 4, np.float32, 1)]),
                               tensors=[[np.ones(4, np.float32)]]))
        (error,) = job.replies(w1)
        assert error.kind == P.Kind.ERROR and "key 9 was never initialized" in error.meta["error"]
    finally:
        job.close()


def test_copies_kept_for_an_init_are_bounded():
    from types import SimpleNamespace
    from ssdsgd.kvstore import protocol as P
    from ssdsgd.kvstore.backup import EARLY_PER_WORKER, Backup
    from ssdsgd.kvstore.replies import RequestError
    backup = Backup(SimpleNamespace(num_servers=2, server_replicas=1), None, print)
    recs = P.make_records([(5, 0, 0, 4, np.float32, 1)])
    waiting = [(b"w1", P.Message(P.Kind.INIT, sender=1, records=recs))]
    copy = P.Message(P.Kind.PUSH, sender=1, flags=P.Flag.BACKUP, records=recs)
    assert not backup.overtook(b"w1", P.Message(P.Kind.PUSH, sender=1, records=recs), {},
                               waiting), "only copies wait"
    assert not backup.overtook(b"w2", copy, {}, waiting), "for an INIT of their own worker"
    for _ in range(EARLY_PER_WORKER):
        assert backup.overtook(b"w1", copy, {}, waiting)
    with pytest.raises(RequestError, match=f"worker 1 sent {EARLY_PER_WORKER} copies before "
                       "worker 0's INIT of key 5 reached this server"):
        backup.overtook(b"w1", copy, {}, waiting)
    assert backup.caught_up({}) == [] and len(backup.caught_up({5: None})) == EARLY_PER_WORKER


def test_replication_messages_outside_their_rules_are_refused_in_one_line():
    from ssdsgd.kvstore import protocol as P
    from ssdsgd.kvstore.replica_map import ReplicaMap
    from ssdsgd.config import ConfigError, parse_config
    from test_server_in_process import SIZES, error_of, init, push
    job = backup_job()          # server_replicas: 0
    try:
        init(job, {k: np.zeros(n, np.float32) for k, n in SIZES.items()})
        w0 = job.workers[0]
        push(job, 0, 0, {k: np.ones(n, np.float32) for k, n in SIZES.items()},
             flags=P.Flag.PULL | P.Flag.BACKUP)
        _, error = error_of(job, w0)
        assert error == ("a backup's copy of a request, but this job has no replicas "
                         "(cluster.server_replicas: 0)")
        for kind in (P.Kind.PROMOTE, P.Kind.TAKEOVER):   # a worker cannot promote
            job.send(w0, P.Message(kind, sender=0, meta={"dead": 1, "owner": 0}))
            assert error_of(job, w0)[1] == f"a server does not handle {kind.name}"
        job.send(w0, P.Message(P.Kind.PULL, sender=0, flags=0x40))
        assert error_of(job, w0)[1] == "unknown flag bits 0x40"
    finally:
        job.close()
    for meta, why in [({"dead": "1", "owner": 0}, "'dead' must be a server rank"),
                      ({"dead": 1}, "owner"), ({"dead": 1, "owner": 0, "x": 1}, "'x'")]:
        with pytest.raises(P.ProtocolError, match=why):
            P.check_meta(P.Kind.PROMOTE, meta)
    # a worker takes a TAKEOVER only from the dead server's backup, once
    workers_map = ReplicaMap(3, 1)
    assert "server 2 is that server's backup" in workers_map.take(1, 0)
    assert workers_map.take(1, 2) is None and workers_map.owner(1) == 2
    assert "copies no requests" in workers_map.take(2, 0)
    with pytest.raises(ConfigError) as e:
        parse_config({"model": {"name": "digits_mlp"}, "data": {"dataset": "digits"},
                      "cluster": {"server_replicas": 1}})
    assert str(e.value) == ("cluster.server_replicas: 1 needs cluster.servers of 2 or more "
                            "(a key's backup lives on another server), got 1 (<config>)")


def test_without_replicas_no_request_is_copied_and_no_route_changes():
    """server_replicas: 0 (the default) takes the path of before: the client's copies are
    none, its routes are the placement's own slices, big keys are still cut over the
    servers, and a server skips no key of its checkpoint state."""
    from ssdsgd.kvstore.replica_map import ReplicaMap, Routes
    from ssdsgd.kvstore.sharding import Placement
    placement = Placement(2, 10)
    placement.place(0, 100)
    placement.place(1, 4)
    routes = Routes(placement, ReplicaMap(2, 0))
    assert routes[0] is placement[0] and [s.server for s in routes[0]] == [0, 1]
    assert routes.and_backups()[1] == placement[1]
    assert ReplicaMap(2, 0).backup(0) is None and not ReplicaMap(2, 0).copying
    job = backup_job()
    try:
        assert job.server.backup.foreign() == set()
    finally:
        job.close()
    # with replicas: server s is backed up on s + 1, and after a death nothing is copied
    replicas = ReplicaMap(3, 1)
    assert [replicas.backup(s) for s in range(3)] == [1, 2, 0]
    assert replicas.lose(2) == 0 and replicas.backup(0) is None
    assert [s.server for s in Routes(placement, replicas)[1]] == [placement[1][0].server]


def test_a_second_server_death_has_no_replica_and_ends_the_job():
    """After one takeover the job has no replica: the scheduler's map refuses a second
    death (it aborts, naming why), and the launcher leaves only the first server behind."""
    from types import SimpleNamespace
    from ssdsgd.kvstore.replica_map import ReplicaError, ReplicaMap
    from ssdsgd.launch.job import _server_left_behind
    replicas = ReplicaMap(2, 1)
    assert replicas.lose(0) == 1
    with pytest.raises(ReplicaError, match="server 0 died before it, and the job has no "
                                           "replica left"):
        replicas.lose(1)
    with pytest.raises(ReplicaError, match="server_replicas is 0"):
        ReplicaMap(2, 0).lose(0)
    lines, left = [], []
    server = [SimpleNamespace(role="server", rank=r, name=f"server {r}", pid=100 + r,
                              poll=lambda: -9) for r in (0, 1)]
    assert _server_left_behind([server[0]], left, lines.append) and left == [server[0]]
    assert lines == ["server 0 (pid 100) was killed by SIGKILL; its backup takes its keys "
                     "and the job continues (cluster.server_replicas: 1)"]
    assert not _server_left_behind([server[1]], left, lines.append)
    worker = SimpleNamespace(role="worker", rank=1, name="worker 1", pid=7, poll=lambda: 1)
    assert not _server_left_behind([worker], [], lines.append)


@pytest.mark.system
@pytest.mark.parametrize("settings", [
    {"sync__compression": "2bit"}, {"sync__pull_schedule": "staggered"}],
    ids=["2bit", "staggered"])
def test_a_killed_server_of_a_compressed_or_staggered_job_is_replaced_as_if_uninterrupted(
        tmp_path, uninterrupted_digits, settings):
    """ssd with 2bit pushes (a worker codes each push once, with its residual; the owner
    hands its backup the sum of the decoded pushes) or staggered pulls (each worker's pull
    phase is its own, never a server's): a server SIGKILLed at a seeded step, its backup
    owns its keys, and the job ends bit for bit as the uninterrupted 1-server job."""
    reference = final(uninterrupted_digits("ssd", **settings))
    name = "replicas-" + "-".join(str(v) for v in settings.values())
    run, _, _ = kill_a_server(tmp_path / "runs", name, [*digits_job("ssd"), *sets(**settings)])
    assert_same(run, reference)


@pytest.mark.system
def test_a_killed_server_of_three_is_replaced_and_the_job_ends_as_if_uninterrupted(
        tmp_path, uninterrupted_digits):
    """3 servers, each the backup of the one before it: the victim's backup takes its
    keys, the server whose keys the victim backed up stops sending sums, and the job ends
    bit for bit as the uninterrupted 1-server job."""
    reference = final(uninterrupted_digits("ssd"))
    run, out, victim = kill_a_server(tmp_path / "runs", "replicas-three-servers",
                                     digits_job("ssd"), servers=3)
    owner = (victim + 1) % 3
    assert f"server {owner} owns its keys from now on, and the job goes on with no replica " \
           "left" in out, out[-3000:]
    assert re.search(rf"\[server {owner}\] .*first step applied as the owner of server "
                     rf"{victim}'s keys", out), out[-3000:]
    assert_same(run, reference)


def _continued_run(out, replicas):
    """tests/scripts/join_worker.py on 3 workers, ssgd, on_worker_failure continue: worker
    2 SIGKILLs itself before step 5 (every step before it applied); the two others wait
    before step 8 until the test lets them go. With ``replicas``: 2 servers, each the
    other's backup, and server 0 SIGKILLed while they wait. The two workers' weights."""
    from conftest import load_npz
    from jobs import dist, launch_args
    go, run_dir = out / "go", out / "run"
    run_dir.mkdir(parents=True)
    env = {"SSDSGD_ALGORITHM": "ssgd", "SSDSGD_ON_WORKER_FAILURE": "continue",
           "SSDSGD_PULL_RELAY": "off", "SSDSGD_BIGARRAY_BOUND": 100,
           "SSDSGD_HEARTBEAT_INTERVAL": 0.2, "SSDSGD_HEARTBEAT_TIMEOUT": 1}
    if replicas:
        env["SSDSGD_SERVER_REPLICAS"] = 1
    job = dist(["--run-dir", run_dir, *launch_args(
        3, 2 if replicas else 1, ["--out", out, "--per-epoch", 9, "--epochs", 4,
                                  "--wait-at", 8, "--go", go, "--die-at", 5, "--die-rank", 2],
        env=env, script="join_worker.py")])
    with job:
        for r in (0, 1):
            job.wait_for(f"rank {r} waits before step 8", 60)
        job.wait_for("the job continues without it", 60)
        if replicas:
            before = roles(job)
            assert ("server", 0) in before, (before, job.text[-4000:])
            os.kill(before[("server", 0)], signal.SIGKILL)
            job.wait_for("server 1 owns its keys from now on", 60)
            assert roles(job) == {r: p for r, p in before.items() if r != ("server", 0)}
        go.touch()
        assert job.wait(90) == 0, job.tail()
    assert "restart" not in job.text
    records = [json.loads((out / f"chunks-rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["removed"] == {"2": 5} for r in records), records
    return [(load_npz(out / f"local-rank{r}.npz"), load_npz(out / f"final-rank{r}.npz"))
            for r in (0, 1)]


@pytest.mark.system
def test_a_dead_worker_then_a_dead_server_end_as_the_worker_alone_would(tmp_path):
    """server_replicas: 1 beside on_worker_failure: continue: worker 2 dies, and both
    servers (each holding its own keys and the other's) aggregate without it from step
    5; then server 0 is SIGKILLed and its backup owns its keys. The two workers end bit
    for bit as in the job with one server and only the worker's death."""
    reference = _continued_run(tmp_path / "one-server", replicas=False)
    got = _continued_run(tmp_path / "replicas", replicas=True)
    for (ref_local, ref_final), (local, final_) in zip(reference, got):
        assert ref_local.keys() == local.keys() and len(local) > 0
        for key in ref_local:
            assert (ref_local[key] == local[key]).all(), key
            assert (ref_final[key] == final_[key]).all(), key
