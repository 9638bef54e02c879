"""How many messages a small step's push is cut into, chosen by timing the job's own steps.

``SSDSGD_PIPELINE_PIECES=auto`` (the default). More pieces let a server apply and answer the
first while the rest arrive, so a step's pushes and replies share the link as ps-lite's
per-key messages do. That pays when the link is the bottleneck and costs Python per message
when it is not (ResNet-20 shapes, ssgd against native ``dist_sync``: 0.84-0.88x with one
message and 1.00-1.03x with 3-4 at 1 Gbit/s; 1.87x with one and 1.22x with 4 at 10 Gbit/s;
docs/benchmarks/small_steps.md). Which case a job is in depends on its links, model and
machines, none of which a worker knows, so it times its steps instead: after ``skip``
steps it tries each candidate on interleaved steps, ``rounds`` times, and keeps the one
whose steps took least (median), if that beats one message by 5 %. Every worker follows the same schedule of steps, so in a
synchronous job they try the same candidate on the same step.

The count changes message boundaries only: each key is still summed over the same pushes
and updated by the same operator, so the results are the same bit for bit whatever it picks.
"""
import logging
import statistics
import time

log = logging.getLogger(__name__)

CANDIDATES = (1, 4, 8)
MARGIN = 0.05       # more pieces are kept only if their steps are this much shorter


class PieceTuner:
    """``value``: the pieces in force. ``mark()`` once per timed step (as a pulling push
    leaves); the period between two marks is charged to the value in force during it."""

    def __init__(self, fixed=None, candidates=CANDIDATES, rounds=3, skip=3,
                 clock=time.perf_counter):
        self.candidates, self._clock = tuple(candidates), clock
        self.value = fixed if fixed is not None else self.candidates[0]
        self.chosen = fixed                 # None while still trying
        self.times = {c: [] for c in self.candidates}
        self._plan = [] if fixed is not None else \
            [c for _ in range(rounds) for c in self.candidates]
        self._skip = skip
        self._trial = None                  # the candidate timed since the last mark
        self._last = None

    def mark(self, timed=True):
        """A step starts now. Returns the pieces for it. ``timed=False``: a step another
        trial times (the relay's, sync/auto.py): it keeps the count in force and is
        charged to no candidate; the plan goes on at the next timed step."""
        if self.chosen is not None:
            return self.value
        now = self._clock()
        if self._trial is not None:
            self.times[self._trial].append(now - self._last)
        self._last, self._trial = now, None
        if not timed:
            return self.value
        if self._skip > 0:                  # the first steps also pay for lazy set-up
            self._skip -= 1
        elif self._plan:
            self._trial = self.value = self._plan.pop(0)
        else:
            self.value = self.chosen = self._fastest()
            log.info("pipeline pieces: %d (median step s: %s)", self.value, ", ".join(
                f"{c}: {statistics.median(self.times[c]):.4f}" for c in self.candidates))
        return self.value

    def _fastest(self):
        """The candidate of least median step, if it beats the first (one message) by
        MARGIN: more messages also cost CPU that other processes' steps pay, which this
        worker's clock sees only in part, and a near tie is noise."""
        median = {c: statistics.median(t) for c, t in self.times.items()}
        best = min(self.candidates, key=lambda c: (median[c], c))
        first = self.candidates[0]
        return best if median[best] < (1 - MARGIN) * median[first] else first
