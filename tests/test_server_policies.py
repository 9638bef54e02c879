"""The server's synchronization policies (ssdsgd/sync: dense sync, async, quorum rounds,
preduce's averages) in process, without sockets or MXNet: the events a server's messages
mean go in, and the actions it would carry out come out, in order. ``Executor`` carries
them out on numpy weights the way the server does (sum in the order given, one update),
so the tests check the values the replies would hold as well as the decisions."""
from types import SimpleNamespace

import numpy as np
import pytest

from ssdsgd.sync.averaging import GroupAverages
from ssdsgd.sync.dense import Async, DenseSync
from ssdsgd.sync.policy import PolicyError, ServerPolicy
from ssdsgd.sync.quorum import QuorumRounds
from ssdsgd.sync.server_policies import make_server_policy


class Executor:
    """The server's part, in miniature: weights per key, an update w -= sum (times
    ``scale``), and each answer recorded as (token, slot, the key's weights then)."""

    def __init__(self, policy, keys):
        self.policy, self.weights, self.answers, self.applied = policy, {}, [], []
        self.pushes = 0
        for key in keys:
            policy.declare(key)
            self.weights[key] = np.zeros(2, np.float64)

    def run(self, actions):
        for kind, *what in actions:
            getattr(self, kind)(*what)
        return actions

    def apply(self, grads, pushes):
        self.pushes += pushes
        self.applied.append([(key, len(parts)) for key, parts, _ in grads])
        for key, parts, scale in grads:
            total = np.sum(parts, axis=0)
            self.weights[key] = self.weights[key] - total * (1 if scale is None else scale)

    def answer(self, token, slot):
        self.answers.append((token, slot, None if slot is None else
                             self.weights[token[slot]].copy()))

    def fill(self, token, slot, step, value):
        self.answers.append((token, slot, (step, value)))

    def note(self, token, fields):
        self.notes = getattr(self, "notes", []) + [(token, fields)]

    def say(self, text):
        self.said = getattr(self, "said", []) + [text]


def g(value):
    return np.full(2, value, np.float64)


def kinds(actions):
    return [a[0] for a in actions]


# ---- dense sync (ssgd, ssd) ---------------------------------------------------------------
def test_a_step_is_applied_once_every_worker_pushed_it_summed_in_rank_order():
    p = DenseSync(3, steps_ahead=3, algorithm="ssgd")
    ex = Executor(p, [7])
    assert ex.run(p.push(2, [(7, 0, "c")], token=None)) == []
    assert ex.run(p.push(0, [(7, 0, "a")], token=None)) == []
    acts = p.push(1, [(7, 0, "b")], token=None)
    assert acts == [("apply", [(7, ["a", "b", "c"], None)], 0)]   # rank order, not arrival
    assert p.version == {7: 1} and p.busy() is None


def test_replies_as_of_a_step_are_answered_right_after_it_is_applied():
    p = DenseSync(2, steps_ahead=3, algorithm="ssgd")
    ex = Executor(p, [0, 1])
    ex.run(p.push(0, [(0, 0, g(1)), (1, 0, g(10))], token=(0, 1)))
    assert p.busy() == (0, 0)
    ex.run(p.push(1, [(0, 0, g(2)), (1, 0, g(20))], token=(0, 1)))
    assert ex.applied == [[(0, 2), (1, 2)]]          # one update for both keys
    values = {(tok, slot): w.tolist() for tok, slot, w in ex.answers}
    assert values == {((0, 1), 0): [-3, -3], ((0, 1), 1): [-30, -30]}
    assert len(ex.answers) == 4


