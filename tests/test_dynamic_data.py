"""Dynamic data and the global budget (issue #26, docs/spec/dynamic_data.md): the
scheduler hands each epoch's chunks to whichever worker asks next, every chunk once,
until the job's budget is spent; the rules in process, the scheduler's answers and
refusals on a live job, and training jobs with a controlled slow rank."""
import json
import os
import re
import signal

import numpy as np
import pytest

import jobs
from conftest import digits_job
from ssdsgd.checkpoint import checkpoint_info
from ssdsgd.config import ConfigError, parse_config
from ssdsgd.data import DataError, epoch_permutation, shard_indices
from ssdsgd.data.dynamic import chunk_plan
from ssdsgd.kvstore import protocol as P
from ssdsgd.kvstore.chunks import ChunkError, Dealer
from ssdsgd.kvstore.scheduler import JobAborted
from ssdsgd.settings import dynamic_data
from test_e2e_configs import dist, records, run_dir_of, sets
from test_hardening import ask, frames_of, job_factory, raw_peer  # noqa: F401 (fixture)
from test_resume import kill_job_after_first_checkpoint, params

N_TRAIN, BATCH = 1437, 16        # the digits set's training samples; the jobs' batch


# ---- the rules, in process ---------------------------------------------------------------
def test_the_dealer_hands_every_chunk_of_an_epoch_once_then_ends_it():
    dealer, plan = Dealer(), chunk_plan(per_epoch=5, total_steps=4, num_workers=2, start=0)
    got = [dealer.deal(r % 2, dict(plan, epoch=0)) for r in range(6)]
    assert [g.get("chunk") for g in got[:5]] == [0, 1, 2, 3, 4]
    assert got[5] == {"epoch": 0, "over": "epoch"}
    assert dealer.deal(1, dict(plan, epoch=1)) == {"epoch": 1, "chunk": 0}
    assert dealer.deal(0, dict(plan, epoch=0)) == {"epoch": 0, "over": "epoch"}   # a late one
    assert [dealer.deal(0, dict(plan, epoch=1)).get("chunk") for _ in range(2)] == [1, 2]
    # budget 4 steps x 2 workers = 8 chunks: 5 of epoch 0, 3 of epoch 1
    assert dealer.deal(1, dict(plan, epoch=1)) == {"epoch": 1, "over": "budget"}
    assert dealer.dealt == {0: 5, 1: 3}


def test_the_dealer_starts_at_the_cursor_and_refuses_what_no_worker_of_the_job_sends():
    dealer, plan = Dealer(), chunk_plan(per_epoch=5, total_steps=10, num_workers=2, start=7)
    assert dealer.deal(0, dict(plan, epoch=1)) == {"epoch": 1, "chunk": 2}    # resumed
    with pytest.raises(ChunkError, match="epoch 2 while epoch 1 still has chunks"):
        dealer.deal(1, dict(plan, epoch=2))
    with pytest.raises(ChunkError, match="differs from the job's .*disagree on the data"):
        dealer.deal(1, dict(plan, epoch=1, per_epoch=6))
    with pytest.raises(ChunkError, match="names per_epoch, budget and start"):
        dealer.deal(1, {"epoch": 1})
    with pytest.raises(ChunkError, match="beyond its budget"):
        Dealer().deal(0, dict(plan, start=21, epoch=4))


