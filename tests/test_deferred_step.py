"""An ssgd Trainer step on ssd_sync returns at once, as on MXNet's dist_sync (ps-lite
queues its pushpull on the engine): the wait for the other workers is the next forward's,
inside the engine, so what the script does between steps overlaps the exchange. In the
heterogeneity benchmark's no-slowdown and slow-worker configurations ssd_sync ssgd ran at
0.79x native dist_sync because its Trainer.step held the thread for the whole round."""
import json

import numpy as np
import pytest

from conftest import load_npz
from jobs import launch

SLOW, STEPS = 1.0, 3


def _job(tmp_path, env, steps=STEPS, slow=SLOW, servers=1):
    """deferred_step.py on 2 workers, run to its end."""
    res = launch(2, servers, ["--out", tmp_path, "--steps", steps, "--slow", slow],
                 env=env, script="deferred_step.py", timeout=180)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def _read(tmp_path, name, rank=0):
    return json.loads((tmp_path / f"{name}-rank{rank}.json").read_text())


def _ranks_end_equal(tmp_path, name):
    """Both ranks' weights in ``name``-rank{0,1}.npz are the same, and there are some."""
    w0, w1 = load_npz(tmp_path / f"{name}-rank0.npz"), load_npz(tmp_path / f"{name}-rank1.npz")
    assert w0.keys() == w1.keys() and w0
    for k in w0:
        np.testing.assert_array_equal(w0[k], w1[k], err_msg=k)


@pytest.mark.system
def test_a_trainer_step_returns_before_the_slow_worker_pushed(tmp_path):
    _job(tmp_path, {"SSDSGD_ALGORITHM": "ssgd"})
    held = _read(tmp_path, "held")
    # rank 0 steps first and its step is not answered before rank 1 pushed, 1 s later;
    # held for the round, its later steps would take about SLOW each
    assert max(held) < SLOW / 2, held
    _ranks_end_equal(tmp_path, "weights")  # and every step's weights arrived all the same


@pytest.mark.system
@pytest.mark.parametrize("servers", [1, 2])
def test_an_ssgd_step_under_a_quorum_returns_before_its_round_closes(tmp_path, servers):
    """A quorum's ssgd step is queued on the engine as well (eager-SGD's own setting:
    a quorum's step held the thread for its round, and ran at 0.80x native dist_sync
    under random delays). ``auto`` keeps both workers in the first round (it excuses
    nobody before it has measured lags), so rank 0's step 0 is answered only once rank
    1 pushed, SLOW later: on the thread, it would be held that long. Every push goes to
    every server, in one message (docs/spec/quorum.md), and both ranks end on the final
    pull's model."""
    _job(tmp_path, {"SSDSGD_ALGORITHM": "ssgd", "SSDSGD_QUORUM": "auto"}, servers=servers)
    held = _read(tmp_path, "held")
    assert max(held) < SLOW / 2, held
    _ranks_end_equal(tmp_path, "final")


@pytest.mark.system
def test_with_the_timeline_on_a_step_still_returns_at_once_and_its_wait_is_recorded(tmp_path):
    """``train.timeline`` is on by default, so a user's ssgd job records one. Recording
    must not take the step off the engine (it did: the same random-delay digits job took
    1.76x as long to train), and the wait that then happens inside the engine must still
    be in the timeline, put to the account of the worker whose push came last."""
    from ssdsgd import timeline_merge as M
    _job(tmp_path, {"SSDSGD_ALGORITHM": "ssgd", "SSDSGD_TIMELINE": "1",
                    "SSDSGD_TIMELINE_DIR": tmp_path / "timeline"})
    held = _read(tmp_path, "held")
    assert max(held) < SLOW / 2, held
    spans = M.spans_of(M.load(tmp_path))
    parents, bad = M.nesting(spans)
    assert bad == []
    for rank in (0, 1):
        mine = [(i, s) for i, s in enumerate(spans) if (s.role, s.rank) == ("worker", rank)]
        names = [s.name for _, s in mine]
        assert names.count("step") == names.count("push") == names.count("pull") == STEPS
        engine = [(i, s) for i, s in mine if s.lane == "engine"]
        assert sorted(s.name for _, s in engine) == sorted(["push", "blocked", "pull"] * STEPS)
        for i, s in engine:
            if s.name != "pull":                     # inside the step's wait on the engine
                pull = spans[parents[i]]
                assert pull.name == "pull" and pull.lane == "engine"
                assert pull.args["waits_for"] == (s.args or {}).get("step", pull.args["waits_for"])
    waits = M.slowest(spans, parents)
    # rank 0's engine waited about SLOW a step for rank 1's push, which came last
    assert waits["slowest_rank"] == 1 and waits["waited_for"][1] > SLOW, waits