def test_a_push_completing_a_step_applies_the_steps_queued_behind_it_in_order():
    """The one "apply, then answer, until nothing is ready" loop: worker 0 ran ahead
    (ssd), so worker 1's step-0 push makes steps 0, 1 and 2 ready, one after another,
    each reply answered between the updates it sits between."""
    p = DenseSync(2, steps_ahead=4, algorithm="ssd")
    ex = Executor(p, [5])
    for step in range(3):
        ex.run(p.push(0, [(5, step, g(1))], token=(5,)))
    ex.run(p.push(1, [(5, 1, g(1))], token=None))
    ex.run(p.push(1, [(5, 2, g(1))], token=None))
    assert ex.applied == [] and p.version[5] == 0
    acts = ex.run(p.push(1, [(5, 0, g(1))], token=None))
    assert kinds(acts) == ["apply", "answer", "apply", "answer", "apply", "answer"]
    assert [w.tolist() for _, _, w in ex.answers] == [[-2, -2], [-4, -4], [-6, -6]]
    assert p.version[5] == 3 and p.busy() is None


@pytest.mark.parametrize("step, text", [(0, "step 0 is already applied"),
                                        (4, "3 steps ahead of the slowest worker; the ssd "
                                            "schedule allows 2"),
                                        (2, "pushed step 2 twice")])
def test_a_push_the_schedule_does_not_allow_is_refused_and_changes_nothing(step, text):
    p = DenseSync(2, steps_ahead=3, algorithm="ssd")
    ex = Executor(p, [0, 1])
    ex.run(p.push(0, [(0, 0, g(1))], token=None))
    ex.run(p.push(1, [(0, 0, g(1))], token=None))
    ex.run(p.push(0, [(0, 2, g(1))], token=None))
    before = (dict(p.version), {k: {t: dict(v) for t, v in s.items()}
                                for k, s in p.pending.items()})
    with pytest.raises(PolicyError, match=text):
        p.push(0, [(1, 0, g(1)), (0, step, g(1))], token=("r",))  # key 1's record is fine
    assert (p.version, p.pending) == before and p.waiting == {0: {}, 1: {}}


def test_a_pull_waits_for_its_step_and_a_pull_of_a_step_never_pushed_is_refused():
    p = DenseSync(2, steps_ahead=3, algorithm="ssgd")
    ex = Executor(p, [3])
    with pytest.raises(PolicyError, match="pulls step 0, which it has not pushed"):
        p.pull(0, [(3, 0)], token=(3,))
    ex.run(p.push(0, [(3, 0, g(1))], token=None))
    assert p.pull(0, [(3, 0)], token=(3,)) == []          # waits for step 0
    acts = ex.run(p.push(1, [(3, 0, g(1))], token=None))
    assert kinds(acts) == ["apply", "answer"]
    assert p.pull(1, [(3, 0)], token=(3,)) == [("answer", (3,), 0)]   # applied: at once
    assert p.pull(1, [], token="empty") == [("answer", "empty", None)]


def test_a_departed_worker_is_counted_out_from_its_step_and_the_mean_kept():
    """on_worker_failure: continue: the first step missing from worker 2, then its
    pushes from that step dropped and the step applied as the mean of the others (the
    sum times N / pushes)."""
    p = DenseSync(3, steps_ahead=3, algorithm="ssgd")
    ex = Executor(p, [0, 1])
    for r in range(3):
        ex.run(p.push(r, [(0, 0, g(r + 1)), (1, 0, g(r + 1))], token=None))
    ex.run(p.push(0, [(0, 1, g(3)), (1, 1, g(3))], token=None))
    ex.run(p.push(2, [(0, 1, g(9))], token=None))
    ex.run(p.push(1, [(1, 1, g(1))], token=None))
    assert p.first_missing(2) == 1 and p.first_missing(1) == 1
    assert p.first_missing(0) == 2
    acts = ex.run(p.leave(2, 1))        # key 1 is complete without worker 2
    assert [[(key, len(parts), scale) for key, parts, scale in a[1]] for a in acts] == \
        [[(1, 2, 1.5)]]
    assert ex.weights[1].tolist() == [-6 - 6, -6 - 6]
    assert list(p.pending[0][1]) == [0]     # worker 2's push of step 1 is dropped
    ex.run(p.push(1, [(0, 1, g(5))], token=None))          # key 0 completes without 2
    assert ex.weights[0].tolist() == [-6 - 12, -6 - 12]
    assert p.removed == {2: 1} and p.busy() is None


