"""Partial reduce in process: the group generator's policy (docs/spec/preduce.md) and the
simulator against what it must reduce to."""
import mxnet as mx
import numpy as np
import pytest

from ssdsgd.glu.preduce import arrival_groups, simulate_preduce
from ssdsgd.sync.groups import GroupError, GroupGenerator, mean, replay
from ssdsgd.settings import SettingError, read_env
from test_simulate import grad_fn, init_weights, make_sgd


def members(groups):
    return [g.members for g in groups]


def test_groups_form_from_ready_workers_only_and_never_conflict():
    gen = GroupGenerator(4, 2)
    assert gen.arrive(3) == []
    assert members(gen.arrive(1)) == [(1, 3)]
    assert gen.arrive(0) == []
    assert members(gen.arrive(2)) == [(0, 2)]
    assert gen.arrive(0) == []
    with pytest.raises(GroupError, match="twice"):
        gen.arrive(0)


def test_a_straggler_never_holds_a_group_up():
    """Worker 3 ready once for every two rounds of the others: the fast three keep forming
    groups among themselves, and every worker still meets every other."""
    order = [0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3]
    groups = replay(order, 4, 2, steps=10)
    assert 3 not in set().union(*members(groups[:2]))
    pairs = {g for g in members(groups)}
    assert {(0, 1), (0, 2), (1, 2)} <= pairs and any(3 in g for g in pairs)


def test_two_equally_fast_pairs_do_not_average_only_among_themselves():
    """0 and 1 are always ready together, then 2 and 3: without the repeat rule the pairs
    (0, 1) and (2, 3) would never exchange information; with it a worker's own groups never
    repeat twice in a row."""
    order = [0, 1, 2, 3] * 6
    groups = members(replay(order, 4, 2, steps=10))
    assert groups[:2] == [(0, 1), (2, 3)]
    assert any(g not in ((0, 1), (2, 3)) for g in groups[2:6])
    for r in range(4):
        own = [g for g in groups if r in g]
        assert all(not (a == b == c) for a, b, c in zip(own, own[1:], own[2:])), (r, own)


def test_a_repeat_is_formed_once_then_the_least_recently_met_worker_is_waited_for():
    gen = GroupGenerator(4, 2)
    for r in (0, 1, 2, 3):
        gen.arrive(r)                              # (0, 1), (2, 3)
    gen.arrive(0)
    assert members(gen.arrive(1)) == [(0, 1)]      # one repeat
    gen.arrive(0)
    assert gen.arrive(1) == []                     # not two: wait
    assert members(gen.arrive(2)) == [(0, 2)]
    assert members(gen.arrive(3)) == [(1, 3)]


def test_finished_workers_shrink_the_groups_and_the_last_group_is_everyone():
    gen = GroupGenerator(3, 2)
    assert members(gen.arrive(0)) == []
    assert members(gen.arrive(1)) == [(0, 1)]
    assert gen.arrive(0, final=True) == []
    assert gen.arrive(1, final=True) == []
    assert members(gen.arrive(2)) == [(2,)]          # alone: continue at once
    last = gen.arrive(2, final=True)
    assert members(last) == [(0, 1, 2)] and last[0].final


def test_group_size_n_is_synchronous_model_averaging():
    groups = members(replay([0, 1, 2] * 3, 3, 3, steps=2))
    assert groups == [(0, 1, 2)] * 3


def test_mean_sums_in_rank_order_then_divides():
    parts = [np.float32([1e8, 1]), np.float32([1, 1e-8]), np.float32([-1e8, 3])]
    want = ((parts[0] + parts[1]) + parts[2]) / np.float32(3)
    np.testing.assert_array_equal(mean(parts), want)


