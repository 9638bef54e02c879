"""SSD-SGD on the real system equals the spec's single-process simulation, step for step.

Each case launches a real job (launch/dist.py: scheduler, S servers, N workers running the
stock gluon.Trainer on kvstore='ssd_sync') and compares every worker's local weights after
its last local update, and the global weights every worker ends with, against
ssdsgd.glu.simulate on the same network, data, seed and optimizer.
"""
import itertools
import json

import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

import tiny
from conftest import load_npz
from jobs import launch
from ssdsgd.glu.simulate import simulate

STEPS, WARMUP, BATCH = 12, 3, 8
RULES = ["glu-estimate", "glu-exact", "glu-corrected", "sgd", "none"]
KS = [1, 2, 5]
NS = [1, 2, 3]
SS = [1, 2]
COMPRESSIONS = {"none": None, "2bit": {"type": "2bit", "threshold": 0.05},
                "topk": {"type": "topk", "ratio": 0.1}}
OPTIMIZERS = {
    "sgd": {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-4},
    "nag": {"learning_rate": 0.05, "momentum": 0.9},
    "adam": {"learning_rate": 0.01},
}


KNOBS = [RULES, KS, NS, SS, list(OPTIMIZERS), list(COMPRESSIONS)]


def _valid(case):
    rule, _, _, _, opt, _ = case
    # estimate and corrected need momentum
    return not (rule in ("glu-estimate", "glu-corrected") and opt == "adam")


def _pairs(case):
    return {(i, case[i], j, case[j]) for i, j in itertools.combinations(range(len(KNOBS)), 2)}


# Every pair of knob values (of a valid combination) in one case at least: a covering
# array of 15 cases, the fewest possible (5 rules x 3 values of k), found by a search
# that also kept the processes per job (n + s) low -- each case is a job of N + S + 2
# processes, each importing MXNet. (The greedy construction it replaces needed 18.)
CASES = [
    ("glu-corrected", 1, 3, 1, "sgd", "2bit"),
    ("glu-corrected", 2, 2, 2, "nag", "topk"),
    ("glu-corrected", 5, 1, 1, "nag", "none"),
    ("glu-estimate", 1, 1, 1, "nag", "topk"),
    ("glu-estimate", 2, 3, 1, "nag", "none"),
    ("glu-estimate", 5, 2, 2, "sgd", "2bit"),
    ("glu-exact", 1, 1, 2, "sgd", "none"),
    ("glu-exact", 2, 2, 1, "nag", "2bit"),
    ("glu-exact", 5, 3, 1, "adam", "topk"),
    ("none", 1, 3, 2, "sgd", "topk"),
    ("none", 2, 1, 1, "adam", "2bit"),
    ("none", 5, 2, 1, "nag", "none"),
    ("sgd", 1, 2, 2, "adam", "none"),
    ("sgd", 2, 1, 1, "sgd", "topk"),
    ("sgd", 5, 3, 1, "nag", "2bit"),
]


def test_the_cases_cover_every_value_and_every_pair():
    for i, values in enumerate(KNOBS):
        assert {c[i] for c in CASES} == set(values)
    assert all(_valid(c) for c in CASES)
    wanted = set().union(*(_pairs(c) for c in itertools.product(*KNOBS) if _valid(c)))
    assert wanted == set().union(*(_pairs(c) for c in CASES))
    # the special cases test_distributed_run_equals_the_simulation checks
    assert ("glu-exact", 1, "none") in {(c[0], c[2], c[5]) for c in CASES}
    assert len(CASES) < 20


def _trainer_keys(net):
    """Trainer key i -> position of that parameter in tiny.params (the files' p{j})."""
    trainer = gluon.Trainer(net.collect_params(), "sgd", kvstore=None)
    order = tiny.params(net)
    return {i: order.index(p) for i, p in enumerate(trainer._params)}


def _params(compression):
    """A case's compression name, or kv.set_gradient_compression's dict itself."""
    return compression if isinstance(compression, dict) else COMPRESSIONS[compression]


def _reference(rule, k, n, opt, warmup=WARMUP, algorithm="ssd", compression="none",
               pull_schedule="aligned", compress_from=0):
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
        return mx.optimizer.create(opt, rescale_grad=1.0 / BATCH, **OPTIMIZERS[opt])

    local_rule, _, glu_state = rule.partition("-")
    return keys, simulate(init, grad_fn, make_optimizer, n, STEPS, algorithm=algorithm,
                          warmup_steps=warmup, delay_steps=k, local_rule=local_rule,
                          glu_state=glu_state or "estimate",
                          compression=_params(compression),
                          pull_schedule=pull_schedule, compress_from=compress_from)


