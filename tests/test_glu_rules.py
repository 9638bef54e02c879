"""ssdsgd.glu.rules: each local rule against a hand formula, and the estimate's convention."""
import math

import mxnet as mx
import numpy as np
import pytest

from ssdsgd.glu.host_sgd import HOST_MAX, HostSGD
from ssdsgd.glu.rules import (BLOCK, corrected_into, correction_gain, flatten_state,
                              make_local_rule, period_model, velocity_into)

N, RESCALE, KEY = 4, 1 / 8, 3
W0 = np.array([0.5, -1.0, 2.0], dtype=np.float32)
M0 = np.array([0.1, -0.2, 0.3], dtype=np.float32)
G = np.array([1.0, 2.0, -4.0], dtype=np.float32)


def nd(a):
    return mx.nd.array(a, dtype='float32')


def sgd(**kw):
    def make():
        opt = mx.optimizer.SGD(rescale_grad=RESCALE, **kw)
        opt.lr_mult = {KEY: 0.5}
        return opt
    return make


def one_step(rule, state=None, lr=0.2, num_update=7):
    w = nd(W0)
    rule.reset(KEY, w.copy(), prev_global_weight=w.copy(), steps_between=1,
               state=None if state is None else [nd(s) for s in state], lr=lr,
               num_update=num_update)
    rule.update(KEY, w, nd(G))
    return w.asnumpy()


def test_glu_exact_sgd_momentum_matches_hand_formula():
    rule = make_local_rule('glu', sgd(momentum=0.9, wd=0.01), N, 'exact')
    assert rule.needs_state
    lr = 0.2 * 0.5  # the server's reported lr times the key's lr_mult
    mom = 0.9 * M0 - lr * (N * RESCALE * G + 0.01 * W0)
    np.testing.assert_allclose(one_step(rule, [M0]), W0 + mom, rtol=1e-6)
    np.testing.assert_allclose(rule.updater.states[KEY].asnumpy(), mom, rtol=1e-6)


def test_glu_exact_nag_matches_hand_formula():
    # MXNet 1.9.1's nag_mom_update keeps mom in weight units, like sgd:
    # mom <- mu*mom - lr*g;  w <- w + mu*mom - lr*g   (g already rescaled; wd = 0 here).
    rule = make_local_rule('glu', lambda: mx.optimizer.NAG(
        momentum=0.9, learning_rate=0.3, rescale_grad=RESCALE), N, 'exact')
    g = N * RESCALE * G
    mom = 0.9 * M0 - 0.2 * g
    np.testing.assert_allclose(one_step(rule, [M0]), W0 + 0.9 * mom - 0.2 * g, rtol=1e-6)


def test_glu_exact_adam_continues_the_server_update_count():
    b1, b2, eps, wd, n = 0.9, 0.999, 1e-8, 0.01, 7
    rule = make_local_rule('glu', lambda: mx.optimizer.Adam(
        learning_rate=0.1, wd=wd, rescale_grad=RESCALE), N, 'exact')
    mean0, var0 = M0, np.abs(M0) * 0.5
    w = one_step(rule, [mean0, var0], lr=0.05, num_update=n)
    g = N * RESCALE * G + wd * W0
    mean = b1 * mean0 + (1 - b1) * g
    var = b2 * var0 + (1 - b2) * g * g
    t = n + 1  # the server applied n updates; this is the (n+1)-th
    lr_t = 0.05 * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    np.testing.assert_allclose(w, W0 - lr_t * mean / (np.sqrt(var) + eps), rtol=1e-5)


def test_sgd_rule_is_stateless_sgd_with_the_server_hyperparameters():
    def make():
        opt = mx.optimizer.Adam(learning_rate=0.1, wd=0.01, clip_gradient=0.6,
                                rescale_grad=RESCALE)
        opt.lr_mult, opt.wd_mult = {KEY: 0.5}, {KEY: 2.0}
        return opt
    rule = make_local_rule('sgd', make, N)
    assert not rule.needs_state
    g = np.clip(N * RESCALE * G, -0.6, 0.6)
    np.testing.assert_allclose(one_step(rule), W0 - 0.2 * 0.5 * (g + 0.02 * W0), rtol=1e-6)


