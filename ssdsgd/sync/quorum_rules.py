"""Whom a quorum round waits for (docs/spec/quorum.md): the rule ``rounds.Rounds`` asks
before it closes a round, and tells of every push that joins one and every round closed.

``FixedQuorum`` is sync.quorum's Q (all, majority, solo, an integer): any Q distinct
workers. ``LateWorkers`` is ``auto``: every worker but those it measured persistently
late, until they are on time again. Only the leader (server 0) asks a rule; the timing
enters here alone, through an injected clock, and what it decides travels in the
decision log (rounds.py), so the followers replay the same rounds.

    rule = LateWorkers(4, clock=time.monotonic)
    rule.joined(2)                                 # worker 2's push joined the open round
    rule.complete({0, 1, 2}, {0, 1, 2, 3})         # False until 3 is in, or excused
    rule.closed({0, 1, 2, 3}, {0, 1, 2, 3}, 17)    # [] or the changes from round 18 on
"""
import math
import statistics
import time
from collections import deque

from ..settings import quorum_size
from .events import MAX_CHANGES


class FixedQuorum:
    """Q distinct workers, fewer if fewer can still come (rule 2a)."""

    def __init__(self, quorum):
        self.quorum = quorum
        self.excused = frozenset()

    def complete(self, members, possible):
        return len(members) >= min(self.quorum, len(possible))

    def joined(self, rank):
        pass

    def closed(self, members, possible, number):
        return []

    def record(self):
        """What the run's summary shows of this rule: nothing to show."""
        return None


class LateWorkers:
    """``sync.quorum: auto``. A round closes once every worker that can still come (rule
    2a) is in it, but the excused ones. After each round the rule measures each worker's
    lag: how long after the round's pace -- the moment half of the workers that could
    come had joined it (a push that waited for the round joins it as it opens) -- its push
    joined, or, if it did not, the round's end. A lag above ``bound`` (``share`` of the
    median round time over the last ``window`` rounds, the step time the job runs at, and
    at least ``floor_s``) is late. A worker late in ``patience`` rounds in a row that
    span ``min_span_s`` seconds or more (so that a loaded machine's scheduling bursts do
    not count) is excused from the next round on; an excused one on time in
    ``patience`` rounds in a row is waited for again. Measured from the pace, not the
    first push, so that a worker ahead of the others (its pushes waiting for the rounds)
    does not make them all look late; and at most half the workers can be after the
    pace, so at most half are excused. A round with fewer than two workers that could
    come measures nothing (the others finished, or wait at a barrier)."""

    SHARE, FLOOR_S, PATIENCE, MIN_SPAN_S, WINDOW = 1 / 3, 0.1, 5, 1.0, 25

    def __init__(self, num_workers, clock=time.monotonic, *, share=SHARE, floor_s=FLOOR_S,
                 patience=PATIENCE, min_span_s=MIN_SPAN_S, window=WINDOW):
        self.n, self.quorum, self.clock = num_workers, num_workers, clock
        self.share, self.floor_s, self.patience = share, floor_s, patience
        self.min_span_s = min_span_s
        self.excused = set()
        self.streak = [0] * num_workers   # rounds in a row against its status
        self.worst = [0.0] * num_workers  # that streak's smallest lag (late), largest (on time)
        self.since = [0.0] * num_workers  # when that streak began (its first round's end)
        self.joins = {}                   # rank -> when its push joined the open round
        self.opened = self.last_close = self.origin = None
        self.durations = deque(maxlen=window)
        self.changes, self.dropped, self.rounds = [], 0, 0

    def complete(self, members, possible):
        return possible - self.excused <= members

    def joined(self, rank):
        now = self.clock()
        if self.origin is None:
            self.origin = now
        if self.opened is None:
            self.opened = now
        self.joins[rank] = now

    def closed(self, members, possible, number):
        """Round ``number`` closed with ``members`` while ``possible`` could have come:
        the changes it decides (dicts, see ``record``), each from round number + 1 on."""
        now = self.clock()
        start = self.last_close if self.last_close is not None else self.opened
        self.durations.append(now - (now if start is None else start))
        self.last_close, self.rounds = now, number + 1
        joins, self.joins, self.opened = self.joins, {}, None
        if len(possible) < 2 or not joins:
            return []
        bound = max(self.share * statistics.median(self.durations), self.floor_s)
        order = sorted(joins.values())
        pace = order[min(math.ceil(len(possible) / 2), len(order)) - 1]
        changes = []
        for rank in sorted(possible):
            lag = max((joins[rank] if rank in joins else now) - pace, 0.0)
            change = self._observe(rank, rank in joins and lag <= bound, lag, now)
            if change is not None:
                change.update(round=number + 1, time=round(now - self.origin, 3),
                              bound=round(bound, 4))
                changes.append(change)
        for change in changes:
            if len(self.changes) < MAX_CHANGES:
                self.changes.append(change)
            else:
                self.dropped += 1
        return changes

    def _observe(self, rank, on_time, lag, now):
        """One round of ``rank``: extend or end its streak against its status; at
        ``patience`` rounds (late: spanning ``min_span_s``) the status flips, never
        excusing the last worker waited for."""
        excused = rank in self.excused
        if on_time != excused:                  # as its status expects
            self.streak[rank] = 0
            return None
        self.streak[rank] += 1
        if self.streak[rank] == 1:
            self.worst[rank], self.since[rank] = lag, now
        self.worst[rank] = (max if excused else min)(self.worst[rank], lag)
        span = now - self.since[rank]
        if self.streak[rank] < self.patience or (not excused and (
                span < self.min_span_s or len(self.excused) + 1 >= self.n)):
            return None
        rounds, self.streak[rank] = self.streak[rank], 0
        if excused:
            self.excused.discard(rank)
        else:
            self.excused.add(rank)
        return {"worker": rank, "change": "in" if excused else "out",
                "lag": round(self.worst[rank], 4), "rounds": rounds,
                "seconds": round(span, 3)}

    def record(self):
        """What the run's summary shows (events.quorum_record checks it): the rounds
        closed, who is excused now, and every change -- ``worker``, ``change`` (out: left
        out, in: waited for again), the first ``round`` it applies to, ``time`` (seconds
        since the first push), ``lag`` (out: the smallest of its late rounds; in: the
        largest of its rounds on time), ``rounds`` in a row and the ``seconds`` they
        span (from the first one's end), ``bound`` -- the first
        MAX_CHANGES of them (``dropped``: the others)."""
        return {"rule": "auto", "rounds": self.rounds, "excused": sorted(self.excused),
                "changes": [dict(c) for c in self.changes], "dropped": self.dropped}


def describe(change):
    """The leader's line for a change (server 0 prints it)."""
    if change["change"] == "out":
        return (f"quorum auto: leaving out worker {change['worker']} (late by "
                f"{change['lag']:.2f} s or more for {change['rounds']} rounds in "
                f"{change['seconds']:.1f} s, bound {change['bound']:.2f} s) from round "
                f"{change['round']}")
    return (f"quorum auto: waiting for worker {change['worker']} again (on time for "
            f"{change['rounds']} rounds, within {change['bound']:.2f} s) from round "
            f"{change['round']}")


def quorum_rule(text, num_workers, clock=time.monotonic):
    """The rule of a well-formed sync.quorum (settings.quorum_size checks the form)."""
    if text == "auto":
        return LateWorkers(num_workers, clock)
    return FixedQuorum(quorum_size(text, num_workers))
