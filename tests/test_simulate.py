"""ssdsgd.glu.simulate: the oracle against what the spec says it must reduce to."""
import mxnet as mx
import numpy as np
import pytest

from ssdsgd.glu.simulate import simulate

SHAPES = {0: (3,), 1: (2, 2)}
LR, MU, WD, RESCALE = 0.05, 0.9, 1e-3, 1 / 4


def init_weights():
    rs = np.random.RandomState(0)
    return {k: mx.nd.array(rs.randn(*s)) for k, s in SHAPES.items()}


def grad_fn(worker, step, weights):
    """Raw gradient of a per-(worker, step) quadratic: a * w - b, depends on the weights."""
    rs = np.random.RandomState(1000 * worker + step)
    return {k: mx.nd.array(rs.uniform(0.5, 1.5, w.shape)) * w - mx.nd.array(rs.randn(*w.shape))
            for k, w in weights.items()}


def same_grad_fn(worker, step, weights):
    """Every worker computes the same gradient (at the same weights)."""
    return grad_fn(0, step, weights)


def make_sgd():
    return mx.optimizer.SGD(learning_rate=LR, momentum=MU, wd=WD, rescale_grad=RESCALE)


def make_adam():
    return mx.optimizer.Adam(learning_rate=0.01, wd=WD, rescale_grad=RESCALE)


def run(steps, num_workers=3, fn=grad_fn, make=make_sgd, **kw):
    return simulate(init_weights(), fn, make, num_workers, steps, **kw)


def as_np(a):
    return a.asnumpy() if isinstance(a, mx.nd.NDArray) else a


