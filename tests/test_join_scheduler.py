"""The scheduler's half of a join (ssdsgd/kvstore/join_wiring.py), in process: a real
Scheduler whose sends are recorded, fed the registrations of a 2-worker ssgd job with
cluster.max_workers, then joiners: each refusal is one line naming why, and a join taken
asks every server to hold and, once they answered, tells them and the joiner the step."""
import socket

import pytest

from ssdsgd.kvstore import protocol as P
from ssdsgd.kvstore.env import NodeEnv
from ssdsgd.kvstore.scheduler import Scheduler
from ssdsgd.launch.job import free_port
from ssdsgd.sync.scheduler_policies import make_scheduler_policy
from ssdsgd.sync.stage import joins_boundary


def test_a_spare_rank_that_comes_before_the_start_takes_no_first_workers_place():
    env = NodeEnv.from_environ({"SSDSGD_SCHEDULER_PORT": str(free_port()),
                                "SSDSGD_NUM_WORKERS": "2", "SSDSGD_MAX_WORKERS": "3",
                                "SSDSGD_ALGORITHM": "ssgd"})
    sched = Scheduler(env, make_scheduler_policy, log=lambda text: None,
                      join_boundary=joins_boundary(env))
    try:
        sched._register(b"w0", {"role": "worker", "rank": 0, "routing_id": "01" * 8}, None)
        msg = _refusal(sched, b"j2", 2)
        assert msg.startswith("worker 2 cannot join: the job has not started yet"), msg
        assert b"j2" not in sched.nodes
    finally:
        sched.close()


def _scheduler(workers, log=lambda text: None, **env):
    """A Scheduler of an ssgd job of ``workers`` workers, cluster.max_workers 4, no relay,
    the SSDSGD_* variables ``env`` beside."""
    env = NodeEnv.from_environ({"SSDSGD_SCHEDULER_PORT": str(free_port()),
                                "SSDSGD_NUM_WORKERS": str(workers), "SSDSGD_MAX_WORKERS": "4",
                                "SSDSGD_ALGORITHM": "ssgd", "SSDSGD_PULL_RELAY": "off", **env})
    return Scheduler(env, make_scheduler_policy, log=log, join_boundary=joins_boundary(env))


def _registered(sched, workers):
    """Its sends, recorded, once server 0 and ``workers`` workers registered."""
    sent = []
    sched._send = lambda ident, kind, meta=None, req=0: sent.append((ident, kind, meta))
    sched._register(b"s0", {"role": "server", "host": "127.0.0.1"}, None)
    for r in range(workers):
        sched._register(b"w%d" % r, {"role": "worker", "rank": r,
                                     "routing_id": f"{r + 1:02x}" * 8}, None)
    return sent


@pytest.fixture
def job():
    """A started job (its workers heard where the server listens) and its sends."""
    sched = _scheduler(2)
    sent = _registered(sched, 2)
    yield sched, sent
    sched.close()


def _join(sched, ident, rank):
    sched._register(ident, {"role": "worker", "rank": rank,
                            "routing_id": "ab" * 8 + ident.hex()}, None)


