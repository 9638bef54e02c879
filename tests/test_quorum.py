"""Quorum rounds (docs/spec/quorum.md): real jobs with injected stragglers end with the
weights of the simulator fed the same arrival order, and no push is lost; quorum auto
leaves a slow worker out as its leader says, and without one is quorum all bit for bit."""
import json
import os
import re
import signal

import mxnet as mx
import numpy as np
import pytest
from mxnet import gluon

import tiny
from conftest import load_npz
import jobs
from jobs import launch
from ssdsgd.glu.simulate_quorum import auto_excusals, simulate_quorum
from ssdsgd.settings import quorum_size
from ssdsgd.slowdown import Slowdown
from ssdsgd.sync.quorum_rules import LateWorkers
from test_e2e_configs import sets
from test_ssd_oracle import _equal_to_the_simulation

STEPS, BATCH, WARMUP, K = 8, 8, 2, 2
SLOW = 0.8        # seconds per step of the straggler: far more than a fast worker's step


def _trainer_keys(net):
    """Trainer key i -> position of that parameter in tiny.params (the files' p{j})."""
    trainer = gluon.Trainer(net.collect_params(), "sgd", kvstore=None)
    order = tiny.params(net)
    return {i: order.index(p) for i, p in enumerate(trainer._params)}


def _reference(n, quorum, staleness, delays, algorithm, cosine=0, steps=STEPS,
               excusals=()):
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

    return keys, simulate_quorum(init, grad_fn, make_optimizer, n, steps,
                                 quorum=quorum_size(quorum, n), max_staleness=staleness,
                                 delays=delays, algorithm=algorithm, warmup_steps=WARMUP,
                                 delay_steps=K, glu_state="exact", excusals=excusals)


def _delays(slowdown, n):
    """Each rank's seconds per step under debug.slowdown (delay form: the same each step)."""
    return [Slowdown(slowdown, r, n).seconds(0) for r in range(n)]


