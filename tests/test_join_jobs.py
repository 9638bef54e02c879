"""Workers that join a running job (docs/spec/membership.md), end to end: real processes,
real ZeroMQ, real MXNet. A 2-worker job started with SSDSGD_MAX_WORKERS=3 takes a third
worker started with ``launch/dist.py --join RUN_DIR`` while it runs, and ends with the
weights of ``simulate_membership`` fed the join step the job recorded; a joiner the job
cannot take is refused in one line."""
import json
import os
import signal

import mxnet as mx
import pytest

import tiny
from conftest import load_npz
from jobs import dist, launch_args
from ssdsgd.data import epoch_permutation
from ssdsgd.glu.simulate_membership import Change, simulate_membership
from ssdsgd.sync import auto
from ssdsgd.sync.membership import Membership
from ssdsgd.sync.stage import join_boundary
from test_quorum import _trainer_keys
from test_ssd_oracle import _equal_to_the_simulation

N, PER_EPOCH, EPOCHS, BATCH, WAIT_AT = 2, 8, 3, 8, 5
LONG = 24     # chunks per epoch where k may be 10: a join after the warm-up may come at 24
TIMEOUT = 90


def _simulated(joins, algorithm="ssgd", lr_step=0, leaves=None, n=N, per_epoch=PER_EPOCH,
               epochs=EPOCHS, removed=None, **sync):
    """The simulator with the job's membership (``joins``, ``leaves``: rank -> step):
    each member's batch at step t is the chunk ``Membership`` gives it (rule 7).
    ``removed`` (rank -> E): a dead worker the servers drop from E, before its data
    leaves (rule 10): its pushes stop at E, its chunks until its departure go untrained."""
    members = Membership(n, per_epoch, per_epoch * epochs)
    for rank, step in joins.items():
        members.join(rank, step)
    for rank, step in (leaves or {}).items():
        members.leave(rank, step)
    net = tiny.make_net()
    keys = _trainer_keys(net)
    params = tiny.params(net)
    init = {i: params[j].data().copy() for i, j in keys.items()}
    data = tiny.ChunkData(per_epoch * BATCH)
    perms = [epoch_permutation(data.n_train, e, 0) for e in range(epochs)]

    def grad_fn(worker, step, weights):
        epoch, chunk = members.chunk(worker, step)
        x, y = data.train_batch(perms[epoch][chunk * BATCH:(chunk + 1) * BATCH])
        for i, j in keys.items():
            params[j].set_data(weights[i])
        tiny.forward_backward(net, x, y)
        return {i: params[j].grad().copy() for i, j in keys.items()}

    def make_optimizer():
        sched = (mx.lr_scheduler.FactorScheduler(step=lr_step, factor=0.5, base_lr=0.1)
                 if lr_step else None)
        return mx.optimizer.create("sgd", learning_rate=0.1, momentum=0.9,
                                   rescale_grad=1.0 / BATCH, lr_scheduler=sched)

    changes = ([Change(step, "join", rank) for rank, step in joins.items()]
               + [Change((removed or {}).get(rank, step), "leave", rank)
                  for rank, step in (leaves or {}).items()])
    return keys, members, simulate_membership(init, grad_fn, make_optimizer, n, members.end(),
                                              changes, algorithm=algorithm, **sync)


def _job(tmp_path, env, max_workers=3, script_args=(), wait_at=WAIT_AT, per_epoch=PER_EPOCH):
    go = tmp_path / "go"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    args = launch_args(N, 2, ["--out", tmp_path, "--per-epoch", per_epoch, "--epochs", EPOCHS,
                              "--wait-at", wait_at, "--go", go, *script_args],
                       env=dict({"SSDSGD_MAX_WORKERS": max_workers, "SSDSGD_PULL_RELAY": "off",
                                 "SSDSGD_BIGARRAY_BOUND": 100}, **env),
                       script="join_worker.py")
    return dist(["--run-dir", run_dir, *args]), run_dir, go


