"""Workers that leave at a step every worker hears of in time (docs/spec/membership.md),
in process: the scheduler's decider for departures (ssdsgd/kvstore/joins.py, as for a
join: every server holds, the largest answer moved to a boundary wins), the reasons a
departure is refused, and the dense server policy's hold_departure and depart against
the simulator."""
import re

import numpy as np
import pytest

from ssdsgd.kvstore.joins import Admissions, JoinError, leave_refusal
from ssdsgd.sync.dense import Async, DenseSync
from ssdsgd.sync.policy import PolicyError
from ssdsgd.sync.stage import join_boundary
from test_joins import TwoServers
from test_server_policies import Executor, g


def test_a_departure_is_decided_as_a_join_is_at_the_stage_rules_boundary():
    a = Admissions(join_boundary("ssd", 4, 3), field="leaving")   # boundaries 1..4, 7, 10
    a.begin(2, [b"s0", b"s1"])
    assert a.answer(b"s1", {"leaving": 2, "next_step": 5}) is None
    assert a.answer(b"s0", {"leaving": 2, "next_step": 8}) == {"leaving": 2, "from_step": 13}
    with pytest.raises(JoinError, match="worker 3 is leaving already"):
        a.begin(3, [b"s0"]) or a.begin(3, [b"s0"])
    with pytest.raises(JoinError, match="LEAVE: not an answer to a departure"):
        a.answer(b"s0", {"joined": 3, "next_step": 1})


@pytest.mark.parametrize("args, says", [
    ((1, [1], set(), False), "worker 1 is the last worker in the job"),
    ((1, [0, 1], {0}, False), "worker 1 is the last worker in the job"),
    ((0, [0, 1, 2], set(), False, "its choice of sync.delay_steps"),
     "worker 0 cannot leave yet: its choice of sync.delay_steps"),
    ((5, [0, 1, 2], set(), False), "worker 5 is not in the job"),
    ((2, [0, 1, 2], {2}, False), "worker 2 is leaving already"),
    ((2, [0, 1, 2], set(), True), "the job is finishing"),
])
def test_a_departure_the_job_cannot_take_has_a_one_line_reason(args, says):
    why = leave_refusal(*args)
    assert why is not None and "\n" not in why
    assert re.search(says, why)
    assert leave_refusal(2, [0, 1, 2], set(), False) is None
    # worker 0 leaves like any worker (the chief's part passes on, membership.md rule 8)
    assert leave_refusal(0, [0, 1, 2], set(), False) is None
    assert leave_refusal(0, [0, 1], set(), False, None) is None
    assert leave_refusal(1, [0, 1, 2], set(), False, "a choice pending") is None


@pytest.mark.parametrize("args, says", [
    ((0, set(), set()), "it was the last worker in the job"),
    ((1, set(), set()), "it was the last worker in the job"),
    ((0, {1, 2}, {1, 2}, None, False), "worker 0 died before its first push"),
    ((0, {1}, set()), "every other worker has finished its part, so none is left to take "
                      "the chief's part from worker 0"),
    ((0, {1, 2}, {1}, "its choice of sync.delay_steps"),
     "worker 0 cannot be removed yet: its choice of sync.delay_steps"),
])
def test_a_removal_the_job_cannot_go_on_without_has_a_one_line_reason(args, says):
    """cluster.on_worker_failure: continue (kvstore/removals.py): a dead worker 0 is
    removed like any rank (its chief's part passes on) unless the job cannot go on."""
    from ssdsgd.kvstore.removals import removal_refusal
    why = removal_refusal(*args)
    assert why is not None and "\n" not in why
    assert says in why, why
    assert removal_refusal(0, {1, 2}, {1, 2}) is None
    assert removal_refusal(0, {1}, {1}, None, True) is None
    assert removal_refusal(2, {0, 1}, set()) is None      # the chief finished: it is done
    assert removal_refusal(1, {0, 2}, {0, 2}, None, False) is None


def test_the_chief_is_the_lowest_rank_in_the_job_not_removed():
    from ssdsgd.sync.membership import Membership
    m = Membership(3, 9, 36)
    assert [m.chief(t, {0}) for t in (0, 5)] == [1, 1]
    assert m.chief(5, {0, 1}) == 2
    m.leave(0, 6)                   # a removed worker 0's data leaves later (rule 10)
    assert [m.chief(t, {0}) for t in (5, 6)] == [1, 1] and m.chief(6) == 1


