"""Workers that join (docs/spec/membership.md), in process: the scheduler's decider
(ssdsgd/kvstore/joins.py: every server holds, the largest answer moved to a boundary
wins), the stage rule's boundary, and the dense server policy's hold and admit."""
import re

import numpy as np
import pytest

from ssdsgd.kvstore.barriers import Barriers
from ssdsgd.kvstore.joins import Admissions, JoinError, refusal
from ssdsgd.sync.dense import Async, DenseSync
from ssdsgd.sync.policy import PolicyError
from ssdsgd.sync import auto
from ssdsgd.sync.stage import join_boundary, pull_offset
from test_server_policies import Executor, g, kinds


def test_the_largest_answer_moved_to_a_boundary_decides_once_every_server_answered():
    a = Admissions(join_boundary("ssd", 4, 3))       # boundaries 1..4, 7, 10, ...
    a.begin(2, [b"s0", b"s1"])
    assert a.answer(b"s1", {"joined": 2, "next_step": 5}) is None
    assert a.answer(b"s0", {"joined": 2, "next_step": 8}) == {"joined": 2, "from_step": 13}
    b = Admissions(join_boundary("ssgd", 0, 1))
    b.begin(3, [b"s0"])
    assert b.answer(b"s0", {"joined": 3, "next_step": 8}) == {"joined": 3, "from_step": 9}


@pytest.mark.parametrize("held, expected", [(0, 1), (2, 3), (3, 4), (4, 10), (5, 10),
                                            (6, 10), (7, 13)])
def test_ssd_joins_in_the_warm_up_or_at_a_pull_boundary_the_workers_hear_of_in_time(
        held, expected):
    """T_w 4, k 3: in the warm-up the step after the held one; after it the first
    T_w + m k whose batch is made after the pull as of s - 1 - k >= held."""
    s = join_boundary("ssd", 4, 3)(held)
    assert s == expected
    assert s <= 4 or ((s - 4) % 3 == 0 and s - 1 - 3 >= held)


@pytest.mark.parametrize("held, expected", [(0, 1), (3, 4), (4, 8), (5, 9), (7, 11)])
def test_ssd_staggered_joins_once_every_worker_pulled_after_the_held_step(held, expected):
    """T_w 4, k 3, staggered pulls: no step is a boundary every worker shares, but each
    worker requests a pull once in any k steps of the steps-delay stage, and waits for it
    the step after: every worker has a reply of a step >= held before it makes the batch
    of held + k + 1 (before that in the warm-up, where every step pulls)."""
    assert join_boundary("ssd", 4, 3, "staggered")(held) == expected
    for rank in range(4):      # the first pull at or after ``held``, waited for before s
        o = pull_offset(rank, 4, 3, "staggered")
        if held >= 4:
            p = next(t for t in range(held, held + 3) if (t - 4 + o) % 3 == 2)
            assert p + 1 <= expected - 1


def test_a_joiners_pull_offset_continues_the_first_workers_rule():
    """floor(r k / N) mod k: a joiner's offset follows from its rank as the first
    workers' do; aligned pulls have none."""
    assert [pull_offset(r, 2, 3, "staggered") for r in range(6)] == [0, 1, 0, 1, 0, 1]
    assert [pull_offset(r, 4, 3, "staggered") for r in range(4, 8)] == [0, 0, 1, 2]
    assert pull_offset(5, 2, 3) == 0


def test_with_k_auto_a_join_after_the_warm_up_waits_for_the_workers_agreement():
    """T_w 4, k auto: a join in the warm-up needs no k; one after it is decided once the
    workers' agreement (the barrier the scheduler keeps) names k, and not before."""
    agreed = {}
    boundary = join_boundary("ssd", 4, None)
    a = Admissions(lambda held: boundary(held, agreed))
    a.begin(2, [b"s0"])
    assert a.answer(b"s0", {"joined": 2, "next_step": 2}) == {"joined": 2, "from_step": 3}
    a.begin(3, [b"s0", b"s1"])
    assert a.answer(b"s0", {"joined": 3, "next_step": 5}) is None
    assert a.answer(b"s1", {"joined": 3, "next_step": 4}) is None    # every server answered
    assert a.settle() == [] and 3 in a.pending                      # but k is not known
    agreed[auto.AGREEMENT] = auto.encode_choice(3, False, "none")
    assert a.settle() == [{"joined": 3, "from_step": 10}] and not a.pending
    assert a.settle() == []


def test_a_barrier_that_makes_an_agreement_keeps_its_value_for_those_who_come_later():
    b = Barriers()
    assert b.arrive("worker", b"w0", 7, [b"w0", b"w1"], "auto_choice") is None
    with pytest.raises(ValueError, match="agreement None while the others wait at one of "
                                         "'auto_choice'"):
        b.arrive("worker", b"w1", 0, [b"w0", b"w1"])
    assert b.arrive("worker", b"w1", 0, [b"w0", b"w1"], "auto_choice") == (
        "worker", {b"w0", b"w1"}, 7)
    assert b.agreed == {"auto_choice": 7}
    # a worker that joined later hears the agreed value at once, whoever else is there
    assert b.arrive("worker", b"w2", 0, [b"w0", b"w1", b"w2"], "auto_choice") == (
        "worker", {b"w2"}, 7)
    # an ordinary barrier keeps nothing
    assert b.arrive("worker", b"w0", 1, [b"w0"]) == ("worker", {b"w0"}, 1)
    assert b.agreed == {"auto_choice": 7}


