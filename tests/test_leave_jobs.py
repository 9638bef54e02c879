"""Workers that leave a running job at a step every worker hears of in time
(docs/spec/membership.md), end to end: real processes, real ZeroMQ, real MXNet. A
3-worker job started with SSDSGD_MAX_WORKERS=4 lets worker 2 go, asked with
``launch/dist.py --leave RUN_DIR --rank 2`` while it runs; it ends with the weights of
``simulate_membership`` fed the step the job decided, and every chunk of the budget is
trained once. A departure the job cannot take is refused in one line."""
import contextlib
import json
import re

import pytest

from conftest import load_npz
from jobs import dist, launch_args
from ssdsgd.sync.membership import Membership
from test_join_jobs import _simulated, each_epoch_once
from test_ssd_oracle import _close, _equal_to_the_simulation

N, PER_EPOCH, EPOCHS, BATCH, WAIT_AT = 3, 9, 4, 8, 5
TIMEOUT = 90


def _refused(run_dir, rank):
    """The one line of a ``--leave`` that fails (exit 2)."""
    late = dist(["--leave", run_dir, "--rank", rank])
    with late:
        assert late.wait(TIMEOUT) == 2, late.tail()
    lines = late.stderr.strip().splitlines()
    assert len(lines) == 1, late.stderr
    return lines[0]


@contextlib.contextmanager
def _keys_swapped(path, holder, rank):
    """join.json with worker ``holder``'s key file listed for ``rank`` (still 0600)."""
    original = path.read_text()
    data = json.loads(original)
    data["workers"][str(rank)] = data["workers"][str(holder)]
    path.write_text(json.dumps(data))
    try:
        yield
    finally:
        path.write_text(original)


def _left_run(tmp_path, env, refused=None, per_epoch=PER_EPOCH, script_args=(), leaving=2,
              n=N, last=None, first=None, left=None):
    """An ``n``-worker job (3); worker ``leaving`` asked to leave while all wait before
    step WAIT_AT. ``refused``: the one-line errors of --leave for a rank the job never
    had, for worker 2 again, with worker 1's key for worker 2, and once the job has
    ended (worker 0 may leave like any worker: tests below). ``last``: the one line of
    --leave for the last worker still in the job, worker n - 1, once ``leaving`` left.
    ``first``: the one line of --leave for worker 0 asked before ``leaving`` is.
    ``left(job)``: called once the departure is decided and the workers were told to go
    on."""
    go = tmp_path / "go"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    args = launch_args(n, 2, ["--out", tmp_path, "--per-epoch", per_epoch, "--epochs", EPOCHS,
                              "--wait-at", WAIT_AT, "--go", go, *script_args],
                       env=dict({"SSDSGD_MAX_WORKERS": n + 1, "SSDSGD_PULL_RELAY": "off",
                                 "SSDSGD_BIGARRAY_BOUND": 100}, **env),
                       script="join_worker.py")
    job = dist(["--run-dir", run_dir, *args])
    with job:
        job.wait_for(lambda: (run_dir / "join.json").exists(), 60, "join.json")
        job.wait_for("job started", 60)
        for r in range(n):      # all three have pushed every step before WAIT_AT
            job.wait_for(f"rank {r} waits before step {WAIT_AT}", 60)
        if first is not None:
            first.append(_refused(run_dir, 0))
        leaver = dist(["--leave", run_dir, "--rank", leaving])
        with leaver:
            assert leaver.wait(TIMEOUT) == 0, leaver.tail()
        if last is not None:
            last.append(_refused(run_dir, n - 1))
        if refused is not None:
            refused += [_refused(run_dir, 7), _refused(run_dir, 2)]
            with _keys_swapped(run_dir / "join.json", 1, 2):
                refused.append(_refused(run_dir, 2))
        go.touch()
        if left is not None:
            left(job)
        assert job.wait(TIMEOUT) == 0, job.tail()
    if refused is not None:
        refused.append(_refused(run_dir, 1))
    records = [json.loads((tmp_path / f"chunks-rank{r}.json").read_text()) for r in range(n)]
    return job, leaver, records