def _joined_run(tmp_path, env, refused=None, script_args=(), wait_at=WAIT_AT,
                per_epoch=PER_EPOCH, waiting=(), joined=None):
    """A 2-worker job, a third joining while the first two wait at step ``wait_at``
    (once ``waiting``, the ranks said so); ``refused`` (a list): the one-line errors of a
    fourth joiner while the job is at cluster.max_workers, and of one once it has ended;
    ``joined(job)``: called once the servers decided the join, before the two go on."""
    job, run_dir, go = _job(tmp_path, env, script_args=script_args, wait_at=wait_at,
                            per_epoch=per_epoch)
    with job:
        job.wait_for(lambda: (run_dir / "join.json").exists(), 60, "join.json")
        job.wait_for("job started", 60)
        for r in waiting:
            job.wait_for(f"rank {r} waits before step {wait_at}", 60)
        joiner = dist(["--join", run_dir])
        with joiner:
            job.wait_for("asks to join", 60)
            if refused is not None:
                refused.append(_refused(run_dir))
            if joined is not None:
                job.wait_for("worker 2 joins the job at step", 60)
                joined(job)
            go.touch()
            assert joiner.wait(TIMEOUT) == 0, joiner.tail() + "\n" + job.tail()
            assert job.wait(TIMEOUT) == 0, job.tail()
    if refused is not None:
        refused.append(_refused(run_dir))
    records = [json.loads((tmp_path / f"chunks-rank{r}.json").read_text()) for r in range(3)]
    return job, joiner, records


def _refused(run_dir):
    """The one line of a ``--join`` that fails (exit 2)."""
    late = dist(["--join", run_dir])
    with late:
        assert late.wait(60) == 2, late.tail()
    lines = late.stderr.strip().splitlines()
    assert len(lines) == 1, late.stderr
    return lines[0]


def _check(tmp_path, records, algorithm="ssgd", lr_step=0, wait_at=WAIT_AT,
           per_epoch=PER_EPOCH, **sync):
    s = records[2]["joined_from"]
    assert s is not None and s > wait_at, records[2]
    # every worker saw the same join, and trained the chunks Membership gives it
    assert all(r["joins"] == {"2": s} for r in records), records
    keys, members, ref = _simulated({2: s}, algorithm, lr_step, per_epoch=per_epoch, **sync)
    for rank, r in enumerate(records):
        first = 0 if rank < N else s
        assert r["chunks"] == [members.chunk(rank, t)[0] * per_epoch + members.chunk(rank, t)[1]
                               for t in range(first, members.end())], (rank, r)
    # the budget, every chunk once
    assert sorted(c for r in records for c in r["chunks"]) == list(range(
        members.first_chunk(members.end())))
    _equal_to_the_simulation(keys, ref,
                             [load_npz(tmp_path / f"local-rank{r}.npz") for r in range(3)],
                             [load_npz(tmp_path / f"final-rank{r}.npz") for r in range(3)],
                             f" (joined at {s})")
    return s


@pytest.mark.system
def test_a_worker_joins_a_running_ssgd_job_and_it_ends_as_the_simulator(tmp_path):
    """Under an lr schedule that halves the lr every 4 global batches: after the join a
    step counts 3/2 of one (rule 3), which the servers' clock and the simulator's agree on."""
    refused = []
    job, joiner, records = _joined_run(tmp_path, {"SSDSGD_ALGORITHM": "ssgd"}, refused,
                                       ["--lr-step", 4])
    s = _check(tmp_path, records, lr_step=4)
    assert s == WAIT_AT + 1     # the servers held from the step the first two wait at
    assert f"worker 2 joins the job at step {s}" in job.text
    full, ended = refused
    assert "every spare rank is taken" in full and "cluster.max_workers = 3" in full, full
    assert "the job has ended" in ended and str(tmp_path / "run") in ended, ended


@pytest.mark.system
@pytest.mark.parametrize("glu_state", ["exact", "estimate"])
def test_a_worker_joins_a_running_ssd_job_at_a_pull_boundary_as_the_simulator(tmp_path,
                                                                               glu_state):
    """ssd, T_w = 3, k = 2: the first two wait before step 5, the servers hold from 5,
    and the join comes at the first pull boundary T_w + m k with s - 1 - k >= 5: 9.
    The joiner's first reset takes its first pull with no history (rule 5)."""
    job, joiner, records = _joined_run(tmp_path, {"SSDSGD_ALGORITHM": "ssd",
                                                  "SSDSGD_WARMUP_STEPS": 3,
                                                  "SSDSGD_DELAY_STEPS": 2,
                                                  "SSDSGD_GLU_STATE": glu_state})
    s = _check(tmp_path, records, "ssd", warmup_steps=3, delay_steps=2, glu_state=glu_state)
    assert s == 9


