"""Partial reduce end to end (docs/spec/preduce.md): a real scheduler forms the groups,
real servers average, four real workers train the stock gluon.Trainer; the result is the
simulator's for the group sequence the job formed, bit for bit."""
import json
import re

import mxnet as mx
import numpy as np
import pytest

import tiny
from conftest import load_npz
from jobs import launch
from ssdsgd.glu.preduce import arrival_groups, simulate_preduce

pytestmark = pytest.mark.system

# DELAY: the straggler's sleep before each step. The check on order needs it late by more
# than the two steps (and averages) the three others take to form the first two groups,
# tens of ms, a few hundred on a loaded 2-core machine; 3 s cost 12 s more per case.
N, STEPS, SLOW, DELAY = 4, 6, 3, 1.0


def assert_the_simulators_weights(out, groups, steps):
    """Every worker's weights before and after the final group (``out``'s files) are
    exactly the simulator's for ``groups`` over ``steps`` steps."""
    ref = simulated(groups, steps)
    for r in range(N):
        local = load_npz(out / f"local-rank{r}.npz")
        final = load_npz(out / f"final-rank{r}.npz")
        for i in range(len(local)):
            np.testing.assert_array_equal(local[f"p{i}"], ref.local_weights[r][i].asnumpy())
            np.testing.assert_array_equal(final[f"p{i}"], ref.worker_weights[r][i].asnumpy())


def simulated(groups, steps=STEPS):
    net = tiny.make_net()
    params = tiny.params(net)
    init = {i: p.data().copy() for i, p in enumerate(params)}

    def grad_fn(worker, step, weights):
        for i, p in enumerate(params):
            p.set_data(weights[i])
        tiny.forward_backward(net, *tiny.batch(worker, step))
        return {i: p.grad().copy() for i, p in enumerate(params)}

    def make_optimizer():    # ssd_worker.py's Trainer: sgd, batch 8 (rescale_grad 1/8)
        return mx.optimizer.SGD(learning_rate=0.1, momentum=0.9, rescale_grad=1 / 8)

    return simulate_preduce(init, grad_fn, make_optimizer, N, steps, groups=groups)