def test_a_server_holds_for_a_departure_and_closes_the_steps_after_it_without_the_leaver():
    p = DenseSync(3, 3, "ssgd")
    ex = Executor(p, [0])
    for r in range(3):
        ex.run(p.push(r, [(0, 0, g(1))], token=None))
    assert p.version == {0: 1}
    ex.run(p.push(0, [(0, 1, g(1))], token=None))
    assert p.hold_departure(2) == 2            # step 1 has a push: 2 is the first free
    for r in (1, 2):
        ex.run(p.push(r, [(0, 1, g(1))], token=None))
    assert p.version == {0: 2}                 # step 1 is before the held step: applied
    for r in (0, 1):
        ex.run(p.push(r, [(0, 2, g(1))], token=None))
    assert p.version == {0: 2}                 # step 2 waits for the decision
    acts = ex.run(p.depart(2, 2))
    assert p.version == {0: 3}                 # and closes without worker 2
    assert [(k, len(parts), scale) for k, parts, scale in acts[0][1]] == [(0, 2, 1.5)]
    with pytest.raises(PolicyError, match="not in the job, or leaving already"):
        p.hold_departure(2)
    with pytest.raises(PolicyError, match="not in the job"):
        p.hold_departure(7)


def test_a_departure_from_an_applied_step_or_unasked_is_refused():
    p = DenseSync(3, 3, "ssgd")
    ex = Executor(p, [0])
    with pytest.raises(PolicyError, match="not asked to hold"):
        p.depart(1, 0)
    p.hold_departure(1)
    p.departing[1] = 5               # as if this server had held later than another
    for r in range(3):
        ex.run(p.push(r, [(0, 0, g(1))], token=None))
    ex.run(p.push(0, [(0, 1, g(1))], token=None))
    with pytest.raises(PolicyError, match="cannot leave from step 0: step 0 is already applied"):
        p.depart(1, 0)
    with pytest.raises(PolicyError, match="cannot leave a job whose algorithm is asgd"):
        Async(3, 1, "asgd").hold_departure(1)


def test_the_servers_half_of_a_departure_equals_the_simulator_bit_for_bit():
    """Two servers (the real policy, the real ``Weights`` with MXNet's optimizer), ssgd
    with 3 workers; worker 2 asks to leave while step 4 is half pushed. Each server
    holds from its first free step (5), step 5 waits for the decision, the decider
    moves worker 2 out from ``join_boundary(5)`` = 6 (it pushes step 5 still), and the
    weights equal ``simulate_membership`` fed that step, bit for bit (fed 7, they
    differ)."""
    from ssdsgd.glu.simulate_membership import Change, simulate_membership
    job = TwoServers(3)
    departures = Admissions(join_boundary("ssgd", 0, 1), field="leaving")
    members, decided = [0, 1, 2], None
    for t in range(10):
        if decided is not None and t == decided["from_step"]:
            members = [0, 1]
        at = job.weights_now()
        grads = {r: job.grad_fn(r, t, at) for r in members}
        job.push(members[0], t, grads[members[0]])
        if t == 4:                     # worker 2 asks to leave: every server holds
            departures.begin(2, ["s0", "s1"])
            answers = [{"leaving": 2, "next_step": p.hold_departure(2)}
                       for _, p in job.servers]
            assert [a["next_step"] for a in answers] == [5, 5]
        for r in members[1:]:
            job.push(r, t, grads[r])
        if t == 5:                     # step 5 is held until the decision
            assert job.versions() == [5, 5]
            decided = (departures.answer("s0", answers[0])
                       or departures.answer("s1", answers[1]))
            assert decided == {"leaving": 2, "from_step": 6}
            job.carry_out(lambda p: p.depart(2, decided["from_step"]))
            assert job.versions() == [6, 6]
    for step, expected in ((6, True), (7, False)):
        oracle = simulate_membership(job.init, job.grad_fn, job.make, 3, 10,
                                     [Change(step, "leave", 2)], algorithm="ssgd")
        assert job.equal(oracle) is expected, step