# ---- asgd ---------------------------------------------------------------------------------
def test_async_applies_every_push_on_arrival_and_answers_at_once():
    p = Async(2, steps_ahead=3, algorithm="asgd")
    ex = Executor(p, [0, 1])
    acts = ex.run(p.push(1, [(0, 0, g(1)), (1, 0, g(2))], token=(0, 1)))
    assert kinds(acts) == ["apply", "answer", "answer"]
    ex.run(p.push(1, [(0, 0, g(1))], token=None))            # the same step again: fine
    assert ex.weights[0].tolist() == [-2, -2] and p.version == {0: 2, 1: 1}
    assert p.pull(0, [(0, 9), (1, 0)], token=(0, 1)) == [("answer", (0, 1), 0),
                                                          ("answer", (0, 1), 1)]
    assert p.first_missing(1) == 1 and p.busy() is None


# ---- quorum rounds ------------------------------------------------------------------------
def quorum(n=3, q=2, s=4, leader=True, replicate=False):
    return QuorumRounds(n, steps_ahead=3, algorithm="ssgd", quorum=q, max_staleness=s,
                        leader=leader, replicate=replicate)


def test_a_round_closes_on_q_pushes_summed_key_by_key_in_rank_order():
    p = quorum()
    ex = Executor(p, [0, 1])
    assert ex.run(p.push(2, [(0, 0, g(1)), (1, 0, g(2))], token=(0, 1))) == []
    acts = ex.run(p.push(0, [(0, 0, g(4))], token=(0,)))
    assert [(key, len(parts), scale) for key, parts, scale in acts[0][1]] == \
        [(0, 2, None), (1, 1, None)] and acts[0][2] == 2
    assert kinds(acts) == ["apply", "answer", "answer"]
    assert ex.weights[0].tolist() == [-5, -5] and ex.pushes == 2
    assert p.global_batches


def test_the_followers_replay_the_leaders_rounds_exactly():
    leader, follower = quorum(replicate=True), quorum(leader=False)
    ex_l, ex_f = Executor(leader, [0]), Executor(follower, [0])
    arrivals = [(0, 1), (2, 5), (1, 2), (0, 3), (2, 7), (1, 4)]
    for rank, value in arrivals:
        ex_l.run(leader.push(rank, [(0, 0, g(value))], token=(0,)))
        ex_f.run(follower.push(rank, [(0, 0, g(value))], token=(0,)))
        text = leader.decisions()
        if text:
            ex_f.run(follower.follow(text))
    assert leader.decisions() is None
    assert ex_f.applied == ex_l.applied and ex_f.weights[0].tolist() == ex_l.weights[0].tolist()
    assert [a[:2] for a in ex_f.answers] == [a[:2] for a in ex_l.answers]


def test_a_final_pull_waits_for_every_worker_and_a_pause_answers_at_once():
    p = quorum(n=2, q=2)
    ex = Executor(p, [0])
    assert p.pull(0, [(0, 0)], token=(0,), final=False) == [("answer", (0,), None)]
    assert ex.run(p.pull(0, [(0, 0)], token="F0", final=True)) == []
    assert kinds(ex.run(p.pause(1, "P1"))) == ["answer"]     # the last active one
    acts = ex.run(p.pull(1, [(0, 0)], token="F1", final=True))
    assert acts == [("answer", "F0", None), ("answer", "F1", None)]
    with pytest.raises(PolicyError, match="final pull twice"):
        p.pull(1, [(0, 0)], token="F1", final=True)
    with pytest.raises(PolicyError, match="pushed after its final pull"):
        p.push(0, [(0, 0, g(1))], token=None)