def test_none_rule_leaves_weights_untouched():
    rule = make_local_rule('none', sgd(momentum=0.9), N)
    assert not rule.needs_state
    np.testing.assert_array_equal(one_step(rule), W0)


@pytest.mark.parametrize('name', ['glu', 'sgd'])
def test_lr_local_overrides_the_reported_lr(name):
    rule = make_local_rule(name, sgd(momentum=0.9), N, 'exact', lr_local=0.01)
    state = [M0] if name == 'glu' else None
    w = one_step(rule, state, lr=0.2)
    mom = (0.9 * M0 if name == 'glu' else 0) - 0.01 * 0.5 * N * RESCALE * G
    np.testing.assert_allclose(w, W0 + mom, rtol=1e-6)


def test_local_lr_is_held_constant_until_the_next_reset():
    # The server's scheduler would halve lr every update; the local copy must not.
    def make():
        return mx.optimizer.SGD(momentum=0.0, rescale_grad=RESCALE, learning_rate=0.2,
                                lr_scheduler=mx.lr_scheduler.FactorScheduler(1, 0.5, 0.2))
    rule = make_local_rule('glu', make, N, 'exact')
    w = nd(W0)
    rule.reset(KEY, w.copy(), state=[], lr=0.2, num_update=5)
    for _ in range(3):
        rule.update(KEY, w, nd(G))
    np.testing.assert_allclose(w.asnumpy(), W0 - 3 * 0.2 * N * RESCALE * G, rtol=1e-6)


@pytest.mark.parametrize('cls', [mx.optimizer.SGD, mx.optimizer.NAG])
def test_estimate_reproduces_the_true_state_in_a_steady_state(cls):
    """Constant gradient: after the momentum settles, the velocity over a period is the
    server's own state, so the conversion (state = velocity, for sgd and nag) is right."""
    def make():
        opt = cls(momentum=0.9, learning_rate=0.1, rescale_grad=RESCALE)
        opt.lr_mult = {KEY: 0.5}
        return opt
    server = mx.optimizer.get_updater(make())
    w, g, k = nd(W0), nd(G), 5
    history = []
    for _ in range(200):
        server(KEY, g, w)
        history.append(w.copy())
    rule = make_local_rule('glu', make, N, 'estimate')
    assert not rule.needs_state
    rule.reset(KEY, history[-1], prev_global_weight=history[-1 - k], steps_between=k,
               lr=0.1, num_update=200)
    true = server.states[KEY].asnumpy()
    np.testing.assert_allclose(rule.updater.states[KEY].asnumpy(), true, rtol=1e-3)


def test_estimate_over_one_step_is_exact_for_sgd_momentum():
    """sgd applies w += mom, so one step of global velocity is the state, even mid-flight."""
    make = sgd(momentum=0.9, wd=0.01)
    server = mx.optimizer.get_updater(make())
    w = nd(W0)
    for step in range(4):
        prev = w.copy()
        server(KEY, nd(G * (step + 1)), w)
    rule = make_local_rule('glu', make, N)
    rule.reset(KEY, w, prev_global_weight=prev, steps_between=1, lr=0.1)
    np.testing.assert_allclose(rule.updater.states[KEY].asnumpy(),
                               server.states[KEY].asnumpy(), rtol=1e-5)


def test_bad_names_are_rejected_with_the_allowed_values():
    with pytest.raises(ValueError, match='glu, sgd, none'):
        make_local_rule('momentum', sgd(momentum=0.9), N)
    with pytest.raises(ValueError, match='estimate, exact'):
        make_local_rule('glu', sgd(momentum=0.9), N, glu_state='guess')


@pytest.mark.parametrize('make', [
    lambda: mx.optimizer.Adam(),
    lambda: mx.optimizer.SGD(momentum=0.0),
    lambda: mx.optimizer.NAG(momentum=0.0),
])
@pytest.mark.parametrize('state', ['estimate', 'corrected'])
def test_estimate_needs_a_momentum_optimizer(make, state):
    with pytest.raises(ValueError, match='glu_state: exact'):
        make_local_rule('glu', make, N, state)
    assert make_local_rule('glu', make, N, 'exact').needs_state