def test_a_pause_asked_by_rank_0_stops_every_worker_at_one_cursor_until_a_release():
    """A mid-epoch checkpoint under dynamic data (docs/spec/dynamic_data.md rule 7): rank
    0's request asks for a pause; from then on every request of the current epoch is
    answered with the pause and the cursor, nothing is handed out, until the checkpoint's
    barrier is released; a request of an ended epoch still ends it. Only rank 0 asks."""
    dealer, plan = Dealer(), chunk_plan(per_epoch=5, total_steps=10, num_workers=2, start=0)
    assert [dealer.deal(r, dict(plan, epoch=0))["chunk"] for r in (0, 1, 1)] == [0, 1, 2]
    with pytest.raises(ChunkError, match="only worker 0 asks for a pause"):
        dealer.deal(1, dict(plan, epoch=0, pause=True))
    assert dealer.deal(0, dict(plan, epoch=0, pause=True)) == {"epoch": 0, "over": "pause",
                                                              "at": 3}
    assert dealer.deal(1, dict(plan, epoch=0)) == {"epoch": 0, "over": "pause", "at": 3}
    assert dealer.deal(0, dict(plan, epoch=0, pause=True)) == {"epoch": 0, "over": "pause",
                                                              "at": 3}
    dealer.release()
    assert dealer.deal(1, dict(plan, epoch=0)) == {"epoch": 0, "chunk": 3}
    assert [dealer.deal(0, dict(plan, epoch=0))["chunk"] for _ in range(1)] == [4]
    assert dealer.deal(0, dict(plan, epoch=1, pause=True))["at"] == 5
    assert dealer.deal(1, dict(plan, epoch=0)) == {"epoch": 0, "over": "epoch"}
    assert dealer.deal(1, dict(plan, epoch=1))["over"] == "pause"
    assert dealer.dealt == {0: 2, 1: 3}


def _report(got, asking=None, pause=None, plan=(5, 20, 0)):
    """A worker's REJOIN ``chunks``; ``asking``: the epoch of its one request in flight,
    or a list of them."""
    asking = [] if asking is None else asking if isinstance(asking, list) else [asking]
    return {"plan": list(plan), "got": got, "count": len(got), "asking": asking,
            "pause": pause}


def test_a_restarted_schedulers_dealer_starts_after_what_the_workers_got():
    """docs/spec/dynamic_data.md rule 8: the workers' reports rebuild the cursor; a chunk
    handed out whose answer was lost (4: worker 2 asks for epoch 0 again, nobody has it)
    is dealt again first, to a worker asking for its epoch, even once the cursor is in the
    next epoch; every other chunk follows the cursor."""
    plan = chunk_plan(per_epoch=5, total_steps=10, num_workers=2, start=0)
    dealer = Dealer()
    said = dealer.rebuild({0: _report([0, 2, 5]), 1: _report([1, 3]),
                           2: _report([], asking=0)})
    assert dealer.next == 6 and dealer.holes == [4] and dealer.dealt == {0: 3, 1: 2, 2: 0}
    assert said == ("the data's cursor rebuilt at chunk 6 from 3 worker(s)' reports; chunks "
                    "[4] were handed out and lost with the scheduler: dealt again")
    assert dealer.deal(1, dict(plan, epoch=1)) == {"epoch": 1, "chunk": 1}
    assert dealer.deal(2, dict(plan, epoch=0)) == {"epoch": 0, "chunk": 4}     # dealt again
    assert dealer.deal(2, dict(plan, epoch=0)) == {"epoch": 0, "over": "epoch"}
    # the last chunk's answer lost: the cursor is before it, and it is dealt as usual
    tail = Dealer()
    tail.rebuild({0: _report([0, 1], asking=0), 1: _report([2])})
    assert (tail.next, tail.holes) == (3, [])
    assert Dealer().rebuild({0: None, 1: None}) is None       # nobody asked yet
    paused = Dealer()
    paused.rebuild({0: _report([0, 1], pause=3), 1: _report([2], pause=3)})
    assert paused.deal(1, dict(plan, epoch=0)) == {"epoch": 0, "over": "pause", "at": 3}


def test_both_answers_a_worker_waited_for_are_dealt_again_after_a_restart():
    """A worker keeps two requests in flight (CHUNKS_IN_FLIGHT): the scheduler died after
    dealing 3 and 4 to them, so its report lists two waiting requests and both chunks are
    dealt again to it, before the cursor moves on."""
    plan = chunk_plan(per_epoch=10, total_steps=10, num_workers=2, start=0)
    dealer = Dealer()
    dealer.rebuild({0: _report([0, 2, 5], plan=(10, 20, 0)),
                    1: _report([1], asking=[0, 0], plan=(10, 20, 0))})
    assert dealer.next == 6 and dealer.holes == [3, 4]
    assert [dealer.deal(1, dict(plan, epoch=0))["chunk"] for _ in range(3)] == [3, 4, 6]
    with pytest.raises(ChunkError, match=r"only 1 worker\(s\) ask again"):
        Dealer().rebuild({0: _report([0, 5], plan=(10, 20, 0)),
                          1: _report([1], asking=[0], plan=(10, 20, 0))})