def test_quorum_auto_says_whom_it_leaves_out_and_notes_it_on_the_final_replies():
    from ssdsgd.sync.quorum_rules import LateWorkers
    clock = SimpleNamespace(t=0.0)
    rule = LateWorkers(2, lambda: clock.t, patience=2, floor_s=0.01, min_span_s=0)
    p = QuorumRounds(2, steps_ahead=3, algorithm="ssgd", quorum=rule, max_staleness=9,
                     leader=True, replicate=False)
    ex = Executor(p, [0])
    for k in range(2):                 # worker 1 joins each round 0.9 s after worker 0
        clock.t = float(k)
        ex.run(p.push(0, [(0, 0, g(1))], token=(0,)))
        clock.t += 0.9
        acts = ex.run(p.push(1, [(0, 0, g(1))], token=(0,)))
    assert kinds(acts) == ["say", "apply", "answer", "answer"]
    assert ex.said == ["quorum auto: leaving out worker 1 (late by 0.90 s or more for 2 "
                       "rounds in 1.0 s, bound 0.32 s) from round 2"]
    assert kinds(ex.run(p.push(0, [(0, 0, g(1))], token=(0,)))) == ["apply", "answer"]
    assert ex.run(p.pull(0, [(0, 0)], token="F0", final=True)) == []
    acts = ex.run(p.pull(1, [(0, 0)], token="F1", final=True))
    assert kinds(acts) == ["note", "answer", "note", "answer"]
    record = acts[0][2]["quorum_auto"]
    assert record["rounds"] == 3 and record["excused"] == [1]
    assert [c["worker"] for c in record["changes"]] == [1]
    assert [t for t, _ in ex.notes] == ["F0", "F1"]


def test_only_a_quorums_follower_takes_round_decisions():
    with pytest.raises(PolicyError, match="without a quorum"):
        DenseSync(2, 3, "ssgd").follow("c0.1")
    with pytest.raises(PolicyError, match="leader received"):
        quorum().follow("c0.1")


# ---- preduce's averages -------------------------------------------------------------------
def test_a_groups_members_get_the_rank_order_mean_once_all_have_sent():
    p = DenseSync(3, 3, "preduce", averaging=GroupAverages(3))
    w0, w2 = np.float32([1, 2, 1e8]), np.float32([3, 4, 1])
    assert p.average(2, 5, (0, 2), [(9, w2)], token="T2") == []
    acts = p.average(0, 5, (0, 2), [(9, w0)], token="T0")
    want = (w0 + w2) / np.float32(2)
    assert [a[:4] for a in acts] == [("fill", "T2", 0, 5), ("fill", "T0", 0, 5)]
    for a in acts:
        np.testing.assert_array_equal(a[4], want)
    assert p.averaging.groups == {}                          # done: forgotten
    assert p.average(0, 6, (0, 1), [], token="E") == [("answer", "E", None)]


@pytest.mark.parametrize("rank, members, text", [(0, (0,), "2 or more"), (0, (0, 3), "2 or more"),
                                                 (1, (0, 2), "2 or more"),
                                                 (0, (0, 1), "members \\[0, 1\\], but its other"),
                                                 (2, (0, 2), "sent its weights for group 1 twice")])
def test_an_average_no_correct_member_sends_is_refused(rank, members, text):
    p = DenseSync(3, 3, "preduce", averaging=GroupAverages(3))
    p.average(2, 1, (0, 2), [(9, np.zeros(2))], token="T2")
    with pytest.raises(PolicyError, match=text):
        p.average(rank, 1, members, [(9, np.zeros(2))], token="X")
    assert list(p.averaging.groups[1].parts[9]) == [2]


def test_only_a_preduce_job_averages():
    with pytest.raises(PolicyError, match="algorithm is ssd, not preduce"):
        DenseSync(2, 3, "ssd").average(0, 0, (0, 1), [], token="T")


# ---- which policy a job's settings choose -------------------------------------------------
def env(**kw):
    values = dict(algorithm="ssd", num_workers=4, num_servers=2, quorum="all",
                  max_staleness=3, delay_steps=5, max_workers=None)
    return SimpleNamespace(**dict(values, **kw))