def _refusal(sched, ident, rank, ask=_join):
    """The one line ``ask`` (a join, or ``_leave``) is refused with."""
    with pytest.raises(P.ProtocolError) as e:
        ask(sched, ident, rank)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_joiners_are_refused_in_one_line_until_the_job_runs_and_when_it_cannot_take_them(job):
    sched, sent = job
    assert "has not started yet" in _refusal(sched, b"j2", 2)
    with socket.create_server(("127.0.0.1", 0)) as port:
        sched._listen(b"w0", sched.nodes[b"w0"], {})
        sched._listen(b"s0", sched.nodes[b"s0"], {"port": port.getsockname()[1]})
    assert "takes a spare rank 2..3" in _refusal(sched, b"j9", 9)
    assert "takes a spare rank 2..3" in _refusal(sched, b"j1", 1)
    sent.clear()
    _join(sched, b"j2", 2)
    kinds = [(ident, kind) for ident, kind, _ in sent]
    assert (b"j2", P.Kind.TOPOLOGY) in kinds and (b"j2", P.Kind.LISTEN) in kinds
    (hold,) = [meta for ident, kind, meta in sent if kind == P.Kind.JOIN]
    assert hold["joined"] == 2 and "routing_id" in hold
    assert "worker 2 is or was in the job already" in _refusal(sched, b"k2", 2)
    sent.clear()
    sched._join_answer(b"s0", sched.nodes[b"s0"], {"joined": 2, "next_step": 7})
    told = sorted((ident, meta["from_step"]) for ident, kind, meta in sent
                  if kind == P.Kind.JOIN)
    assert told == [(b"j2", 8), (b"s0", 8)]          # ssgd: s = H + 1
    assert sched.joined[0]["rank"] == 2 and sched.joined[0]["from_step"] == 8
    with pytest.raises(P.ProtocolError, match="not an answer to a join"):
        sched._join_answer(b"s0", sched.nodes[b"s0"], {"joined": 2, "next_step": 9})
    sched.nodes[b"w1"]["finished"] = True
    assert "the job is finishing" in _refusal(sched, b"j3", 3)


def test_a_job_at_max_workers_refuses_the_next_joiner(job):
    sched, sent = job
    with socket.create_server(("127.0.0.1", 0)) as port:
        sched._listen(b"w0", sched.nodes[b"w0"], {})
        sched._listen(b"s0", sched.nodes[b"s0"], {"port": port.getsockname()[1]})
    _join(sched, b"j2", 2)
    _join(sched, b"j3", 3)
    assert "at most cluster.max_workers = 4" in _refusal(sched, b"j4", 3)


def test_an_ssd_job_with_an_auto_warmup_of_known_length_takes_joiners_at_the_workers_boundary():
    """The training program's default warm-up is auto, a share of the run whose length
    every process has (SSDSGD_TOTAL_STEPS): the scheduler computes the same T_w as the
    workers (sync/auto.py) and takes joiners; the demo's own settings were refused with
    "this job's algorithm or settings take no joiner". Without a length T_w is not the
    scheduler's to know (a worker may learn it from its lr scheduler): no joiner."""
    from ssdsgd.sync import auto
    base = {"SSDSGD_SCHEDULER_PORT": "1", "SSDSGD_NUM_WORKERS": "2",
            "SSDSGD_MAX_WORKERS": "3", "SSDSGD_ALGORITHM": "ssd",
            "SSDSGD_DELAY_STEPS": "4", "SSDSGD_PULL_RELAY": "off"}
    env = NodeEnv.from_environ({**base, "SSDSGD_TOTAL_STEPS": "440"})
    warmup, _ = auto.warmup_steps(env.warmup_steps, 440)
    boundary = joins_boundary(env)
    assert boundary is not None and warmup == 22
    assert boundary(5) == 6 and boundary(30) == 22 + 4 * 4     # s - 1 - k >= held
    assert joins_boundary(NodeEnv.from_environ(base)) is None


def _leave(sched, ident, rank):
    sched._handle(ident, P.Message(P.Kind.LEAVE, meta={"leaving": rank}), None)


def _leave_refusal(sched, ident, rank):
    return _refusal(sched, ident, rank, _leave)