@pytest.mark.system
@pytest.mark.parametrize("algorithm", ["ssgd", "ssd"])
def test_a_worker_joins_a_job_whose_pulls_are_relayed_as_the_simulator(tmp_path, algorithm):
    """sync.pull_relay chain: the first two workers pass on the replies they wait for
    together (0 -> 1), and the join's step reaches both through them (a relayed reply
    carries the membership changes a direct one does). The joiner opens no relay (no
    chain was told its address) and is answered directly. ssd: T_w = 3, k = 2."""
    ssd = algorithm == "ssd"
    sync = ({"SSDSGD_WARMUP_STEPS": 3, "SSDSGD_DELAY_STEPS": 2, "SSDSGD_GLU_STATE": "exact"}
            if ssd else {})
    job, joiner, records = _joined_run(tmp_path, {"SSDSGD_ALGORITHM": algorithm,
                                                  "SSDSGD_PULL_RELAY": "chain", **sync})
    _check(tmp_path, records, algorithm,
           **({"warmup_steps": 3, "delay_steps": 2, "glu_state": "exact"} if ssd else {}))
    relayed_in = [r["replies_relayed_in"] for r in records]
    relayed_out = [r["replies_relayed_out"] for r in records]
    assert relayed_out[0] == relayed_in[1] > 0, (relayed_in, relayed_out)
    assert relayed_in[0] == relayed_out[1] == relayed_in[2] == relayed_out[2] == 0, \
        (relayed_in, relayed_out)


@pytest.mark.system
def test_a_worker_joins_an_ssd_job_with_staggered_pulls_as_the_simulator(tmp_path):
    """Staggered pulls (T_w = 3, k = 3, offsets 0 and 1) have no step every worker resets
    at: the join comes k + 1 steps after the step the servers hold from (5, or 4: ssd
    does not wait for step 4 to be applied), when every worker has waited for a pull of
    a later step; the joiner (offset floor(2 k / 2) mod k = 0) starts from w_G(s - 1)."""
    job, joiner, records = _joined_run(tmp_path, {"SSDSGD_ALGORITHM": "ssd",
                                                  "SSDSGD_WARMUP_STEPS": 3,
                                                  "SSDSGD_DELAY_STEPS": 3,
                                                  "SSDSGD_PULL_SCHEDULE": "staggered",
                                                  "SSDSGD_GLU_STATE": "exact"})
    s = _check(tmp_path, records, "ssd", warmup_steps=3, delay_steps=3, glu_state="exact",
               pull_schedule="staggered")
    assert s in (join_boundary("ssd", 3, 3, "staggered")(held) for held in (4, 5)), s


@pytest.mark.system
@pytest.mark.parametrize("wait_at, when", [(2, "in the warm-up"), (3, "at its end"),
                                           (5, "after it"), (3, "while they agree")])
def test_a_worker_joins_an_ssd_job_with_the_defaults_as_the_simulator(tmp_path, wait_at,
                                                                       when):
    """ssd with every sync setting at its default: T_w auto (5 % of a run stated as 12
    steps: 4), k auto, the relay auto (off: the job takes joiners). The join comes in the
    warm-up (the joiner takes part in the agreement on k), at its end (it agrees before
    its first step), after it (the scheduler decides its step from the k agreed, and the
    joiner hears that k at once), or while they agree: worker 1 waits before the warm-up's
    last step, which worker 0 pushed, so the servers hold from step 4 = T_w and the step
    waits until the agreement names k. Every worker runs the k rank 0 chose, and the
    weights are the simulator's with it."""
    agreeing = when == "while they agree"
    job, joiner, records = _joined_run(tmp_path, {
        "SSDSGD_ALGORITHM": "ssd", "SSDSGD_PULL_RELAY": "auto", "SSDSGD_TOTAL_STEPS": 12},
        wait_at=wait_at, per_epoch=LONG, script_args=["--wait-rank", 1] if agreeing else (),
        waiting=[1] if agreeing else ())
    if agreeing:
        assert "worker 2's join waits for the workers' agreement" in job.text, job.tail()
        wait_at += 1        # worker 0 pushed the step worker 1 waits before
    warmup = records[0]["warmup_steps"]
    k = records[0]["delay_steps"]
    assert warmup == 4 and auto.K_MIN <= k <= auto.K_MAX, records[0]
    assert all((r["warmup_steps"], r["delay_steps"]) == (warmup, k) for r in records), records
    s = _check(tmp_path, records, "ssd", wait_at=wait_at, per_epoch=LONG, warmup_steps=warmup,
               delay_steps=k, glu_state="exact")      # the job's default
    assert s == join_boundary("ssd", warmup, k)(wait_at), (s, k)
    if wait_at >= warmup:
        assert (s - warmup) % k == 0 and s - 1 - k >= wait_at, (s, k)
    assert "pull relay off (auto: off, this job cannot relay" in job.text, job.tail()