def test_the_settings_choose_the_policy():
    assert make_server_policy(env(), 0).steps_ahead == 7
    assert make_server_policy(env(algorithm="ssgd"), 0).steps_ahead == 3
    assert type(make_server_policy(env(), 0)) is DenseSync
    assert type(make_server_policy(env(algorithm="asgd"), 0)) is Async
    q = make_server_policy(env(quorum="majority"), 1)
    assert type(q) is QuorumRounds and q.rounds.q == 3 and not q.rounds.leader
    assert make_server_policy(env(quorum="majority"), 0).rounds.replicate
    auto = make_server_policy(env(quorum="auto"), 0)
    assert type(auto) is QuorumRounds and auto.rounds.q == 4
    assert type(auto.rounds.rule).__name__ == "LateWorkers"
    assert make_server_policy(env(), 0).steps_ahead == 7
    pre = make_server_policy(env(algorithm="preduce"), 0)
    assert type(pre) is DenseSync and isinstance(pre.averaging, GroupAverages)
    assert make_server_policy(env(), 0).averaging is None
    assert all(issubclass(c, ServerPolicy) for c in (DenseSync, Async, QuorumRounds))


# ---- a policy's actions carried out by the server's own weights ---------------------------
def test_the_servers_weights_carry_out_a_policys_updates():
    """The transport's half without sockets: a dense policy's apply actions run by
    ``kvstore.weights.Weights`` with MXNet's SGD, the answers reading the weights there;
    the departure's mean gradient is counted as N workers'."""
    import mxnet as mx
    from ssdsgd.kvstore.weights import Weights

    lr = np.float32(0.5)
    weights = Weights(3, reclaim=lambda shard: None)
    weights.use_optimizer(mx.optimizer.create("sgd", learning_rate=float(lr)), False)
    p = DenseSync(3, steps_ahead=3, algorithm="ssgd")
    start = np.float32([1, 2, 3, 4])
    weights.declare(0, 0, start.copy())
    p.declare(0)
    seen = []
    run = {"apply": weights.apply,
           "answer": lambda token, slot: seen.append(weights.shards[0].weight.asnumpy())}
    grads = [np.float32([1, 0, 0, 0]), np.float32([0, 2, 0, 0]), np.float32([0, 0, 4, 8])]
    for rank, grad in enumerate(grads):
        for kind, *what in p.push(rank, [(0, 0, grad)], token=("t",)):
            run[kind](*what)
    np.testing.assert_allclose(seen, [start - lr * sum(grads)] * 3, rtol=1e-6)
    for kind, *what in p.push(0, [(0, 1, grads[0])], token=None) + p.leave(1, 1) + \
            p.leave(2, 1):
        run[kind](*what)
    want = start - lr * sum(grads) - lr * grads[0] * np.float32(3)
    np.testing.assert_allclose(weights.shards[0].weight.asnumpy(), want, rtol=1e-6)
    assert weights.shards[0].version == 2 and weights.update_count(weights.shards[0]) == 2


def test_unsent_replies_of_one_step_share_one_copy_when_the_weights_change():
    """Every worker's pull of a step lends the same view of the weights; when the next
    step changes them before ZeroMQ took the replies, the replies keep the old values in
    one copy, not one copy each (N workers' pulls of a big model were N copies)."""
    from ssdsgd.kvstore.replies import Peer, Replies, Reply
    from ssdsgd.kvstore.weights import Weights

    replies = Replies(sock=None, weights=None, env=None, log=print)
    weights = replies.weights = Weights(3, reclaim=replies.reclaim)
    weights.declare(0, 0, np.float32([1, 2, 3, 4]))
    weights.declare(1, 0, np.float32([5]))
    shard, other = weights.shards[0], weights.shards[1]
    # replies still waiting for key 1 (so not sent) when key 0 changes
    waiting = [Reply(bytes([r]), r + 1, [shard, other], False, Peer(r)) for r in range(3)]
    for reply in waiting:
        replies._snapshot(reply, 0, shard)
    assert all(r.parts[0][0] is waiting[0].parts[0][0] for r in waiting)   # one view
    replies.reclaim(shard)
    shard.weight[:] = 0                    # the next step's update
    copies = {id(r.parts[0][0]) for r in waiting}
    assert len(copies) == 1, "each unsent reply took a copy of its own"
    np.testing.assert_array_equal(waiting[0].parts[0][0], [1, 2, 3, 4])
    assert shard.lent == []