class _ChunkLink:
    """The scheduler's dealer behind a worker's CHUNK requests, as ``ChunkFeed`` sees it
    through the store (``ask_chunk``, ``take_chunk``): a request reaches the real
    ``Dealer`` only when the worker takes an answer (the network delivers in order), so
    the test sees how many a worker keeps in flight."""

    def __init__(self, dealer, rank, log):
        self.dealer, self.rank, self.log = dealer, rank, log
        self.in_flight, self.most = [], 0

    def ask_chunk(self, epoch, plan, pause=False):
        self.in_flight.append(dict(plan, epoch=epoch, **({"pause": True} if pause else {})))
        self.most = max(self.most, len(self.in_flight))
        return len(self.log) + len(self.in_flight)

    def take_chunk(self, fut, epoch, per_epoch):
        answer = self.dealer.deal(self.rank, self.in_flight.pop(0))
        self.log.append((self.rank, answer))
        if answer.get("over") == "pause":
            return answer["at"], "pause"
        return answer.get("chunk"), answer.get("over")


def test_a_feed_keeps_two_requests_in_flight_and_trains_every_chunk_it_is_dealt_once():
    """data/dynamic.py: two requests in flight (one was not enough: docs/benchmarks/
    heterogeneity.md), answered in order; a chunk dealt is trained, a pause reaches
    each worker once, and the epoch ends only once every answer is in."""
    from ssdsgd.data.dynamic import CHUNKS_IN_FLIGHT, ChunkFeed

    class Data:
        n_train = 10 * 4

        def train_batch(self, idx, rng):
            return idx, idx

    dealer, log = Dealer(), []
    plan = chunk_plan(per_epoch=10, total_steps=6, num_workers=2, start=0)
    pauses, due, trained, walks = {0: [], 1: []}, [False], {0: [], 1: []}, {}

    def step(r, epoch):
        """One batch of worker r, or False at the end of its epoch."""
        try:
            _, (x, _) = next(walks[r])
        except StopIteration:
            return False
        trained[r].append((epoch, tuple(int(i) for i in x)))
        if len(trained[0]) == 2 and not pauses[0]:
            due[0] = True                    # rank 0's clock: a checkpoint
        return True

    def barrier(r, at, epoch):
        """The checkpoint's barrier: the other worker trains until it pauses too, and
        the last to arrive releases the dealer's pause."""
        pauses[r].append(at)
        due[0] = False
        other = 1 - r
        for _ in range(100):
            if len(pauses[other]) >= len(pauses[r]):
                break
            assert step(other, epoch), "a worker ended its epoch at a pause"
        if len(pauses[other]) == len(pauses[r]):
            dealer.release()

    links = [_ChunkLink(dealer, r, log) for r in (0, 1)]
    feeds = [ChunkFeed(link, Data(), 0, 4, plan, pause_due=lambda r=r: r == 0 and due[0],
                       on_pause=lambda at, r=r: barrier(r, at, current[0]))
             for r, link in enumerate(links)]
    current = [0]
    for epoch in (0, 1):
        current[0] = epoch
        walks.update({r: feed.epoch(epoch) for r, feed in enumerate(feeds)})
        live = [0, 1]
        for turn in range(100):
            if not live:
                break
            r = live[turn % len(live)]
            if not step(r, epoch):
                live.remove(r)
        assert not live
    assert all(link.most == CHUNKS_IN_FLIGHT for link in links)
    got = sorted(c for r in trained.values() for c in r)
    assert len(got) == len(set(got)) == 12 and feeds[0].over == feeds[1].over == "budget"
    assert pauses[0] == pauses[1] and len(pauses[0]) == 1       # one pause, at one cursor
    at = pauses[0][0]
    dealt = [(r, a["chunk"]) for r, a in log if "chunk" in a]
    assert len(dealt) == 12 and sorted(c for _, c in dealt[:at]) == list(range(at))