def test_reset_rejects_missing_inputs():
    with pytest.raises(ValueError, match='state arrays'):
        make_local_rule('glu', sgd(momentum=0.9), N, 'exact').reset(KEY, nd(W0), state=[])
    with pytest.raises(ValueError, match='prev_global_weight'):
        make_local_rule('glu', sgd(momentum=0.9), N).reset(KEY, nd(W0))


def test_flatten_state():
    a, b = nd(W0), nd(M0)
    assert flatten_state(None) == []
    assert flatten_state(a) == [a]
    assert flatten_state((a, b)) == [a, b]
    assert flatten_state((None, a)) == [a]


# ---- the estimates that cost no bytes: period model, corrected ---------------------------

@pytest.mark.parametrize('cls', [mx.optimizer.SGD, mx.optimizer.NAG])
@pytest.mark.parametrize('k', [1, 3, 7])
def test_period_model_matches_the_optimizer_kernel(cls, k):
    """Momentum and displacement after k steps of MXNet's own kernel are the model's
    linear combination of m0 and the per-step forces f_j = -lr * rescale * g_j (wd = 0)."""
    lr, mu = 0.1, 0.9
    opt = cls(momentum=mu, learning_rate=lr, rescale_grad=RESCALE)
    updater = mx.optimizer.get_updater(opt)
    w = nd(W0)
    updater(KEY, nd(np.zeros(3)), w)          # creates the state
    updater.states[KEY][:] = nd(M0)
    w[:] = nd(W0)
    rs = np.random.RandomState(k)
    grads = rs.randn(k, 3).astype(np.float32)
    for g in grads:
        updater(KEY, nd(g), w)
    a, c, A, B = period_model(mu, k, nesterov=cls is mx.optimizer.NAG)
    forces = -lr * RESCALE * grads
    np.testing.assert_allclose(updater.states[KEY].asnumpy(), c * M0 + A @ forces,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(w.asnumpy() - W0, a * M0 + B @ forces, rtol=1e-5, atol=1e-6)


def test_period_model_rejects_bad_arguments():
    with pytest.raises(ValueError, match='steps >= 1'):
        period_model(0.9, 0)
    with pytest.raises(ValueError, match='momentum'):
        period_model(1.0, 3)


def _corrected_period(cls, k, num_workers, wd=0.0, seed=0, offset=0.0):
    """One server and num_workers 'corrected' rules over two pull periods of k steps, each
    worker with its own gradients; every worker starts from the server's true momentum
    (plus `offset`). Returns the server's momentum and each worker's seed at the end of
    each period."""
    def make():
        return cls(momentum=0.9, learning_rate=0.1, wd=wd, rescale_grad=RESCALE)
    server, w_g = mx.optimizer.get_updater(make()), nd(W0)
    server(KEY, nd(np.zeros(3)), w_g)
    server.states[KEY][:] = nd(M0)
    w_g[:] = nd(W0)
    rules = [make_local_rule('glu', make, num_workers, 'corrected') for _ in range(num_workers)]
    for rule in rules:   # first reset: one step of "velocity" equal to the true momentum
        rule.reset(KEY, w_g.copy(), prev_global_weight=w_g - nd(M0 + offset), steps_between=1,
                   lr=0.1)
    local = [w_g.copy() for _ in rules]
    rs = np.random.RandomState(seed)
    out = []
    for _period in range(2):
        for _ in range(k):
            grads = [nd(rs.randn(3)) for _ in rules]
            total = grads[0].copy()
            for g in grads[1:]:
                total += g
            server(KEY, total, w_g)
            for rule, w, g in zip(rules, local, grads):
                rule.update(KEY, w, g)
        for rule, w in zip(rules, local):
            rule.reset(KEY, w_g.copy(), prev_global_weight=w_g, steps_between=k, lr=0.1,
                       local_weight=w.copy())
            w[:] = w_g
        out.append((server.states[KEY].asnumpy(),
                    [rule.updater.states[KEY].asnumpy() for rule in rules]))
    return out


@pytest.mark.parametrize('cls', [mx.optimizer.SGD, mx.optimizer.NAG])
@pytest.mark.parametrize('k', [1, 4])
def test_corrected_seeds_average_to_the_server_momentum(cls, k):
    """The server's force is the sum of the workers' gradients, each local copy's is N
    times its own: the workers' momenta average to the server's, and their displacements
    to its displacement, so the correction sums to zero and the mean seed is the server's
    momentum, period after period (wd = 0). At k = 1 every seed is exact."""
    for true, seeds in _corrected_period(cls, k, num_workers=3):
        np.testing.assert_allclose(np.mean(seeds, axis=0), true, rtol=1e-4, atol=1e-6)
        if k == 1:
            for seed in seeds:
                np.testing.assert_allclose(seed, true, rtol=1e-4, atol=1e-6)
        else:   # ... while each worker's own seed differs (its own gradients' noise)
            assert not np.allclose(seeds[0], true, rtol=1e-2)


def test_corrected_heals_a_wrong_common_seed():
    """A seed that is wrong for every worker alike (a resumed job seeds zero) shrinks by
    c - beta*a per period (|.| < 1 for every k: -0.20, -0.33, -0.33, -0.27 at k = 2, 5,
    10, 20 with sgd momentum 0.9; 0 at k = 1)."""
    k, offset = 5, np.array([0.05, -0.1, 0.2], dtype=np.float32)
    a, c, _, _ = period_model(0.9, k)
    factor = c - correction_gain(0.9, k) * a
    assert -0.35 < factor < -0.3
    for p, (true, seeds) in enumerate(_corrected_period(mx.optimizer.SGD, k, 3,
                                                         offset=offset), 1):
        np.testing.assert_allclose(np.mean(seeds, axis=0) - true, factor ** p * offset,
                                   rtol=1e-3, atol=1e-6)


def test_corrected_needs_the_local_weights_after_its_first_reset():
    rule = make_local_rule('glu', sgd(momentum=0.9), N, 'corrected')
    assert not rule.needs_state and rule.needs_local_weight
    assert not make_local_rule('glu', sgd(momentum=0.9), N, 'estimate').needs_local_weight
    w = nd(W0)
    rule.reset(KEY, w.copy(), prev_global_weight=w.copy(), steps_between=1, lr=0.1)
    rule.update(KEY, w, nd(G))
    with pytest.raises(ValueError, match='local_weight'):
        rule.reset(KEY, nd(W0), prev_global_weight=nd(W0), steps_between=3, lr=0.1)


@pytest.mark.parametrize('size', [5, BLOCK, 2 * BLOCK + 7])
def test_the_in_place_seeds_equal_the_formulas_on_mxnet_bit_for_bit(size):
    """The worker and the simulator seed in place on numpy, block by block; the numbers
    are MXNet's whole-array float32 operations' (the earlier implementation's), so a
    seed does not change with the block size or the library that computes it."""
    rng = np.random.default_rng(size)
    g, p, w, m = (rng.standard_normal(size).astype(np.float32) for _ in range(4))
    gain, k = correction_gain(0.9, 5), 5
    out = np.full(size, np.nan, np.float32)
    velocity_into(out, g, p, k)
    np.testing.assert_array_equal(out, ((nd(g) - nd(p)) / k).asnumpy())
    seed, local = m.copy(), w.copy()
    corrected_into(seed, g, local, gain)
    np.testing.assert_array_equal(seed, (nd(m) + gain * (nd(g) - nd(w))).asnumpy())
    np.testing.assert_array_equal(local, w)       # w_i is read, not written


@pytest.mark.parametrize("name,make,state", [
    ('glu', sgd(momentum=0.9, wd=1e-4), 'exact'),
    ('glu', sgd(momentum=0.9, wd=1e-4, clip_gradient=0.05), 'corrected'),
    ('glu', lambda: mx.optimizer.NAG(momentum=0.9, rescale_grad=RESCALE), 'exact'),
    ('glu', lambda: mx.optimizer.Adam(rescale_grad=RESCALE), 'exact'),
    ('sgd', sgd(momentum=0.9), 'exact'),
])
def test_update_many_equals_one_update_per_key_bit_for_bit(name, make, state):
    """The worker updates all keys of a step with one call (multi-tensor kernels); the
    simulator updates key by key. They must give the same bits, keys with different lrs
    (two resets) and lr_mults included."""
    rng = np.random.default_rng(0)
    shapes = [(16, 3, 3, 3), (16,), (KEY + 60,), (64, 64), (10,)] * 12   # 60 keys
    init = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(3)]
    results = []
    for many in (False, True):
        rule = make_local_rule(name, make, N, state)
        ws = [nd(w) for w in init]
        for key, w in enumerate(ws):
            st = [nd(np.full(w.shape, 0.01, np.float32)) for _ in
                  flatten_state(make().create_state_multi_precision(key, w))]
            rule.reset(key, w.copy(), prev_global_weight=w.copy(), steps_between=1,
                       state=st, lr=0.1 if key % 3 else 0.05, num_update=2)
        for step_grads in grads:
            gs = [nd(g) for g in step_grads]
            if many:
                rule.update_many(list(range(len(ws))), ws, gs)
            else:
                for key, (w, g) in enumerate(zip(ws, gs)):
                    rule.update(key, w, g)
        results.append([w.asnumpy() for w in ws])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("clip", [None, 0.7, -1.0])