def _run(tmp_path, rule, k, n, s, opt, warmup=WARMUP, algorithm="ssd", compression="none",
         pull_schedule="aligned", pull_relay="off", delays=None):
    local_rule, _, glu_state = rule.partition("-")
    extra = (["--compression", json.dumps(_params(compression))]
             if _params(compression) else [])
    extra += ["--delays", json.dumps(delays)] if delays else []
    res = launch(n, s, ["--out", tmp_path, "--steps", STEPS, "--optimizer", opt,
                        "--opt-params", json.dumps(OPTIMIZERS[opt])] + extra,
                 env={"SSDSGD_ALGORITHM": algorithm, "SSDSGD_WARMUP_STEPS": warmup,
                      "SSDSGD_DELAY_STEPS": k, "SSDSGD_LOCAL_RULE": local_rule,
                      "SSDSGD_GLU_STATE": glu_state or "estimate",
                      "SSDSGD_PULL_SCHEDULE": pull_schedule, "SSDSGD_PULL_RELAY": pull_relay,
                      "SSDSGD_BIGARRAY_BOUND": 100})   # the 16x12 weight spans both servers
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return ([load_npz(tmp_path / f"local-rank{r}.npz") for r in range(n)],
            [load_npz(tmp_path / f"final-rank{r}.npz") for r in range(n)])


def _close(actual, expected, what):
    np.testing.assert_allclose(actual, expected, rtol=2e-4, atol=2e-5, err_msg=what)


def _equal_to_the_simulation(keys, ref, locals_, finals, note="", ranks=None):
    """Every worker's local weights after its last update and the global weights it ended
    with are the simulator's (``ranks``: the workers ``locals_`` and ``finals`` are of, in
    order; 0..len - 1 if None)."""
    for x, r in enumerate(range(len(locals_)) if ranks is None else ranks):
        for i, j in keys.items():
            _close(locals_[x][f"p{j}"], ref.worker_weights[r][i].asnumpy(),
                   f"worker {r} local weights of key {i}{note}")
            _close(finals[x][f"p{j}"], ref.global_weights[i].asnumpy(),
                   f"worker {r} final global weights of key {i}{note}")