@pytest.mark.parametrize("value", [(2, False, "none"), (10, True, "2bit"), (7, False, "topk")])
def test_a_choice_survives_its_barrier_value(value):
    assert auto.decode_choice(auto.encode_choice(*value)) == value
    assert auto.agreed_k({auto.AGREEMENT: auto.encode_choice(*value)}) == value[0]
    assert auto.agreed_k({}) is None


@pytest.mark.parametrize("server, meta", [
    (b"s0", {"joined": 5, "next_step": 1}),      # no such join
    (b"sX", {"joined": 2, "next_step": 1}),      # a server that was not asked
    (b"s0", {"joined": 2}),                      # no step
])
def test_an_answer_to_no_question_is_refused(server, meta):
    a = Admissions(join_boundary("ssgd", 0, 1))
    a.begin(2, [b"s0", b"s1"])
    with pytest.raises(JoinError, match="not an answer to a join"):
        a.answer(server, meta)


@pytest.mark.parametrize("args, says", [
    ((3, 2, 2, False, False), "has not started yet"),
    ((3, 2, 2, True, True), "is finishing"),
    ((2, 2, 2, True, False), "at most cluster.max_workers = 2 workers and has had 2"),
    ((3, 1, 3, True, False), "has had 3 .* ranks are not reused"),
])
def test_a_join_the_job_cannot_take_has_a_one_line_reason(args, says):
    why = refusal(*args)
    assert why is not None and "\n" not in why
    assert re.search(says, why)
    assert refusal(3, 2, 2, True, False) is None


def test_a_server_holds_from_its_first_free_step_and_admits_from_the_decided_one():
    p = DenseSync(2, steps_ahead=3, algorithm="ssgd")
    ex = Executor(p, [0, 1])
    for r in range(2):
        ex.run(p.push(r, [(0, 0, g(1)), (1, 0, g(1))], token=None))
    ex.run(p.push(0, [(0, 1, g(2)), (1, 1, g(2))], token=None))
    assert p.hold(2) == 2                         # step 1 has a push: 2 is the first free
    ex.run(p.push(1, [(0, 1, g(2)), (1, 1, g(2))], token=None))   # step 1 < 2: applied
    assert p.version == {0: 2, 1: 2}
    assert ex.run(p.push(0, [(0, 2, g(3)), (1, 2, g(3))], token=None)) == []
    assert ex.run(p.push(1, [(0, 2, g(3)), (1, 2, g(3))], token=None)) == []   # held
    assert ex.run(p.admit(2, 2)) == []           # step 2 now waits for worker 2 too
    with pytest.raises(PolicyError, match="joined the job from step 2"):
        p.push(2, [(0, 1, g(1))], token=None)
    # its first pull, as of step 1 (never pushed by it), is answered at once
    assert p.pull(2, [(0, 1), (1, 1)], token=(0, 1)) == [("answer", (0, 1), 0),
                                                          ("answer", (0, 1), 1)]
    acts = ex.run(p.push(2, [(0, 2, g(4)), (1, 2, g(4))], token=None))
    assert kinds(acts) == ["apply"]
    assert [(key, len(parts), scale) for key, parts, scale in acts[0][1]] == \
        [(0, 3, 2 / 3), (1, 3, 2 / 3)]          # the mean of three, counted as two
    assert ex.weights[0] == pytest.approx([-(2 + 4) - 10 * 2 / 3] * 2)
    # a later departure: the two left are the job's first size again, no scale
    ex.run(p.push(0, [(0, 3, g(6))], token=None) + p.push(2, [(0, 3, g(3))], token=None))
    assert p.first_missing(1) == 3
    acts = ex.run(p.leave(1, 3))
    assert [(key, len(parts), scale) for key, parts, scale in acts[0][1]] == [(0, 2, None)]


def test_a_join_from_an_applied_step_or_of_a_member_is_refused():
    p = DenseSync(2, steps_ahead=3, algorithm="ssgd")
    ex = Executor(p, [0])
    for r in range(2):
        ex.run(p.push(r, [(0, 0, g(1))], token=None))
    with pytest.raises(PolicyError, match="in the job already"):
        p.hold(1)
    with pytest.raises(PolicyError, match="was not asked to hold"):
        p.admit(2, 1)
    assert p.hold(2) == 1
    with pytest.raises(PolicyError, match="in the job already, or joining"):
        p.hold(2)
    with pytest.raises(PolicyError, match="step 0 is already applied"):
        p.admit(2, 0)
    with pytest.raises(PolicyError, match="cannot join a job whose algorithm is asgd"):
        Async(2, steps_ahead=3, algorithm="asgd").hold(2)