def assert_close(a, b, rtol=1e-5, atol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(as_np(a[k]), as_np(b[k]), rtol=rtol, atol=atol)


def plain_momentum_sgd(steps, num_workers, delay=0):
    """Independent numpy loop: w(t) = w(t-1) + mom(t), mom(t) = mu*mom - lr*(r*sum_i g_i + wd*w),
    with the gradients taken at w(t - 1 - delay) (w(t) := w(-1) for t < 0)."""
    w = {k: v.asnumpy().astype(np.float64) for k, v in init_weights().items()}
    mom = {k: np.zeros_like(v) for k, v in w.items()}
    history = [w]
    for t in range(steps):
        at = history[max(0, len(history) - 1 - delay)]
        grads = [grad_fn(i, t, {k: mx.nd.array(v) for k, v in at.items()})
                 for i in range(num_workers)]
        new = {}
        for k in w:
            total = sum(g[k].asnumpy().astype(np.float64) for g in grads)
            mom[k] = MU * mom[k] - LR * (RESCALE * total + WD * history[-1][k])
            new[k] = history[-1][k] + mom[k]
        history.append(new)
    return history[-1]


@pytest.mark.parametrize('kw', [dict(warmup_steps=12, delay_steps=3),
                                dict(warmup_steps=50, delay_steps=1),
                                dict(algorithm='ssgd', delay_steps=4)])
def test_all_warmup_or_ssgd_is_plain_synchronous_sgd(kw):
    res = run(12, **kw)
    expected = plain_momentum_sgd(12, 3)
    assert_close(expected, res.global_weights)
    for w in res.worker_weights:
        assert_close(expected, w)


def test_k1_rule_none_is_one_step_stale():
    """k = 1, d = 0: the worker resets to w_G(t-1) every step and computes g(t) there.
    So after step t the worker holds w_G(t-1), and w_G(t) = Opt(w_G(t-1), sum g at w_G(t-2))."""
    steps = 9
    res = run(steps, delay_steps=1, local_rule='none')
    shorter = run(steps - 1, delay_steps=1, local_rule='none')
    for w in res.worker_weights:
        assert_close(shorter.global_weights, w, rtol=0, atol=0)
    assert_close(plain_momentum_sgd(steps, 3, delay=1), res.global_weights)


@pytest.mark.parametrize('steps', [3, 5, 6, 8, 10])
def test_rule_none_follows_the_pull_schedule(steps):
    """Resets happen at t = T_w + j*k (the pull requested at t - 1 with (t-1-T_w) mod k ==
    k-1, and the warm-up's last pull at T_w), each to w_G(t - 1). With d = 0 the worker
    after the last step t holds w_G(r - 1), r the last reset step <= t."""
    T_w, k = 2, 3
    res = run(steps, warmup_steps=T_w, delay_steps=k, local_rule='none')
    r = T_w + (steps - 1 - T_w) // k * k
    reference = run(r, warmup_steps=T_w, delay_steps=k, local_rule='none')  # w_G(r - 1)
    for w in res.worker_weights:
        assert_close(reference.global_weights, w, rtol=0, atol=0)


def test_runs_are_deterministic():
    a = run(10, warmup_steps=2, delay_steps=3)
    b = run(10, warmup_steps=2, delay_steps=3)
    assert_close(a.global_weights, b.global_weights, rtol=0, atol=0)
    for wa, wb in zip(a.worker_weights, b.worker_weights):
        assert_close(wa, wb, rtol=0, atol=0)


@pytest.mark.parametrize('make,state,T_w,k', [
    (make_sgd, 'exact', 0, 3), (make_sgd, 'exact', 2, 4),
    (make_adam, 'exact', 0, 3), (make_adam, 'exact', 3, 4),
    (make_sgd, 'estimate', 2, 1),
    (make_sgd, 'corrected', 0, 3), (make_sgd, 'corrected', 2, 4)])
def test_glu_with_identical_workers_tracks_the_global_model(make, state, T_w, k):
    """If all N workers compute the same gradient and the local state equals the server's,
    the local copy (Opt on N*g) repeats the server's update (Opt on g + ... + g), so every
    worker holds w_G(t) after every step and the run is SSGD. That holds with exact state
    for any k (Adam too: its update count is re-seeded), with the estimate for sgd at
    k = 1, where one step of velocity is exactly the momentum, and with 'corrected' for
    sgd at any k: its first seed is exact and its own momentum then stays the server's."""
    steps = 10
    res = run(steps, 2, same_grad_fn, make, warmup_steps=T_w, delay_steps=k, glu_state=state)
    sync = run(steps, 2, same_grad_fn, make, algorithm='ssgd')
    assert_close(sync.global_weights, res.global_weights)
    for w in res.worker_weights:
        assert_close(res.global_weights, w)


@pytest.mark.parametrize('T_w', [0, 1, 3])
def test_estimate_is_exact_at_the_first_steps_delay_step(T_w):
    """At t = T_w the estimate uses w_G(T_w-1) - w_G(T_w-2) (w_G(t<0) := initial), which for
    sgd is the server's momentum, so with identical workers the first period is SSGD."""
    k = 4
    res = run(T_w + k, 2, same_grad_fn, warmup_steps=T_w, delay_steps=k)
    sync = run(T_w + k, 2, same_grad_fn, algorithm='ssgd')
    assert_close(sync.global_weights, res.global_weights)
    longer = run(T_w + k + 3, 2, same_grad_fn, warmup_steps=T_w, delay_steps=k)
    sync = run(T_w + k + 3, 2, same_grad_fn, algorithm='ssgd')
    with pytest.raises(AssertionError):  # ... and only the first: later it is an estimate
        assert_close(sync.global_weights, longer.global_weights)


@pytest.mark.parametrize('state', ['estimate', 'exact'])
def test_glu_runs_with_sgd_momentum_and_moves_the_workers(state):
    res = run(10, delay_steps=3, glu_state=state)
    none = run(10, delay_steps=3, local_rule='none')
    for w, w_none in zip(res.worker_weights, none.worker_weights):
        assert all(np.isfinite(a.asnumpy()).all() for a in w.values())
        assert not np.allclose(w[0].asnumpy(), w_none[0].asnumpy())


def test_adam_needs_exact_state():
    with pytest.raises(ValueError, match='glu_state: exact'):
        run(3, make=make_adam, delay_steps=2, glu_state='estimate')
    res = run(3, make=make_adam, delay_steps=2, glu_state='exact')
    assert all(np.isfinite(w.asnumpy()).all() for w in res.global_weights.values())


def test_bad_arguments():
    with pytest.raises(ValueError, match='ssd or ssgd'):
        run(2, algorithm='asgd')
    with pytest.raises(ValueError, match='delay_steps'):
        run(2, delay_steps=0)


def hand_corrected_ssd(steps, num_workers, T_w, k):
    """Independent numpy loop of the spec with glu_state 'corrected' for sgd momentum:
    at a reset to the pull of step p, a worker seeds its momentum with its own momentum
    plus beta * (w_G(p) - w_i), beta = sum_j A_j B_j / sum_j B_j^2, A_j = mu^(k-j),
    B_j = sum_{s=j..k} mu^(s-j); the first reset seeds w_G(T_w-1) - w_G(T_w-2)."""
    A = np.array([MU ** (k - j) for j in range(1, k + 1)])
    B = np.array([sum(MU ** (s - j) for s in range(j, k + 1)) for j in range(1, k + 1)])
    beta = (A @ B) / (B @ B)
    f64 = lambda ws: {key: v.asnumpy().astype(np.float64) for key, v in ws.items()}  # noqa
    w_g, mom = f64(init_weights()), {key: 0.0 for key in SHAPES}
    history = [w_g]                    # w_G(-1), w_G(0), ...
    local = [dict(w_g) for _ in range(num_workers)]
    local_mom = [None] * num_workers
    reset_to = None                    # (step, weights) of the pending pull
    for t in range(steps):
        grads = [f64(grad_fn(i, t, {key: mx.nd.array(v) for key, v in local[i].items()}))
                 for i in range(num_workers)]
        new = {}
        for key in w_g:
            total = sum(g[key] for g in grads)
            mom[key] = MU * mom[key] - LR * (RESCALE * total + WD * history[-1][key])
            new[key] = history[-1][key] + mom[key]
        history.append(new)
        if t < T_w:
            local = [dict(new) for _ in range(num_workers)]
            continue
        if t == T_w:
            reset_to = (T_w - 1, history[-2])
        for i in range(num_workers):
            if reset_to is not None:
                w_p = reset_to[1]
                if local_mom[i] is None:
                    local_mom[i] = {key: w_p[key] - history[-3][key] for key in w_p}
                else:
                    local_mom[i] = {key: local_mom[i][key] + beta * (w_p[key] - local[i][key])
                                    for key in w_p}
                local[i] = dict(w_p)
            for key in local[i]:
                local_mom[i][key] = MU * local_mom[i][key] - LR * (
                    num_workers * RESCALE * grads[i][key] + WD * local[i][key])
                local[i][key] = local[i][key] + local_mom[i][key]
        reset_to = (t, new) if (t - T_w) % k == k - 1 else None
    return history[-1], local


@pytest.mark.parametrize('T_w,k', [(2, 3), (1, 2)])
def test_corrected_state_matches_a_hand_loop(T_w, k):
    """Different gradients per worker: the simulator's 'corrected' run (the rule's seed and
    the local weights the simulator hands it) equals an independent numpy loop."""
    steps = T_w + 3 * k + 1
    res = run(steps, warmup_steps=T_w, delay_steps=k, glu_state='corrected')
    w_g, local = hand_corrected_ssd(steps, 3, T_w, k)
    assert_close(w_g, res.global_weights, rtol=1e-4, atol=1e-5)
    for expected, w in zip(local, res.worker_weights):
        assert_close(expected, w, rtol=1e-4, atol=1e-5)
    estimate = run(steps, warmup_steps=T_w, delay_steps=k, glu_state='estimate')
    with pytest.raises(AssertionError):   # the test can tell the estimates apart
        assert_close(w_g, estimate.global_weights, rtol=1e-4, atol=1e-5)


# --- compression (docs/spec/compression.md) --------------------------------------------

TWO_BIT = {'type': '2bit', 'threshold': 0.4}


def two_bit_momentum_sgd(steps, num_workers, threshold):
    """Independent loop: synchronous momentum SGD whose pushes go through MXNet's own 2bit
    quantizer (one residual per worker and key), decoded and summed in rank order."""
    from ssdsgd.kvstore.compression import Compression
    from ssdsgd.testing.mxnet_compression import MXNet2Bit
    spec = Compression.from_params({'type': '2bit', 'threshold': threshold})
    quantizer, server = MXNet2Bit(spec.threshold), MXNet2Bit(spec.server_threshold)
    w = {k: v.asnumpy() for k, v in init_weights().items()}
    mom = {k: np.zeros_like(v) for k, v in w.items()}
    residual = [{k: np.zeros(v.size, np.float32) for k, v in w.items()}
                for _ in range(num_workers)]
    for t in range(steps):
        at = {k: mx.nd.array(v) for k, v in w.items()}
        grads = [grad_fn(i, t, at) for i in range(num_workers)]
        for k in w:
            total = None
            for i in range(num_workers):
                packed, residual[i][k] = quantizer.quantize(grads[i][k].asnumpy(), residual[i][k])
                value = server.dequantize(packed, w[k].size).reshape(w[k].shape)
                total = value if total is None else total + value
            mom[k] = MU * mom[k] - LR * (RESCALE * total + WD * w[k])
            w[k] = w[k] + mom[k]
    return w


@pytest.mark.skipif(not __import__('ssdsgd.testing.mxnet_compression', fromlist=['x'])
                    .available(), reason='libmxnet does not export GradientCompression')
@pytest.mark.parametrize('kw', [dict(algorithm='ssgd'), dict(warmup_steps=20, delay_steps=2)])
def test_ssgd_with_2bit_is_sgd_on_mxnets_quantized_pushes(kw):
    res = run(10, compression=TWO_BIT, **kw)
    expected = two_bit_momentum_sgd(10, 3, TWO_BIT['threshold'])
    assert_close(expected, res.global_weights)
    plain = run(10, **kw)
    with pytest.raises(AssertionError):     # and compression did change the result
        assert_close(plain.global_weights, res.global_weights)


def test_local_rule_uses_the_uncompressed_gradient():
    """k = 1, rule sgd: after step t a worker holds w_G(t-1) - lr*(N*r*g_i(t) + wd*w_G(t-1)),
    g_i(t) taken at its weights after step t-1 -- its own gradient, not the pushed one."""
    steps, n = 8, 3
    kw = dict(delay_steps=1, local_rule='sgd', compression=TWO_BIT)
    full, before = run(steps, n, **kw), run(steps - 1, n, **kw)
    w_g = before.global_weights
    for i in range(n):
        g = grad_fn(i, steps - 1, before.worker_weights[i])
        expected = {k: w_g[k] - LR * (n * RESCALE * g[k] + WD * w_g[k]) for k in w_g}
        assert_close(expected, full.worker_weights[i])
        # which discriminates: a pushed 2bit value is one of -t, 0, +t per element
        t = np.float32(TWO_BIT['threshold'])
        assert not np.isin(g[0].asnumpy(), [-t, 0, t]).any()


def test_push_bytes_count_the_compressed_size():
    plain = run(4, algorithm='ssgd')
    packed = run(4, algorithm='ssgd', compression=TWO_BIT)
    # 3 + 4 float32 elements per worker and step; 2bit sends one 4-byte word per key
    assert plain.push_bytes == 4 * 3 * (3 + 4) * 4
    assert packed.push_bytes == 4 * 3 * 2 * 4


def test_bad_compression_params_are_refused():
    with pytest.raises(ValueError, match='one of 2bit'):
        run(2, compression={'type': '3bit'})