def test_host_sgd_is_mxnets_kernel_bit_for_bit(clip):
    """The local rule's numpy SGD (host_sgd) against MXNet's Updater, over hyperparameters
    whose products round (no power-of-two scales), wd 0 included, keys up to HOST_MAX
    elements and weights, gradients and momenta with exact zeros: the same bits, sign of
    zero included. A negative clip_gradient means no clipping, as in MXNet's kernel."""
    rng = np.random.default_rng(1)
    sizes = [1, 7, 300, 4096, HOST_MAX]
    for trial in range(5):
        hyper = dict(learning_rate=float(10 ** rng.uniform(-4, 0)),
                     wd=0.0 if trial == 0 else float(10 ** rng.uniform(-6, -2)),
                     momentum=float(rng.uniform(0.5, 0.99)),
                     rescale_grad=float(1 / rng.integers(3, 1000)))
        if clip is not None:
            hyper["clip_gradient"] = clip
        init = [rng.standard_normal(n).astype(np.float32) * 10 ** rng.uniform(-3, 1)
                for n in sizes]
        for w in init:
            w[::5] = 0.0
        grads = [[(rng.standard_normal(n) * 10 ** rng.uniform(-3, 3)).astype(np.float32)
                  for n in sizes] for _ in range(3)]
        for step in grads:
            step[0][:] = 0.0
        results = []
        for host in (False, True):
            opt = mx.optimizer.SGD(**hyper)
            updater = mx.optimizer.get_updater(opt)
            ws = [nd(w) for w in init]
            for key, w in enumerate(ws):
                updater.states[key] = opt.create_state_multi_precision(key, w)
                updater.states_synced[key] = True
            rule = HostSGD()
            keys = list(range(len(ws)))
            for step in grads:
                gs = [nd(g) for g in step]
                if host:
                    assert all(rule.take(updater, k, w, g) for k, w, g in zip(keys, ws, gs))
                    rule.update(opt, updater, keys, ws, gs)
                else:
                    for k, w, g in zip(keys, ws, gs):
                        updater(k, g, w)
            results.append([a.asnumpy().view(np.int32) for key in keys
                            for a in (ws[key], updater.states[key])])
        for mx_bits, host_bits in zip(*results):
            np.testing.assert_array_equal(host_bits, mx_bits, err_msg=str(hyper))


def test_host_sgd_leaves_big_keys_and_other_optimizers_to_mxnet():
    opt = mx.optimizer.SGD(momentum=0.9)
    updater = mx.optimizer.get_updater(opt)
    big, small = mx.nd.zeros(HOST_MAX + 1), mx.nd.zeros(10)
    for key, w in enumerate((big, small)):
        updater.states[key] = opt.create_state_multi_precision(key, w)
        updater.states_synced[key] = True
    rule = HostSGD()
    assert not rule.take(updater, 0, big, mx.nd.zeros(HOST_MAX + 1))
    assert rule.take(updater, 1, small, mx.nd.zeros(10))
    assert not rule.take(updater, 2, small, mx.nd.zeros(10))          # no state yet
    assert not rule.take(updater, 1, small.astype("float16"), mx.nd.zeros(10))
    assert HostSGD.applies(opt)
    assert not HostSGD.applies(mx.optimizer.SGD(momentum=0.0))        # another kernel
    assert not HostSGD.applies(mx.optimizer.NAG(momentum=0.9))
    assert not HostSGD.applies(mx.optimizer.SGD(momentum=0.9, multi_precision=True))
