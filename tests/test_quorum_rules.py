"""sync.quorum: auto's rule (ssdsgd/sync/quorum_rules.py) on an injected clock: a worker
persistently late is excused, waited for again once it is on time, a single late round
excuses nobody, jitter without a slow worker excuses nobody; and in rounds.Rounds: the
rounds close without the excused worker, its late push is still applied once, the
staleness bound still holds, and followers learn who is excused."""
import random

import pytest

from ssdsgd.settings import SettingError, quorum_rounds, quorum_size
from ssdsgd.sync.events import PolicyError, reply_fields
from ssdsgd.sync.quorum_rules import FixedQuorum, LateWorkers, describe, quorum_rule
from ssdsgd.sync.rounds import Rounds


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def closes(actions):
    return [[r for r, _ in what] for kind, what in actions if kind == "close"]


def one_round(rule, clock, start, offsets, number, possible=None):
    """Each worker of ``offsets`` ({rank: seconds after start}) joins the open round at
    its time; the round closes at the last; the rule's changes."""
    for rank, offset in sorted(offsets.items(), key=lambda kv: kv[1]):
        clock.t = start + offset
        rule.joined(rank)
    return rule.closed(set(offsets), set(possible or offsets), number)


def run(rule, clock, lags_of, rounds, period=1.0, n=3):
    """``rounds`` rounds, one every ``period`` s; lags_of(r) -> {rank: offset}; every
    change, with the round it was decided after."""
    changes = []
    for r in range(rounds):
        offsets = lags_of(r)
        changes += [(r, c) for c in one_round(rule, clock, r * period, offsets, r,
                                              possible=range(n))]
    return changes


def test_quorum_auto_is_a_setting_that_runs_rounds():
    assert quorum_size("auto", 4) == 4 and quorum_rounds("auto", 4)
    assert quorum_rounds("auto", 1) and not quorum_rounds("all", 4)
    assert quorum_rounds("majority", 4) and not quorum_rounds("4", 4)
    with pytest.raises(SettingError, match="expected all, majority, solo, auto or an"):
        quorum_size("sometimes", 4)
    assert isinstance(quorum_rule("auto", 4), LateWorkers)
    assert quorum_rule("majority", 4).quorum == 3 and isinstance(quorum_rule("2", 4),
                                                                 FixedQuorum)


@pytest.mark.parametrize("values, reason", [
    ({"algorithm": "asgd"}, "there are no rounds to close"),
    ({"algorithm": "preduce"}, "its groups already form without slow workers"),
    ({"algorithm": "ssd", "compression": "2bit"}, "no test or simulator runs compressed"),
    ({"algorithm": "ssd", "pull_relay": "chain"}, "replies go to each worker on its own")])
def test_auto_is_refused_where_a_quorum_below_n_is(values, reason):
    from ssdsgd.sync.registry import refusal
    for n in (1, 4, None):                  # auto runs rounds whatever N
        text = refusal({"quorum": "auto", "num_workers": n, **values}, lambda s: s)
        assert text is not None and reason in text and "auto" in text, text
    assert refusal({"quorum": "auto", "num_workers": 4, "algorithm": "ssgd"},
                   lambda s: s) is None


def test_a_persistently_late_worker_is_excused_after_patience_rounds():
    clock = Clock()
    rule = LateWorkers(3, clock, patience=4, floor_s=0.01)
    # worker 2 pushes 0.6 s after the others in every round of 0.7 s
    changes = run(rule, clock, lambda r: {0: 0.0, 1: 0.05, 2: 0.65}, 8, period=0.7)
    assert [(r, c["worker"], c["change"], c["round"]) for r, c in changes] == \
        [(3, 2, "out", 4)]                 # after its fourth late round, from round 4 on
    c = changes[0][1]
    assert c["lag"] == pytest.approx(0.6) and c["rounds"] == 4
    assert c["seconds"] == pytest.approx(2.1)       # from round 0's end to round 3's
    assert c["bound"] == pytest.approx(0.7 / 3, rel=0.05)
    assert rule.excused == {2} and rule.complete({0, 1}, {0, 1, 2})
    assert not rule.complete({0, 2}, {0, 1, 2})
    assert describe(c) == ("quorum auto: leaving out worker 2 (late by 0.60 s or more for "
                           "4 rounds in 2.1 s, bound 0.23 s) from round 4")


