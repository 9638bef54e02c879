"""The quorum round rules (ssdsgd/sync/rounds.py) in process: what closes a round, where a
late push goes, the staleness bound, the end, and followers replaying the leader."""
import random

import mxnet as mx
import pytest

import tiny
from ssdsgd.glu.simulate import simulate
from ssdsgd.glu.simulate_quorum import simulate_quorum
from ssdsgd.sync.rounds import RoundError, Rounds
from ssdsgd.settings import SettingError, quorum_size


def closes(actions):
    return [[r for r, _ in what] for kind, what in actions if kind == "close"]


def replies(actions):
    return [what for kind, what in actions if kind == "reply"]


def test_quorum_sizes():
    assert [quorum_size(q, 4) for q in ("all", "majority", "solo", "3", "9")] == [4, 3, 1, 3, 4]
    assert quorum_size("majority", 5) == 3 and quorum_size("majority", 1) == 1
    with pytest.raises(SettingError, match="sync.quorum: expected all, majority, solo"):
        quorum_size("most", 4)


def test_a_round_closes_on_q_workers_and_a_late_push_joins_the_open_round():
    r = Rounds(3, 2, max_staleness=5)
    assert closes(r.push(0, "a0", token="A0")) == []
    acts = r.push(1, "b0", token="B0")
    assert closes(acts) == [[0, 1]] and replies(acts) == ["A0", "B0"]
    r.push(0, "a1", token="A1")
    acts = r.push(2, "c0", token="C0")     # late for round 0: into round 1, never lost
    assert closes(acts) == [[0, 2]] and replies(acts) == ["A1", "C0"]
    assert r.applied == [2, 1, 1]


def test_at_most_one_push_per_worker_per_round():
    r = Rounds(3, 2, max_staleness=5)
    r.push(0, "a0")
    r.push(0, "a1")                        # waits for the next round
    acts = r.push(1, "b0")
    assert closes(acts) == [[0, 1]]
    assert r.members == {0: "a1"}


def test_a_latest_reply_goes_once_the_push_is_in_the_open_round():
    r = Rounds(2, 2, max_staleness=5)
    assert replies(r.push(0, "a0", token="A0", latest=True)) == ["A0"]
    assert replies(r.push(0, "a1", token="A1", latest=True)) == []   # queued
    acts = r.push(1, "b0")
    assert closes(acts) == [[0, 1]] and replies(acts) == ["A1"]


def test_staleness_holds_rounds_until_the_straggler_pushes():
    r = Rounds(2, 1, max_staleness=1)
    assert closes(r.push(0, "a0", token="A0")) == [[0]]      # round 0: 1 old for worker 1
    assert closes(r.push(0, "a1", token="A1")) == []         # round 1 would be 2 old
    acts = r.push(1, "b0", token="B0")
    assert closes(acts) == [[0, 1]] and replies(acts) == ["A1", "B0"]


def test_workers_in_a_barrier_do_not_hold_the_round_of_a_slow_one():
    # the two fast workers wait at a barrier (a checkpoint) for the slow one, whose push
    # is alone in the open round: without the pauses the round would wait for a second
    # worker forever (it did, at the first checkpoint of a digits job with a quorum)
    r = Rounds(3, 2, max_staleness=1)
    assert closes(r.push(0, "a0")) == [] and closes(r.push(1, "b0")) == [[0, 1]]
    assert replies(r.push(2, "c0", token="C0")) == []
    assert closes(r.pause(0)) == []                     # worker 1 could still come
    acts = r.pause(1)
    assert closes(acts) == [[2]] and replies(acts) == ["C0"]
    assert closes(r.push(2, "c1", token="C1")) == [[2]]  # alone until the others push
    assert closes(r.pause(2)) == [] and r.paused == set()   # all there: the barrier ends
    assert closes(r.push(0, "a1")) == []                # back from it: Q = 2 again
    assert closes(r.push(1, "b1")) == [[0, 1]]
    r.final(0, "F0")
    with pytest.raises(RoundError, match="after its final pull"):
        r.pause(0)


def test_the_end_flushes_every_push_and_answers_every_final_pull():
    r = Rounds(3, 3, max_staleness=9)
    r.push(0, "a0")
    r.push(0, "a1")
    assert replies(r.final(1, "F1")) == []
    acts = r.final(2, "F2")            # nobody else can come: rounds close with worker 0
    assert closes(acts) == [[0], [0]] and replies(acts) == []
    acts = r.final(0, "F0")
    assert replies(acts) == ["F1", "F2", "F0"]
    with pytest.raises(RoundError, match="worker 0 pushed after its final pull"):
        r.push(0, "late")