def _check(tmp_path, records, algorithm="ssgd", per_epoch=PER_EPOCH, leaving=2, n=N,
           **sync):
    s = records[0]["leaves"][str(leaving)]
    assert s >= WAIT_AT, records[0]
    assert all(r["leaves"] == {str(leaving): s} for r in records), records
    assert records[leaving]["end"] == s, records[leaving]   # it pushed the steps before s only
    keys, members, ref = _simulated({}, algorithm, leaves={leaving: s}, n=n,
                                    per_epoch=per_epoch,
                                    epochs=EPOCHS, **sync)
    for rank, r in enumerate(records):
        assert r["chunks"] == [members.chunk(rank, t)[0] * per_epoch + members.chunk(rank, t)[1]
                               for t in range(min(members.end(), r["end"]))], (rank, r)
    assert sorted(c for r in records for c in r["chunks"]) == list(range(
        members.first_chunk(members.end())))
    locals_ = [load_npz(tmp_path / f"local-rank{r}.npz") for r in range(n)]
    finals = [load_npz(tmp_path / f"final-rank{r}.npz") for r in range(n)]
    for r in range(n):
        for i, j in keys.items():
            _close(locals_[r][f"p{j}"], ref.worker_weights[r][i].asnumpy(),
                   f"worker {r} local weights of key {i} (left at {s})")
            if r != leaving:    # the leaver ends with the weights of its own last step
                _close(finals[r][f"p{j}"], ref.global_weights[i].asnumpy(),
                       f"worker {r} final global weights of key {i} (left at {s})")
    return s


@pytest.mark.system
def test_a_worker_leaves_a_running_ssgd_job_and_it_ends_as_the_simulator(tmp_path):
    refused = []
    job, leaver, records = _left_run(tmp_path, {"SSDSGD_ALGORITHM": "ssgd"}, refused)
    s = _check(tmp_path, records)
    assert s == WAIT_AT + 1     # the servers held from the step the three wait at
    assert f"worker 2 leaves the job of {tmp_path / 'run'} at step {s}" in leaver.text
    assert f"worker 2 leaves the job at step {s}" in job.text, job.tail()
    unknown, again, others_key, ended = refused
    assert "has no worker 7" in unknown, unknown
    assert "worker 2 is leaving already" in again, again
    assert "a connection holding worker 1's key cannot make worker 2 leave" in others_key, \
        others_key
    assert "the job has ended" in ended, ended


@pytest.mark.system
def test_a_worker_leaves_a_running_ssd_job_at_a_pull_boundary_as_the_simulator(tmp_path):
    """ssd, T_w = 3, k = 2, glu exact: the three wait before step 5, having pushed step 4
    (which the servers may not have applied yet: ssd does not wait for it), so the
    servers hold from 5, or from 4, and the departure comes at the first pull boundary
    T_w + m k with s - 1 - k >= that step: 9, or 7."""
    job, leaver, records = _left_run(tmp_path, {"SSDSGD_ALGORITHM": "ssd",
                                                "SSDSGD_WARMUP_STEPS": 3,
                                                "SSDSGD_DELAY_STEPS": 2,
                                                "SSDSGD_GLU_STATE": "exact"})
    assert _check(tmp_path, records, "ssd", warmup_steps=3, delay_steps=2,
                  glu_state="exact") in (7, 9)


@pytest.mark.system
@pytest.mark.parametrize("n", [2, 3])
def test_worker_0_leaves_a_running_ssgd_job_and_it_ends_as_the_simulator(tmp_path, n):
    """Worker 0 goes like any worker (docs/spec/membership.md rule 8): from its step on
    the others train its chunks and the servers aggregate without it; the job ends with
    ``simulate_membership``'s weights fed that step. With 2 workers worker 1 is then the
    last one, and may not leave: one line."""
    refused = [] if n == 2 else None
    job, leaver, records = _left_run(tmp_path, {"SSDSGD_ALGORITHM": "ssgd"}, leaving=0, n=n,
                                     last=refused)
    s = _check(tmp_path, records, leaving=0, n=n)
    assert s == WAIT_AT + 1
    assert f"worker 0 leaves the job of {tmp_path / 'run'} at step {s}" in leaver.text
    assert f"worker 0 leaves the job at step {s}" in job.text, job.tail()
    if n == 2:
        (last,) = refused
        assert "worker 1 cannot leave: worker 1 is the last worker in the job" in last, last