def test_a_late_streak_must_span_min_span_s_too():
    # rounds of 1/8 s, worker 2 late by 1/16 s in each: a burst of a loaded machine's
    # scheduling looks like this for a few rounds; late for a whole second it is slow
    clock = Clock()
    rule = LateWorkers(3, clock, patience=3, floor_s=0.01, min_span_s=1.0)
    changes = run(rule, clock, lambda r: {0: 0.0, 1: 0.0, 2: 0.0625}, 30, period=0.125)
    assert [(r, c["worker"], c["rounds"]) for r, c in changes] == [(8, 2, 9)]
    assert changes[0][1]["seconds"] == pytest.approx(1.0)


def test_a_single_late_round_excuses_nobody():
    clock = Clock()
    rule = LateWorkers(3, clock, patience=3, floor_s=0.01, min_span_s=0)
    # late by far in every other round, and in two in a row: never three in a row
    late = {3, 5, 7, 9, 10, 14, 15}
    changes = run(rule, clock, lambda r: {0: 0.0, 1: 0.02, 2: 5.0 if r in late else 0.03},
                  20, period=6.0)
    assert changes == [] and rule.excused == set()


def test_without_a_slow_worker_jitter_excuses_nobody():
    clock, rng = Clock(), random.Random(7)
    rule = LateWorkers(4, clock)           # the defaults
    # steps of 5 ms, each push up to 20 ms late at random (a loaded machine's scheduling)
    changes = run(rule, clock, lambda r: {i: rng.uniform(0, 0.02) for i in range(4)},
                  2000, period=0.025, n=4)
    assert changes == [] and rule.record()["rounds"] == 2000


def test_a_worker_ahead_of_the_others_does_not_make_them_late():
    # worker 0's pushes wait for the rounds (it is a step ahead): each round opens with
    # it, and the others come a round's time later; measured from the pace (half of the
    # workers in), not from the first push, nobody is late
    clock = Clock()
    rule = LateWorkers(4, clock, patience=2, floor_s=0.01, min_span_s=0)
    changes = run(rule, clock, lambda r: {0: 0.0, 1: 0.5, 2: 0.51, 3: 0.52}, 30,
                  period=0.52, n=4)
    assert changes == []


def test_an_excused_worker_on_time_again_is_waited_for_again():
    clock = Clock()
    rule = LateWorkers(3, clock, patience=3, floor_s=0.01)
    changes = run(rule, clock, lambda r: {0: 0.0, 1: 0.01, 2: 0.9}, 3, period=1.0)
    assert [c["change"] for _, c in changes] == ["out"]
    # absent from the rounds (its pushes come after they close): still late
    for r in range(3, 10):
        assert one_round(rule, clock, 10 + r * 0.1, {0: 0.0, 1: 0.01}, r,
                         possible={0, 1, 2}) == []
    assert rule.excused == {2}
    # it catches up: in each round, within the bound, three rounds in a row
    got = []
    for r in range(10, 14):
        got += one_round(rule, clock, 10 + r * 0.1, {0: 0.0, 1: 0.01, 2: 0.02}, r)
    assert [(c["worker"], c["change"], c["round"]) for c in got] == [(2, "in", 13)]
    assert rule.excused == set() and not rule.complete({0, 1}, {0, 1, 2})
    assert describe(got[0]).startswith("quorum auto: waiting for worker 2 again (on time "
                                       "for 3 rounds, within ")


