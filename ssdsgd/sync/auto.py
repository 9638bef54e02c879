"""The knobs that only trade speed, chosen by the job when left at ``auto`` (the default):
the warm-up T_w from the run's length, and k and the pull relay from the warm-up's own
timings (docs/auto.md has the rules and the measurements they rest on).

Pure functions, and a ``Schedule`` that the worker's stage machine asks for the T_w and k
in force. Every worker must use the same k (the spec's schedule), so rank 0 decides from
its timings and tells the others at the end of the warm-up (one barrier); T_w needs no
agreement, every worker computes it from the same figures. Pinning a knob
(``sync.delay_steps: 7``) turns its ``auto`` off.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import sys
import time

from . import stage
from .registry import refusal

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

# k's cap by the job's optimizer and (peak) lr: the largest k in {2, 5, 10} whose runs in
# docs/glu.md (digits MLPs, tanh and ReLU, glu_state exact) ended within 1 point of SSGD
# at that lr; an lr between two measured ones takes the larger one's cap. Above the table
# no k ended within 1 point (sgd at lr 0.15 and 0.2: every k lost 5-30 points, k = 2 the
# least), so K_MIN and a warning; an optimizer not measured gets the paper's k.
K_CAP_BY_LR = {
    "sgd": ((0.05, 10), (0.1, 5)),
    "nag": ((0.05, 10), (0.1, 5)),
    "adam": ((0.03, 10),),
}
TIMED_MIN = 2                   # timed warm-up steps the k rule needs (the first is not timed)
TIMED_LAST = 20                 # the k rule reads the last this many warm-up steps


RELAY_MIN_WORKERS = 3           # an auto relay needs a chain of at least this many
# The relay's trial: where the relay is auto, the warm-up's steps T_w - 1 - RELAY_TRIAL ..
# T_w - 2 are relayed and timed, so the choice rests on what a relayed pull cost here, not
# on a model of it (the model's 2/N missed CURVE's decrypt and re-encrypt on every hop:
# docs/auto.md). Needs TIMED_MIN direct steps before it and the last warm-up step after.
RELAY_TRIAL = 3

# sync.compression: auto (opt-in: compression changes results). The codecs weighed, in the
# order of what they cost in accuracy (docs/spec/compression.md: topk at its default ratio
# matched uncompressed training, 2bit lost some in ssd and much in ssgd); the first whose
# step estimate is within SLACK of the best one's is taken.
CODECS_BY_COST = ("none", "topk", "2bit")

# The scheduler keeps the value of the barrier that carries rank 0's choice under this
# name: a worker that joins later takes it, and a join's step in the steps-delay stage,
# which depends on k, is decided from it (stage.join_boundary).
AGREEMENT = "auto_choice"


def encode_choice(k: int, relay: bool, codec: str) -> int:
    """k, the relay and the codec as one barrier value (the largest wins: only rank 0
    passes a non-zero one)."""
    return (2 * k + relay) * len(CODECS_BY_COST) + CODECS_BY_COST.index(codec)


def decode_choice(value: int) -> tuple[int, bool, str]:
    agreed, index = divmod(value, len(CODECS_BY_COST))
    return agreed // 2, bool(agreed % 2), CODECS_BY_COST[index]


def agreed_k(agreed) -> int | None:
    """The k the workers agreed on, from the scheduler's kept barrier values; None
    before they did."""
    value = agreed.get(AGREEMENT)
    return None if value is None else decode_choice(value)[0]


def is_auto(value) -> bool:
    return value == "auto"


def relay_listens(env) -> bool:
    """Does this worker open a pull relay (docs/spec/pull_relay.md)? A joiner never (the
    table of relays is handed out at the start); else with ``chain`` always; with
    ``auto``, where a relay may be chosen: SSD-SGD's pulls, a chain of RELAY_MIN_WORKERS
    or more, and a job the registry would run with ``chain`` (it refuses a relay beside
    a quorum, staggered pulls or a worker left behind)."""
    if env.joining:     # no chain knows its address: the relays are the start's
        return False
    if env.pull_relay != "auto":
        return env.pull_relay == "chain"
    return (stage.delays_pulls(env.algorithm) and env.num_workers >= RELAY_MIN_WORKERS
            and refusal({**dataclasses.asdict(env), "pull_relay": "chain"}, str) is None)


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
    which carries the optimizer state when ``glu_state: exact`` needs it);
    ``relayed_round_s``: a round of the relay's trial, whose replies were relayed (None:
    no trial)."""
    compute_s: float
    round_s: float
    sent_bytes: float
    received_bytes: float
    pull_bytes: float
    relayed_round_s: float | None = None

    def link_s(self, nbytes: float) -> float:
        """What ``nbytes`` cost on the link, at the warm-up rounds' time per byte."""
        return self.round_s / max(self.sent_bytes + self.received_bytes, 1.0) * nbytes