@pytest.mark.system
def test_after_worker_0_left_a_killed_scheduler_is_restarted_as_the_simulator(tmp_path):
    """cluster.scheduler_restarts beside a departure: worker 0 leaves (--leave) and its
    process ends, then the scheduler is SIGKILLed while workers 1 and 2 train (paced:
    timing only). The restarted scheduler takes the two back without waiting for
    worker 0, which left and is not lost, and the job ends with ``simulate_membership``'s
    weights fed the departure's step."""
    from test_scheduler_restart import kill_the_scheduler, restart_took
    per_epoch = 2 * PER_EPOCH       # 27 steps of the two after the departure, 0.3 s each

    def kill_the_scheduler_once_worker_0_ended(job):
        job.wait_for(lambda: job.running("worker", 0) is None, 60,
                     "worker 0's process to end after it left")
        kill_the_scheduler(job, 60)
    job, leaver, records = _left_run(
        tmp_path, {"SSDSGD_ALGORITHM": "ssgd", "SSDSGD_SCHEDULER_RESTARTS": 1,
                   "SSDSGD_HEARTBEAT_INTERVAL": 0.2, "SSDSGD_HEARTBEAT_TIMEOUT": 1},
        per_epoch=per_epoch, script_args=("--pace", 0.3), leaving=0,
        left=kill_the_scheduler_once_worker_0_ended)
    assert _check(tmp_path, records, per_epoch=per_epoch, leaving=0) == WAIT_AT + 1
    for r in (1, 2):
        assert f"worker {r}: rejoined the job with the restarted scheduler" in job.text, \
            job.tail()
    line, took = restart_took(job.text)
    assert took < 15, line      # worker 0 was not waited for


@pytest.mark.system
def test_worker_0_leaves_a_running_ssd_job_at_a_pull_boundary_as_the_simulator(tmp_path):
    """ssd, T_w = 3, k = 2, glu exact (pinned: no choice of worker 0's pending), worker 0
    leaving: the departure comes at a pull boundary, 7 or 9, and every worker's weights
    are the simulator's (worker 0's local ones those of its last step)."""
    job, leaver, records = _left_run(tmp_path, {"SSDSGD_ALGORITHM": "ssd",
                                                "SSDSGD_WARMUP_STEPS": 3,
                                                "SSDSGD_DELAY_STEPS": 2,
                                                "SSDSGD_GLU_STATE": "exact"}, leaving=0)
    assert _check(tmp_path, records, "ssd", warmup_steps=3, delay_steps=2,
                  glu_state="exact", leaving=0) in (7, 9)


@pytest.mark.system
def test_worker_0_may_not_leave_before_the_workers_agreed_on_its_auto_choice(tmp_path):
    """ssd with k at auto (T_w = 8): k is worker 0's choice at the end of the warm-up,
    which the others take at a barrier; asked to leave before that (the workers wait
    before step 5) worker 0 is refused in one line naming the cause, and the job goes on
    (worker 2 then leaves, and it ends as the simulator with the k they agreed on)."""
    first = []
    job, leaver, records = _left_run(tmp_path, {"SSDSGD_ALGORITHM": "ssd",
                                                "SSDSGD_WARMUP_STEPS": 8,
                                                "SSDSGD_GLU_STATE": "exact"},
                                     per_epoch=27, first=first)
    (line,) = first
    assert ("worker 0 cannot leave: worker 0 cannot leave yet: its choice of "
            "sync.delay_steps (auto)") in line, line
    k = records[0]["delay_steps"]     # worker 2 left in the warm-up, before the choice
    assert k and records[1]["delay_steps"] == k, records
    assert _check(tmp_path, records, "ssd", per_epoch=27, warmup_steps=8, delay_steps=k,
                  glu_state="exact") == WAIT_AT + 1


@pytest.mark.system
def test_a_worker_leaves_an_ssd_job_with_staggered_pulls_as_the_simulator(tmp_path):
    """Staggered pulls (3 workers, T_w = 3, k = 3: offsets 0, 1, 2): the departure
    comes k + 1 steps after the step the servers hold from (5, or 4), when every worker
    has waited for a pull of a later step."""
    job, leaver, records = _left_run(tmp_path, {"SSDSGD_ALGORITHM": "ssd",
                                                "SSDSGD_WARMUP_STEPS": 3,
                                                "SSDSGD_DELAY_STEPS": 3,
                                                "SSDSGD_PULL_SCHEDULE": "staggered",
                                                "SSDSGD_GLU_STATE": "exact"})
    assert _check(tmp_path, records, "ssd", warmup_steps=3, delay_steps=3, glu_state="exact",
                  pull_schedule="staggered") in (8, 9)