def test_a_joiner_that_leaves_pushes_its_join_step_at_least():
    p = DenseSync(2, 4, "ssgd")
    Executor(p, [0])
    p.hold(2)
    p.admit(2, 6)                      # it joins from step 6; nothing is pushed yet
    assert p.hold_departure(2) == 7    # its step 6 before it goes


def test_a_dead_workers_data_leaves_at_a_boundary_after_the_servers_dropped_it():
    """on_worker_failure: continue in a job that takes joiners (docs/spec/membership.md
    rule 10): the servers drop the dead worker from the first step they lack (E), then
    hold for its departure as for one asked for; the decision (s >= E) is what the
    workers' data follows, and the servers keep aggregating without it from E, not s."""
    p = DenseSync(3, 3, "ssgd", joins=True)
    ex = Executor(p, [0])
    for t in range(2):
        for r in range(3):
            ex.run(p.push(r, [(0, t, g(1))], token=None))
    for r in (0, 1):
        ex.run(p.push(r, [(0, 2, g(1))], token=None))
    assert p.first_missing(2) == 2
    acts = ex.run(p.leave(2, 2))               # the removal: step 2 closes without it
    assert p.version == {0: 3}
    assert [(k, len(parts), scale) for k, parts, scale in acts[0][1]] == [(0, 2, 1.5)]
    ex.run(p.push(0, [(0, 3, g(1))], token=None))
    assert p.hold_departure(2) == 4            # a dead worker's departure is held for too
    ex.run(p.push(1, [(0, 3, g(1))], token=None))
    assert p.version == {0: 4}                 # step 3 is before the held step
    ex.run(p.depart(2, 5))
    assert p.removed == {2: 2}                 # still out from E = 2, not from s = 5
    for r in (0, 1):
        ex.run(p.push(r, [(0, 4, g(1))], token=None))
    assert p.version == {0: 5}
    with pytest.raises(PolicyError, match="not in the job, or leaving already"):
        p.hold_departure(2)


def test_a_joiner_that_dies_before_its_first_push_is_missing_from_its_join_step():
    """A worker admitted from step s lacks nothing before s: its removal's step is s at
    least, or the steps between would close short of a push the job never expected."""
    p = DenseSync(2, 3, "ssgd", joins=True)
    ex = Executor(p, [0])
    for r in range(2):
        ex.run(p.push(r, [(0, 0, g(1))], token=None))
    p.hold(2)
    ex.run(p.admit(2, 3))
    assert p.first_missing(2) == 3


@pytest.mark.parametrize("workers, relay, k, failure, says", [
    (2, "auto", "5", "abort", None),          # a chain of 2: no relay is chosen
    (3, "auto", "5", "continue", None),       # no relay beside a worker left behind
    (3, "auto", "5", "abort", "its choice of sync.pull_relay (auto)"),
    (3, "off", "auto", "continue", "its choice of sync.delay_steps (auto)"),
])
def test_worker_0_waits_for_the_agreement_only_on_a_knob_it_chooses(workers, relay, k,
                                                                    failure, says):
    """ssd's not_yet_leaving names pull_relay at auto only where a relay may be chosen
    (sync/auto.py relay_listens): elsewhere it is off from the start and, with k
    pinned, no agreement ever comes, so worker 0 could never leave or be removed."""
    from ssdsgd.kvstore.env import NodeEnv
    from ssdsgd.sync.scheduler_policies import make_scheduler_policy
    env = NodeEnv.from_environ({
        "SSDSGD_SCHEDULER_PORT": "1234", "SSDSGD_NUM_WORKERS": str(workers),
        "SSDSGD_NUM_SERVERS": "1", "SSDSGD_ALGORITHM": "ssd", "SSDSGD_PULL_RELAY": relay,
        "SSDSGD_DELAY_STEPS": k, "SSDSGD_ON_WORKER_FAILURE": failure})
    policy = make_scheduler_policy(env)
    why = policy.not_yet_leaving(0, set(), asked=False)
    assert (why is None) if says is None else why.startswith(says), why
    assert policy.not_yet_leaving(1, set()) is None
    from ssdsgd.sync.auto import AGREEMENT
    assert policy.not_yet_leaving(0, {AGREEMENT}, asked=False) is None   # agreed: it may go
