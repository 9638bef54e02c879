"""localsgd and diloco (docs/spec/localsgd_diloco.md): the simulator's reductions, and the
real system equal to the simulator.

Fast: localsgd with H = 1 is synchronous model averaging (preduce's simulator with every
worker in every group) and, with stateless SGD, ssgd; diloco with H = 1 and stateless SGD
inside is ssgd with the servers' Nesterov step at lr outer_lr x lr; a warm-up covering the
run is ssgd. System: real jobs (launch/dist.py, the stock gluon.Trainer on
kvstore='ssd_sync') end with the simulator's weights, for N in {1, 2, 3}, S in {1, 2} and
H in {1, 4}, and the shipped digits config trains with each, writing its checkpoints.
"""
import json

import mxnet as mx
import numpy as np
import pytest

import tiny
from conftest import load_npz
from jobs import launch, run
from ssdsgd.glu.preduce import simulate_preduce
from ssdsgd.glu.simulate import simulate
from ssdsgd.glu.simulate_periodic import simulate_periodic
from test_e2e_configs import records, run_dir_of
from test_ssd_oracle import BATCH, OPTIMIZERS, STEPS, WARMUP, _close, _trainer_keys


def _problem(opt, params=None, batch=BATCH):
    """tiny's network as the simulators see it: keys, initial weights, gradients and the
    Trainer's optimizer (rescale_grad 1 / ``batch``)."""
    net = tiny.make_net()
    keys = _trainer_keys(net)
    layers = tiny.params(net)
    init = {i: layers[j].data().copy() for i, j in keys.items()}

    def grad_fn(worker, step, weights):
        for i, j in keys.items():
            layers[j].set_data(weights[i])
        tiny.forward_backward(net, *tiny.batch(worker, step, BATCH))
        return {i: layers[j].grad().copy() for i, j in keys.items()}

    def make_optimizer():
        return mx.optimizer.create(opt, rescale_grad=1.0 / batch,
                                   **(OPTIMIZERS[opt] if params is None else params))
    return keys, init, grad_fn, make_optimizer


def _same(actual, expected, what, rtol=2e-4, atol=2e-5):
    for key in expected:
        np.testing.assert_allclose(actual[key].asnumpy(), expected[key].asnumpy(), rtol=rtol,
                                   atol=atol, err_msg=f"{what}, key {key}")


@pytest.mark.parametrize("n", [2, 3])
def test_localsgd_with_h1_is_synchronous_model_averaging(n):
    """Every step each worker's own step (momentum and wd on its own state), then the mean
    of the N models: preduce's simulator with groups of every worker."""
    _, init, grad_fn, make_opt = _problem("sgd", batch=BATCH * n)
    res = simulate_periodic(init, grad_fn, make_opt, n, STEPS, algorithm="localsgd",
                            sync_period=1)
    _, _, _, per_worker = _problem("sgd")       # the Trainer's step on the worker's batch
    everyone = tuple(range(n))
    ref = simulate_preduce(init, grad_fn, per_worker, n, STEPS,
                           groups=[everyone] * (STEPS + 1))
    assert res.syncs == STEPS
    for r in range(n):
        _same(res.worker_weights[r], ref.worker_weights[r], f"worker {r}")
    _same(res.global_weights, ref.worker_weights[0], "global")


def test_localsgd_with_h1_and_plain_sgd_is_ssgd():
    n, plain = 3, {"learning_rate": 0.1, "wd": 1e-4}
    _, init, grad_fn, make_opt = _problem("sgd", plain, batch=BATCH * n)
    res = simulate_periodic(init, grad_fn, make_opt, n, STEPS, algorithm="localsgd",
                            warmup_steps=WARMUP, sync_period=1)
    ref = simulate(init, grad_fn, make_opt, n, STEPS, algorithm="ssgd")
    _same(res.global_weights, ref.global_weights, "global")


@pytest.mark.parametrize("outer_lr,outer_momentum", [(0.7, 0.9), (1.3, 0.5)])
def test_diloco_with_h1_and_plain_sgd_is_nesterov_ssgd(outer_lr, outer_momentum):
    """A delta of one plain SGD step is lr times the worker's mean gradient, so the outer
    Nesterov step on the mean delta is ssgd with NAG(lr = outer_lr x lr, outer_momentum)."""
    n, lr = 2, 0.1
    _, init, grad_fn, make_opt = _problem("sgd", {"learning_rate": lr}, batch=BATCH * n)
    res = simulate_periodic(init, grad_fn, make_opt, n, STEPS, algorithm="diloco",
                            sync_period=1, outer_lr=outer_lr, outer_momentum=outer_momentum)
    _, _, _, nesterov = _problem("nag", {"learning_rate": outer_lr * lr,
                                         "momentum": outer_momentum}, batch=BATCH * n)
    ref = simulate(init, grad_fn, nesterov, n, STEPS, algorithm="ssgd")
    _same(res.global_weights, ref.global_weights, "global")


@pytest.mark.parametrize("algorithm", ["localsgd", "diloco"])
def test_a_warmup_covering_the_run_is_ssgd_exactly(algorithm):
    n = 2
    _, init, grad_fn, make_opt = _problem("sgd", batch=BATCH * n)
    res = simulate_periodic(init, grad_fn, make_opt, n, STEPS, algorithm=algorithm,
                            warmup_steps=STEPS, sync_period=4)
    ref = simulate(init, grad_fn, make_opt, n, STEPS, algorithm="ssgd")
    assert res.syncs == 0
    for key in init:
        np.testing.assert_array_equal(res.global_weights[key].asnumpy(),
                                      ref.global_weights[key].asnumpy())