@pytest.mark.system
@pytest.mark.parametrize("algorithm, codec", [("ssd", "2bit"), ("ssd", "topk"),
                                              ("ssgd", "2bit")])
def test_a_worker_joins_a_job_with_compressed_pushes_as_the_simulator(tmp_path, algorithm,
                                                                      codec):
    """Compression with error feedback (docs/spec/compression.md): the joiner's residual
    starts empty at its first push, as a worker's does at the job's start, and the
    simulator's pusher for it too. ssd: T_w = 3, k = 2, the join at 9; ssgd: at 6."""
    params = {"2bit": {"type": "2bit", "threshold": 0.05},
              "topk": {"type": "topk", "ratio": 0.1}}[codec]
    ssd = ({"SSDSGD_WARMUP_STEPS": 3, "SSDSGD_DELAY_STEPS": 2, "SSDSGD_GLU_STATE": "exact"}
           if algorithm == "ssd" else {})
    job, joiner, records = _joined_run(tmp_path, {"SSDSGD_ALGORITHM": algorithm, **ssd},
                                       script_args=["--compression", json.dumps(params)])
    sync = dict(warmup_steps=3, delay_steps=2, glu_state="exact") if ssd else {}
    s = _check(tmp_path, records, algorithm, compression=params, **sync)
    assert s == (9 if ssd else WAIT_AT + 1)


@pytest.mark.system
def test_a_join_decided_after_the_jobs_last_step_ends_cleanly(tmp_path):
    """ssd, T_w = 3, k = 10, a 12-step job: a join asked before step 5 comes at the
    first pull boundary after it, 23, past the job's end. The joiner trains nothing and
    says so, the job ends cleanly (no node left to stop), and the first two end with the
    weights of the job without the join."""
    job, joiner, records = _joined_run(tmp_path, {"SSDSGD_ALGORITHM": "ssd",
                                                  "SSDSGD_WARMUP_STEPS": 3,
                                                  "SSDSGD_DELAY_STEPS": 10,
                                                  "SSDSGD_GLU_STATE": "exact"})
    assert records[2]["joined_from"] == 23 and records[2]["chunks"] == [], records[2]
    assert "rank 2 joined at step 23, after the job's last step (11): nothing to train" \
        in joiner.text, joiner.tail()
    assert "did not exit" not in job.text, job.tail()
    keys, members, ref = _simulated({}, "ssd", warmup_steps=3, delay_steps=10,
                                    glu_state="exact")
    assert all(r["chunks"] == [members.chunk(r_, t)[0] * PER_EPOCH + members.chunk(r_, t)[1]
                               for t in range(members.end())]
               for r_, r in enumerate(records[:N])), records
    _equal_to_the_simulation(keys, ref,
                             [load_npz(tmp_path / f"local-rank{r}.npz") for r in range(N)],
                             [load_npz(tmp_path / f"final-rank{r}.npz") for r in range(N)],
                             " (a join after the end)")


