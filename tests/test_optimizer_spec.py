"""Optimizers travel as descriptions and come back as MXNet's own classes."""
import mxnet as mx
import numpy as np
import pytest

from ssdsgd.mxglue.optimizer_spec import (OptimizerSpecError, build, describe, flatten_state,
                                           unflatten_state)


@pytest.mark.parametrize("opt", [
    mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, wd=1e-4, rescale_grad=1 / 32),
    mx.optimizer.NAG(learning_rate=0.05, momentum=0.8, clip_gradient=5.0),
    mx.optimizer.Adam(learning_rate=1e-3, beta1=0.8),
    mx.optimizer.SGD(momentum=0.9, lr_scheduler=mx.lr_scheduler.MultiFactorScheduler(
        [10, 20], 0.1, base_lr=0.4, warmup_steps=5)),
    mx.optimizer.SGD(learning_rate=0.1, lr_scheduler=mx.lr_scheduler.PolyScheduler(100, 0.1, 2)),
    mx.optimizer.SGD(learning_rate=0.1, lr_scheduler=mx.lr_scheduler.CosineScheduler(100, 0.1)),
])
def test_rebuilt_optimizer_updates_identically(opt):
    rebuilt = build(describe(opt))
    assert type(rebuilt) is type(opt)
    for a, b in ((opt, rebuilt),):
        w1, w2 = mx.nd.ones((4, 3)), mx.nd.ones((4, 3))
        g = mx.nd.array(np.linspace(-1, 1, 12).reshape(4, 3))
        u1, u2 = mx.optimizer.get_updater(a), mx.optimizer.get_updater(b)
        for _ in range(30):
            u1(0, g, w1)
            u2(0, g, w2)
        np.testing.assert_array_equal(w1.asnumpy(), w2.asnumpy())


def test_lr_and_wd_multipliers_travel_per_key():
    opt = mx.optimizer.SGD(learning_rate=0.1)
    opt.lr_mult = {3: 0.5}
    opt.wd_mult = {3: 0.0}
    spec = describe(opt)
    rebuilt = build(spec)
    assert rebuilt.lr_mult == {3: 0.5} and rebuilt.wd_mult == {3: 0.0}


def test_multipliers_by_name_reach_the_key_numbers_as_module_gives_them():
    """Module keys lr/wd multipliers by parameter name (and gives biases wd_mult 0); the
    servers key them by number: idx2name resolves them as Optimizer._get_lr does, and a
    number's own multiplier wins over its name's."""
    names = {0: "fc1_weight", 1: "fc1_bias", 2: "bn_gamma", 3: "bn_beta"}
    sym = mx.sym.Variable("fc1_weight", lr_mult=0.5)
    opt = mx.optimizer.SGD(learning_rate=0.1, wd=1e-3, sym=sym, param_idx2name=names)
    opt.lr_mult[2] = 3.0
    spec = describe(opt)
    assert spec["lr_mult"] == {"0": 0.5, "2": 3.0}
    assert spec["wd_mult"] == {"1": 0.0, "3": 0.0}
    rebuilt = build(spec)
    for index in names:
        assert rebuilt._get_lr(index) == opt._get_lr(index)
        assert rebuilt._get_wd(index) == opt._get_wd(index)


def test_custom_optimizer_class_is_named_in_the_error():
    @mx.optimizer.Optimizer.register
    class MyFancyOpt(mx.optimizer.SGD):
        pass
    with pytest.raises(OptimizerSpecError, match="MyFancyOpt"):
        describe(MyFancyOpt())


def test_custom_scheduler_is_named_in_the_error():
    class MySched(mx.lr_scheduler.LRScheduler):
        def __call__(self, n):
            return 0.1
    with pytest.raises(OptimizerSpecError, match="MySched"):
        describe(mx.optimizer.SGD(lr_scheduler=MySched()))


def test_state_flattening_round_trips_structures():
    opt = mx.optimizer.Adam()
    state = opt.create_state(0, mx.nd.zeros(3))
    flat = flatten_state(state)
    assert len(flat) == 2
    back = unflatten_state(state, [mx.nd.ones(3), mx.nd.ones(3) * 2])
    assert isinstance(back, tuple) and back[1].asnumpy()[0] == 2
    assert flatten_state(None) == [] and unflatten_state(None, []) is None
