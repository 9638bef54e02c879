"""The stage of step t, in one place: which stage a step is in, whether it waits for the
weights and whether it pulls, and how far a worker may push ahead of the servers. The
worker's stage machine, the training program and the server read it.

Pure functions of the step index and the settings, after the algorithm's stage rule (its
entry in ``ssdsgd.sync.registry``). The spec fixes the reset points, so the whole
schedule is known in advance: warm-up steps (t < T_w) and every step of ``ssgd``/``asgd``
push and wait for the weights; a steps-delay step pushes without waiting and requests
the global weights when (t - T_w) mod k = k - 1, to be waited for one step later; a
``preduce`` step is local and then averaged with a group, never pulled. ``localsgd`` and
``diloco`` (docs/spec/localsgd_diloco.md) warm up as ssd does; after it each step is a
local step, and every H-th (``(t - T_w) mod H = H - 1``) also syncs: the worker pushes
its model delta and waits for the new global weights (H takes k's place in ``plan``).

With ``pull_schedule: staggered`` (docs/spec/staggered_pulls.md) worker i requests when
(t - T_w + o_i) mod k = k - 1, o_i = floor(i k / N): the N pulls of a period leave on
different steps instead of as one burst through the servers' links.
"""
import dataclasses
import enum

from .registry import ALGORITHMS


class Stage(str, enum.Enum):
    """The one stage vocabulary: the stage machine, the training program and the metrics
    all use these values (a ``str`` enum, so it is written to JSON as its value)."""
    WARMUP = "warmup"            # ssd, t < T_w: synchronous SGD
    STEPS_DELAY = "steps_delay"  # ssd, t >= T_w: push every step, pull every k steps
    SSGD = "ssgd"                # algorithm ssgd: every step synchronous (dist_sync)
    ASGD = "asgd"                # algorithm asgd: the server applies each push (dist_async)
    PREDUCE = "preduce"          # algorithm preduce: local step, then a group's average
    LOCAL_STEPS = "local_steps"  # localsgd, diloco, t >= T_w: local steps, a sync every H

    def __str__(self):
        return self.value


@dataclasses.dataclass(frozen=True)
class StepPlan:
    stage: Stage
    synchronous: bool   # push and wait for w_G(t) in this step
    request_pull: bool  # ask for w_G(t) with the push (waited for at t + 1 when asynchronous)


PULL_SCHEDULES = ("aligned", "staggered")


def pull_offset(rank, num_workers, delay_steps, schedule="aligned"):
    """o_i: how many steps earlier in each period worker ``rank`` requests its pull:
    floor(i k / N) mod k, so a joiner's (rank N or above, docs/spec/membership.md)
    follows from its rank as the first workers' do."""
    if schedule not in PULL_SCHEDULES:
        raise ValueError(f"pull_schedule must be one of {PULL_SCHEDULES}; got {schedule!r}")
    if schedule == "aligned":
        return 0
    if rank < 0:
        raise ValueError(f"rank {rank} is negative")
    return rank * delay_steps // num_workers % delay_steps


# The stage rules of the registry's algorithms: (t, algorithm, T_w, k, offset) -> StepPlan.
def _synchronous(t, algorithm, warmup_steps, delay_steps, offset):
    return StepPlan(Stage(algorithm), True, True)


def _local(t, algorithm, warmup_steps, delay_steps, offset):
    return StepPlan(Stage(algorithm), False, False)


def _steps_delay(t, algorithm, warmup_steps, delay_steps, offset):
    if t < warmup_steps:
        return StepPlan(Stage.WARMUP, True, True)
    return StepPlan(Stage.STEPS_DELAY, False,
                    (t - warmup_steps + offset) % delay_steps == delay_steps - 1)


def _periodic(t, algorithm, warmup_steps, period, offset):
    if t < warmup_steps:
        return StepPlan(Stage.WARMUP, True, True)
    return StepPlan(Stage.LOCAL_STEPS, False, (t - warmup_steps) % period == period - 1)


