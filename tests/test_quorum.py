"""Quorum rounds (docs/spec/quorum.md): real jobs with injected stragglers end with the
weights of the simulator fed the same arrival order, and no push is lost."""

import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

import tiny
from conftest import load_npz
from jobs import launch
from ssdsgd.glu.simulate_quorum import simulate_quorum
from ssdsgd.settings import quorum_size
from ssdsgd.slowdown import Slowdown

STEPS, BATCH, WARMUP, K = 8, 8, 2, 2
SLOW = 0.8        # seconds per step of the straggler: far more than a fast worker's step


def _trainer_keys(net):
    """Trainer key i -> position of that parameter in tiny.params (the files' p{j})."""
    trainer = gluon.Trainer(net.collect_params(), "sgd", kvstore=None)
    order = tiny.params(net)
    return {i: order.index(p) for i, p in enumerate(trainer._params)}


def _reference(n, quorum, staleness, delays, algorithm, cosine=0):
    net = tiny.make_net()
    keys = _trainer_keys(net)
    params = tiny.params(net)
    init = {i: params[j].data().copy() for i, j in keys.items()}

    def grad_fn(worker, step, weights):
        for i, j in keys.items():
            params[j].set_data(weights[i])
        tiny.forward_backward(net, *tiny.batch(worker, step, BATCH))
        return {i: params[j].grad().copy() for i, j in keys.items()}

    def make_optimizer():
        sched = mx.lr_scheduler.CosineScheduler(max_update=cosine, base_lr=0.1,
                                                final_lr=0.0) if cosine else None
        return mx.optimizer.create("sgd", learning_rate=0.1, momentum=0.9,
                                   rescale_grad=1.0 / BATCH, lr_scheduler=sched)

    return keys, simulate_quorum(init, grad_fn, make_optimizer, n, STEPS,
                                 quorum=quorum_size(quorum, n), max_staleness=staleness,
                                 delays=delays, algorithm=algorithm, warmup_steps=WARMUP,
                                 delay_steps=K, glu_state="exact")


def _delays(slowdown, n):
    """Each rank's seconds per step under debug.slowdown (delay form: the same each step)."""
    return [Slowdown(slowdown, r, n).seconds(0) for r in range(n)]


def _run(tmp_path, n, s, quorum, staleness, slowdown, algorithm, cosine=0):
    res = launch(n, s, ["--out", tmp_path, "--steps", STEPS, "--cosine", cosine],
                 env={"SSDSGD_SLOWDOWN": slowdown, "SSDSGD_ALGORITHM": algorithm, "SSDSGD_WARMUP_STEPS": WARMUP,
                      "SSDSGD_DELAY_STEPS": K, "SSDSGD_QUORUM": quorum,
                      # both sides the same local rule state: the default, exact (the simulator says estimate unless told)
                      "SSDSGD_GLU_STATE": "exact",
                      "SSDSGD_MAX_STALENESS": staleness,
                      "SSDSGD_BIGARRAY_BOUND": 100},    # the 16x12 weight spans both servers
                 script="quorum_worker.py", timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return ([load_npz(tmp_path / f"local-rank{r}.npz") for r in range(n)],
            [load_npz(tmp_path / f"final-rank{r}.npz") for r in range(n)])


def _close(actual, expected, what):
    np.testing.assert_allclose(actual, expected, rtol=2e-4, atol=2e-5, err_msg=what)


# (algorithm, N, S, quorum, max_staleness, cosine): the last rank is a straggler
# (debug.slowdown delay:R=SLOW), and there are as many fast workers as the quorum, so who
# is late is fixed by the delays alone. cosine > 0: a cosine lr schedule over that many
# updates, which a quorum counts in global batches (more rounds close than there are
# steps; a schedule of rounds would reach 0 early).
CASES = [("ssgd", 3, 1, "majority", 1, 0),
         ("ssgd", 2, 2, "solo", 2, STEPS),
         ("ssgd", 4, 2, "3", 1, STEPS),
         ("ssd", 3, 2, "majority", 1, STEPS),
         ("ssd", 2, 1, "solo", 2, 0),
         ("ssd", 4, 1, "3", 1, 0)]


@pytest.mark.system
@pytest.mark.parametrize("algorithm,n,s,quorum,staleness,cosine", CASES,
                         ids=[f"{c[0]}-n{c[1]}-s{c[2]}-q{c[3]}" + ("-cosine" if c[5] else "")
                              for c in CASES])
def test_stragglers_end_with_the_simulators_weights(tmp_path, algorithm, n, s, quorum,
                                                    staleness, cosine):
    slowdown = f"delay:{n - 1}={SLOW}"
    locals_, finals = _run(tmp_path, n, s, quorum, staleness, slowdown, algorithm, cosine)
    keys, ref = _reference(n, quorum, staleness, _delays(slowdown, n), algorithm, cosine)
    # the straggler's pushes joined later rounds than the fast workers' of the same step
    assert any(len(r) < n for r in ref.rounds[:STEPS]), ref.rounds
    assert ref.applied == [STEPS] * n
    for r in range(n):
        for i, j in keys.items():
            _close(locals_[r][f"p{j}"], ref.worker_weights[r][i].asnumpy(),
                   f"worker {r} weights before the end, key {i} (rounds {ref.rounds})")
            _close(finals[r][f"p{j}"], ref.global_weights[i].asnumpy(),
                   f"worker {r} final weights, key {i} (rounds {ref.rounds})")


@pytest.mark.system
def test_every_push_of_every_worker_is_applied_exactly_once(tmp_path):
    # solo: the fast worker closes rounds alone; the two stragglers' pushes are all late
    n, steps = 3, 6
    res = launch(n, 2, ["--out", tmp_path, "--steps", steps],
                 env={"SSDSGD_SLOWDOWN": "delay:1=0.3,2=0.7", "SSDSGD_ALGORITHM": "ssd", "SSDSGD_WARMUP_STEPS": 1,
                      "SSDSGD_DELAY_STEPS": 2, "SSDSGD_LOCAL_RULE": "sgd",
                      "SSDSGD_QUORUM": "solo", "SSDSGD_MAX_STALENESS": 3,
                      "SSDSGD_BIGARRAY_BOUND": 4},        # the key is cut over both servers
                 script="quorum_count.py", timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for r in range(n):
        final = np.load(tmp_path / f"final-rank{r}.npy")
        np.testing.assert_array_equal(final, -np.ones(n * steps, np.float32),
                                      err_msg=f"worker {r}: -(times each push was applied)")