@pytest.mark.system
@pytest.mark.parametrize("leaving", [0, 1, 2])
def test_a_worker_leaves_a_job_whose_pulls_are_relayed_as_the_simulator(tmp_path, leaving):
    """sync.pull_relay chain (3 workers, ssd, T_w = 3, k = 2): the replies the workers wait
    for together go 0 -> 1 -> 2, and the departure's step reaches every worker through
    them (a relayed reply carries the membership changes a direct one does). Worker 1
    leaves the middle of the chain, worker 2 its end, or worker 0 its head: from the
    departure on, the chain is the workers still pulling."""
    job, leaver, records = _left_run(tmp_path, {"SSDSGD_ALGORITHM": "ssd",
                                                "SSDSGD_WARMUP_STEPS": 3,
                                                "SSDSGD_DELAY_STEPS": 2,
                                                "SSDSGD_GLU_STATE": "exact",
                                                "SSDSGD_PULL_RELAY": "chain"},
                                     leaving=leaving)
    assert _check(tmp_path, records, "ssd", warmup_steps=3, delay_steps=2, glu_state="exact",
                  leaving=leaving) in (7, 9)
    relayed_in = [r["replies_relayed_in"] for r in records]
    relayed_out = [r["replies_relayed_out"] for r in records]
    # (each worker's counts as of its last step: the final pull in ``close`` is not in them)
    assert relayed_in[0] == 0 and relayed_out[2] == 0, (relayed_in, relayed_out)
    assert min(relayed_in[1:]) > 0 and relayed_out[0] > 0, (relayed_in, relayed_out)
    if leaving == 1:    # once it left, worker 0 passed the pieces on to worker 2 itself
        assert relayed_out[0] > relayed_in[1], (relayed_in, relayed_out)


@pytest.mark.system
def test_a_worker_leaves_an_ssd_job_with_the_defaults_as_the_simulator(tmp_path):
    """ssd with every sync setting at its default (T_w auto of a run stated as 12 steps:
    4; k and the relay auto): the departure, asked after the warm-up, comes at a pull
    boundary of the k the workers agreed on, which the scheduler kept."""
    job, leaver, records = _left_run(tmp_path, {"SSDSGD_ALGORITHM": "ssd",
                                                "SSDSGD_PULL_RELAY": "auto",
                                                "SSDSGD_TOTAL_STEPS": 12}, per_epoch=27)
    warmup, k = records[0]["warmup_steps"], records[0]["delay_steps"]
    assert warmup == 4 and all(r["delay_steps"] == k for r in records), records
    s = _check(tmp_path, records, "ssd", per_epoch=27, warmup_steps=warmup, delay_steps=k,
               glu_state="exact")
    assert (s - warmup) % k == 0 and s - 1 - k >= WAIT_AT - 1, (s, k)


@pytest.mark.system
def test_a_worker_leaves_an_ssd_job_with_2bit_pushes_as_the_simulator(tmp_path):
    """The leaver's residual goes with it; the others' error feedback is untouched."""
    params = {"type": "2bit", "threshold": 0.05}
    job, leaver, records = _left_run(tmp_path, {"SSDSGD_ALGORITHM": "ssd",
                                                "SSDSGD_WARMUP_STEPS": 3,
                                                "SSDSGD_DELAY_STEPS": 2,
                                                "SSDSGD_GLU_STATE": "exact"},
                                     script_args=["--compression", json.dumps(params)])
    assert _check(tmp_path, records, "ssd", warmup_steps=3, delay_steps=2,
                  glu_state="exact", compression=params) in (7, 9)


@pytest.mark.system
@pytest.mark.parametrize("algorithm", ["ssgd", "ssd"])
def test_the_training_program_lets_a_worker_go_and_trains_every_chunk_once(tmp_path,
                                                                          algorithm):
    """``python -m ssdsgd.train`` (digits, 3 workers, cluster.max_workers 4): worker 2
    leaves with --leave; it ends its part at the decided step, the other two train its
    chunks from then on (rule 7), so each epoch's chunks are trained once, and the
    summary records the departure and the throughput of each membership. ssd: T_w = 8,
    k = 4 (the relay off, quoted: YAML reads a bare off as false)."""
    from test_e2e_configs import records, run_dir_of, sets
    from test_dynamic_data import BATCH as B, N_TRAIN
    ssd = ({"sync__warmup_steps": 8, "sync__delay_steps": 4, "sync__pull_relay": '"off"'}
           if algorithm == "ssd" else {})
    job = dist(["configs/digits.yaml", *sets(
        sync__algorithm=algorithm, cluster__workers=N, cluster__max_workers=N + 1, **ssd,
        data__batch_size=B, train__epochs=3, train__log_interval=4,
        output__plots="false", output__dir=tmp_path,
        debug__slowdown="delay:0=0.1,1=0.1,2=0.1")])
    with job:
        job.wait_for(lambda: any(tmp_path.glob("*/join.json")), 60, "join.json")
        run = run_dir_of(tmp_path)
        job.wait_for("job started", 60)
        leaver = dist(["--leave", run, "--rank", 2])
        with leaver:
            assert leaver.wait(TIMEOUT) == 0, leaver.tail()
        assert job.wait(TIMEOUT) == 0, job.tail()
    summary = json.loads((run / "summary.json").read_text())
    (left,) = summary["workers_left"]
    s = left["from_step"]
    assert left["rank"] == 2 and left["how"] == "left" and 0 < s, summary
    assert f"rank 2 left the job at step {s}" in job.text, job.tail()
    ends = [records(run, r, "end")[-1] for r in range(N)]
    per_epoch = N_TRAIN // (N * B) * N
    members = Membership(N, per_epoch, per_epoch * 3)
    members.leave(2, s)
    assert [e["steps"] for e in ends] == [members.end(), members.end(), s], ends
    spans = summary["throughput_by_membership"]
    assert [(x["workers"], x["from_step"]) for x in spans] == [(3, 0), (2, s)], spans
    assert sum(x["samples"] for x in spans) == members.first_chunk(members.end()) * B
    each_epoch_once(ends, per_epoch, B, 3, dropped=1)
    assert summary["final_accuracy"] > 0.8, summary