@pytest.mark.system
@pytest.mark.parametrize("algorithm", ["ssgd", "ssd", "defaults"])
def test_the_training_program_takes_a_joiner_and_trains_every_chunk_once(tmp_path,
                                                                         algorithm):
    """``python -m ssdsgd.train`` (digits): a third worker joins with --join; the
    batches follow the membership (rule 7), so each epoch's chunks are trained once
    whoever trains them, and the summary records the join. ssd: T_w = 8, k = 4 (the
    relay off, quoted: YAML reads a bare off as false); defaults: ssd with T_w, k and the
    relay at auto."""
    from test_e2e_configs import records, run_dir_of, sets
    from test_dynamic_data import BATCH, N_TRAIN
    ssd = ({"sync__warmup_steps": 8, "sync__delay_steps": 4, "sync__pull_relay": '"off"'}
           if algorithm == "ssd" else {})
    job = dist(["configs/digits.yaml", *sets(
        sync__algorithm=algorithm.replace("defaults", "ssd"), cluster__max_workers=3, **ssd,
        data__batch_size=BATCH, train__epochs=3, train__log_interval=4,
        output__plots="false", output__dir=tmp_path,
        debug__slowdown="delay:0=0.1,1=0.1")])
    with job:
        job.wait_for(lambda: any(tmp_path.glob("*/join.json")), 60, "join.json")
        run = run_dir_of(tmp_path)
        job.wait_for("job started", 60)
        joiner = dist(["--join", run])
        with joiner:
            assert joiner.wait(TIMEOUT) == 0, joiner.tail()
            assert job.wait(TIMEOUT) == 0, job.tail()
    assert "rank 2 (joining a job of 2 workers)" in joiner.text, joiner.tail()
    summary = json.loads((run / "summary.json").read_text())
    (joined,) = summary["workers_joined"]
    s = joined["from_step"]
    assert joined["rank"] == 2 and 0 < s, summary
    ends = [records(run, r, "end")[-1] for r in range(3)]
    per_epoch = N_TRAIN // (N * BATCH) * N
    members = Membership(N, per_epoch, per_epoch * 3)
    members.join(2, s)
    assert [e["steps"] for e in ends] == [members.end()] * 3, ends
    # the throughput after the join, by the wall clock (the samples of each membership)
    spans = summary["throughput_by_membership"]
    assert [(x["workers"], x["from_step"]) for x in spans] == [(2, 0), (3, s)], spans
    assert sum(x["samples"] for x in spans) == members.first_chunk(members.end()) * BATCH
    assert all(x["samples_per_sec"] > 0 for x in spans), spans
    assert f"3 workers, steps {s}-{members.end() - 1}: " in job.text, job.tail()
    each_epoch_once(ends, per_epoch, BATCH, 3, dropped=2)
    assert summary["final_accuracy"] > 0.8, summary
    if algorithm == "defaults":
        assert summary["choices"]["delay_steps"]["why"].startswith("auto"), summary
        assert summary["choices"]["pull_relay"]["value"] == "off", summary
        assert {e["kv"]["delay_steps"] for e in ends} == {summary["delay_steps"]}, ends


@pytest.mark.system
def test_the_training_program_ends_cleanly_when_a_join_comes_after_its_last_step(tmp_path):
    """``python -m ssdsgd.train``, ssd with k = 10 and T_w = 3 over one epoch of 11 steps
    (2 workers, batch 64, 1.5 s a step): a joiner started once rank 0 has logged step 4
    comes at a pull boundary 3 + 10 m with m >= 2, past step 10. It trains nothing and
    says so; the job ends cleanly and its summary records the join."""
    from test_e2e_configs import records, run_dir_of, sets
    from test_dynamic_data import N_TRAIN
    batch = 64
    job = dist(["configs/digits.yaml", *sets(
        sync__algorithm="ssd", sync__warmup_steps=3, sync__delay_steps=10,
        sync__pull_relay='"off"', cluster__max_workers=3, data__batch_size=batch,
        train__epochs=1, train__log_interval=1, output__plots="false",
        output__dir=tmp_path, debug__slowdown="delay:0=1.5,1=1.5")])
    with job:
        job.wait_for(lambda: any(tmp_path.glob("*/join.json")), 60, "join.json")
        run = run_dir_of(tmp_path)
        job.wait_for(lambda: any(r["step"] >= 4 for r in records(run, 0, "train")), 60,
                     "rank 0 at step 4")
        joiner = dist(["--join", run])
        with joiner:
            assert joiner.wait(TIMEOUT) == 0, joiner.tail() + "\n" + job.tail()
            assert job.wait(TIMEOUT) == 0, job.tail()
    steps = N_TRAIN // (N * batch)
    summary = json.loads((run / "summary.json").read_text())
    (joined,) = summary["workers_joined"]
    s = joined["from_step"]
    assert s >= steps and (s - 3) % 10 == 0, summary
    assert (f"rank 2 joined at step {s}, after the job's last step ({steps - 1}): "
            "nothing to train") in joiner.text, joiner.tail()
    assert "did not exit" not in job.text, job.tail()
    ends = [records(run, r, "end")[-1] for r in range(3)]
    assert ends[2]["samples"] == 0 and ends[2]["steps"] == s, ends[2]
    each_epoch_once(ends, steps * N, batch, 1, dropped=0)