@pytest.mark.system
def test_an_ssd_step_returns_before_the_pull_it_resets_from_is_answered(tmp_path):
    """ssd's steps-delay steps are queued on the engine too (worker/delay_on_engine.py):
    warm-up 1, k = 2, so step 2 requests w_G(2) and step 3 resets from it. Rank 1 pushes
    its step 2 about 3 SLOW after the start, rank 0 makes its step 3 about 2 SLOW sooner:
    a reset on rank 0's thread would hold it for that long."""
    steps = 5
    _job(tmp_path, {"SSDSGD_ALGORITHM": "ssd", "SSDSGD_WARMUP_STEPS": 1,
                    "SSDSGD_DELAY_STEPS": 2}, steps=steps)
    held = _read(tmp_path, "held")
    assert held[0] > SLOW / 2, held           # the warm-up step waits for rank 1's push
    assert max(held[1:]) < SLOW / 2, held     # the steps-delay steps, the reset's too
    _ranks_end_equal(tmp_path, "final")  # both end on the global weights


@pytest.mark.system
@pytest.mark.parametrize("algorithm,period", [("ssd", "SSDSGD_DELAY_STEPS"),
                                              ("localsgd", "SSDSGD_SYNC_PERIOD")])
def test_warmup_steps_nothing_times_return_before_their_round_closes(tmp_path, algorithm,
                                                                    period):
    """ssd's warm-up steps are synchronous SGD, queued on the engine as ssgd's are, but
    for the last (it carries the state the first reset takes) and the ones the k rule
    times (none here: k is pinned, and 2 workers cannot relay). Warm-up 3, k = 2: steps
    0 and 1 return at once; step 2 waits for rank 1's push, SLOW later; the steps after
    the warm-up are queued as before. Both ranks end on the same global weights."""
    steps = 5
    _job(tmp_path, {"SSDSGD_ALGORITHM": algorithm, "SSDSGD_WARMUP_STEPS": 3, period: 2},
         steps=steps)
    held = _read(tmp_path, "held")
    assert max(held[:2]) < SLOW / 2, held     # queued: the script's wait is the forward's
    assert held[2] > SLOW / 2, held           # the last warm-up step, on the thread
    metrics = _read(tmp_path, "metrics")
    assert metrics["warmup_on_engine"] == 2 and metrics["warmup"] == 3, metrics
    _ranks_end_equal(tmp_path, "final")


@pytest.mark.system
def test_warmup_steps_the_k_rule_times_stay_on_rank_0s_thread(tmp_path):
    """k auto: every warm-up step of rank 0 after the first may be one the k rule reads
    (its last 20), so a short warm-up queues none of them there, and the job still
    chooses k from them. Rank 1's timings choose nothing: its steps queue (but the last),
    and it takes rank 0's k."""
    steps = 6
    res = _job(tmp_path, {"SSDSGD_ALGORITHM": "ssd", "SSDSGD_WARMUP_STEPS": 4}, steps=steps,
               slow=0.2)
    m0, m1 = (_read(tmp_path, "metrics", r) for r in (0, 1))
    assert m0["warmup_on_engine"] == 0 and m0["warmup"] == 4, m0
    assert m1["warmup_on_engine"] == 3 and m1["warmup"] == 4, m1
    assert "from the warm-up" in res.stdout + res.stderr, res.stdout[-2000:]
    assert m0["choices"]["delay_steps"]["why"].startswith("auto: compute"), m0["choices"]
    assert m1["choices"]["delay_steps"] == {"value": m0["delay_steps"],
                                            "why": "auto: rank 0's choice"}, m1["choices"]