def test_simulator_with_one_group_of_everyone_per_step_is_model_averaging():
    """P = N: every step all models are averaged, so the workers stay equal, and with plain
    SGD (no momentum) that is synchronous SGD on the mean gradient."""
    n, steps = 3, 4
    make = lambda: mx.optimizer.SGD(learning_rate=0.1, rescale_grad=0.25)  # noqa: E731
    res = simulate_preduce(init_weights(), grad_fn, make, n, steps,
                           arrivals=list(range(n)) * (steps + 1), group_size=n)
    w = {k: v.copy() for k, v in init_weights().items()}
    for t in range(steps):
        grads = [grad_fn(i, t, w) for i in range(n)]
        for k in w:
            w[k] = w[k] - 0.1 * 0.25 * sum(g[k] for g in grads) / n
    for i in range(n):
        for k in w:
            np.testing.assert_allclose(res.worker_weights[i][k].asnumpy(), w[k].asnumpy(),
                                       rtol=1e-5, atol=1e-6)


def test_simulator_follows_the_groups_and_ends_on_the_average():
    n, steps = 4, 3
    order = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]
    res = simulate_preduce(init_weights(), grad_fn, make_sgd, n, steps, arrivals=order)
    assert res.groups[-1].final and res.groups[-1].members == (0, 1, 2, 3)
    for k in init_weights():
        want = mean([res.local_weights[i][k].asnumpy() for i in range(n)])
        for i in range(n):
            np.testing.assert_array_equal(res.worker_weights[i][k].asnumpy(), want)
    # the same groups, given directly, give the same weights
    again = simulate_preduce(init_weights(), grad_fn, make_sgd, n, steps,
                             groups=[g.members for g in res.groups])
    np.testing.assert_array_equal(again.worker_weights[0][0].asnumpy(),
                                  res.worker_weights[0][0].asnumpy())
    with pytest.raises(ValueError, match="no step left"):
        simulate_preduce(init_weights(), grad_fn, make_sgd, 2, 1,
                         groups=[(0, 1), (0, 1), (0, 1)])


def test_group_records_of_the_workers_make_one_sequence():
    assert arrival_groups([[[0, [0, 1]], [2, [0, 1, 2]]], [[0, [0, 1]], [1, [1, 2]]],
                           [[1, [1, 2]], [2, [0, 1, 2]]]]) == [(0, 1), (1, 2), (0, 1, 2)]
    with pytest.raises(ValueError, match="missing"):
        arrival_groups([[[0, [0, 1]], [2, [0, 1]]]])


@pytest.mark.parametrize("size, workers, text", [
    ("1", "4", "SSDSGD_GROUP_SIZE='1': expected an integer >= 2"),
    ("5", "4", "SSDSGD_GROUP_SIZE: expected at most SSDSGD_NUM_WORKERS (4) workers per group, "
               "got 5")])
def test_bad_group_sizes_are_one_line_errors(size, workers, text):
    with pytest.raises(SettingError) as e:
        read_env({"SSDSGD_SCHEDULER_PORT": "1", "SSDSGD_ALGORITHM": "preduce",
                  "SSDSGD_GROUP_SIZE": size, "SSDSGD_NUM_WORKERS": workers})
    assert str(e.value) == text and "\n" not in str(e.value)


def test_compression_with_preduce_is_a_one_line_error():
    from ssdsgd import settings as S
    with pytest.raises(SettingError, match=r"^sync.algorithm: preduce works with "
                                           r"sync.compression: none only, got '2bit' \(.*\)$"):
        S.cross_check({"algorithm": "preduce", "compression": "2bit", "num_workers": 4,
                       "group_size": 2}, lambda name: S.BY_NAME[name].path)


def test_a_worker_at_a_barrier_is_away_and_the_groups_shrink_without_it():
    """A checkpoint's barrier: workers 0 and 1 wait there, so they cannot report ready;
    worker 2, ready, must not wait for them (a group of one continues at once). After the
    barrier they are back and groups of P form again."""
    gen = GroupGenerator(3, 2)
    assert members(gen.arrive(0) + gen.arrive(1)) == [(0, 1)]
    assert gen.arrive(2) == []
    assert gen.wait_at_barrier(0) == []
    assert members(gen.wait_at_barrier(1)) == [(2,)]
    assert gen.wait_at_barrier(2) == []
    gen.barrier_released()
    assert gen.arrive(0) == [] and members(gen.arrive(2)) == [(0, 2)]
    assert gen.arrive(1) == []
    with pytest.raises(GroupError, match="barrier"):
        gen.wait_at_barrier(1)                     # ready for a group and at a barrier at once