@dataclasses.dataclass(frozen=True)
class CodecCost:
    """What coding one step's push with a codec costs on this worker, measured: seconds
    of CPU, and the bytes it sends per byte of float32 gradient."""
    seconds: float
    wire: float


def compression(t: Timings, costs: dict):
    """(codec name, why): the codec of ``costs`` ({name: CodecCost}) or none whose
    steps-delay step is estimated shortest, preferring the one that costs least in
    accuracy (CODECS_BY_COST) within SLACK. A step is estimated at max(compute + coding,
    push): the push-every-step bound with the push's bytes as the codec sends them, and
    its coding on the training thread's CPU."""
    push_s = t.link_s(t.sent_bytes)
    estimates = {"none": max(t.compute_s, push_s)}
    estimates.update((name, max(t.compute_s + c.seconds, push_s * c.wire))
                     for name, c in costs.items())
    best = min(estimates.values())
    name = next(n for n in CODECS_BY_COST if n in estimates
                and estimates[n] <= (1 + SLACK) * best)
    return name, ("auto: a steps-delay step estimated at " + ", ".join(
        f"{n} {estimates[n] * 1e3:.1f} ms" for n in CODECS_BY_COST if n in estimates)
        + f" (compute {t.compute_s * 1e3:.1f} ms, push {push_s * 1e3:.1f} ms uncompressed); "
        f"the first within {SLACK:.0%} of the best, in the order {', '.join(CODECS_BY_COST)}")


def k_cap(optimizer_spec) -> tuple[int, str, bool]:
    """(the largest k the accuracy data supports for this optimizer and lr, why, whether
    the job is warned: its lr is above every one measured); K_CAP_BY_LR. No optimizer
    (the servers only sum): K_MAX."""
    if not optimizer_spec:
        return K_MAX, "no optimizer on the servers", False
    name = optimizer_spec.get("name")
    lr = (optimizer_spec.get("params") or {}).get("learning_rate")
    table = K_CAP_BY_LR.get(name)
    if table is None or not isinstance(lr, (int, float)):
        return K_UNTIMED, (f"no accuracy data for {name} in docs/glu.md: at most the "
                           f"paper's k = {K_UNTIMED}"), False
    for top, k in table:
        if lr <= top:
            return k, f"at most {k} at {name} lr {lr:g} (docs/auto.md)", False
    return K_MIN, (f"{name} lr {lr:g} is above every lr at which a k ended within 1 point "
                   f"of SSGD (docs/glu.md, up to {table[-1][0]:g}): at most {K_MIN}, and "
                   "expect a loss of accuracy; sync.algorithm: ssgd keeps it"), True


