"""ssdsgd.glu.simulate_membership: the simulator of docs/spec/membership.md against the
fixed-N simulator (no change: bit for bit) and an independent numpy loop (joins, leaves)."""
import mxnet as mx
import numpy as np
import pytest

from ssdsgd.glu.simulate import simulate
from ssdsgd.glu.simulate_membership import (Change, MembershipError, members_by_step,
                                            simulate_membership)
from test_simulate import LR, MU, RESCALE, WD, grad_fn, init_weights, make_sgd


def make_scheduled():
    return mx.optimizer.SGD(learning_rate=LR, momentum=MU, wd=WD, rescale_grad=RESCALE,
                            lr_scheduler=mx.lr_scheduler.FactorScheduler(step=4, factor=0.5))


def same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k].asnumpy(), b[k].asnumpy()), k


@pytest.mark.parametrize('kw', [dict(algorithm='ssgd'),
                                dict(warmup_steps=4, delay_steps=3),
                                dict(warmup_steps=2, delay_steps=2, glu_state='exact'),
                                dict(warmup_steps=2, delay_steps=3, pull_schedule='staggered')])
def test_no_change_is_the_fixed_simulator_bit_for_bit(kw):
    fixed = simulate(init_weights(), grad_fn, make_scheduled, 2, 13, **kw)
    moved = simulate_membership(init_weights(), grad_fn, make_scheduled, 2, 13, [], **kw)
    same(fixed.global_weights, moved.global_weights)
    for a, b in zip(fixed.worker_weights, moved.worker_weights):
        same(a, b)


def test_ssd_whose_warm_up_covers_the_run_is_ssgd_with_the_same_join():
    changes = [Change(4, 'join', 2)]
    ssgd = simulate_membership(init_weights(), grad_fn, make_sgd, 2, 9, changes,
                               algorithm='ssgd')
    ssd = simulate_membership(init_weights(), grad_fn, make_sgd, 2, 9, changes,
                              warmup_steps=9, delay_steps=3)
    same(ssgd.global_weights, ssd.global_weights)
    for a, b in zip(ssgd.worker_weights, ssd.worker_weights):
        same(a, b)


def numpy_ssgd(steps, schedule, clock_n0=None):
    """Independent float64 loop: mom = mu mom - lr(t) (r sum_{M(t)} g x 2/|M| + wd w),
    w += mom (the job started with 2); lr(t) of FactorScheduler(4, 0.5) at pushes / N0
    if ``clock_n0``."""
    w = {k: v.asnumpy().astype(np.float64) for k, v in init_weights().items()}
    mom = {k: np.zeros_like(v) for k, v in w.items()}
    pushes = 0
    for t, members in enumerate(schedule):
        grads = [grad_fn(r, t, {k: mx.nd.array(v) for k, v in w.items()}) for r in members]
        pushes += len(members)
        lr = LR
        if clock_n0:
            lr = LR * 0.5 ** int(max(0.0, np.ceil(pushes / clock_n0 / 4) - 1))
        for k in w:
            total = sum(g[k].asnumpy().astype(np.float64) for g in grads) * 2 / len(members)
            mom[k] = MU * mom[k] - lr * (RESCALE * total + WD * w[k])
            w[k] = w[k] + mom[k]
    return w


def close(expected, got):
    for k in expected:
        np.testing.assert_allclose(got[k].asnumpy(), expected[k], rtol=1e-5, atol=1e-6)


def test_ssgd_join_then_leave_matches_an_independent_loop():
    changes = [Change(5, 'join', 2), Change(9, 'leave', 1)]
    res = simulate_membership(init_weights(), grad_fn, make_sgd, 2, 12, changes,
                              algorithm='ssgd')
    schedule = members_by_step(2, changes, 12)
    assert schedule[4] == (0, 1) and schedule[5] == (0, 1, 2) and schedule[9] == (0, 2)
    close(numpy_ssgd(12, schedule), res.global_weights)
    # every member ends with the global weights; the one that left with its last step's
    close(numpy_ssgd(12, schedule), res.worker_weights[2])
    close(numpy_ssgd(9, schedule[:9]), res.worker_weights[1])


def test_the_lr_schedule_counts_global_batches_of_the_first_n():
    changes = [Change(3, 'join', 2)]
    res = simulate_membership(init_weights(), grad_fn, make_scheduled, 2, 10, changes,
                              algorithm='ssgd')
    schedule = members_by_step(2, changes, 10)
    close(numpy_ssgd(10, schedule, clock_n0=2), res.global_weights)
    # counting updates instead would be another run: the clock is not a no-op here
    other = numpy_ssgd(10, schedule, clock_n0=3)
    assert any(not np.allclose(other[k], res.global_weights[k].asnumpy()) for k in other)