def test_followers_replaying_the_leader_close_the_same_rounds():
    rng = random.Random(3)
    for trial in range(30):
        n, q, s = rng.randint(2, 5), None, rng.randint(1, 3)
        q = rng.randint(1, n)
        leader = Rounds(n, q, s, replicate=True, max_queued=100)
        follower = Rounds(n, q, s, leader=False, max_queued=100)
        pushes = [r for r in range(n) for _ in range(6)]
        rng.shuffle(pushes)
        led, followed, log = [], [], []
        count = [0] * n
        for rank in pushes:     # the leader sees pushes in one order, the follower in another
            acts = leader.push(rank, (rank, count[rank]), token=(rank, count[rank]))
            count[rank] += 1
            led += [("c", [x for _, x in w]) if k == "close" else ("r", w) for k, w in acts]
            log += leader.log
            leader.log.clear()
        for rank in range(n):
            led += [("c", [x for _, x in w]) if k == "close" else ("r", w)
                    for k, w in leader.final(rank, ("final", rank))]
        log += leader.log
        seen = [0] * n
        order = sorted(pushes, key=lambda _: rng.random())
        chunks = [log[i:i + 3] for i in range(0, len(log), 3)]
        for i, rank in enumerate(order):
            acts = follower.push(rank, (rank, seen[rank]), token=(rank, seen[rank]))
            seen[rank] += 1
            if i < len(chunks):
                acts += follower.follow(" ".join(chunks[i]))
            followed += [("c", [x for _, x in w]) if k == "close" else ("r", w)
                         for k, w in acts]
        for chunk in chunks[len(order):]:
            followed += [("c", [x for _, x in w]) if k == "close" else ("r", w)
                         for k, w in follower.follow(" ".join(chunk))]
        for rank in range(n):
            followed += [("c", [x for _, x in w]) if k == "close" else ("r", w)
                         for k, w in follower.final(rank, ("final", rank))]
        key = lambda e: e[0] == "c"
        assert [e for e in led if key(e)] == [e for e in followed if key(e)], trial
        assert leader.applied == follower.applied == [6] * n


def test_a_follower_refuses_malformed_decisions():
    f = Rounds(2, 1, 1, leader=False)
    with pytest.raises(RoundError, match="malformed"):
        f.follow("c0.x")
    with pytest.raises(RoundError, match="beyond 1"):
        f.follow("c0.7")
    with pytest.raises(RoundError, match="leader received"):
        Rounds(2, 1, 1).follow("c0")


def _problem():
    net = tiny.make_net()
    params = tiny.params(net)
    init = {i: p.data().copy() for i, p in enumerate(params)}

    def grad_fn(worker, step, weights):
        for i, p in enumerate(params):
            p.set_data(weights[i])
        tiny.forward_backward(net, *tiny.batch(worker, step, 8))
        return {i: p.grad().copy() for i, p in enumerate(params)}

    def make_optimizer():
        return mx.optimizer.create("sgd", learning_rate=0.1, momentum=0.9, rescale_grad=1 / 8)
    return init, grad_fn, make_optimizer


def test_a_quorum_of_all_is_the_synchronous_simulation():
    # ssgd and ssd: a steps-delay pull is answered once the round holding its push closed,
    # so with Q = N it is the contract's "as of step t" (an answer with the newest closed
    # round at once, one round older, cost ssd k=5 twice the steps to 95% on the digits)
    init, grad_fn, make_optimizer = _problem()
    for algorithm in ("ssgd", "ssd"):
        kw = dict(algorithm=algorithm, warmup_steps=2, delay_steps=2)
        ref = simulate(init, grad_fn, make_optimizer, 3, 6, **kw)
        got = simulate_quorum(init, grad_fn, make_optimizer, 3, 6, quorum=3,
                              max_staleness=1, delays=[0.3, 0, 0.1], **kw)
        assert got.rounds == [[0, 1, 2]] * 6
        for key, w in ref.global_weights.items():
            assert (got.global_weights[key] - w).abs().max().asscalar() < 1e-6, algorithm
        for mine, theirs in zip(got.worker_weights, ref.worker_weights):
            for key, w in theirs.items():
                assert (mine[key] - w).abs().max().asscalar() < 1e-6, algorithm


def test_an_impossible_arrival_order_is_refused():
    init, grad_fn, make_optimizer = _problem()
    with pytest.raises(ValueError, match="worker 0 cannot send now"):
        simulate_quorum(init, grad_fn, make_optimizer, 2, 3, quorum=2, max_staleness=1,
                        arrivals=[0, 0], algorithm="ssgd")


def test_a_final_pull_that_lets_a_held_round_close_releases_its_workers():
    # dynamic data deals a slow worker fewer steps: its final pull leaves the staleness
    # bound, the round it held closes, and the fast workers it held go on to their end
    init, grad_fn, make_optimizer = _problem()
    got = simulate_quorum(init, grad_fn, make_optimizer, 3, [10, 10, 4], quorum=2,
                          max_staleness=1, delays=[0, 0, 0.8], algorithm="ssgd")
    assert got.applied == [10, 10, 4]
    assert got.rounds[-1] == [0, 1] and got.arrivals[-1] in (0, 1)