RULES = {"synchronous": _synchronous, "local": _local, "steps_delay": _steps_delay,
         "periodic": _periodic}


def plan(t, algorithm, warmup_steps, delay_steps, offset=0):
    """The stage of step ``t``; ``offset``: this worker's ``pull_offset``."""
    return RULES[ALGORITHMS[algorithm].stage](t, algorithm, warmup_steps, delay_steps, offset)


def delays_pulls(algorithm):
    """True if the algorithm has a steps-delay stage (a local rule between pulls)."""
    return ALGORITHMS[algorithm].stage == "steps_delay"


def syncs_periodically(algorithm):
    """True for localsgd and diloco: after the warm-up, local steps and a model sync
    every H = sync.sync_period steps."""
    return ALGORITHMS[algorithm].stage == "periodic"


def steps_ahead_bound(algorithm, delay_steps):
    """How many steps past the last applied one a worker may push: in the steps-delay
    stage a worker runs at most k steps ahead of the slowest (it waits for every pull one
    step after requesting it, spec step 3); otherwise every step waits for its reply. One
    more for slack. This bounds the gradients a server holds to (bound x N x model)."""
    return (delay_steps if delays_pulls(algorithm) else 1) + 2


def join_boundary(algorithm, warmup_steps, delay_steps, pull_schedule="aligned"):
    """``boundary(held, agreed)``: the step a joiner comes in at, given ``held``, the
    largest step the servers hold from (docs/spec/membership.md, "The step"), or None
    while it cannot be known yet. Every worker must learn of the join from a reply a
    server sent after it admitted the joiner (a step >= held) before it makes its batch
    of that step: in ssgd and ssd's warm-up it makes batch s once it has w_G(s - 1), so
    s = held + 1; in ssd's steps-delay stage s is a pull boundary T_w + m k (every worker
    resets to the same global weights there) and batch s is made after the pull as of
    s - 1 - k, so s - 1 - k >= held. ``delay_steps`` None: k is ``auto``, known once the
    workers agreed on it at the end of the warm-up (``agreed``, the scheduler's kept
    barrier values: ``auto.agreed_k``); a step in the warm-up needs no k.
    Staggered pulls have no step every worker resets at: s = held + k + 1, since every
    worker requests a pull in any k steps from ``held`` on and waits for it, at the step
    after, before it makes the batch of s; the joiner's own first reset is at s (rule 5)."""
    if algorithm != "ssd":
        return lambda held, agreed=None: held + 1

    def boundary(held, agreed=None):
        if held + 1 <= warmup_steps:
            return held + 1
        k = delay_steps
        if k is None:
            from .auto import agreed_k
            k = agreed_k(agreed or {})
            if k is None:
                return None
        if pull_schedule == "staggered":
            return held + k + 1
        m = max(0, -(-(held + 1 + k - warmup_steps) // k))
        return warmup_steps + m * k
    return boundary


def takes_joiners(env) -> bool:
    """cluster.max_workers above the workers (docs/spec/membership.md)."""
    return (env.max_workers or 0) > env.num_workers


def joins_boundary(env):
    """The job's ``join_boundary`` if it takes joiners (cluster.max_workers above its
    workers, docs/spec/membership.md), else None; ssd needs T_w in advance: pinned, or
    ``auto`` of a run whose length every process has (SSDSGD_TOTAL_STEPS: the workers'
    own rule, ``auto.warmup_steps``); an auto warm-up of a run of unknown length (a worker
    may learn it from its lr scheduler) is not the scheduler's to know. k may be auto:
    the workers' agreement on it tells the scheduler."""
    from .auto import is_auto, warmup_steps
    if not takes_joiners(env):
        return None
    if env.algorithm == "ssd" and is_auto(env.warmup_steps) and env.total_steps is None:
        return None
    warmup = (warmup_steps(env.warmup_steps, env.total_steps)[0]
              if env.algorithm == "ssd" else 0)
    delay = None if is_auto(env.delay_steps) else int(env.delay_steps)
    return join_boundary(env.algorithm, warmup, delay, env.pull_schedule)