def delay_steps(t: Timings, k_max: int = K_MAX, relay_workers: int = 0,
                codec: CodecCost | None = None):
    """(k, relay, why). The link time a byte costs is the round's time over the round's
    bytes; a push then costs ``push_s``, a pull ``pull_s``. A steps-delay step takes about
    max(compute, push) (the push-every-step bound). A pull as of step t is answered once
    step t is applied, so it starts when that step's push has landed: what the step after
    it cannot hide, (push + pull - compute), is added once per k steps, and k keeps that
    within SLACK of the bound. ``relay_workers``: the chain a relay would have (0: no
    relay possible); the relay is chosen when it makes the step estimate shorter
    (``relayed_pull_s``).
    ``codec``: the pushes are compressed with it (its wire bytes, its coding time counted
    as compute; pulls are not compressed)."""
    push_s, pull_s = t.link_s(t.sent_bytes), t.link_s(t.pull_bytes)
    compute_s = t.compute_s
    if codec is not None:
        push_s, compute_s = push_s * codec.wire, compute_s + codec.seconds
    bound = max(compute_s, push_s, 1e-6)

    def period(cost_s):
        """(k, the step estimate) for a pull of ``cost_s``."""
        excess = push_s + cost_s - compute_s
        k = K_MIN if excess <= 0 else math.ceil(excess / (SLACK * bound))
        k = min(k_max, max(K_MIN, k))
        return k, bound + max(0.0, excess) / k
    k, step_s = period(pull_s)
    relay, relayed = False, None
    if relay_workers >= RELAY_MIN_WORKERS:
        relayed, how = relayed_pull_s(t, pull_s, relay_workers)
        k_relayed, step_relayed = period(relayed)
        if step_relayed < step_s:
            relay, k = True, k_relayed
    return k, relay, (
        f"auto: compute {t.compute_s * 1e3:.1f} ms/step, push {push_s * 1e3:.1f} ms, pull "
        f"{pull_s * 1e3:.1f} ms (from the warm-up's {t.round_s * 1e3:.1f} ms rounds)"
        + (f", relayed {relayed * 1e3:.1f} ms ({how})" if relayed is not None else "")
        + f"; k within [{K_MIN}, {k_max}]")


def relayed_pull_s(t: Timings, pull_s: float, relay_workers: int):
    """(what a relayed pull costs, how it was found). Measured where the warm-up relayed
    its trial steps: a relayed round saved (or cost) ``round_s - relayed_round_s`` on a
    reply of ``received_bytes``, scaled to the pull's bytes (at least 1 / relay_workers
    of a pull: the servers still send one copy). Else modelled: 2 / relay_workers of a
    pull from the servers (their link carries one copy instead of N, the rest is the
    chain's hops), which charges nothing for the CPU a hop spends, so it is used only
    where the warm-up is too short for a trial."""
    if t.relayed_round_s is None:
        return pull_s * 2 / relay_workers, f"modelled, 2/{relay_workers} of a pull"
    saved = t.round_s - t.relayed_round_s
    relayed = max(pull_s - saved * t.pull_bytes / max(t.received_bytes, 1.0),
                  pull_s / relay_workers)
    return relayed, (f"measured: relayed rounds {t.relayed_round_s * 1e3:.1f} ms against "
                     f"{t.round_s * 1e3:.1f} ms")