def test_two_joins_decided_together_hold_until_both_are_admitted():
    p = DenseSync(1, steps_ahead=4, algorithm="ssgd")
    ex = Executor(p, [0])
    assert p.hold(1) == 0 and p.hold(2) == 0
    assert ex.run(p.push(0, [(0, 0, g(1))], token=None)) == []
    assert ex.run(p.admit(1, 2)) == []           # worker 2's decision is still to come
    assert p.version == {0: 0}
    acts = ex.run(p.admit(2, 3))                 # step 0 had only worker 0 in it
    assert [(k, len(parts), scale) for k, parts, scale in acts[0][1]] == [(0, 1, None)]
    ex.run(p.push(0, [(0, 1, g(1))], token=None))
    assert p.version == {0: 2}                   # step 1: worker 0 alone, as decided
    ex.run(p.push(0, [(0, 2, g(1))], token=None))
    assert p.version == {0: 2}                   # step 2 waits for worker 1 too
    acts = ex.run(p.push(1, [(0, 2, g(1))], token=None))
    assert [(k, len(parts), scale) for k, parts, scale in acts[0][1]] == [(0, 2, 0.5)]


class TwoServers:
    """Two servers of an ssgd job of ``n`` workers, in process: the real dense policy and
    the real ``Weights`` with MXNet's optimizer (key k on server k), short of the
    messages; ``grad_fn`` and ``make`` are the simulator's."""
    shapes = {0: (3,), 1: (4,)}

    def __init__(self, n):
        import mxnet as mx
        from ssdsgd.kvstore.weights import Weights
        self.mx = mx
        rs = np.random.RandomState(0)
        self.init = {k: mx.nd.array(rs.randn(*s)) for k, s in self.shapes.items()}
        self.servers = []
        for k in self.shapes:
            w, p = Weights(n, reclaim=lambda shard: None), DenseSync(n, 3, "ssgd")
            w.declare(k, 0, self.init[k].asnumpy())
            p.declare(k)
            w.use_optimizer(self.make(), False)
            self.servers.append((w, p))

    def grad_fn(self, rank, step, weights):
        mx, r = self.mx, np.random.RandomState(1000 * rank + step)
        return {k: mx.nd.array(r.uniform(0.5, 1.5, w.shape)) * w - mx.nd.array(r.randn(*w.shape))
                for k, w in weights.items()}

    def make(self):
        return self.mx.optimizer.SGD(learning_rate=0.05, momentum=0.9, wd=1e-3,
                                     rescale_grad=0.25)

    def weights_now(self):
        return {k: self.servers[k][0].shards[k].weight.copy() for k in self.shapes}

    def push(self, rank, t, grads):
        for k, (w, p) in enumerate(self.servers):
            for kind, *what in p.push(rank, [(k, t, grads[k].asnumpy())], token=None):
                assert kind == "apply"
                w.apply(*what)

    def carry_out(self, decide):
        """``decide(policy)``'s actions applied on every server."""
        for w, p in self.servers:
            for kind, *what in decide(p):
                w.apply(*what)

    def versions(self):
        return [p.version[k] for k, (_, p) in enumerate(self.servers)]

    def equal(self, oracle):
        return all(np.array_equal(got.asnumpy(), oracle.global_weights[k].asnumpy())
                   for k, got in self.weights_now().items())


def test_the_servers_half_of_a_join_equals_the_simulator_bit_for_bit():
    """Two servers (the real policy, the real ``Weights`` with MXNet's optimizer), ssgd
    with 2 workers; worker 2 asks to join while step 4 is half pushed. Each server holds
    from its first free step (5), step 5 waits for the decision, the decider admits from
    ``join_boundary(5)`` = 6, and the weights equal ``simulate_membership`` fed that step,
    bit for bit: what a running job's servers would do, short of the messages."""
    from ssdsgd.glu.simulate_membership import Change, simulate_membership
    job = TwoServers(2)
    servers = job.servers
    admissions = Admissions(join_boundary("ssgd", 0, 1))
    members, decided = [0, 1], None
    for t in range(10):
        if decided is not None and t == decided["from_step"]:
            members = [0, 1, 2]
        at = job.weights_now()
        grads = {r: job.grad_fn(r, t, at) for r in members}
        job.push(members[0], t, grads[members[0]])
        if t == 4:                     # worker 2 registers: every server holds
            admissions.begin(2, ["s0", "s1"])
            answers = [{"joined": 2, "next_step": p.hold(2)} for _, p in servers]
            assert [a["next_step"] for a in answers] == [5, 5]
        for r in members[1:]:
            job.push(r, t, grads[r])
        if t == 5:                     # step 5 is held until the decision
            assert job.versions() == [5, 5]
            decided = admissions.answer("s0", answers[0]) or admissions.answer("s1", answers[1])
            assert decided == {"joined": 2, "from_step": 6}
            job.carry_out(lambda p: p.admit(2, decided["from_step"]))
            assert job.versions() == [6, 6]
    oracle = simulate_membership(job.init, job.grad_fn, job.make, 2, 10, [Change(6, "join", 2)],
                                 algorithm="ssgd")
    assert job.equal(oracle)
