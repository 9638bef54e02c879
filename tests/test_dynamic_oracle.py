"""Dynamic data under a quorum (docs/spec/dynamic_data.md) against the quorum simulator:
a real job whose scheduler deals each epoch's chunks to whichever worker asks next, with a
controlled slow rank, trains every chunk of its budget once and ends with the weights of
ssdsgd/glu/simulate_quorum.py fed each worker's chunks in the order the job dealt them
(its step count and its data) and the same per-step delays."""
import json

import mxnet as mx
import pytest

import tiny
from conftest import load_npz
from jobs import launch
from ssdsgd.data import epoch_permutation
from ssdsgd.glu.simulate_quorum import simulate_quorum
from test_quorum import SLOW, _delays, _trainer_keys
from test_ssd_oracle import _equal_to_the_simulation

N, PER_EPOCH, EPOCHS, BATCH = 3, 12, 2, 8   # an epoch of 4 chunks a worker: a slow one,
# holding 2 in flight (data/dynamic.py), trains fewer


def _simulated(chunks, slowdown, staleness):
    """The simulator with each worker's dealt chunks as its steps."""
    net = tiny.make_net()
    keys = _trainer_keys(net)
    params = tiny.params(net)
    init = {i: params[j].data().copy() for i, j in keys.items()}
    data = tiny.ChunkData(PER_EPOCH * BATCH)
    perms = [epoch_permutation(data.n_train, e, 0) for e in range(EPOCHS)]

    def grad_fn(worker, step, weights):
        epoch, chunk = divmod(chunks[worker][step], PER_EPOCH)
        x, y = data.train_batch(perms[epoch][chunk * BATCH:(chunk + 1) * BATCH])
        for i, j in keys.items():
            params[j].set_data(weights[i])
        tiny.forward_backward(net, x, y)
        return {i: params[j].grad().copy() for i, j in keys.items()}

    def make_optimizer():
        return mx.optimizer.create("sgd", learning_rate=0.1, momentum=0.9,
                                   rescale_grad=1.0 / BATCH)

    return keys, simulate_quorum(init, grad_fn, make_optimizer, N,
                                 [len(c) for c in chunks], quorum=2,
                                 max_staleness=staleness, delays=_delays(slowdown, N),
                                 algorithm="ssgd")


@pytest.mark.system
def test_a_slow_rank_under_dynamic_data_ends_with_the_simulators_weights(tmp_path):
    slowdown, staleness = f"delay:{N - 1}={SLOW}", 1
    res = launch(N, 2, ["--out", tmp_path, "--per-epoch", PER_EPOCH, "--epochs", EPOCHS],
                 env={"SSDSGD_ALGORITHM": "ssgd", "SSDSGD_QUORUM": "majority",
                      "SSDSGD_SLOWDOWN": slowdown, "SSDSGD_MAX_STALENESS": staleness,
                      "SSDSGD_BIGARRAY_BOUND": 100},    # the 16x12 weight spans both servers
                 script="dynamic_worker.py", timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = [json.loads((tmp_path / f"chunks-rank{r}.json").read_text()) for r in range(N)]
    chunks = [r["chunks"] for r in records]
    # the budget (2 epochs of 6 chunks), every chunk once, the slow rank training fewer
    assert sorted(c for cs in chunks for c in cs) == list(range(PER_EPOCH * EPOCHS)), chunks
    assert len(chunks[N - 1]) < min(len(c) for c in chunks[:N - 1]), chunks
    assert sum(r["trained"].get("0", {}).get("batches", 0) for r in records) == PER_EPOCH
    keys, ref = _simulated(chunks, slowdown, staleness)
    assert ref.applied == [len(c) for c in chunks]
    assert any(len(r) < N for r in ref.rounds), ref.rounds
    _equal_to_the_simulation(keys, ref,
                             [load_npz(tmp_path / f"local-rank{r}.npz") for r in range(N)],
                             [load_npz(tmp_path / f"final-rank{r}.npz") for r in range(N)],
                             f" (rounds {ref.rounds})")