def each_epoch_once(ends, per_epoch, batch, epochs, dropped):
    """The workers' end records (their ``data``) trained each epoch's chunks once, whoever
    trained them; the last epoch drops the chunks of a step that does not fit (at most
    ``dropped``: the largest membership less one)."""
    from test_dynamic_data import N_TRAIN
    for e in range(epochs):
        got = [end["data"].get(str(e), {}) for end in ends]
        perm = epoch_permutation(N_TRAIN, e, 0)[:per_epoch * batch].astype("int64")
        batches = sum(g.get("batches", 0) for g in got)
        if e < epochs - 1:
            assert batches == per_epoch, (e, got)
            assert sum(g.get("index_sum", 0) for g in got) == int(perm.sum()), e
        else:
            assert per_epoch - dropped <= batches <= per_epoch, (e, got)


@pytest.mark.system
def test_a_join_then_a_killed_server_with_replicas_ends_as_the_simulator(tmp_path):
    """cluster.server_replicas: 1 (2 servers) beside cluster.max_workers: every server
    holds and admits the joiner for the keys it owns and those it backs up (one policy
    holds both), and the joiner copies its requests to the backups as every worker does.
    Server 0 SIGKILLed once the join is decided, before the joiner's first step is
    applied: its backup takes its keys, and the job ends with the simulator's weights."""
    from test_recovery import role_of

    def kill_server_0(job):
        victim, = [p for p in job.processes() if role_of(p) == ("server", 0)]
        os.kill(victim, signal.SIGKILL)
        job.wait_for("server 1 owns its keys from now on", 60)
    job, joiner, records = _joined_run(tmp_path, {
        "SSDSGD_ALGORITHM": "ssgd", "SSDSGD_SERVER_REPLICAS": 1,
        "SSDSGD_HEARTBEAT_INTERVAL": 0.2, "SSDSGD_HEARTBEAT_TIMEOUT": 1},
        waiting=(0, 1), joined=kill_server_0)
    assert "server 0 (pid" in job.text and "its backup takes its keys" in job.text
    assert _check(tmp_path, records) == WAIT_AT + 1


@pytest.mark.system
@pytest.mark.parametrize("algorithm", ["ssgd", "ssd"])
def test_a_killed_scheduler_of_a_job_a_worker_joined_is_restarted_as_the_simulator(
        tmp_path, algorithm):
    """cluster.scheduler_restarts beside cluster.max_workers: the scheduler SIGKILLed
    once a join is decided (ssd: with k auto, after the workers agreed on it). The
    restarted scheduler takes back the joiner (a rank above the first workers) with
    the others, and the joins, departures and agreements the lost one recorded; the
    job ends with the simulator's weights, no server or worker restarted."""
    from test_scheduler_restart import kill_the_scheduler
    env = {"SSDSGD_ALGORITHM": algorithm, "SSDSGD_SCHEDULER_RESTARTS": 1,
           "SSDSGD_HEARTBEAT_INTERVAL": 0.2, "SSDSGD_HEARTBEAT_TIMEOUT": 1}
    sync = {}
    if algorithm == "ssd":
        env.update(SSDSGD_WARMUP_STEPS=3, SSDSGD_GLU_STATE="exact")
    per_epoch = LONG if algorithm == "ssd" else PER_EPOCH    # k auto may choose 10
    job, joiner, records = _joined_run(tmp_path, env, waiting=(0, 1), per_epoch=per_epoch,
                                       joined=lambda job: kill_the_scheduler(job, 120))
    assert "worker 2: rejoined the job with the restarted scheduler" in joiner.text, \
        joiner.tail()
    if algorithm == "ssd":
        sync = {"warmup_steps": 3, "delay_steps": records[0]["delay_steps"],
                "glu_state": "exact"}
    _check(tmp_path, records, algorithm, per_epoch=per_epoch, **sync)