@pytest.mark.parametrize("reports,error", [
    ({0: _report([0, 1]), 1: _report([1])}, "two workers report the same chunk"),
    ({0: _report([0, 2]), 1: _report([4], asking=0)}, r"chunks \[1, 3\] were handed "
                                                      r"out and no worker got them, but "
                                                      r"only 1 worker"),
    ({0: _report([0]), 1: _report([1], plan=(6, 20, 0))}, "different data plans"),
    ({0: _report([0, 2], pause=3), 1: _report([], asking=0)}, "lost before a pause"),
    ({0: _report([11]), 1: _report([], asking=0)}, "waits for a chunk of epoch 0, and "
                                                   "another is in epoch 2")])
def test_reports_that_cannot_be_a_jobs_are_refused(reports, error):
    with pytest.raises(ChunkError, match=error):
        Dealer().rebuild(reports)


def test_chunks_a_finished_worker_may_hold_are_not_dealt_again():
    reports = {0: _report([0, 2], asking=0)}
    with pytest.raises(ChunkError, match=r"worker\(s\) \[1\] finished before and may have"):
        Dealer().rebuild(reports, unknown={1})
    assert Dealer().rebuild({0: _report([0, 1], asking=0)}, unknown={1})   # no gap: fine


def test_a_workers_record_lists_its_last_two_epochs_and_what_it_waits_for():
    from ssdsgd.kvstore.chunk_record import REPORT, ChunkRecord
    record, ask = ChunkRecord(), {"per_epoch": 5, "budget": 20, "start": 0}
    assert record.report() is None
    for epoch, chunk in ((0, 1), (0, 3), (1, 0), (2, 2)):
        record.asked(dict(ask, epoch=epoch))
        record.answered({"epoch": epoch, "chunk": chunk})
    record.asked(dict(ask, epoch=2))
    record.asked(dict(ask, epoch=2))
    assert record.report() == {"plan": [5, 20, 0], "got": [5, 12], "count": 4,
                               "asking": [2, 2], "pause": None}
    record.answered({"epoch": 2, "over": "pause", "at": 13})
    assert record.report()["asking"] == [2]
    assert not REPORT[0](dict(record.report(), asking=2))
    assert not REPORT[0](dict(record.report(), asking=[2] * 65))
    assert record.report()["pause"] == 13 and REPORT[0](record.report())
    record.released()
    assert record.report()["pause"] is None
    assert not REPORT[0](dict(record.report(), got=[-1]))
    assert not REPORT[0](dict(record.report(), evil=1))


def test_an_epochs_chunks_are_the_samples_of_its_static_shards():
    n, per_step_workers = N_TRAIN, 3
    spe = n // (per_step_workers * BATCH)
    perm = epoch_permutation(n, 4, 7)
    chunks = np.concatenate([perm[c * BATCH:(c + 1) * BATCH] for c in range(spe * 3)])
    shards = np.concatenate([shard_indices(n, 4, 7, r, 3, BATCH).ravel() for r in range(3)])
    assert sorted(chunks) == sorted(shards) and len(set(chunks)) == spe * 3 * BATCH


def _raw(**sync):
    return {"cluster": {"workers": 4}, "model": {"name": "digits_mlp"},
            "data": {"dataset": "digits", "assignment": sync.pop("assignment", "auto")},
            "sync": sync, "train": {"checkpoint_every_s": sync.pop("every_s", None)}}


def test_auto_is_dynamic_exactly_below_n_or_with_preduce_and_dynamic_is_refused_elsewhere():
    assert not dynamic_data("auto", "ssgd", "all", 4) and not dynamic_data("auto", "ssd", "4", 4)
    assert dynamic_data("auto", "ssgd", "majority", 4)
    assert dynamic_data("auto", "preduce", "all", 4)
    assert not dynamic_data("static", "ssd", "solo", 4)
    assert parse_config(_raw(assignment="dynamic", quorum="majority")).data.assignment == "dynamic"
    with pytest.raises(ConfigError, match=r"^data.assignment: dynamic works with sync.quorum "
                                          r"below the 4 workers or sync.algorithm: preduce"):
        parse_config(_raw(assignment="dynamic", algorithm="ssgd"))
    # mid-epoch checkpoints: at a pause of the dealer (rule 7); not with preduce, whose
    # jobs are not resumed (a paused preduce job was seen to hang: docs/spec/dynamic_data.md)
    assert parse_config(_raw(assignment="dynamic", quorum="solo", every_s=60)
                        ).train.checkpoint_every_s == 60
    with pytest.raises(ConfigError, match=r"^sync.algorithm: preduce takes checkpoints at "
                                          r"epoch ends only; unset train.checkpoint_every_s"):
        parse_config(_raw(algorithm="preduce", every_s=60))
    with pytest.raises(ConfigError, match=r"^data.assignment: expected one of auto, static"):
        parse_config(_raw(assignment="random"))