def test_a_departure_is_refused_in_one_line_or_asks_the_servers_and_tells_who_must_hear(job):
    """LEAVE from a connection that never registered (``--leave``): refused until the job
    runs, for a rank not in the job, for the last worker left (here worker 0, once worker 1
    leaves); taken, every server holds, and once
    they answered every server, the leaver and the asker hear the step. The leaver's
    FINISH then takes it out of the job: a barrier no longer waits for it."""
    sched, sent = job
    assert "the job has not started yet" in _leave_refusal(sched, b"a1", 1)
    with socket.create_server(("127.0.0.1", 0)) as port:
        sched._listen(b"w0", sched.nodes[b"w0"], {})
        sched._listen(b"s0", sched.nodes[b"s0"], {"port": port.getsockname()[1]})
    assert "worker 3 is not in the job" in _leave_refusal(sched, b"a3", 3)
    sent.clear()
    _leave(sched, b"a1", 1)
    assert sent == [(b"s0", P.Kind.LEAVE, {"leaving": 1})]
    assert "worker 1 is leaving already" in _leave_refusal(sched, b"b1", 1)
    # worker 0 may leave like any worker, but not as the last one in the job
    assert "worker 0 is the last worker in the job" in _leave_refusal(sched, b"a0", 0)
    sent.clear()
    sched._handle(b"s0", P.Message(P.Kind.LEAVE, meta={"leaving": 1, "next_step": 4}), None)
    told = sorted((ident, meta["from_step"]) for ident, kind, meta in sent
                  if kind == P.Kind.LEAVE)
    assert told == [(b"a1", 5), (b"s0", 5), (b"w1", 5)]    # ssgd: s = H + 1
    assert sched.departed[1]["from_step"] == 5
    sched._barrier(b"w0", sched.nodes[b"w0"], {})
    assert not any(kind == P.Kind.BARRIER for _, kind, _ in sent)   # it waits for w1
    sched._finish(b"w1", sched.nodes[b"w1"], {})
    assert b"w1" not in sched.nodes
    assert (b"w0", P.Kind.BARRIER) in [(i, k) for i, k, _ in sent]  # released without it


def test_a_job_that_takes_no_joiner_lets_no_worker_leave():
    env = NodeEnv.from_environ({"SSDSGD_SCHEDULER_PORT": str(free_port()),
                                "SSDSGD_NUM_WORKERS": "2", "SSDSGD_ALGORITHM": "ssgd"})
    sched = Scheduler(env, make_scheduler_policy, log=lambda text: None,
                      join_boundary=joins_boundary(env))
    try:
        msg = _leave_refusal(sched, b"a1", 1)
        assert "take no leaver (only ssgd and ssd with cluster.max_workers" in msg, msg
    finally:
        sched.close()


@pytest.fixture
def continuing():
    """A started 3-worker ssgd job with cluster.on_worker_failure: continue and
    cluster.max_workers 4, and its sends."""
    lines = []
    sched = _scheduler(3, lines.append, SSDSGD_ON_WORKER_FAILURE="continue")
    sent = _registered(sched, 3)
    with socket.create_server(("127.0.0.1", 0)) as port:
        sched._listen(b"w0", sched.nodes[b"w0"], {})
        sched._listen(b"s0", sched.nodes[b"s0"], {"port": port.getsockname()[1]})
    sent.clear()
    yield sched, sent, lines
    sched.close()


def _to(sent, kind):
    return [(ident, meta) for ident, k, meta in sent if k == kind]


def test_with_continue_a_dead_workers_data_leaves_at_the_boundary_after_its_removal(continuing):
    """docs/spec/membership.md rule 10: the servers drop the dead worker from the first
    step they lack (the removal), then hold for its departure as for one asked for, and
    every server hears the step from which the others train its chunks."""
    sched, sent, lines = continuing
    sched._failed(b"w2", "worker 2 sent no heartbeat")
    assert _to(sent, P.Kind.MEMBERSHIP) == [(b"s0", {"removed": 2})]
    assert not _to(sent, P.Kind.LEAVE)           # not before the servers dropped it
    sent.clear()
    sched._handle(b"s0", P.Message(P.Kind.MEMBERSHIP, meta={"removed": 2, "next_step": 4}),
                  None)
    told = _to(sent, P.Kind.MEMBERSHIP)
    assert sorted(i for i, _ in told) == [b"s0", b"w0", b"w1"]
    assert all(m == {"removed": 2, "from_step": 4} for _, m in told)
    assert _to(sent, P.Kind.LEAVE) == [(b"s0", {"leaving": 2})]
    sent.clear()
    sched._handle(b"s0", P.Message(P.Kind.LEAVE, meta={"leaving": 2, "next_step": 6}), None)
    assert _to(sent, P.Kind.LEAVE) == [(b"s0", {"leaving": 2, "from_step": 7})]
    assert sched.departed[2]["from_step"] == 7
    assert any("worker 2's chunks go to the 2 others from step 7" in x for x in lines), lines
    assert "worker 2 cannot leave: worker 2 is not in the job" in _leave_refusal(
        sched, b"a2", 2)