def test_diloco_moves_away_from_localsgd_and_both_learn():
    """The outer step matters (diloco is not localsgd under another name), and neither
    drifts: both end nearer the data's rule than where they started (a lower loss)."""
    n, steps = 2, 24
    keys, init, grad_fn, make_opt = _problem("sgd", batch=BATCH * n)
    out = {a: simulate_periodic(init, grad_fn, make_opt, n, steps, algorithm=a,
                                warmup_steps=WARMUP, sync_period=4)
           for a in ("localsgd", "diloco")}
    gap = max(np.abs(out["localsgd"].global_weights[k].asnumpy()
                     - out["diloco"].global_weights[k].asnumpy()).max() for k in init)
    assert gap > 1e-3, gap
    net = tiny.make_net()
    layers = tiny.params(net)

    def loss(weights):
        for i, j in keys.items():
            layers[j].set_data(weights[i])
        x, y = tiny.batch(99, 999, 256)
        return float(tiny.LOSS(net(x), y).mean().asscalar())
    for a, res in out.items():
        assert loss(res.global_weights) < loss(init), a


# ---- the real system equals the simulator ---------------------------------------------
# (algorithm, N, S, H, optimizer): for each algorithm every N, S and H at least once
CASES = [
    ("localsgd", 1, 2, 4, "sgd"),
    ("localsgd", 2, 1, 1, "adam"),
    ("localsgd", 3, 2, 4, "nag"),
    ("diloco", 1, 1, 1, "nag"),
    ("diloco", 2, 2, 4, "sgd"),
    ("diloco", 3, 1, 4, "adam"),
]


def test_the_cases_cover_every_value_for_each_algorithm():
    for algorithm in ("localsgd", "diloco"):
        mine = [c for c in CASES if c[0] == algorithm]
        assert {c[1] for c in mine} == {1, 2, 3}
        assert {c[2] for c in mine} == {1, 2} and {c[3] for c in mine} == {1, 4}


@pytest.mark.system
@pytest.mark.parametrize("algorithm,n,s,h,opt", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_distributed_run_equals_the_simulation(tmp_path, algorithm, n, s, h, opt):
    res = launch(n, s, ["--out", tmp_path, "--steps", STEPS, "--optimizer", opt,
                        "--opt-params", json.dumps(OPTIMIZERS[opt])],
                 env={"SSDSGD_ALGORITHM": algorithm, "SSDSGD_WARMUP_STEPS": WARMUP,
                      "SSDSGD_SYNC_PERIOD": h,
                      "SSDSGD_BIGARRAY_BOUND": 100})   # the 16x12 weight spans both servers
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    keys, init, grad_fn, make_opt = _problem(opt, batch=BATCH)
    ref = simulate_periodic(init, grad_fn, make_opt, n, STEPS, algorithm=algorithm,
                            warmup_steps=WARMUP, sync_period=h)
    for r in range(n):
        local, final = (load_npz(tmp_path / f"{name}-rank{r}.npz") for name in ("local", "final"))
        for i, j in keys.items():
            _close(local[f"p{j}"], ref.worker_weights[r][i].asnumpy(),
                   f"worker {r} local weights of key {i}")
            _close(final[f"p{j}"], ref.global_weights[i].asnumpy(),
                   f"worker {r} final global weights of key {i}")
        metrics = json.loads((tmp_path / f"info-rank{r}.json").read_text())["metrics"]
        assert metrics["warmup"] == WARMUP and metrics["local_steps"] == STEPS - WARMUP
        # the metrics are read before close(), whose last sync is the simulator's too
        assert metrics["pushes"] == WARMUP + (STEPS - WARMUP) // h, metrics
    assert ref.syncs == -(-(STEPS - WARMUP) // h)


@pytest.mark.system
@pytest.mark.parametrize("algorithm", ["localsgd", "diloco"])
def test_localsgd_and_diloco_configs_train_with_checkpoints(tmp_path, algorithm):
    """The shipped digits config through launch/dist.py (python -m ssdsgd.train on every
    worker), 2 epochs with a checkpoint each: it learns, the stages are the spec's, the
    checkpoints are written; resuming the run is refused in one line."""
    overrides = {"sync.algorithm": algorithm, "sync.warmup_steps": 6, "sync.sync_period": 4,
                 "train.epochs": 2, "train.checkpoint_every": 1, "output.plots": "false",
                 "output.dir": tmp_path}
    if algorithm == "diloco":   # with momentum inside and H = 4 the published 0.9 diverges
        overrides["sync.outer_momentum"] = 0.5    # (docs/spec/localsgd_diloco.md)
    res = run(["configs/digits.yaml",
               *[a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]],
              timeout=150)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run_dir = run_dir_of(tmp_path)
    ck = run_dir / "checkpoints"
    assert {"epoch-0000.params", "epoch-0001.params"} <= {p.name for p in ck.iterdir()}
    stages = [r["stage"] for r in records(run_dir, 1, "train")]
    assert stages and set(stages) == {"local_steps"}, stages    # logged every 20 steps
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["algorithm"] == algorithm
    assert summary["final_accuracy"] > 0.5, summary
    again = run(["--resume", str(run_dir), "--set", "train.epochs=3"], timeout=60)
    out = again.stdout + again.stderr
    assert again.returncode != 0 and "Traceback" not in out, out
    assert f"{algorithm} works with SSDSGD_START_STEP: 0 only" in out, out
