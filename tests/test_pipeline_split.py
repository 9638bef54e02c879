"""How the worker cuts a server's part of an exchange into messages (pipelining), and how
many pieces it picks by timing its steps (SSDSGD_PIPELINE_PIECES=auto)."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import jobs
from ssdsgd.kvstore.splitting import PIECE_MIN, cut as _cut
from ssdsgd.kvstore.piece_tuner import CANDIDATES, PieceTuner
from ssdsgd.settings import BY_NAME, SettingError, count_or_auto

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "tests" / "scripts" / "train_small.py"

PIECES = 8     # SSDSGD_PIPELINE_PIECES as a slow link would set it


def _items(sizes):
    return [((key,), [None], nbytes) for key, nbytes in enumerate(sizes)]


def _bytes(chunks):
    return [c[2] for c in chunks]


def test_a_small_model_is_cut_into_pieces_the_server_can_answer_one_by_one():
    sizes = [17_000] * 65                      # ResNet-20-like: 1.1 MB in 65 keys
    chunks = _cut(_items(sizes), 4 << 20, PIECES)   # the default chunk is bigger than the part
    assert PIECES <= len(chunks) <= PIECES + 1        # greedy: the last piece is the rest
    assert sum(_bytes(chunks)) == sum(sizes)
    assert [r for c in chunks for r in c[0]] == [(k,) for k in range(65)]   # key order kept


def test_pieces_are_never_smaller_than_the_minimum():
    assert len(_cut(_items([PIECE_MIN // 2, PIECE_MIN // 2]), 4 << 20, PIECES)) == 1
    # each piece is filled until the next key would pass PIECE_MIN
    assert all(b > PIECE_MIN - 20_000 for b in _bytes(_cut(_items([20_000] * 40), 4 << 20, PIECES))[:-1])


def test_a_smaller_chunk_setting_still_wins_and_none_means_one_message():
    assert len(_cut(_items([100] * 10), 250, PIECES)) == 5
    assert len(_cut(_items([17_000] * 65), None)) == 1


def test_a_big_model_keeps_the_chunk_setting():
    chunks = _cut(_items([1 << 20] * 100), 4 << 20, PIECES)
    assert _bytes(chunks) == [4 << 20] * 25


def test_with_one_piece_a_part_below_the_chunk_setting_is_one_message():
    """What SSDSGD_PIPELINE_PIECES=1 (and auto until it has timed a few steps) gives: at
    10 Gbit/s 8 pieces cost ssgd 1.27x -> 0.78-0.90x native (docs/benchmarks/small_steps.md)."""
    assert len(_cut(_items([17_000] * 65), 4 << 20)) == 1
    assert len(_cut(_items([1 << 20] * 100), 4 << 20)) == 25


# --- SSDSGD_PIPELINE_PIECES=auto: the worker times its steps (piece_tuner) ---------------

def _clock(periods):
    """A clock whose successive readings are ``periods`` apart."""
    now = [0.0]
    it = iter(periods)

    def read():
        value = now[0]
        now[0] += next(it)
        return value
    return read


def test_the_tuner_tries_each_candidate_in_turn_then_keeps_the_fastest_median():
    step_s = {1: 0.070, 2: 0.050, 4: 0.040, 8: 0.045}   # a slow link: 4 pieces best
    seen, periods = [], [0.2, 0.2, 0.2]                  # the skipped steps
    plan = [c for _ in range(3) for c in (1, 2, 4, 8)]
    periods += [step_s[c] for c in plan]
    periods[3 + 2] = 5.0        # one of 4's trials hit a checkpoint: the median ignores it
    tuner = PieceTuner(candidates=(1, 2, 4, 8), clock=_clock(periods + [0.0] * 10))
    for _ in range(3 + len(plan) + 1 + 5):
        seen.append(tuner.mark())
    assert seen[:3] == [1, 1, 1]                         # skipped steps keep the first
    assert seen[3:3 + len(plan)] == plan                 # interleaved trials
    assert tuner.chosen == 4 and set(seen[3 + len(plan):]) == {4}
    assert [len(t) for t in tuner.times.values()] == [3, 3, 3, 3]


def test_steps_the_relay_times_are_not_charged_to_a_candidate_and_keep_the_count():
    """The relay's trial (sync/auto.py) relays and times some warm-up steps; marked
    untimed, those steps neither time a candidate nor change the count in force, so the
    relay's trial runs with one count and the tuner's medians hold no relayed step (the
    two trials overlapped in warm-ups of 7-16 steps)."""
    step_s = {1: 0.070, 4: 0.040, 8: 0.045}
    plan = [c for _ in range(3) for c in (1, 4, 8)]
    relayed = 9.0                                   # what a relayed step takes here
    periods = [0.2] * 3 + [step_s[c] for c in plan[:4]] + [relayed] * 3 \
        + [step_s[c] for c in plan[4:]] + [0.0] * 5
    tuner = PieceTuner(candidates=(1, 4, 8), clock=_clock(periods))
    seen = [tuner.mark() for _ in range(3 + 4)]
    during = [tuner.mark(timed=False) for _ in range(3)]      # the relay's trial steps
    assert during == [seen[-1]] * 3                 # the count in force, unchanged
    seen += [tuner.mark() for _ in range(len(plan) - 4 + 1)]
    assert seen[3:] == plan[:4] + plan[4:] + [4]   # the plan resumed where it stopped
    assert tuner.chosen == 4 and all(relayed not in t for t in tuner.times.values())


def test_on_a_fast_link_the_tuner_keeps_one_message():
    step_s = {1: 0.010, 2: 0.013, 4: 0.016, 8: 0.022}
    plan = [c for _ in range(3) for c in (1, 2, 4, 8)]
    tuner = PieceTuner(candidates=(1, 2, 4, 8), clock=_clock([0.01] * 3 + [step_s[c] for c in plan] + [0.0]))
    for _ in range(3 + len(plan) + 1):
        tuner.mark()
    assert tuner.chosen == 1 and tuner.value == 1


def test_a_fixed_count_is_never_timed():
    def no_clock():
        raise AssertionError("a fixed count must not read the clock")
    tuner = PieceTuner(fixed=3, clock=no_clock)
    assert [tuner.mark() for _ in range(30)] == [3] * 30


@pytest.mark.parametrize("text,value", [("auto", None), ("1", 1), ("64", 64)])
def test_the_setting_takes_auto_or_a_count(text, value):
    assert count_or_auto(BY_NAME["pipeline_pieces"].parse(text)) == value
    assert BY_NAME["pipeline_pieces"].check(4) == "4"          # YAML's integer


@pytest.mark.parametrize("text", ["0", "65", "fast", "-1", "2.5"])
def test_a_wrong_count_is_a_clear_error(text):
    with pytest.raises(SettingError, match="expected auto or an integer >= 1 and <= 64"):
        BY_NAME["pipeline_pieces"].parse(text)


@pytest.mark.system
def test_auto_pieces_change_the_messages_not_the_weights(tmp_path):
    """A real job (2 workers, 1 server, ssgd) whose 0.5 MB step can be cut: with auto it
    tries each candidate count (more messages than with 1) and ends with the same
    weights, bit for bit, as with one message per step."""
    runs = {}
    for pieces in ("1", "auto"):
        out = tmp_path / pieces
        args = ["-n", 2, "-s", 1, "--env", "SSDSGD_ALGORITHM=ssgd",
                "--env", f"SSDSGD_PIPELINE_PIECES={pieces}", "--env", "OMP_NUM_THREADS=1",
                "--", sys.executable, str(TRAIN), "--kvstore", "ssd_sync", "--steps", "20",
                "--hidden", "4096", "--out", str(out)]
        proc = jobs.run(args, env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                        timeout=120, merge=True)
        assert proc.returncode == 0, proc.stdout[-3000:]
        runs[pieces] = {}
        for rank in range(2):
            meta = json.loads((out / f"meta-rank{rank}.json").read_text())
            with np.load(out / f"weights-rank{rank}.npz") as w:
                runs[pieces][rank] = (dict(w), meta["kv_metrics"])
    for rank in range(2):
        (fixed, fixed_m), (auto, auto_m) = runs["1"][rank], runs["auto"][rank]
        assert fixed_m["pipeline_pieces"] == 1
        assert auto_m["pipeline_pieces"] in CANDIDATES
        assert auto_m["messages_sent"] > fixed_m["messages_sent"]     # it cut some steps
        assert sorted(auto) == sorted(fixed)
        for key in fixed:
            np.testing.assert_array_equal(auto[key], fixed[key], err_msg=f"rank {rank} {key}")


def test_a_near_tie_keeps_one_message():
    """More messages must beat one by MARGIN: a 3 % gain is within the noise of a step and
    does not pay for the server's CPU per message."""
    step_s = {1: 0.0300, 2: 0.0291, 4: 0.0295, 8: 0.0310}
    plan = [c for _ in range(3) for c in (1, 2, 4, 8)]
    tuner = PieceTuner(candidates=(1, 2, 4, 8), clock=_clock([0.01] * 3 + [step_s[c] for c in plan] + [0.0]))
    for _ in range(3 + len(plan) + 1):
        tuner.mark()
    assert tuner.chosen == 1
