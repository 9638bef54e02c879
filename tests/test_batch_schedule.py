"""The servers' lr schedule under a quorum counts global batches (docs/spec/quorum.md,
rule 6): the wrapper, its description for checkpoints, and the simulator's count."""
import mxnet as mx
import numpy as np
import pytest

from ssdsgd.glu.simulate_quorum import simulate_quorum
from ssdsgd.mxglue.batch_schedule import GlobalBatchSchedule
from ssdsgd.mxglue.optimizer_spec import OptimizerSpecError, build, describe


def _cosine(n=20):
    return mx.lr_scheduler.CosineScheduler(max_update=n, base_lr=0.5, final_lr=0.0)


def test_full_rounds_give_the_update_counts_lr_and_partial_rounds_a_slower_clock():
    plain, wrapped = _cosine(), GlobalBatchSchedule(_cosine(), num_workers=4)
    for r in range(1, 21):
        wrapped.pushes = 4 * r                       # every round held N pushes
        assert wrapped(r) == plain(r)
    wrapped.pushes = 3 * 20                          # 20 rounds of 3 (majority of 4)
    assert wrapped(20) == plain(15) > plain(20) == 0.0


def test_a_wrapped_optimizer_is_described_with_its_clock_for_a_checkpoint():
    opt = mx.optimizer.create("sgd", learning_rate=0.5, momentum=0.9,
                              lr_scheduler=_cosine())
    opt.lr_scheduler = GlobalBatchSchedule(opt.lr_scheduler, 4, pushes=30)
    spec = describe(opt)
    assert spec["lr_scheduler"]["class"] == "CosineScheduler"
    again = build(spec)
    assert isinstance(again.lr_scheduler, GlobalBatchSchedule)
    assert (again.lr_scheduler.pushes, again.lr_scheduler.num_workers) == (30, 4)
    assert again.learning_rate == _cosine()(7.5) == opt.learning_rate


@pytest.mark.parametrize("clock", [{"pushes": -1, "num_workers": 4},
                                   {"pushes": 3, "num_workers": 0},
                                   {"pushes": 3.5, "num_workers": 4},
                                   {"pushes": 3}])
def test_a_bad_clock_in_a_description_is_refused_by_name(clock):
    opt = mx.optimizer.create("sgd", learning_rate=0.5, lr_scheduler=_cosine())
    spec = describe(opt)
    spec["lr_scheduler"].update(clock)
    with pytest.raises(OptimizerSpecError, match="pushes and num_workers"):
        build(spec)


def test_the_simulator_counts_a_quorums_schedule_in_pushes():
    """Solo with one worker 3x slow: far more rounds than steps; the last reply's lr is
    the schedule's at the job's global batches (steps), not at the round count."""
    steps, n = 6, 2
    init = {0: mx.nd.ones((3,))}
    lrs = []

    def make_optimizer():
        return mx.optimizer.create("sgd", learning_rate=0.5, momentum=0.0,
                                   lr_scheduler=_cosine(2 * steps))

    def grad_fn(worker, step, weights):
        return {0: mx.nd.ones((3,)) * (worker + 1)}

    res = simulate_quorum(init, grad_fn, make_optimizer, n, steps, quorum=1,
                          max_staleness=100, delays=[1, 3], algorithm="ssgd")
    assert len(res.rounds) > steps
    # each round applied -(lr at P/N) * sum of its gradients: replay the rule
    expected, pushes, sched = np.ones(3, np.float32), 0, _cosine(2 * steps)
    for ranks in res.rounds:
        pushes += len(ranks)
        lrs.append(sched(pushes / n))
        expected -= np.float32(lrs[-1]) * np.float32(sum(r + 1 for r in ranks))
    np.testing.assert_allclose(res.global_weights[0].asnumpy(), expected, rtol=1e-5)
    assert lrs[-1] == sched(steps) > 0           # counted in rounds it would be 0