@pytest.mark.system
@pytest.mark.parametrize("rule,k,n,s,opt,compression", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_distributed_run_equals_the_simulation(tmp_path, rule, k, n, s, opt, compression):
    locals_, finals = _run(tmp_path, rule, k, n, s, opt, compression=compression)
    keys, ref = _reference(rule, k, n, opt, compression=compression)
    _equal_to_the_simulation(keys, ref, locals_, finals)
    gap = max(np.abs(locals_[0][f"p{j}"] - finals[0][f"p{j}"]).max() for j in keys.values())
    if rule == "glu-exact" and n == 1 and compression == "none":
        # one worker with the server's exact state: the local copy IS the global model
        # (with compression the server gets the compressed gradient, the local copy not)
        assert gap < 1e-5, gap
    elif n > 1 and rule != "none":
        assert gap > 1e-6, "local weights should differ from the global ones between pulls"


@pytest.mark.system
@pytest.mark.parametrize("rule", ["glu-estimate", "glu-corrected", "sgd"])
def test_steps_queued_on_the_engine_equal_the_simulation(tmp_path, rule):
    """SGD with momentum on small CPU keys, uncompressed: every steps-delay step after
    the first is one operation on MXNet's engine (worker/delay_on_engine.py), its reset
    and local update done on the I/O thread; the weights are the simulator's. The local
    rule sgd updates without momentum (another MXNet kernel, not host_sgd's): none of its
    steps queue, and its weights are the simulator's as before. 3 workers, 2 servers (a
    key split over both), k = 2."""
    n, k = 3, 2
    locals_, finals = _run(tmp_path, rule, k, n, 2, "sgd")
    keys, ref = _reference(rule, k, n, "sgd")
    _equal_to_the_simulation(keys, ref, locals_, finals)
    for r in range(n):
        metrics = json.loads((tmp_path / f"info-rank{r}.json").read_text())["metrics"]
        # the first steps-delay step seeds the local rule on this thread; the rest queue
        queued = 0 if rule == "sgd" else STEPS - WARMUP - 1
        assert metrics["steps_on_engine"] == queued, metrics


@pytest.mark.system
def test_warmup_covering_the_whole_run_equals_ssgd_exactly(tmp_path):
    _, ssd = _run(tmp_path / "ssd", "glu-estimate", 2, 2, 1, "sgd", warmup=STEPS)
    _, ssgd = _run(tmp_path / "ssgd", "glu-estimate", 2, 2, 1, "sgd", algorithm="ssgd")
    for r in range(2):
        for name in ssd[r]:
            np.testing.assert_array_equal(ssd[r][name], ssgd[r][name])


@pytest.mark.system
def test_without_warmup_exact_glu_state_equals_the_simulation(tmp_path):
    # the first reset's optimizer state must be as of the weights it resets to, not one
    # step later (one worker completes each step with its own push)
    locals_, finals = _run(tmp_path, "glu-exact", 2, 1, 1, "sgd", warmup=0)
    keys, ref = _reference("glu-exact", 2, 1, "sgd", warmup=0)
    _equal_to_the_simulation(keys, ref, locals_, finals)


@pytest.mark.system
@pytest.mark.parametrize("rule,opt,compression", [("glu-corrected", "sgd", "2bit"),
                                                  ("glu-exact", "adam", "none")])
def test_staggered_pulls_equal_the_simulation(tmp_path, rule, opt, compression):
    """docs/spec/staggered_pulls.md: worker i pulls floor(i k / N) steps earlier in each
    period; 3 workers, k = 5 (offsets 0, 1, 3), 2 servers (a key split over both)."""
    n, k = 3, 5
    locals_, finals = _run(tmp_path, rule, k, n, 2, opt, compression=compression,
                           pull_schedule="staggered")
    keys, ref = _reference(rule, k, n, opt, compression=compression, pull_schedule="staggered")
    _equal_to_the_simulation(keys, ref, locals_, finals)


@pytest.mark.system
@pytest.mark.parametrize("algorithm,rule,opt,compression", [
    ("ssd", "glu-exact", "sgd", "2bit"), ("ssgd", "glu-exact", "adam", "none")])
def test_relayed_pulls_equal_the_simulation(tmp_path, algorithm, rule, opt, compression):
    """docs/spec/pull_relay.md: with sync.pull_relay chain a server sends a reply that
    several workers wait for once, and the workers pass it on; the weights are the
    simulator's, and the chain really carried them (3 workers, 2 servers, k = 2)."""
    n, k = 3, 2
    locals_, finals = _run(tmp_path, rule, k, n, 2, opt, compression=compression,
                           algorithm=algorithm, pull_relay="chain")
    keys, ref = _reference(rule, k, n, opt, compression=compression, algorithm=algorithm)
    _equal_to_the_simulation(keys, ref, locals_, finals)
    stats = [json.loads((tmp_path / f"info-rank{r}.json").read_text())["metrics"]
             for r in range(n)]
    relayed_in = [m["replies_relayed_in"] for m in stats]
    relayed_out = [m["replies_relayed_out"] for m in stats]
    # the chain is 0 -> 1 -> 2 for every reply the three wait for together
    assert relayed_in[0] == 0 and relayed_out[2] == 0, (relayed_in, relayed_out)
    assert relayed_in[1] == relayed_out[0] == relayed_in[2] == relayed_out[1] > 0, \
        (relayed_in, relayed_out)


@pytest.mark.system
def test_auto_compression_equals_the_simulation_compressed_from_the_end_of_the_warmup(
        tmp_path):
    """sync.compression: auto (the Trainer's {'type': 'auto'}): the warm-up pushes
    uncompressed, rank 0 chooses at its end, and every worker compresses with the chosen
    codec (at its defaults) from step T_w on: the simulator with compress_from = T_w.
    Worker 1 sleeps 150 ms before each step, so rank 0's warm-up rounds wait for it: the
    push looks link-bound against rank 0's few ms of compute, and a codec pays."""
    n, k = 2, 2
    locals_, finals = _run(tmp_path, "glu-exact", k, n, 1, "sgd", compression={"type": "auto"},
                           delays={"1": 0.15})
    choices = [json.loads((tmp_path / f"info-rank{r}.json").read_text())["metrics"]["choices"]
               for r in range(n)]
    chosen = choices[0]["compression"]["value"]
    assert chosen in ("topk", "2bit") and choices[0]["compression"]["why"].startswith(
        "auto: a steps-delay step estimated at none"), choices[0]
    assert [c["compression"]["value"] for c in choices] == [chosen] * n
    keys, ref = _reference("glu-exact", k, n, "sgd", compress_from=WARMUP,
                           compression={"type": chosen})
    _equal_to_the_simulation(keys, ref, locals_, finals, f" ({chosen})")