@pytest.mark.parametrize("chunks", ["87", -1, 1.5])
def test_a_checkpoint_record_with_a_malformed_cursor_is_a_one_line_error(tmp_path, chunks):
    ck = tmp_path / "checkpoints"
    ck.mkdir()
    (ck / "epoch-0000.params").write_bytes(b"")
    (ck / "latest.json").write_text(json.dumps(
        {"next_epoch": 1, "step": 29, "params": "epoch-0000.params", "chunks": chunks}))
    with pytest.raises(DataError, match=r"latest.json: next_batch, workers and chunks "
                                        r"\(dynamic data's cursor\) must be integers >= 0$"):
        checkpoint_info(tmp_path)


# ---- the scheduler, live -------------------------------------------------------------------
@pytest.mark.system
def test_workers_of_a_live_job_get_every_chunk_once_and_bad_requests_a_clear_error(
        job_factory):
    job = job_factory(workers=2)
    c0, c1 = job.clients
    plan = chunk_plan(per_epoch=6, total_steps=6, num_workers=2, start=0)
    seen = {0: [], 1: []}
    for client in (c0, c1, c1, c1, c0, c1, c0):
        chunk, over = client.take_chunk(client.ask_chunk(0, plan), 0, 6)
        if chunk is not None:
            seen[client.rank].append(chunk)
    assert sorted(seen[0] + seen[1]) == list(range(6)) and over == "epoch"
    assert c0.take_chunk(c0.ask_chunk(1, plan), 1, 6) == (0, None)
    # what is not a worker's request is refused in one line, and the scheduler serves on
    peer = raw_peer(job.scheduler_address, job.keys())
    for meta, reason in ((b'{"epoch": "1"}', "'epoch' must be an epoch number"),
                         (b'{"epoch": 1, "per_epoch": 0}', "'per_epoch' must be a number of "
                                                           "chunks from 1"),
                         (b'{"epoch": 1, "chunk": -1}', "'chunk' must be a step"),
                         (b'{"epoch": 1, "evil": []}', "unexpected meta field 'evil'"),
                         (b'{}', "'epoch'"),
                         (b'{"epoch": 1}', "CHUNK from a node that never registered")):
        reply = ask(peer, frames_of(P.Kind.CHUNK, meta))
        assert reply.kind == P.Kind.ERROR and reason in reply.meta["error"], reply.meta
        assert "\n" not in reply.meta["error"]
    # a worker of the job that disagrees on the data fails, naming why
    with pytest.raises(JobAborted, match=r"refused a message of this worker: .*plan .* "
                                         r"differs from the job's"):
        c1.take_chunk(c1.ask_chunk(1, dict(plan, budget=99)), 1, 6)
    assert job.alive() and c0.take_chunk(c0.ask_chunk(1, plan), 1, 6) == (1, None)


# ---- training jobs ---------------------------------------------------------------------------
SLOW = 0.3      # seconds the slow rank sleeps every step (debug.slowdown)


def majority_job(root, epochs=2, algorithm="ssgd", quorum="majority"):
    """3 workers, ssgd, a majority quorum (or preduce), rank 2 slow: data.assignment auto
    is dynamic."""
    return ["configs/digits.yaml", *digits_job("ssgd"), *sets(
        cluster__workers=3, sync__algorithm=algorithm, sync__quorum=quorum,
        debug__slowdown=f"delay:2={SLOW}", train__epochs=epochs, output__dir=root)]