# 2 servers, not 1 and 2 (a 4-worker job fewer): the small keys are each held whole by
# one server, as a single server holds every key, and the 16x12 weight is split over both.
@pytest.mark.parametrize("servers", [2])
def test_a_late_worker_does_not_hold_groups_up_and_the_weights_are_the_simulators(
        tmp_path, servers):
    """Worker 3 sleeps DELAY (1 s) before each step: the first groups are the others', and every
    worker's weights (before and after the final group of all four) are exactly the
    simulator's for the groups the scheduler formed."""
    res = launch(N, servers, ["--out", tmp_path, "--steps", STEPS,
                              "--delays", json.dumps({str(SLOW): DELAY})],
                 env={"SSDSGD_ALGORITHM": "preduce", "SSDSGD_GROUP_SIZE": 2,
                      "SSDSGD_BIGARRAY_BOUND": 50},    # the 16x12 weight is split over S
                 timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    infos = [json.loads((tmp_path / f"info-rank{r}.json").read_text()) for r in range(N)]
    groups = arrival_groups([info["groups"] for info in infos])
    assert SLOW not in set().union(*groups[:2]), groups
    assert groups[-1] == tuple(range(N))
    assert all(len(g) == 2 for g in groups[:STEPS]), groups
    assert_the_simulators_weights(tmp_path, groups, STEPS)
    assert any(not np.array_equal(load_npz(tmp_path / "local-rank0.npz")["p0"],
                                  load_npz(tmp_path / f"local-rank{r}.npz")["p0"])
               for r in range(1, N)), "each worker keeps its own model"
    assert infos[0]["metrics"]["preduce"] == STEPS


@pytest.mark.parametrize("size, text", [
    (5, "SSDSGD_GROUP_SIZE: expected at most SSDSGD_NUM_WORKERS (4) workers per group, got 5"),
    (1, "SSDSGD_GROUP_SIZE='1': expected an integer >= 2")])
def test_bad_group_size_is_a_one_line_error_before_anything_starts(tmp_path, size, text):
    res = launch(N, 1, ["--out", tmp_path, "--steps", 1],
                 env={"SSDSGD_ALGORITHM": "preduce", "SSDSGD_GROUP_SIZE": size}, timeout=60)
    assert res.returncode != 0
    lines = [line for line in (res.stdout + res.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and text in lines[0], lines
    assert not list(tmp_path.glob("info-rank*.json"))


def test_the_server_averages_exactly_and_rejects_bad_averages():
    """Two real WorkerClients in this process (a preduce job's two workers), a real
    scheduler and server: the scheduler groups them, the server answers each member with
    the rank-order mean, and refuses AVERAGEs no correct worker sends, naming why."""
    import concurrent.futures
    import jobs
    from conftest import node_env
    from ssdsgd.kvstore.client import ServerError, WorkerClient
    from ssdsgd.kvstore.env import NodeEnv
    from ssdsgd.launch.job import free_port

    env = node_env(free_port(), num_workers=2, num_servers=1, SSDSGD_ALGORITHM="preduce",
                   SSDSGD_HEARTBEAT_TIMEOUT=20)
    jobs.node("scheduler", env), jobs.node("server", env)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        clients = list(pool.map(lambda r: WorkerClient(NodeEnv.from_environ(
            dict(env, SSDSGD_ROLE="worker", SSDSGD_RANK=str(r)))), range(2)))
        c0, c1 = sorted(clients, key=lambda c: c.rank)
        try:
            keys = [(0, 4, np.dtype(np.float32))]
            first = pool.submit(lambda: c0.init(keys, [np.zeros(4, np.float32)]).wait())
            c1.init(keys, None).wait()
            first.result(60)
            ready = pool.submit(c0.ready)
            assert c1.ready() == (0, (0, 1)) and ready.result(60) == (0, (0, 1))
            w0, w1 = np.float32([1, 2, 3, 1e8]), np.float32([3, 4, 5, 1])
            for members, text in (((1,), "2 or more"), ((0, 7), "2 or more")):
                with pytest.raises(ServerError, match=text):
                    c0.average(0, members, [(0, w0)]).wait()
            mine = c0.average(0, (0, 1), [(0, w0)])
            with pytest.raises(ServerError, match="twice"):
                c0.average(0, (0, 1), [(0, w0)]).wait()
            theirs = c1.average(0, (0, 1), [(0, w1)]).wait()
            want = (w0 + w1) / np.float32(2)
            np.testing.assert_array_equal(mine.wait()[0].value, want)
            np.testing.assert_array_equal(theirs[0].value, want)
        finally:
            for c in clients:
                c.close()


@pytest.mark.parametrize("workers, assignment", [(3, "static"), (4, "static"), (3, "auto")])
def test_preduce_with_per_epoch_checkpoints_finishes(tmp_path, workers, assignment):
    """Groups of 2 out of 3 or 4 workers and a checkpoint every epoch (the default): the
    workers that reach the checkpoint's barrier first are no longer ready for a group, so
    the last one's group must shrink instead of waiting for them (it hung for ever).
    Static shards save each worker's state; dynamic data (auto with preduce,
    docs/spec/dynamic_data.md) saves the cursor instead."""
    from jobs import run
    from test_e2e_configs import run_dir_of
    overrides = {"cluster.workers": workers, "sync.algorithm": "preduce",
                 "sync.group_size": 2, "train.epochs": 2, "train.checkpoint_every": 1,
                 "output.plots": "false", "output.dir": tmp_path,
                 "data.assignment": assignment}
    res = run(["configs/digits.yaml",
               *[a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]],
              timeout=150)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ck = run_dir_of(tmp_path) / "checkpoints"
    states = {f"epoch-0000.worker-{r}.npz" for r in range(workers)}
    if assignment == "static":
        assert states <= {p.name for p in ck.iterdir()}
    else:
        assert not states & {p.name for p in ck.iterdir()}
    latest = json.loads((ck / "latest.json").read_text())
    assert latest["epoch"] == 1 and ("chunks" in latest) == (assignment == "auto")


def test_a_restarted_scheduler_rebuilds_the_groups_and_the_weights_are_the_simulators(
        tmp_path):
    """cluster.scheduler_restarts: the scheduler, which forms the groups, SIGKILLed once
    every worker is at step 4 of 10 (each sleeps before its steps, worker 3 longer). The
    launcher starts it again; it rebuilds the groups formed, who met whom and the repeats
    from what each worker was told, and owes a group to any member whose message was
    lost. No server or worker restarts, and every worker's weights are exactly the
    simulator's for the groups formed before and after."""
    import os
    import signal
    import time
    from jobs import dist, launch_args
    from test_recovery import role_of
    steps, mark = 10, 4
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    job = dist(["--run-dir", run_dir, *launch_args(
        N, 2, ["--out", tmp_path, "--steps", steps, "--mark-at", mark, "--delays",
               json.dumps({"0": 0.15, "1": 0.15, "2": 0.15, str(SLOW): 0.4})],
        env={"SSDSGD_ALGORITHM": "preduce", "SSDSGD_GROUP_SIZE": 2,
             "SSDSGD_BIGARRAY_BOUND": 50, "SSDSGD_SCHEDULER_RESTARTS": 1,
             "SSDSGD_HEARTBEAT_INTERVAL": 0.2, "SSDSGD_HEARTBEAT_TIMEOUT": 1})], merge=True)
    with job:
        job.wait_for(lambda: all((tmp_path / f"at-step-{mark}-rank{r}").exists()
                                 for r in range(N)), 120, f"every worker at step {mark}")
        before = {role_of(p): p for p in job.processes() if role_of(p)}
        os.kill(before[("scheduler", 0)], signal.SIGKILL)
        killed = time.monotonic()
        job.wait_for("re-registered and the job goes on", 120,
                     "the launcher's line that the restarted scheduler has every node back")
        assert job.wait(240) == 0, job.tail()
    print(f"back {time.monotonic() - killed:.1f} s after the kill (the job's end included)")
    infos = [json.loads((tmp_path / f"info-rank{r}.json").read_text()) for r in range(N)]
    groups = arrival_groups([info["groups"] for info in infos])
    rebuilt = re.search(r"restart 1: preduce: (\d+) groups formed before the loss", job.text)
    assert rebuilt, job.tail()
    assert 0 < int(rebuilt.group(1)) < len(groups), (rebuilt.group(0), groups)
    assert groups[-1] == tuple(range(N))
    for who in ("server 0", "server 1", *(f"worker {r}" for r in range(N))):
        assert f"{who}: rejoined the job with the restarted scheduler" in job.text, who
    assert_the_simulators_weights(tmp_path, groups, steps)
