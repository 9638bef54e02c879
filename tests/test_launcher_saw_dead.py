"""What the scheduler does with the processes its launcher saw exit
(kvstore/job_status.py write_lost; ssdsgd/kvstore/scheduler.py ``_seen_dead``), in
process: a real Scheduler of a 2-server, 2-worker job registered by hand. A server is
failed at once with cluster.server_replicas: 1 and a worker (worker 0 too) with
on_worker_failure: continue, each named as its launcher saw it; nothing else is (no
replicas, abort, a finished worker, another restart's list). The job-level
runs are test_replicas.py's and test_launch_remote.py's."""
from ssdsgd.kvstore import job_status
from ssdsgd.kvstore.env import NodeEnv
from ssdsgd.kvstore.scheduler import LOST_READ_S, Scheduler
from ssdsgd.launch.job import free_port
from ssdsgd.sync.scheduler_policies import make_scheduler_policy


def _scheduler(status, **env):
    env = NodeEnv.from_environ({"SSDSGD_SCHEDULER_PORT": str(free_port()),
                                "SSDSGD_NUM_WORKERS": "2", "SSDSGD_NUM_SERVERS": "2",
                                "SSDSGD_ALGORITHM": "ssgd", "SSDSGD_STATUS_FILE": str(status),
                                **env})
    sched = Scheduler(env, make_scheduler_policy, log=lambda text: None)
    sched._send = lambda *a, **k: None
    for s in (0, 1):
        sched._register(b"s%d" % s, {"role": "server", "host": "127.0.0.1"}, None)
    for r in (0, 1):
        sched._register(b"w%d" % r, {"role": "worker", "rank": r,
                                     "routing_id": f"{r + 1:02x}" * 8}, None)
    return sched


def _seen(sched, now):
    return [(ident, why) for ident, why in sched._seen_dead(now)]


def test_a_server_and_a_worker_the_launcher_saw_exit_are_failed_at_once(tmp_path):
    status = tmp_path / "status.json"
    sched = _scheduler(status, SSDSGD_SERVER_REPLICAS="1",
                       SSDSGD_ON_WORKER_FAILURE="continue")
    try:
        assert _seen(sched, 100.0) == []           # nothing written yet
        job_status.write_lost(str(status), 0, [1], [0, 1])
        assert _seen(sched, 100.0 + LOST_READ_S / 2) == []      # read at most so often
        seen = dict(_seen(sched, 100.0 + LOST_READ_S))
        servers = {ident: n["rank"] for ident, n in sched.nodes.items()
                   if n["role"] == "server"}
        one = next(i for i, r in servers.items() if r == 1)
        assert set(seen) == {one, b"w0", b"w1"}, seen    # worker 0 is removed like any
        assert seen[one].startswith("server 1 (pid ") and seen[b"w1"].startswith("worker 1 ")
        assert seen[b"w0"].startswith("worker 0 ")
        assert all(why.endswith(": its process exited (its launcher saw it)")
                   for why in seen.values()), seen
        sched.nodes[b"w1"]["finished"] = True      # its part was done: not failed
        assert set(dict(_seen(sched, 200.0))) == {one, b"w0"}
        job_status.write_lost(str(status), 1, [1], [1])     # another restart's list
        assert _seen(sched, 300.0) == []
    finally:
        sched.close()


def test_without_replicas_or_continue_the_list_changes_nothing(tmp_path):
    """Without a rule that lets the job go on, the launcher ends the job itself; the
    scheduler does not act on its list (the heartbeats still would)."""
    status = tmp_path / "status.json"
    sched = _scheduler(status)
    try:
        job_status.write_lost(str(status), 0, [0, 1], [1])
        assert _seen(sched, 100.0) == []
    finally:
        sched.close()
