"""The knobs that only trade speed, chosen by the job when left at ``auto`` (the default):
the warm-up T_w from the run's length, and k from the warm-up's own timings
(docs/auto.md has the rules and the measurements they rest on).

Pure functions, and a ``Schedule`` that the worker's stage machine asks for the T_w and k
in force. Every worker must use the same k (the spec's schedule), so rank 0 decides from
its timings and tells the others at the end of the warm-up (one barrier); T_w needs no
agreement, every worker computes it from the same figures. Pinning a knob
(``sync.delay_steps: 7``) turns its ``auto`` off.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import sys

# The warm-up: a share of the run, at least the steps the k rule times, at most the
# paper's CIFAR-10 warm-up (a longer run needs no longer one); docs/auto.md.
WARMUP_SHARE = 0.05
WARMUP_MIN = 4
WARMUP_MAX = 500
WARMUP_UNKNOWN_LENGTH = 100     # the run's length is not known (SSDSGD_TOTAL_STEPS unset)

# k: the smallest that keeps the pulls' cost per step within SLACK of the push-every-step
# bound, within [K_MIN, K_MAX]; K_MAX is the largest k at which docs/glu.md's runs with
# glu_state exact stay within 1 point of SSGD at every lr up to 0.1.
SLACK = 0.1
K_MIN, K_MAX = 2, 10
K_UNTIMED = 5                   # fewer than TIMED_MIN timed warm-up steps: the paper's k
TIMED_MIN = 2                   # timed warm-up steps the k rule needs (the first is not timed)
TIMED_LAST = 20                 # the k rule reads the last this many warm-up steps


def is_auto(value) -> bool:
    return value == "auto"


def warmup_steps(setting, total_steps: int | None,
                 source: str = "SSDSGD_TOTAL_STEPS") -> tuple[int, str]:
    """T_w and why: the pinned count, or ``auto``'s share of a run of ``total_steps``
    (as ``source`` says)."""
    if not is_auto(setting):
        return int(setting), "pinned"
    if total_steps is None:
        return WARMUP_UNKNOWN_LENGTH, ("auto; the run's length is unknown: set "
                                       "SSDSGD_TOTAL_STEPS, an lr scheduler with max_update "
                                       "or sync.warmup_steps")
    steps = min(WARMUP_MAX, max(WARMUP_MIN, math.ceil(WARMUP_SHARE * total_steps)))
    return steps, (f"auto: {WARMUP_SHARE:.0%} of the run's {total_steps} steps ({source}), "
                   f"within [{WARMUP_MIN}, {WARMUP_MAX}]")


def run_length(optimizer_spec) -> int | None:
    """The run's length as the optimizer's lr scheduler states it (``max_update`` of
    MXNet's CosineScheduler and PolyScheduler), or None."""
    sched = (optimizer_spec or {}).get("lr_scheduler") or {}
    value = (sched.get("params") or {}).get("max_update")
    return int(value) if isinstance(value, (int, float)) and value >= 1 else None


@dataclasses.dataclass(frozen=True)
class Timings:
    """Medians over the timed warm-up steps of one worker: ``compute_s`` between two steps
    (the script's forward, backward and data), ``round_s`` blocked in a step (push, the
    slowest worker, the update, the reply), and the bytes a step sent and received;
    ``pull_bytes``: what a steps-delay pull will receive (the last warm-up step's reply,
    which carries the optimizer state when ``glu_state: exact`` needs it)."""
    compute_s: float
    round_s: float
    sent_bytes: float
    received_bytes: float
    pull_bytes: float


def delay_steps(t: Timings, k_max: int = K_MAX) -> tuple[int, str]:
    """k and why. The link time a byte costs is the round's time over the round's bytes;
    a push then costs ``push_s``, a pull ``pull_s``. A steps-delay step takes about
    max(compute, push) (the push-every-step bound), and a pull that does not fit in the
    step after it adds (pull - compute) once per k steps: k keeps that within SLACK of the
    bound."""
    per_byte = t.round_s / max(t.sent_bytes + t.received_bytes, 1.0)
    push_s, pull_s = per_byte * t.sent_bytes, per_byte * t.pull_bytes
    bound = max(t.compute_s, push_s, 1e-6)
    excess = pull_s - t.compute_s
    k = K_MIN if excess <= 0 else math.ceil(excess / (SLACK * bound))
    k = min(k_max, max(K_MIN, k))
    return k, (f"auto: compute {t.compute_s * 1e3:.1f} ms/step, push {push_s * 1e3:.1f} ms, "
               f"pull {pull_s * 1e3:.1f} ms (from the warm-up's {t.round_s * 1e3:.1f} ms "
               f"rounds), k within [{K_MIN}, {k_max}]")


class Schedule:
    """T_w and k in force on one worker. ``begin``/``end`` bracket every step so the
    warm-up is timed; ``decide`` at the end of the warm-up's last step (every worker at
    the same step) agrees on k. ``choices``: what was chosen and why, for the log and the
    run's summary."""

    def __init__(self, env, rank: int):
        self.rank, self._setting = rank, env.warmup_steps
        self._length_known = env.total_steps is not None
        self.warmup_steps, why_w = warmup_steps(env.warmup_steps, env.total_steps)
        self.auto_k = is_auto(env.delay_steps)
        self.delay_steps = None if self.auto_k else int(env.delay_steps)
        self.choices = {"warmup_steps": {"value": self.warmup_steps, "why": why_w}}
        if not self.auto_k:
            self.choices["delay_steps"] = {"value": self.delay_steps, "why": "pinned"}
        self._samples = []        # (compute_s, round_s, sent, received) of timed steps
        self._left = None         # when the last step returned (clock)
        self._before = None

    def learn_length(self, optimizer_spec, t: int):
        """An auto warm-up whose run length was unknown takes it from the lr scheduler
        (before the first step: every worker sets its optimizer before training)."""
        total = run_length(optimizer_spec)
        if self._length_known or total is None or t > 0 or not is_auto(self._setting):
            return
        self._length_known = True
        self.warmup_steps, why = warmup_steps(self._setting, total,
                                              "the lr scheduler's max_update")
        self.choices["warmup_steps"] = {"value": self.warmup_steps, "why": why}
        self.say(f"warm-up {self.warmup_steps} steps ({why})")

    @property
    def undecided(self) -> bool:
        return self.delay_steps is None

    def begin(self, t: int, now: float, stats: dict):
        self._before = (t, now, *_counters(stats))

    def end(self, now: float, stats: dict):
        t, start, *before = self._before
        if 0 < t < self.warmup_steps and self._left is not None:
            self._samples.append((start - self._left, *(
                after - b for after, b in zip(_counters(stats), before))))
            del self._samples[:-TIMED_LAST]
        self._left = now

    def timings(self) -> Timings | None:
        """The medians of the timed steps (the last one's reply as the pull), or None."""
        if len(self._samples) < TIMED_MIN:
            return None
        columns = list(zip(*self._samples))
        return Timings(*(statistics.median(c) for c in columns),
                       pull_bytes=max(self._samples[-1][3], statistics.median(columns[3])))

    def decide(self, agree) -> int:
        """k, from rank 0's timings; ``agree(value)`` returns rank 0's value on every
        worker (the client's barrier: the largest value any worker passed)."""
        timings = self.timings()
        if timings is None:
            k, why = K_UNTIMED, (f"auto, untimed: fewer than {TIMED_MIN} timed warm-up "
                                 f"steps (T_w = {self.warmup_steps})")
        else:
            k, why = delay_steps(timings)
        if agree is not None:
            agreed = agree(k if self.rank == 0 else 0)
            if agreed != k:
                why = f"auto: rank 0's choice (this worker's timings gave {k})"
            k = agreed
        self.set_delay(k, why)
        return k

    def set_delay(self, k: int, why: str):
        self.delay_steps = k
        self.choices["delay_steps"] = {"value": k, "why": why}
        self.say(f"k = {k} ({why})")

    def say(self, line: str):
        """Rank 0 tells the user (stderr: a script need not have set up logging)."""
        if self.rank == 0:
            print(f"ssdsgd: {line}", file=sys.stderr, flush=True)

    def describe(self) -> str:
        """The start-up line."""
        k = self.choices.get("delay_steps")
        return (f"warm-up {self.warmup_steps} steps ({self.choices['warmup_steps']['why']}); "
                + (f"k = {k['value']} (pinned)" if k else
                   "k: auto, chosen at the end of the warm-up from its timings"))


def _counters(stats: dict) -> tuple:
    """The client's figures a step is timed by: blocked seconds, bytes sent, received."""
    return (stats.get("time_blocked", 0.0), stats.get("bytes_sent", 0),
            stats.get("bytes_received", 0))