class Schedule:
    """T_w, k and the pull relay in force on one worker, and so the plan of each step
    (``plan``). ``begin``/``end`` bracket every step so the warm-up is timed;
    ``after_step`` at the end of the warm-up's last step (every worker at the same step)
    agrees on what was left to the job. ``choices``: what was chosen and why, for the log
    and the run's summary. ``relay_workers``: the chain a relay would have (0 if this job
    cannot relay: ``relay_listens``); ``on_choice(schedule)`` is called once k, the relay
    and the compression are known. ``compression``: a codec's name, "none", or None while
    ``auto`` (``compress_auto``) has not decided."""

    def __init__(self, env, rank: int, num_workers: int, relay_workers: int = 0,
                 on_choice=None):
        self.rank, self.num_workers, self._setting = rank, num_workers, env.warmup_steps
        self.algorithm, self.pull_schedule = env.algorithm, env.pull_schedule
        self.on_choice, self.offset = on_choice, 0   # offset: this worker's pull_offset
        self._length_known = env.total_steps is not None
        self.warmup_steps, why_w = warmup_steps(env.warmup_steps, env.total_steps)
        self.choices = {"warmup_steps": {"value": self.warmup_steps, "why": why_w}}
        self.delay_steps = None if is_auto(env.delay_steps) else int(env.delay_steps)
        # k auto: the job agrees on it once, at a barrier the scheduler keeps (AGREEMENT)
        self._to_agree = stage.delays_pulls(self.algorithm) and self.delay_steps is None
        if stage.syncs_periodically(self.algorithm):   # localsgd, diloco: H plays k's part
            self.delay_steps = env.sync_period
            self.choices["sync_period"] = {"value": self.delay_steps, "why": "pinned"}
        elif self.delay_steps is not None:
            self.choices["delay_steps"] = {"value": self.delay_steps, "why": "pinned"}
        self.relay_workers = relay_workers if is_auto(env.pull_relay) else 0
        self.relay = None if self.relay_workers else env.pull_relay == "chain"
        if self.relay is not None:
            self.choices["pull_relay"] = {"value": _relay_name(self.relay), "why": (
                "pinned" if not is_auto(env.pull_relay) else
                "auto: off, this job cannot relay (it needs ssd's aligned pulls, no quorum, "
                f"no worker left behind, and at least {RELAY_MIN_WORKERS} "
                "workers)")}
        self.compression, self._measure = "none", None   # compress_auto: undecided
        self.k_max, self._cap_why = K_MAX, None          # learn_cap: by optimizer and lr
        self._samples = []        # (compute_s, round_s, sent, received) of timed steps
        self._left = None         # when the last step returned (clock)
        self._trial_from = None   # when the step before the relay's trial returned
        self._trial_s = None      # from then to the end of the warm-up (its last step)
        self._last_received = None    # the last warm-up step's reply (after a trial)
        self._before = None
        if not self.undecided:
            self._chosen()
        if stage.delays_pulls(self.algorithm):
            self.say(self.describe())
        elif stage.syncs_periodically(self.algorithm):
            self.say(f"warm-up {self.warmup_steps} steps ({why_w}); then a model sync every "
                     f"{self.delay_steps} steps (sync.sync_period)")

    def compress_auto(self, measure):
        """``sync.compression: auto`` (the Trainer's ``compression_params={'type':
        'auto'}``): decided with k at the end of the warm-up; ``measure(nbytes)`` returns
        {codec name: CodecCost} of a push of ``nbytes`` (only rank 0's counts). Without a
        warm-up to time (ssgd, asgd) the pushes stay uncompressed, and it says so."""
        if not stage.delays_pulls(self.algorithm):
            self.choices["compression"] = {"value": "none", "why": (
                f"auto: {self.algorithm} has no warm-up to time; set sync.compression to "
                "a codec to compress")}
            self.say(f"compression none ({self.choices['compression']['why']})")
            return
        self.compression, self._measure = None, measure
        self.say("compression: auto, chosen at the end of the warm-up from its timings")

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

    def learn_cap(self, optimizer_spec):
        """k auto: at most what the accuracy data supports for the job's optimizer and lr
        (``k_cap``); said when it warns."""
        if self.delay_steps is not None or not stage.delays_pulls(self.algorithm):
            return
        self.k_max, self._cap_why, warns = k_cap(optimizer_spec)
        if warns:
            self.say(f"k auto: {self._cap_why}")

    def _capped(self, why: str) -> str:
        return why if self._cap_why is None else f"{why}; {self._cap_why}"

    @property
    def undecided(self) -> bool:
        """Something is left to ``decide`` (k, the relay or the compression)."""
        return self.delay_steps is None or self.relay is None or self.compression is None

    def plan(self, t: int):
        """The stage of step ``t`` (sync/stage.py). Past the warm-up with nothing timed
        (T_w = 0, or resumed past it without a recorded choice) every worker takes the
        same fallback, with no agreement needed."""
        if t >= self.warmup_steps and self._choosing():
            self.set_choice(min(K_UNTIMED, self.k_max), False,
                            self._capped("auto, untimed: no warm-up step to time"), "none")
        return self.stage_of(t)

    def stage_of(self, t: int):
        """``plan`` without choosing anything (metrics)."""
        return stage.plan(t, self.algorithm, self.warmup_steps, self.delay_steps, self.offset)

    def after_step(self, t_next: int, agree):
        """After the warm-up's last step: every worker decides, together (``decide``)."""
        if t_next == self.warmup_steps and (self._choosing() or self._to_agree):
            self.decide(agree)

    def before_step(self, t: int, agree):
        """Before step ``t`` past the warm-up, where k is auto and this worker took no part
        in the job's agreement yet: a worker that joins after it (it hears rank 0's
        choice at once), a job resumed past the warm-up or with none (T_w = 0), whose
        workers agree on the recorded choice or the untimed fallback. So the scheduler
        always knows k, which a join's step depends on (stage.join_boundary)."""
        if t >= self.warmup_steps and self._to_agree:
            self.decide(agree)

    def _choosing(self):
        return self.undecided and stage.delays_pulls(self.algorithm)

    def trial_steps(self) -> range:
        """The warm-up steps relayed to time the relay (RELAY_TRIAL): only where the relay
        is auto and undecided, and the warm-up has TIMED_MIN timed direct steps before
        them and its last step after them; else none."""
        last = self.warmup_steps - 1
        if self.relay is not None or self.relay_workers < RELAY_MIN_WORKERS \
                or not self._choosing() \
                or last - RELAY_TRIAL < 1 + TIMED_MIN:
            return range(0)
        return range(last - RELAY_TRIAL, last)

    def queues_warmup_step(self, t: int) -> bool:
        """May warm-up step ``t`` be queued on MXNet's engine as an ssgd step is
        (worker/deferred.py)? A queued step returns before its round is done, so it times
        nothing. Not the last: its reply seeds the local rule, with the state. Not the
        relay's trial, on any worker: its replies come down the chain. And while k, the
        relay or the compression is auto and undecided, on rank 0, whose timings alone
        choose (``decide``: the others pass 0 to the agreement), not the last TIMED_LAST
        steps before the trial nor the step before them, whose end starts the first
        sample."""
        last = self.warmup_steps - 1
        warms_up = stage.delays_pulls(self.algorithm) or \
            stage.syncs_periodically(self.algorithm)
        if not warms_up or not 0 <= t < last or t in self.trial_steps():
            return False
        return not self._choosing() or self.rank != 0 or \
            t < last - RELAY_TRIAL - TIMED_LAST - 1

    def skip_timing(self):
        """A step was queued (``queues_warmup_step``): the next one's compute is not
        timed from its return."""
        self._left = None

    def trial_relays(self, t: int) -> bool | None:
        """Is step ``t``'s reply relayed for the trial? None outside it and the step after
        it: the choice in force decides (every worker asks at the same steps)."""
        trial = self.trial_steps()
        if not trial or not trial.start <= t <= trial.stop:
            return None
        return t in trial

    @contextlib.contextmanager
    def timed(self, t: int, stats: dict, clock=time.perf_counter):
        """Around step ``t``: a warm-up step but the first is timed (``stats``: the
        client's, read before and after). The relay's trial and the warm-up's last step
        after it are timed as one span: the last relayed reply's lag shows in the step
        after it, where the workers wait for the last of the chain to push."""
        start, before = clock(), _counters(stats)
        yield
        trial = self.trial_steps()
        sample = (start - self._left if self._left is not None else None,
                  *(after - b for after, b in zip(_counters(stats), before)))
        if trial and t == trial.start:
            self._trial_from = self._left
        if trial and trial.start <= t <= trial.stop:
            if t == trial.stop:
                self._last_received = sample[3]
                if self._trial_from is not None:
                    self._trial_s = clock() - self._trial_from
        elif 0 < t < self.warmup_steps and self._left is not None:
            self._samples.append(sample)
            del self._samples[:-TIMED_LAST]
        self._left = clock()

    def timings(self) -> Timings | None:
        """The medians of the timed direct steps (the last warm-up step's reply as the
        pull), and the relayed rounds of the trial, or None."""
        if len(self._samples) < TIMED_MIN:
            return None
        columns = list(zip(*self._samples))
        medians = [statistics.median(c) for c in columns]
        last = self._last_received if self._last_received is not None else columns[3][-1]
        relayed = None
        if self._trial_s is not None:       # the span less its last (direct) step
            relayed = (self._trial_s - medians[0] - medians[1]) / RELAY_TRIAL - medians[0]
        return Timings(*medians, pull_bytes=max(last, medians[3]),
                       relayed_round_s=None if relayed is None else max(relayed, 0.0))

    def decide(self, agree):
        """k and the relay where auto, from rank 0's timings; ``agree(value)`` returns
        rank 0's value on every worker (the client's barrier: the largest value any worker
        passed), None: no agreement needed (every worker takes the fallback)."""
        timings = self.timings()
        codec, why_c = self.compression or "none", "pinned"
        if timings is None:
            k, relay = min(K_UNTIMED, self.k_max), False
            why = why_c = self._capped(f"auto, untimed: fewer than {TIMED_MIN} timed warm-up "
                                       f"steps (T_w = {self.warmup_steps})")
        else:
            costs = {}
            if self.compression is None and self.rank == 0:    # only rank 0's choice counts
                costs = self._measure(timings.sent_bytes)
                codec, why_c = compression(timings, costs)
            k, relay, why = delay_steps(timings, k_max=self.k_max,
                                        relay_workers=self.relay_workers,
                                        codec=costs.get(codec))
            why = self._capped(why)
        k = k if self.delay_steps is None else self.delay_steps
        relay = relay if self.relay is None else self.relay
        if agree is not None:
            mine = encode_choice(k, relay, codec)
            agreed = agree(mine if self.rank == 0 else 0, agreement=AGREEMENT)
            if self.rank != 0:      # its own steps may have been queued, untimed
                why = why_c = "auto: rank 0's choice"
            elif agreed != mine:
                why = why_c = f"auto: rank 0's choice (this worker's timings gave k = {k})"
            k, relay, codec = decode_choice(agreed)
            self._to_agree = False
        self.set_choice(k, relay, why, codec, why_c)

    def set_choice(self, k: int, relay: bool, why: str, codec: str = "none",
                   why_codec: str | None = None):
        """Take k, the relay and the compression (where auto) and say so."""
        said = []
        if self.compression is None:
            self.compression = codec
            self.choices["compression"] = {"value": codec, "why": why_codec or why}
            if why_codec and why_codec != why:
                self.say(f"compression {codec} ({why_codec})")
            else:
                said.append(f"compression {codec}")
        if self.delay_steps is None:
            self.delay_steps = k
            self.choices["delay_steps"] = {"value": k, "why": why}
            said.append(f"k = {k}")
        if self.relay is None:
            self.relay = relay
            self.choices["pull_relay"] = {"value": _relay_name(relay), "why": why}
            said.append(f"pull relay {_relay_name(relay)}")
        if said:
            self.say(f"{', '.join(said)} ({why})")
        self._chosen()

    def _chosen(self):
        self.offset = stage.pull_offset(self.rank, self.num_workers, self.delay_steps,
                                        self.pull_schedule)
        if self.on_choice is not None:
            self.on_choice(self)

    def say(self, line: str):
        """Rank 0 tells the user (stderr: a script need not have set up logging)."""
        if self.rank == 0:
            print(f"ssdsgd: {line}", file=sys.stderr, flush=True)

    def describe(self) -> str:
        """The start-up line."""
        k, relay = self.choices.get("delay_steps"), self.choices.get("pull_relay")
        auto = [name for name, c in (("k", k), ("the pull relay", relay)) if c is None]
        return (f"warm-up {self.warmup_steps} steps ({self.choices['warmup_steps']['why']})"
                + (f"; k = {k['value']} (pinned)" if k else "")
                + (f"; pull relay {relay['value']} ({relay['why']})"
                   if relay and relay["why"] != "pinned" else "")
                + (f"; {' and '.join(auto)}: auto, chosen at the end of the warm-up from "
                   "its timings" if auto else ""))


def _relay_name(on: bool) -> str:
    return "chain" if on else "off"


def _counters(stats: dict) -> tuple:
    """The client's figures a step is timed by: blocked seconds, bytes sent, received."""
    return (stats.get("time_blocked", 0.0), stats.get("bytes_sent", 0),
            stats.get("bytes_received", 0))