def _run(tmp_path, n, s, quorum, staleness, slowdown, algorithm, cosine=0, steps=STEPS):
    """(each worker's weights before its end, after it, the job's output)."""
    res = launch(n, s, ["--out", tmp_path, "--steps", steps, "--cosine", cosine],
                 env={"SSDSGD_SLOWDOWN": slowdown, "SSDSGD_ALGORITHM": algorithm, "SSDSGD_WARMUP_STEPS": WARMUP,
                      "SSDSGD_DELAY_STEPS": K, "SSDSGD_QUORUM": quorum,
                      # both sides the same local rule state: the default, exact (the simulator says estimate unless told)
                      "SSDSGD_GLU_STATE": "exact",
                      "SSDSGD_MAX_STALENESS": staleness,
                      "SSDSGD_BIGARRAY_BOUND": 100},    # the 16x12 weight spans both servers
                 script="quorum_worker.py", timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return ([load_npz(tmp_path / f"local-rank{r}.npz") for r in range(n)],
            [load_npz(tmp_path / f"final-rank{r}.npz") for r in range(n)],
            res.stdout + res.stderr)


# (algorithm, N, S, quorum, max_staleness, cosine): the last rank is a straggler
# (debug.slowdown delay:R=SLOW), and there are as many fast workers as the quorum, so who
# is late is fixed by the delays alone. cosine > 0: a cosine lr schedule over that many
# updates, which a quorum counts in global batches (more rounds close than there are
# steps; a schedule of rounds would reach 0 early).
# For each algorithm a named quorum (majority or solo), 1 and 2 servers, and a run with
# and without the cosine schedule; the numeric quorum ("3" of 4: settings.quorum_size, the
# same for both algorithms, as the servers' rounds are) and N = 4 in the ssd case, which
# covers them for both (an ssgd case of them, 4 workers and 2 servers, the heaviest job
# here, was cut).
CASES = [("ssgd", 3, 1, "majority", 1, 0),
         ("ssgd", 2, 2, "solo", 2, STEPS),
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
    locals_, finals, out = _run(tmp_path, n, s, quorum, staleness, slowdown, algorithm,
                                cosine)
    keys, ref = _reference(n, quorum, staleness, _delays(slowdown, n), algorithm, cosine)
    if algorithm == "ssd":      # its steps-delay steps after the first queued on the engine
        done = [json.loads(m) for m in re.findall(r"rank \d+ done: (\{.*?\})", out)]
        assert [d["steps_on_engine"] for d in done] == [STEPS - WARMUP - 1] * n, done
    # the straggler's pushes joined later rounds than the fast workers' of the same step
    assert any(len(r) < n for r in ref.rounds[:STEPS]), ref.rounds
    assert ref.applied == [STEPS] * n
    _equal_to_the_simulation(keys, ref, locals_, finals, f" (rounds {ref.rounds})")


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


@pytest.mark.system
def test_a_restarted_scheduler_loses_no_round_decision(tmp_path):
    """2 servers: server 0 decides the rounds and the scheduler passes its decisions on to
    server 1. The scheduler SIGKILLed mid-run (cluster.scheduler_restarts 1); server 0
    goes on deciding while it is down (solo: the fast worker closes rounds alone), then
    sends every decision it kept again, and server 1 applies each one once: every push
    of every worker is applied exactly once on both servers (the key is cut over
    both), and no process is restarted."""
    n, steps = 3, 60
    args = jobs.launch_args(n, 2, ["--out", tmp_path, "--steps", steps, "--progress"], env={
        "SSDSGD_SLOWDOWN": "delay:0=0.03,1=0.06,2=0.1", "SSDSGD_ALGORITHM": "ssd",
        "SSDSGD_WARMUP_STEPS": 1, "SSDSGD_DELAY_STEPS": 2, "SSDSGD_LOCAL_RULE": "sgd",
        "SSDSGD_QUORUM": "solo", "SSDSGD_MAX_STALENESS": 3, "SSDSGD_BIGARRAY_BOUND": 4,
        "SSDSGD_SCHEDULER_RESTARTS": 1}, script="quorum_count.py")
    with jobs.dist(args, merge=True) as job:
        job.wait_for("rank 0 step 15 done", 120)
        os.kill(job.process("scheduler"), signal.SIGKILL)
        job.wait_for("re-registered and the job goes on", 60)
        assert job.wait(timeout=120) == 0, job.text[-3000:]
    out = job.text
    assert "server 0: sent its kept round decisions again after the scheduler restart" in out
    assert f"rank {n - 1} step {steps - 1} done" in out[out.index("lost the scheduler"):]
    for r in range(n):
        final = np.load(tmp_path / f"final-rank{r}.npy")
        np.testing.assert_array_equal(final, -np.ones(n * steps, np.float32),
                                      err_msg=f"worker {r}: -(times each push was applied)")


def test_decisions_sent_again_are_applied_once_and_a_gap_is_named():
    from ssdsgd.sync.decision_log import DecisionLog, Followed
    from ssdsgd.sync.events import PolicyError
    log, follower = DecisionLog(kept=4), Followed()
    assert log.add("a b") == 0 and log.add("c") == 2
    assert follower.take(0, "a b") == "a b"
    assert log.add("d e") == 3                  # c lost on the way, d e held
    assert log.kept() == [(1, "b c d e")]       # the last 4
    assert follower.take(1, "b c d e") == "c d e" and follower.applied == 5
    assert follower.take(3, "d e") == ""        # a copy of what it has
    log.add("f g h i j")
    with pytest.raises(PolicyError, match="decisions 5 to 5 never came"):
        follower.take(*log.kept()[0])


AUTO_STEPS = 12


@pytest.mark.system
@pytest.mark.parametrize("algorithm,s,staleness", [("ssgd", 1, 2), ("ssd", 2, 1)])
def test_quorum_auto_leaves_out_a_slow_worker_as_its_leader_recorded(tmp_path, algorithm,
                                                                     s, staleness):
    # worker 2 is 0.8 s late in every round: server 0 leaves it out after LateWorkers'
    # patience, says so, and records it; the simulator fed that record ends with the
    # job's weights (the order of arrivals is the delays', as above)
    n, slowdown = 3, "delay:2=%s" % SLOW
    locals_, finals, out = _run(tmp_path, n, s, "auto", staleness, slowdown, algorithm,
                                steps=AUTO_STEPS)
    record = json.loads((tmp_path / "auto-rank0.json").read_text())
    assert [(c["worker"], c["change"], c["round"]) for c in record["changes"]] == \
        [(2, "out", LateWorkers.PATIENCE)], record
    assert record["changes"][0]["lag"] > 0.5 and record["excused"] == [2]
    assert "[server 0] ssdsgd server 0: quorum auto: leaving out worker 2 (late by " in out
    assert out.count("quorum auto:") == 1, out[-3000:]
    keys, ref = _reference(n, "auto", staleness, _delays(slowdown, n), algorithm,
                           steps=AUTO_STEPS, excusals=auto_excusals(record))
    assert all(r == [0, 1, 2] for r in ref.rounds[:LateWorkers.PATIENCE]), ref.rounds
    assert [0, 1] in ref.rounds[LateWorkers.PATIENCE:], ref.rounds
    assert ref.applied == [AUTO_STEPS] * n
    _equal_to_the_simulation(keys, ref, locals_, finals, f" (rounds {ref.rounds})")


@pytest.mark.system
def test_quorum_auto_without_a_slow_worker_is_quorum_all_bit_for_bit(tmp_path):
    n, s = 3, 2
    runs = {q: _run(tmp_path / q, n, s, q, 4, "none", "ssd", steps=AUTO_STEPS)
            for q in ("all", "auto")}
    record = json.loads((tmp_path / "auto" / "auto-rank0.json").read_text())
    assert record["changes"] == [] and record["rounds"] == AUTO_STEPS, record
    assert "quorum auto:" not in runs["auto"][2]
    assert not (tmp_path / "all" / "auto-rank0.json").exists()
    for which in (0, 1):                  # before the end, after it
        for r in range(n):
            for name, value in runs["all"][which][r].items():
                np.testing.assert_array_equal(runs["auto"][which][r][name], value,
                                              err_msg=f"worker {r}, {name}")


@pytest.mark.system
def test_a_digits_job_under_quorum_auto_prints_and_records_who_it_left_out(tmp_path):
    job = sets(cluster__workers=3, sync__quorum="auto", debug__slowdown="delay:2=0.3",
               data__batch_size=16, train__epochs=1, train__max_steps=24,
               train__log_interval=8, output__plots="false", output__dir=tmp_path)
    res = jobs.run(["configs/digits.yaml", *job], timeout=240)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    line = [ln for ln in out.splitlines() if "quorum auto: leaving out worker 2" in ln]
    assert len(line) == 1 and line[0].startswith("[server 0] "), out[-4000:]
    run, = [d for d in tmp_path.iterdir() if d.is_dir()]
    summary = json.loads((run / "summary.json").read_text())
    record = summary["quorum_auto"]
    assert record["excused"] == [2] and record["rounds"] >= 24, record
    assert [(c["worker"], c["change"]) for c in record["changes"]] == [(2, "out")]
    assert summary["workers_reporting"] == 3 and summary["final_accuracy"] > 0.5, summary