@pytest.mark.system
@pytest.mark.parametrize("algorithm, die_at, dead", [("ssgd", 5, 2), ("ssd", 2, 2),
                                                     ("ssgd", 5, 0), ("ssd", 2, 0)])
def test_with_continue_a_dead_worker_leaves_a_job_that_takes_joiners_as_the_simulator(
        tmp_path, algorithm, die_at, dead):
    """cluster.on_worker_failure: continue beside cluster.max_workers (the command form,
    ``--env SSDSGD_ON_WORKER_FAILURE=continue``): worker ``dead`` (2, or 0, the chief)
    SIGKILLs itself before step ``die_at``, every step before it applied (ssgd; ssd in
    its warm-up, T_w = 3, k = 2). The servers aggregate without it from E = ``die_at``;
    its data leaves at a step s every worker hears of in time (docs/spec/membership.md
    rule 10): its chunks of the steps E..s-1 go untrained, the two others train every
    other chunk of the budget once, and they end with ``simulate_membership``'s weights
    (its pushes stop at E, the data follows s)."""
    sync = ({"warmup_steps": 3, "delay_steps": 2, "glu_state": "exact"}
            if algorithm == "ssd" else {})
    env = {f"SSDSGD_{k.upper()}": v for k, v in sync.items()}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    args = launch_args(N, 2, ["--out", tmp_path, "--per-epoch", PER_EPOCH, "--epochs", EPOCHS,
                              "--die-at", die_at, "--die-rank", dead],
                       env=dict({"SSDSGD_MAX_WORKERS": N + 1, "SSDSGD_PULL_RELAY": "off",
                                 "SSDSGD_BIGARRAY_BOUND": 100, "SSDSGD_ALGORITHM": algorithm,
                                 "SSDSGD_ON_WORKER_FAILURE": "continue",
                                 "SSDSGD_HEARTBEAT_INTERVAL": 0.2,
                                 "SSDSGD_HEARTBEAT_TIMEOUT": 1}, **env),
                       script="join_worker.py")
    job = dist(["--run-dir", run_dir, *args])
    with job:
        assert job.wait(TIMEOUT) == 0, job.tail()
    assert f"worker {dead} (pid" in job.text and "the job continues without it" in \
        job.text, job.tail()
    alive = [r for r in range(N) if r != dead]
    records = [json.loads((tmp_path / f"chunks-rank{r}.json").read_text()) for r in alive]
    assert not (tmp_path / f"chunks-rank{dead}.json").exists()
    assert all(r["removed"] == {str(dead): die_at} for r in records), records
    decided = re.findall(rf"worker {dead}'s chunks go to the 2 others from step (\d+)",
                         job.text)
    heard = {r["leaves"][str(dead)] for r in records if str(dead) in r["leaves"]}
    assert len(heard) <= 1 and all(set(r["leaves"]) <= {str(dead)} for r in records), records
    if heard:
        s = heard.pop()
        assert s > die_at and decided == [str(s)], (records, job.tail())
        # a worker that did not hear of it had taken its last step before s
        assert all(r["end"] <= s for r in records if not r["leaves"]), records
        if algorithm == "ssd":
            assert s > 3 and (s - 3) % 2 == 0, s      # a pull boundary after the warm-up
    else:
        # on a loaded machine the data's leave can be decided after the survivors' last
        # step (a CI run: removed at 5, the others' steps 5..11 done before it): no step
        # heard of it, so every chunk of the dead worker's from die_at on goes untrained
        # (rule 10, s at or past the end); the launcher names a step past the end, if any
        s = records[0]["end"]
        assert all(int(x) >= s for x in decided), (decided, job.tail())
    keys, members, ref = _simulated({}, algorithm, leaves={dead: s}, removed={dead: die_at},
                                    n=N,
                                    per_epoch=PER_EPOCH, epochs=EPOCHS, **sync)

    def chunk(rank, t):
        epoch, c = members.chunk(rank, t)
        return epoch * PER_EPOCH + c
    end = members.end()
    for rank, r in zip(alive, records):
        assert r["end"] == end and r["chunks"] == [chunk(rank, t) for t in range(end)], r
    # steps die_at..s-1 of the dead worker go untrained; on a loaded machine the data's leave
    # can be decided after the budget's last step (s >= end: a 12-step job): then every
    # step of it from die_at on (a CI run had s past the end, and this failed on None)
    lost = {chunk(dead, t) for t in range(die_at, min(s, end))}
    before = {chunk(dead, t) for t in range(die_at)}
    assert sorted(c for r in records for c in r["chunks"]) == sorted(
        set(range(members.first_chunk(end))) - lost - before)
    _equal_to_the_simulation(keys, ref,
                             [load_npz(tmp_path / f"local-rank{r}.npz") for r in alive],
                             [load_npz(tmp_path / f"final-rank{r}.npz") for r in alive],
                             f" (removed at {die_at}, data left at {s})", ranks=alive)