def check_every_sample_once(ends, epochs, n_workers=3):
    """Each epoch of ``epochs``: the workers' chunks are exactly its permutation's first
    per_epoch batches (counted, and by the sums of their indices and squares)."""
    per_epoch = N_TRAIN // (n_workers * BATCH) * n_workers
    for e in epochs:
        got = [end["data"].get(str(e), {}) for end in ends]
        perm = epoch_permutation(N_TRAIN, e, 0)[:per_epoch * BATCH].astype(np.int64)
        assert sum(g.get("batches", 0) for g in got) == per_epoch, (e, got)
        assert sum(g.get("index_sum", 0) for g in got) == int(perm.sum()), e
        assert sum(g.get("index_sq", 0) for g in got) == int((perm ** 2).sum()), e
    return per_epoch


@pytest.mark.system
@pytest.mark.parametrize("algorithm,quorum", [("ssgd", "majority"), ("preduce", "all")])
def test_a_slow_rank_takes_fewer_batches_and_the_budget_is_spent_once(tmp_path, algorithm,
                                                                     quorum):
    p = dist(majority_job(tmp_path, algorithm=algorithm, quorum=quorum), timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    run = run_dir_of(tmp_path)
    ends = [records(run, r, "end")[-1] for r in range(3)]
    per_epoch = check_every_sample_once(ends, (0, 1))
    steps = [end["steps"] for end in ends]
    assert sum(steps) == 2 * per_epoch                  # the budget, spent once
    assert min(steps[0], steps[1]) > per_epoch // 3 * 2 > steps[2], steps  # static: 29 x 2
    assert all(end["global_step"] == per_epoch * 2 // 3 for end in ends)  # budget / N
    summary = json.loads((run / "summary.json").read_text())
    assert summary["data_assignment"] == "dynamic" and summary["final_accuracy"] > 0.8
    assert "progress: step 58/58 (100%)" in p.stderr + p.stdout   # the job's global batches


@pytest.mark.system
def test_with_quorum_all_auto_keeps_todays_static_shards_bit_for_bit(tmp_path,
                                                                     uninterrupted_digits):
    a = uninterrupted_digits("ssgd")                    # data.assignment left at auto
    p = dist(["configs/digits.yaml", *digits_job("ssgd"),
              *sets(data__assignment="static", output__dir=tmp_path)])
    assert p.returncode == 0, p.stderr[-3000:]
    b = run_dir_of(tmp_path)
    last = "checkpoints/epoch-0001.params"
    pa, pb = params(a / last), params(b / last)
    assert pa.keys() == pb.keys() and pa
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)
    assert records(a, 0, "end")[-1]["data"] is None
    assert json.loads((a / "summary.json").read_text())["data_assignment"] == "static"


@pytest.mark.system
@pytest.mark.parametrize("algorithm", ["ssgd", "ssd"])
def test_a_job_killed_after_an_epoch_resumes_at_the_cursor_and_trains_the_rest_once(
        tmp_path, algorithm):
    """Killed (SIGKILL, every process) after its epoch-end checkpoint, resumed with
    --resume: every worker starts at the checkpoint's global batches, and the rest of the
    budget, epoch 1, is trained once. (ssd: its local weights start from the checkpoint's
    global model, docs/spec/dynamic_data.md.)"""
    root = tmp_path / "b"
    run = kill_job_after_first_checkpoint(majority_job(root, algorithm=algorithm), root,
                                          timeout=240)
    latest = json.loads((run / "checkpoints" / "latest.json").read_text())
    per_epoch = N_TRAIN // (3 * BATCH) * 3
    assert (latest["next_epoch"], latest["chunks"], latest["step"], latest["workers"]) == (
        1, per_epoch, per_epoch // 3, 0)
    resumed = dist(["--resume", str(run)], timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Traceback" not in resumed.stdout + resumed.stderr
    ends = [records(run, r, "end")[-1] for r in range(3)]
    assert all(set(end["data"]) == {"1"} for end in ends), ends   # epoch 1 only, all of it
    check_every_sample_once(ends, (1,))
    assert [records(run, r, "start")[-1]["start_step"] for r in range(3)] == [latest["step"]] * 3
    assert json.loads((run / "summary.json").read_text())["final_accuracy"] > 0.8


@pytest.mark.system
def test_a_job_killed_after_a_mid_epoch_checkpoint_resumes_at_the_pause_and_trains_the_rest_once(
        tmp_path):
    """train.checkpoint_every_s with dynamic data (docs/spec/dynamic_data.md rule 7):
    worker 0's clock pauses the dealer, every worker stops after the chunks it has, and
    the checkpoint's cursor is the pause's. Killed after one (SIGKILL, every process) and
    resumed, the job trains the rest of that epoch's chunks and the next epoch's, once."""
    root = tmp_path / "b"
    run = kill_job_after_first_checkpoint(
        [*majority_job(root), *sets(train__checkpoint_every_s=1, train__checkpoint_every=0)],
        root, timeout=240, ready=lambda latest: latest.get("next_batch", 0) > 0)
    latest = json.loads((run / "checkpoints" / "latest.json").read_text())
    per_epoch = N_TRAIN // (3 * BATCH) * 3
    at = latest["chunks"]
    assert latest["params"] == f"chunk-{at:08d}.params", latest
    assert (latest["next_epoch"], latest["next_batch"]) == divmod(at, per_epoch), latest
    assert latest["step"] == at // 3 and latest["workers"] == 0, latest
    # no other mid-epoch checkpoint: static data's barrier every log_interval steps would
    # wait for steps a fast worker never takes, and record an epoch's end mid-epoch
    assert all("/chunk-" in r["path"] for r in records(run, 0, "checkpoint")), \
        records(run, 0, "checkpoint")
    resumed = dist(["--resume", str(run), *sets(train__checkpoint_every_s="null")],
                   timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ends = [records(run, r, "end")[-1] for r in range(3)]
    epoch, first = divmod(at, per_epoch)
    rest = [end["data"].get(str(epoch), {}) for end in ends]
    perm = epoch_permutation(N_TRAIN, epoch, 0)[first * BATCH:per_epoch * BATCH].astype(np.int64)
    assert sum(g.get("batches", 0) for g in rest) == per_epoch - first, rest
    assert sum(g.get("index_sum", 0) for g in rest) == int(perm.sum())
    assert sum(g.get("index_sq", 0) for g in rest) == int((perm ** 2).sum())
    check_every_sample_once(ends, range(epoch + 1, 2))
    assert json.loads((run / "summary.json").read_text())["final_accuracy"] > 0.8


@pytest.mark.system
def test_a_restarted_scheduler_rebuilds_the_cursor_and_every_sample_is_trained_once(
        tmp_path):
    """cluster.scheduler_restarts 1 with a majority quorum (dynamic data): the scheduler
    SIGKILLed in the first epoch. The restarted one rebuilds the dealer from what each
    worker reports it got (rule 8), and each epoch's samples are trained exactly once;
    no server or worker is restarted."""
    from test_recovery import start, wait_for_step
    with start([*majority_job(tmp_path), *sets(cluster__scheduler_restarts=1)]) as job:
        run = wait_for_step(job, tmp_path, 12)
        os.kill(job.process("scheduler"), signal.SIGKILL)
        job.wait_for("re-registered and the job goes on", 60)
        assert job.wait(timeout=240) == 0, job.text[-3000:]
    assert re.search(r"restart 1: the data's cursor rebuilt at chunk \d+ from 3 worker",
                     job.text), job.text[-3000:]
    ends = [records(run, r, "end")[-1] for r in range(3)]
    per_epoch = check_every_sample_once(ends, (0, 1))
    assert sum(end["steps"] for end in ends) == 2 * per_epoch     # the budget, spent once
    assert "resuming from the checkpoint" not in job.text         # the job not restarted


def test_quorum_auto_takes_dynamic_data_as_a_quorum_below_n_does():
    """quorum auto's rounds close without the workers its rule excuses, and each worker
    ends at its final pull (quorum.md rule 4): uneven step counts are fine, so auto
    assignment deals the batches there too and an explicit dynamic is accepted."""
    assert dynamic_data("auto", "ssd", "auto", 4) and dynamic_data("auto", "ssgd", "auto", 2)
    assert parse_config(_raw(assignment="dynamic", quorum="auto")).data.assignment == "dynamic"