def test_with_continue_a_joiner_that_dies_while_joining_is_removed_once_it_joined(continuing):
    """A joiner whose join the servers are still deciding when it dies: the join is
    decided first (every server already holds for it), then it is removed as any worker
    from the first step it did not push (its join step at least) and its data leaves."""
    sched, sent, lines = continuing
    _join(sched, b"j3", 3)
    sent.clear()
    sched._failed(b"j3", "worker 3 sent no heartbeat")
    assert b"j3" not in sched.nodes and not _to(sent, P.Kind.MEMBERSHIP)
    sched._handle(b"s0", P.Message(P.Kind.JOIN, meta={"joined": 3, "next_step": 5}), None)
    assert (b"s0", {"joined": 3, "from_step": 6}) in _to(sent, P.Kind.JOIN)
    assert _to(sent, P.Kind.MEMBERSHIP) == [(b"s0", {"removed": 3})]


def test_a_barrier_of_a_step_waits_for_the_workers_in_the_job_at_that_step(job):
    """A checkpoint's barrier in a job that takes joiners (membership.md rule 11): at a
    step before a joiner's, it is not waited for; at its step, it is; one that left by
    the barrier's step is not; two barriers of different steps at once are refused."""
    sched, sent = job
    with socket.create_server(("127.0.0.1", 0)) as port:
        sched._listen(b"w0", sched.nodes[b"w0"], {})
        sched._listen(b"s0", sched.nodes[b"s0"], {"port": port.getsockname()[1]})
    _join(sched, b"j2", 2)
    sched._join_answer(b"s0", sched.nodes[b"s0"], {"joined": 2, "next_step": 7})
    assert sched.joined[0]["from_step"] == 8

    def barrier(ident, step):
        sched._handle(ident, P.Message(P.Kind.BARRIER, meta={"step": step}), None)

    def released():
        out = sorted(i for i, kind, _ in sent if kind == P.Kind.BARRIER)
        sent.clear()
        return out
    sent.clear()
    barrier(b"w0", 7)
    barrier(b"w1", 7)
    assert released() == [b"w0", b"w1"]            # the joiner pushes from step 8
    barrier(b"w0", 8)
    barrier(b"w1", 8)
    assert released() == []
    barrier(b"j2", 8)
    assert released() == [b"j2", b"w0", b"w1"]
    barrier(b"w0", 9)
    msg = _refusal(sched, b"w1", 10, lambda s, i, step: barrier(i, step))
    assert "a barrier of step 10 while the others wait at one of step 9" in msg, msg
    _leave(sched, b"a1", 1)
    sched._handle(b"s0", P.Message(P.Kind.LEAVE, meta={"leaving": 1, "next_step": 8}), None)
    assert sched.departed[1]["from_step"] == 9
    barrier(b"j2", 9)
    assert released() == [b"j2", b"w0"]            # worker 1 pushes steps before 9 only