@pytest.mark.system
@pytest.mark.parametrize("dead", [2, 0])
def test_the_training_program_with_continue_hands_a_dead_workers_chunks_to_the_others(
        tmp_path, dead):
    """``python -m ssdsgd.train`` (digits, ssgd, 3 workers, cluster.max_workers 4,
    on_worker_failure continue): worker ``dead`` (2, or 0, the chief) SIGKILLed while
    the job runs. The summary (worker 1's when worker 0 died: the lowest rank left is
    the chief) names it removed from the step E the servers lacked, its data leaving at
    s >= E (rule 10); the two others train every chunk of the budget but the dead
    worker's of the steps before s, and the throughput spans follow the data's
    membership."""
    import os
    import signal
    from test_dynamic_data import BATCH as B, N_TRAIN
    from test_e2e_configs import records, sets
    from test_recovery import role_of, wait_for_step
    root = tmp_path / "runs"
    alive = [r for r in range(N) if r != dead]
    job = dist(["configs/digits.yaml", *sets(
        sync__algorithm="ssgd", cluster__workers=N, cluster__max_workers=N + 1,
        cluster__on_worker_failure="continue", cluster__heartbeat_interval=0.2,
        cluster__heartbeat_timeout=1.0, data__batch_size=B, train__epochs=3,
        train__log_interval=4, output__plots="false", output__dir=root,
        debug__slowdown=f"delay:{alive[0]}=0.05")], merge=True)
    with job:
        run = wait_for_step(job, root, 8)
        victim, = [c for c in job.processes() if role_of(c) == ("worker", dead)]
        os.kill(victim, signal.SIGKILL)
        assert job.wait(TIMEOUT) == 0, job.tail()
    summary = json.loads((run / "summary.json").read_text())
    (left,) = summary["workers_left"]
    e, s = left["from_step"], left["data_from_step"]
    assert left["rank"] == dead and left["how"] == "removed" and 8 <= e <= s, summary
    assert f"worker {dead}'s chunks go to the 2 others from step {s}" in job.text, job.tail()
    per_epoch = N_TRAIN // (N * B) * N
    members = Membership(N, per_epoch, per_epoch * 3)
    members.leave(dead, s)
    ends = [records(run, r, "end")[-1] for r in alive]
    assert [x["steps"] for x in ends] == [members.end()] * 2, ends
    trained = sum(d.get("batches", 0) for x in ends for d in x["data"].values())
    assert trained == members.first_chunk(members.end()) - s    # the dead one had one a step
    spans = summary["throughput_by_membership"]
    assert [(x["workers"], x["from_step"]) for x in spans] == [(3, 0), (2, s)], spans
    # the samples the servers applied: every chunk but the dead worker's of steps E..s-1
    assert sum(x["samples"] for x in spans) == \
        (members.first_chunk(members.end()) - (s - e)) * B, (spans, e, s)
    assert summary["final_accuracy"] > 0.8, summary