def test_ssd_join_at_a_boundary_takes_the_global_weights_and_keeps_up():
    """k = 3, T_w = 2: boundaries 2, 5, 8. The joiner at 5 starts from w_G(4); after the
    pull of step 7 every member holds w_G(7) again (the reset at 8 is to that pull)."""
    seen = {}
    res = simulate_membership(init_weights(), grad_fn, make_sgd, 2, 9,
                              [Change(5, 'join', 2)], warmup_steps=2, delay_steps=3,
                              on_step=lambda t, w: seen.__setitem__(
                                  t, {k: v.copy() for k, v in w.items()}))
    assert len(res.worker_weights) == 3
    # the three workers' local weights differ (each took its own gradient at step 8) ...
    assert not np.array_equal(res.worker_weights[0][0].asnumpy(),
                              res.worker_weights[2][0].asnumpy())
    # ... by one local step from w_G(7): far closer to it than to the start
    for w in res.worker_weights:
        assert np.abs(w[0].asnumpy() - seen[7][0].asnumpy()).max() < \
            np.abs(w[0].asnumpy() - init_weights()[0].asnumpy()).max()


@pytest.mark.parametrize('glu_state', ['estimate', 'exact'])
def test_ssd_staggered_join_at_any_step_starts_from_the_global_weights_before_it(glu_state):
    """Staggered pulls (T_w = 2, k = 3, N = 2: offsets 0 and 1) have no step every worker
    resets at, so a joiner may come in at any steps-delay step s (docs/spec/membership.md
    rule 5): its gradient of step s is taken at w_G(s - 1), and from then on it pulls
    with its offset (tests/test_joins.py; the real job against this, test_join_jobs.py)."""
    seen, taken = {}, {}

    def recording(rank, step, weights):
        taken[rank, step] = {k: v.copy() for k, v in weights.items()}
        return grad_fn(rank, step, weights)

    res = simulate_membership(init_weights(), recording, make_sgd, 2, 12,
                              [Change(6, 'join', 2)], warmup_steps=2, delay_steps=3,
                              pull_schedule='staggered', glu_state=glu_state,
                              on_step=lambda t, w: seen.__setitem__(
                                  t, {k: v.copy() for k, v in w.items()}))
    assert (2, 5) not in taken and (2, 6) in taken
    same(taken[2, 6], seen[5])
    assert not np.array_equal(taken[0, 6][0].asnumpy(), seen[5][0].asnumpy())   # local
    assert len(res.worker_weights) == 3


@pytest.mark.parametrize('changes, kw, says', [
    ([Change(4, 'join', 2)], dict(warmup_steps=2, delay_steps=3), "not a pull boundary"),
    ([Change(3, 'join', 3)], dict(algorithm='ssgd'), "next unused rank, 2"),
    ([Change(3, 'leave', 0), Change(3, 'leave', 1)], dict(algorithm='ssgd'),
     "worker 1 cannot leave at step 3 .* its last worker"),
    ([Change(3, 'leave', 0), Change(5, 'leave', 0)], dict(algorithm='ssgd'),
     "worker 0 cannot leave at step 5 .not in"),
    ([Change(30, 'join', 2)], dict(algorithm='ssgd'), "outside the run's steps"),
])
def test_a_schedule_the_rules_refuse_is_named(changes, kw, says):
    with pytest.raises(MembershipError, match=says):
        simulate_membership(init_weights(), grad_fn, make_sgd, 2, 9, changes, **kw)


def test_digits_a_third_worker_joining_late_ends_within_a_point_of_three_throughout():
    """The algorithm's half of issue #29's accuracy claim, in process: ssd k = 5 on
    digits, 8 epochs of the same sample budget, the third worker joining at step 200 of
    290 (a pull boundary) against three workers from the start."""
    from ssdsgd.glu.simulate_membership import digits_join
    full = digits_join(3, epochs=8, k=5)
    grown = digits_join(2, join_at=200, epochs=8, k=5)
    print(f"3 workers throughout: {full.accuracy:.3f} in {full.steps} steps; "
          f"2 + 1 at step 200: {grown.accuracy:.3f} in {grown.steps} steps")
    assert full.accuracy > 0.85 and grown.steps > full.steps
    assert grown.accuracy >= full.accuracy - 0.01