def test_rounds_without_two_workers_that_could_come_measure_nothing():
    # the others finished (or wait at a barrier): a worker alone is never late or on time
    clock = Clock()
    rule = LateWorkers(3, clock, patience=2, floor_s=0.01, min_span_s=0)
    run(rule, clock, lambda r: {0: 0.0, 1: 0.0, 2: 0.9}, 2)
    assert rule.excused == {2}
    for r in range(2, 10):
        assert one_round(rule, clock, r, {2: 0.0}, r, possible={2}) == []
    assert rule.excused == {2}


def test_the_record_is_what_a_worker_accepts():
    clock = Clock()
    rule = LateWorkers(2, clock, patience=2, floor_s=0.01, min_span_s=0)
    run(rule, clock, lambda r: {0: 0.0, 1: 0.8}, 3, n=2)
    record = rule.record()
    assert record["excused"] == [1] and record["rounds"] == 3
    assert reply_fields({"quorum_auto": record}) == {"quorum_auto": record}
    bad = dict(record, changes=[dict(record["changes"][0], worker=-1)])
    with pytest.raises(PolicyError, match="field 'worker' must be a worker rank"):
        reply_fields({"quorum_auto": bad})
    with pytest.raises(PolicyError, match="unexpected field 'extra'"):
        reply_fields({"quorum_auto": record, "extra": 1})


# ---- in the rounds ------------------------------------------------------------------------

def _excused_rounds(clock, staleness=9, replicate=False):
    """Rounds of 3 workers under auto (patience 2), worker 2 excused after rounds 0 and 1,
    where it came 1 s after the others (rounds of 1.1 s)."""
    r = Rounds(3, LateWorkers(3, clock, patience=2, floor_s=0.01, min_span_s=0), staleness,
               replicate=replicate)
    for k in range(2):
        clock.t = 1.1 * k
        r.push(0, f"a{k}", token=f"A{k}")
        clock.t += 0.01
        r.push(1, f"b{k}", token=f"B{k}")
        clock.t += 1.0
        assert closes(r.push(2, f"c{k}", token=f"C{k}")) == [[0, 1, 2]]
    assert r.excused == {2} and [c["change"] for c in r.decided] == ["out"]
    return r


def test_rounds_close_without_an_excused_worker_and_still_apply_its_late_push():
    clock = Clock()
    r = _excused_rounds(clock)
    clock.t = 30.0
    r.push(0, "a2", token="A2")
    clock.t = 30.01
    assert closes(r.push(1, "b2", token="B2")) == [[0, 1]]      # round 2, without it
    clock.t = 31.0
    assert closes(r.push(2, "c2", token="C2")) == []   # into round 3: waits for 0 and 1
    r.push(0, "a3", token="A3")
    acts = r.push(1, "b3", token="B3")
    assert closes(acts) == [[0, 1, 2]]                 # its push applied, once, late
    assert r.applied == [4, 4, 3]


def test_the_staleness_bound_still_holds_rounds_for_an_excused_worker():
    clock = Clock()
    r = _excused_rounds(clock, staleness=1)
    clock.t = 30.0
    r.push(0, "a2", token="A2")
    assert closes(r.push(1, "b2", token="B2")) == [[0, 1]]   # round 2: worker 2 holds 1
    r.push(0, "a3", token="A3")
    assert closes(r.push(1, "b3", token="B3")) == []         # round 3 would be 2 old
    assert closes(r.push(2, "c2", token="C2")) == [[0, 1, 2]]


def test_followers_learn_who_is_excused_and_close_the_same_rounds():
    clock = Clock()
    leader = _excused_rounds(clock, replicate=True)
    log = " ".join(leader.log)
    assert log.count("c0.1.2 x2") == 1 and log.count("x") == 1
    follower = Rounds(3, 3, 9, leader=False)
    for k in range(2):
        for rank, name in enumerate("abc"):
            follower.push(rank, f"{name}{k}", token=f"{name.upper()}{k}")
    acts = follower.follow(log)
    assert closes(acts) == [[0, 1, 2], [0, 1, 2]] and follower.excused == {2}
    assert closes(follower.follow("w2")) == [] and follower.excused == set()
    with pytest.raises(Exception, match="names a rank beyond 2"):
        follower.follow("x7")