@pytest.mark.system
@pytest.mark.parametrize("algorithm", ["ssgd", "ssd"])
def test_the_training_program_lets_worker_0_go_and_worker_1_becomes_the_chief(tmp_path,
                                                                             algorithm):
    """``python -m ssdsgd.train`` (digits, 3 workers, cluster.max_workers 4, a checkpoint
    every epoch): worker 0 leaves with --leave once the job has started. From its step on
    worker 1, the lowest rank left, is the chief (docs/spec/membership.md rule 8): it
    validates at the epoch ends after it, takes the checkpoints (latest.json), reports
    the final test accuracy and writes summary.json, which records worker 0's
    departure; every chunk of the budget is trained once, the job exits 0 and nothing
    of it is left running. ssd: T_w = 8, k = 4 (pinned: no choice of worker 0's pending)."""
    from test_e2e_configs import records, run_dir_of, sets
    from test_dynamic_data import BATCH as B, N_TRAIN
    ssd = ({"sync__warmup_steps": 8, "sync__delay_steps": 4, "sync__pull_relay": '"off"'}
           if algorithm == "ssd" else {})
    job = dist(["configs/digits.yaml", *sets(
        sync__algorithm=algorithm, cluster__workers=N, cluster__max_workers=N + 1, **ssd,
        data__batch_size=B, train__epochs=3, train__log_interval=4,
        train__checkpoint_every=1, output__plots="false", output__dir=tmp_path,
        debug__slowdown="delay:0=0.1,1=0.1,2=0.1")])
    with job:
        job.wait_for(lambda: any(tmp_path.glob("*/join.json")), 60, "join.json")
        run = run_dir_of(tmp_path)
        job.wait_for("job started", 60)
        leaver = dist(["--leave", run, "--rank", 0])
        with leaver:
            assert leaver.wait(TIMEOUT) == 0, leaver.tail()
        assert job.wait(TIMEOUT) == 0, job.tail()
        assert job.processes() == [], job.processes()     # nothing of it left running
    summary = json.loads((run / "summary.json").read_text())
    (left,) = summary["workers_left"]
    s = left["from_step"]
    assert left["rank"] == 0 and left["how"] == "left" and 0 < s, summary
    assert f"rank 0 left the job at step {s}" in job.text, job.tail()
    per_epoch = N_TRAIN // (N * B) * N
    members = Membership(N, per_epoch, per_epoch * 3)
    members.leave(0, s)
    ends = [records(run, r, "end")[-1] for r in range(N)]
    assert [e["steps"] for e in ends] == [s, members.end(), members.end()], ends
    each_epoch_once(ends, per_epoch, B, 3, dropped=1)
    spans = summary["throughput_by_membership"]
    assert [(x["workers"], x["from_step"]) for x in spans] == [(3, 0), (2, s)], spans
    # the chief's part: worker 0's until step s, worker 1's from then on
    assert all(v["step"] <= s for v in records(run, 0, "val")), records(run, 0, "val")
    vals1 = records(run, 1, "val")
    assert vals1 and all(v["step"] >= s for v in vals1) and not records(run, 2, "val")
    assert summary["final_accuracy"] == vals1[-1]["accuracy"] > 0.8, summary
    assert summary["steps"] == members.end() and summary["workers_reporting"] == N, summary
    done = [line for line in job.text.splitlines() if "done: test accuracy" in line]
    assert len(done) == 1 and "[worker 1]" in done[0], done
    latest = json.loads((run / "checkpoints" / "latest.json").read_text())
    assert latest["step"] >= s and (run / "checkpoints" / latest["params"]).exists(), latest
    # the job's last checkpoint (and the epoch ends after step s) are worker 1's
    assert records(run, 1, "checkpoint")[-1]["path"].endswith(latest["params"]), latest
    assert not records(run, 2, "checkpoint")