def test_a_late_arrival_at_a_made_agreement_is_answered_alone(job):
    """A joiner that comes to an agreement the others made (k auto, docs/auto.md) hears
    its value at once, and nothing else happens: no barrier of the others is released,
    so neither the policy's release nor the dealer's (a pause of dynamic data ends only
    at its checkpoint's barrier)."""
    sched, sent = job
    with socket.create_server(("127.0.0.1", 0)) as port:
        sched._listen(b"w0", sched.nodes[b"w0"], {})
        sched._listen(b"s0", sched.nodes[b"s0"], {"port": port.getsockname()[1]})
    for w, value in ((b"w0", 5), (b"w1", 0)):
        sched._handle(w, P.Message(P.Kind.BARRIER, meta={"value": value,
                                                         "agreement": "auto_choice"}), None)
    _join(sched, b"j2", 2)
    sched._join_answer(b"s0", sched.nodes[b"s0"], {"joined": 2, "next_step": 7})
    sched.dealer.paused = True
    sent.clear()
    sched._handle(b"j2", P.Message(P.Kind.BARRIER, meta={"agreement": "auto_choice"}), None)
    assert sent == [(b"j2", P.Kind.BARRIER, {"group": "worker", "value": 5})]
    assert sched.dealer.paused


def _restarted(tmp_path, deciding, lines):
    """A scheduler restarted from a status whose membership record names a join of
    worker 2 decided from step 6, the agreement on k and, as ``deciding``, the joins
    and departures the lost one was deciding."""
    from ssdsgd.kvstore import job_status
    status = tmp_path / "status.json"
    job_status.write(str(status), started=True, workers=[0, 1, 2], finished=[], membership={
        "joined": [[2, 6]], "departed": [], "agreed": {"auto_choice": 5},
        "deciding": deciding,
        "layout": {"num_workers": 2, "num_servers": 1, "workers": ["01" * 8, "02" * 8]},
        "listen": {"servers": [["127.0.0.1", 9]]}})
    return _scheduler(2, lines.append, SSDSGD_SCHEDULER_RESTART="1",
                      SSDSGD_STATUS_FILE=str(status))


def _rejoin_all(sched):
    sched._rejoin(b"s0", {"role": "server", "rank": 0, "ready": True}, None)
    for r in range(3):
        sched._rejoin(b"w%d" % r, {"role": "worker", "rank": r, "ready": True,
                                   "routing_id": f"{r + 1:02x}" * 8}, None)


def test_a_restarted_scheduler_takes_back_the_joins_and_takes_another_joiner(tmp_path):
    """Worker 2 joined before the loss: it is expected back, a barrier of a step before
    its join does not wait for it, a fourth worker may join the restarted job, hearing
    the topology and LISTEN the others heard, and a worker may leave it."""
    sched = _restarted(tmp_path, [], [])
    sent = []
    sched._send = lambda ident, kind, meta=None, req=0: sent.append((ident, kind, meta))
    try:
        assert ("worker", 2) in sched.rebuild.missing()
        _rejoin_all(sched)
        assert sched.rebuild.done and sched.barriers.agreed == {"auto_choice": 5}
        sent.clear()
        for w in (b"w0", b"w1"):
            sched._handle(w, P.Message(P.Kind.BARRIER, meta={"step": 5}), None)
        assert sorted(i for i, k, _ in sent if k == P.Kind.BARRIER) == [b"w0", b"w1"]
        sent.clear()
        _join(sched, b"j3", 3)
        told = {kind: meta for ident, kind, meta in sent if ident == b"j3"}
        assert told[P.Kind.LISTEN] == {"servers": [["127.0.0.1", 9]]}
        assert told[P.Kind.TOPOLOGY]["rank"] == 3
        assert [m for i, k, m in sent if k == P.Kind.JOIN] == [
            {"joined": 3, "routing_id": "ab" * 8 + b"j3".hex()}]
        sent.clear()                   # and a worker may leave it, asked with --leave
        _leave(sched, b"a1", 1)
        sched._handle(b"s0", P.Message(P.Kind.LEAVE, meta={"leaving": 1, "next_step": 9}),
                      None)
        assert (b"s0", P.Kind.LEAVE, {"leaving": 1, "from_step": 10}) in sent
    finally:
        sched.close()


