"""preduce beside a restarted scheduler (docs/spec/preduce.md, "A restarted scheduler"):
each worker records the groups it was told (``GroupRecord``, fed by its I/O thread), and
a new scheduler's generator is rebuilt from their reports: the groups formed, who met
whom last, the repeats, and the group a member was owed (formed, but its message lost
with the old scheduler). In process, the generator against the one that was lost."""
import re

import pytest

from ssdsgd.sync.groups import GroupError, GroupGenerator, GroupRecord, REPORT


def _deliver(records, groups, lost=()):
    """Each member's record hears its groups, but for the (number, rank) in ``lost``."""
    for g in groups:
        for m in g.members:
            if (g.number, m) not in lost:
                records[m].received(g.message())


def _state(gen):
    return gen.formed, gen.last, gen.met, gen.repeats, gen.done


def test_a_rebuilt_generator_holds_the_lost_ones_state_and_owes_the_lost_messages():
    """Four workers, groups of two, a repeat among them; the scheduler is lost once
    group 5 is formed but before worker 3 heard of it. The rebuilt generator has the
    lost one's state; worker 3's ready (sent again) gets group 5 alone, nobody else
    hears of it again; and from then on it forms what the lost one would have."""
    lost, records = GroupGenerator(4, 2), {r: GroupRecord(r) for r in range(4)}
    formed = []
    for r in [0, 1, 2, 3, 0, 1, 2, 3, 0, 2, 1, 3]:
        formed += lost.arrive(r)
    assert [g.members for g in formed] == [(0, 1), (2, 3), (0, 1), (2, 3), (0, 2), (1, 3)]
    assert formed[2].repeat and not formed[0].repeat
    _deliver(records, formed, lost={(5, 3)})
    reports = {r: rec.report() for r, rec in records.items()}
    assert all(REPORT[0](rep) for rep in reports.values())
    rebuilt = GroupGenerator(4, 2)
    said = rebuilt.rebuild(reports)
    assert _state(rebuilt) == _state(lost)
    assert "6 groups formed" in said and "worker 3 is owed group 5" in said, said
    (owed,) = rebuilt.arrive(3)
    assert (owed.number, owed.members, owed.to) == (5, (1, 3), (3,))
    # from here on the readies of both are the same: 3's next one follows group 5
    for r in [0, 2, 1, 3, 0, 1]:
        assert [g.members for g in rebuilt.arrive(r)] == [g.members for g in lost.arrive(r)]
    assert _state(rebuilt) == _state(lost)


def test_a_group_nobody_heard_of_was_never_formed_and_the_final_group_is_owed_too():
    lost, records = GroupGenerator(3, 2), {r: GroupRecord(r) for r in range(3)}
    formed = lost.arrive(0) + lost.arrive(1) + lost.arrive(2)   # (0, 1); 2 waits
    formed += lost.arrive(0)                                    # (0, 2)
    assert [g.members for g in formed] == [(0, 1), (0, 2)]
    _deliver(records, formed, lost={(1, 0), (1, 2)})            # group 1 reached no one
    rebuilt = GroupGenerator(3, 2)
    rebuilt.rebuild({r: rec.report() for r, rec in records.items()})
    assert rebuilt.formed == 1                      # its number is free: no one used it
    assert rebuilt.arrive(0) == []                  # both send their ready again
    (again,) = rebuilt.arrive(2)
    assert (again.number, again.members, again.to) == (1, (0, 2), ())
    # the final group, of every worker, heard by worker 0 only
    lost, records = GroupGenerator(2, 2), {r: GroupRecord(r) for r in range(2)}
    formed = lost.arrive(0, final=True) + lost.arrive(1, final=True)
    assert formed[0].final
    _deliver(records, formed, lost={(0, 1)})
    rebuilt = GroupGenerator(2, 2)
    rebuilt.rebuild({r: rec.report() for r, rec in records.items()})
    assert rebuilt.done
    with pytest.raises(GroupError, match="final"):
        rebuilt.arrive(1)                       # it is owed the final group
    (owed,) = rebuilt.arrive(1, final=True)
    assert owed.final and owed.to == (1,) and owed.members == (0, 1)


@pytest.mark.parametrize("reports, says", [
    ({0: {"last": [0, [0, 1]], "repeat": False, "final": False, "repeats": 0, "met": [[1, 0]]},
      1: {"last": [0, [1, 2]], "repeat": False, "final": False, "repeats": 0, "met": [[2, 0]]}},
     "group 0 has two member lists"),
    ({0: {"last": [0, [1, 2]], "repeat": False, "final": False, "repeats": 0, "met": []}},
     "worker 0 reports group 0 of workers [1, 2]"),
    ({0: {"last": [0, [0, 7]], "repeat": False, "final": False, "repeats": 0, "met": []}},
     "not one of the 3 workers"),
    ({0: {"last": None, "repeat": False, "final": False, "repeats": 0, "met": [[9, 0]]}},
     "worker 0 reports it met worker 9: not one of the 3 workers"),
])
def test_reports_that_do_not_fit_together_are_refused_naming_the_group(reports, says):
    with pytest.raises(GroupError, match=re.escape(says)):
        GroupGenerator(3, 2).rebuild(reports)


@pytest.mark.parametrize("bad", [
    None, [], {"last": [0, [0, 1]]}, {"last": "x", "repeat": False, "final": False,
                                      "repeats": 0, "met": []},
    {"last": [0, [1, 0]], "repeat": False, "final": False, "repeats": 0, "met": []},
    {"last": None, "repeat": False, "final": False, "repeats": -1, "met": []},
    {"last": None, "repeat": False, "final": False, "repeats": 0, "met": [[1]]},
    {"last": None, "repeat": False, "final": False, "repeats": 0, "met": [[0, 0]] * 70000}])
def test_a_malformed_report_fails_its_check(bad):
    assert not REPORT[0](bad)


def test_a_record_says_what_its_worker_heard():
    rec = GroupRecord(0)
    assert rec.report() == {"last": None, "repeat": False, "final": False, "repeats": 0,
                            "met": []}
    gen = GroupGenerator(2, 2)
    first = gen.arrive(1) + gen.arrive(0)
    rec.received(first[0].message())
    again = gen.arrive(0) + gen.arrive(1)
    rec.received(again[0].message())
    assert rec.report() == {"last": [1, [0, 1]], "repeat": True, "final": False,
                            "repeats": 1, "met": [[1, 1]]}
    rec.received({"event": "group", "group": "x"})    # malformed: ignored (ready() says so)
    assert rec.report()["last"] == [1, [0, 1]]


def test_the_schedulers_part_checks_each_report_and_tells_an_owed_group_to_its_member_only():
    from ssdsgd.sync.events import PolicyError
    from ssdsgd.sync.scheduler_policies import FormGroups
    with pytest.raises(PolicyError, match="worker 1's report of its groups must be"):
        FormGroups(3, 2).rebuild({0: None, 1: {"last": "x"}})
    heard = {"last": [0, [0, 1]], "repeat": False, "final": False, "repeats": 0,
             "met": [[1, 0]]}
    part = FormGroups(2, 2)
    assert "worker 1 is owed group 0" in part.rebuild({0: heard, 1: None})
    (action,) = part.on_event("worker", 1, "ready", {})
    assert action == ("workers", [1], {"event": "group", "group": 0, "members": [0, 1],
                                       "repeat": False, "final": False})