def _static_continue_run(tmp_path, n, die_at, env=None, timeout=TIMEOUT):
    """tests/scripts/join_worker.py on ``n`` workers of a job that takes no joiner, with
    on_worker_failure continue: worker 0 SIGKILLs itself before step ``die_at`` (every
    step before it applied). The finished job."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    args = launch_args(n, 2, ["--out", tmp_path, "--per-epoch", PER_EPOCH, "--epochs", EPOCHS,
                              "--die-at", die_at, "--die-rank", 0],
                       env=dict({"SSDSGD_ALGORITHM": "ssgd", "SSDSGD_PULL_RELAY": "off",
                                 "SSDSGD_BIGARRAY_BOUND": 100,
                                 "SSDSGD_ON_WORKER_FAILURE": "continue",
                                 "SSDSGD_HEARTBEAT_INTERVAL": 0.2,
                                 "SSDSGD_HEARTBEAT_TIMEOUT": 1}, **(env or {})),
                       script="join_worker.py")
    job = dist(["--run-dir", run_dir, *args])
    with job:
        job.wait(timeout)
    return job


@pytest.mark.system
def test_with_continue_a_dead_worker_0_of_a_static_job_is_removed_as_the_simulator(tmp_path):
    """on_worker_failure continue, 3 workers, ssgd, no joiners (each worker keeps its own
    chunks): worker 0 SIGKILLs itself before step 5. It is removed like any rank: the
    servers aggregate workers 1 and 2 from E = 5, its chunks from then on go untrained,
    and the two end with ``simulate_membership``'s weights (worker 0's pushes stop at E)."""
    job = _static_continue_run(tmp_path, N, 5)
    assert job.returncode == 0, job.tail()
    assert "worker 0 (pid" in job.text and "the job continues without it" in job.text, \
        job.tail()
    assert "worker 0 left the job" in job.text, job.tail()
    alive = [1, 2]
    records = [json.loads((tmp_path / f"chunks-rank{r}.json").read_text()) for r in alive]
    assert not (tmp_path / "chunks-rank0.json").exists()
    assert all(r["removed"] == {"0": 5} and r["leaves"] == {} for r in records), records
    # its data never leaves (no joiners): the membership of the chunks is the first one's
    keys, members, ref = _simulated({}, "ssgd", leaves={0: 10 ** 6}, removed={0: 5}, n=N,
                                    per_epoch=PER_EPOCH, epochs=EPOCHS)
    end = members.end()
    assert end == PER_EPOCH * EPOCHS // N
    for rank, r in zip(alive, records):
        assert r["end"] == end and r["chunks"] == [
            members.chunk(rank, t)[0] * PER_EPOCH + members.chunk(rank, t)[1]
            for t in range(end)], r
    _equal_to_the_simulation(keys, ref,
                             [load_npz(tmp_path / f"local-rank{r}.npz") for r in alive],
                             [load_npz(tmp_path / f"final-rank{r}.npz") for r in alive],
                             " (worker 0 removed at 5)", ranks=alive)


def _abort_line(job):
    """The launcher's one line quoting the scheduler's reason for aborting the job."""
    lines = [line for line in job.text.splitlines()
             if "the scheduler aborted the job:" in line]
    assert len(lines) == 1, job.tail()
    assert "Traceback" not in job.text, job.tail()
    return lines[0]


@pytest.mark.system
def test_with_continue_the_last_worker_dying_aborts_the_job_in_one_line(tmp_path):
    """on_worker_failure continue with one worker: worker 0, the last worker in the job,
    dies; nobody is left to finish it, so the job fails (exit 1, not 0 as if every worker
    had finished) with one line naming the cause."""
    job = _static_continue_run(tmp_path, 1, 3)
    assert job.returncode == 1, job.tail()
    line = _abort_line(job)
    assert "worker 0" in line and "it was the last worker in the job" in line, line


@pytest.mark.system
def test_with_continue_worker_0_dying_before_its_auto_choice_is_agreed_aborts(tmp_path):
    """ssd with k at auto (T_w = 8), on_worker_failure continue: worker 0 dies before
    step 3, in the warm-up, before the workers agreed on its choice of k: the job cannot
    go on without it (nobody would choose), so it fails with one line naming the cause
    (the same cause that refuses worker 0's departure then)."""
    job = _static_continue_run(tmp_path, 2, 3, env={"SSDSGD_ALGORITHM": "ssd",
                                                    "SSDSGD_WARMUP_STEPS": 8,
                                                    "SSDSGD_GLU_STATE": "exact"})
    assert job.returncode == 1, job.tail()
    line = _abort_line(job)
    assert ("worker 0 cannot be removed yet: its choice of sync.delay_steps (auto)"
            in line), line


@pytest.mark.system
def test_with_continue_worker_0_dying_before_its_first_push_aborts(tmp_path):
    """on_worker_failure continue, 2 workers, ssgd: worker 0 dies before step 0, after the
    Trainer's set-up (its optimizer and its INITs) but before it pushed. The scheduler
    cannot tell from its view whether every server had worker 0's initial values and
    optimizer (which the others start from and would wait for), so the job fails with one
    line naming the cause rather than risk a hang."""
    job = _static_continue_run(tmp_path, 2, 0)
    assert job.returncode == 1, job.tail()
    line = _abort_line(job)
    assert "worker 0" in line and "worker 0 died before its first push" in line, line