def test_a_scheduler_restarted_while_a_join_was_decided_ends_the_job_naming_it(tmp_path):
    """The lost scheduler's record says worker 3's join was being decided: every server
    holds for a decision the restarted scheduler cannot make again (it never heard the
    servers' answers), so once every node is back it aborts the job naming the join,
    rather than let the servers hold forever."""
    from ssdsgd.kvstore.scheduler import JobAborted
    sched = _restarted(tmp_path, [3], [])
    sched._send = lambda ident, kind, meta=None, req=0: None
    try:
        with pytest.raises(JobAborted, match=r"lost while the join or departure of "
                                             r"worker\(s\) \[3\] was being decided"):
            _rejoin_all(sched)
    finally:
        sched.close()


@pytest.fixture
def replicated():
    """A started ssgd job of 2 servers with cluster.server_replicas: 1, 3 workers,
    on_worker_failure: continue; its sends and log lines."""
    lines = []
    sched = _scheduler(3, log=lines.append, SSDSGD_NUM_SERVERS="2",
                       SSDSGD_SERVER_REPLICAS="1", SSDSGD_ON_WORKER_FAILURE="continue")
    sent = []
    sched._send = lambda ident, kind, meta=None, req=0: sent.append((ident, kind, meta))
    for s in (0, 1):
        sched._register(b"s%d" % s, {"role": "server", "host": "127.0.0.1"}, None)
    for r in range(3):
        sched._register(b"w%d" % r, {"role": "worker", "rank": r,
                                     "routing_id": f"{r + 1:02x}" * 8}, None)
    servers = sorted((n["rank"], i) for i, n in sched.nodes.items() if n["role"] == "server")
    with socket.create_server(("127.0.0.1", 0)) as p0, \
            socket.create_server(("127.0.0.1", 0)) as p1:
        sched._listen(b"w0", sched.nodes[b"w0"], {})
        for (_, ident), port in zip(servers, (p0, p1)):
            sched._listen(ident, sched.nodes[ident], {"port": port.getsockname()[1]})
    sent.clear()
    yield sched, sent, lines, [ident for _, ident in servers]
    sched.close()


@pytest.mark.parametrize("change", ["leave", "join", "removal"])
def test_a_server_lost_while_a_change_is_decided_leaves_the_decision_to_the_others(
        replicated, change):
    """cluster.server_replicas: 1: a server that dies after the scheduler asked every
    server to hold for a join or a departure, or for a dead worker's first missing step,
    and before it answered. Its backup saw the same pushes (the workers copy every
    request to it) and answers for the keys it now owns, so the others' answers decide.
    Before, the decision waited for the dead server's answer for ever (a host the
    discovery script dropped, worker and server together: the job stood still)."""
    sched, sent, lines, (s0, s1) = replicated
    if change == "leave":
        _leave(sched, b"a1", 1)
        kind, meta, told = P.Kind.LEAVE, {"leaving": 1, "next_step": 4}, (b"s0", 5)
    elif change == "join":
        _join(sched, b"j3", 3)
        kind, meta, told = P.Kind.JOIN, {"joined": 3, "next_step": 4}, (b"j3", 5)
    else:
        sched._failed(b"w2", "worker 2 sent no heartbeat")
        kind, meta, told = P.Kind.MEMBERSHIP, {"removed": 2, "next_step": 4}, (b"w0", 4)
    assert sorted(i for i, _ in _to(sent, kind)) == sorted([s0, s1])   # both asked
    sched._handle(s0, P.Message(kind, meta=meta), None)
    assert not [m for _, m in _to(sent, kind) if "from_step" in m]      # s1 still owes
    sched._failed(s1, "server 1 sent no heartbeat")
    assert (s0, P.Kind.PROMOTE, {"dead": 1, "owner": 0}) in sent
    decided = {i: m["from_step"] for i, m in _to(sent, kind) if "from_step" in m}
    assert decided.get(told[0]) == told[1] and decided.get(s0) == told[1], (sent, lines)
    assert s1 not in decided
