"""Which stage a step is in and whether it pulls: pure functions of the step index.

The spec fixes the reset points, so the whole schedule is known in advance: warm-up steps
(t < T_w) and every step of ``ssgd``/``asgd`` push and wait for the weights; a steps-delay
step pushes without waiting and requests the global weights when (t - T_w) mod k = k - 1,
to be waited for one step later.

With ``pull_schedule: staggered`` (docs/spec/staggered_pulls.md) worker i requests when
(t - T_w + o_i) mod k = k - 1, o_i = floor(i k / N): the N pulls of a period leave on
different steps instead of as one burst through the servers' links.
"""
import dataclasses
import enum


class Stage(str, enum.Enum):
    """The one stage vocabulary: the stage machine, the training program and the metrics
    all use these values (a ``str`` enum, so it is written to JSON as its value)."""
    WARMUP = "warmup"            # ssd, t < T_w: synchronous SGD
    STEPS_DELAY = "steps_delay"  # ssd, t >= T_w: push every step, pull every k steps
    SSGD = "ssgd"                # algorithm ssgd: every step synchronous (dist_sync)
    ASGD = "asgd"                # algorithm asgd: the server applies each push (dist_async)
    PREDUCE = "preduce"          # algorithm preduce: local step, then a group's average

    def __str__(self):
        return self.value


@dataclasses.dataclass(frozen=True)
class StepPlan:
    stage: Stage
    synchronous: bool   # push and wait for w_G(t) in this step
    request_pull: bool  # ask for w_G(t) with the push (waited for at t + 1 when asynchronous)


PULL_SCHEDULES = ("aligned", "staggered")


def pull_offset(rank, num_workers, delay_steps, schedule="aligned"):
    """o_i: how many steps earlier in each period worker ``rank`` requests its pull."""
    if schedule not in PULL_SCHEDULES:
        raise ValueError(f"pull_schedule must be one of {PULL_SCHEDULES}; got {schedule!r}")
    if schedule == "aligned":
        return 0
    if not 0 <= rank < num_workers:
        raise ValueError(f"rank {rank} is not in [0, {num_workers})")
    return rank * delay_steps // num_workers


def plan(t, algorithm, warmup_steps, delay_steps, offset=0):
    """The step's stage; ``offset``: this worker's ``pull_offset``."""
    if algorithm == "asgd":
        return StepPlan(Stage.ASGD, True, True)
    if algorithm == "ssgd":
        return StepPlan(Stage.SSGD, True, True)
    if algorithm == "preduce":
        return StepPlan(Stage.PREDUCE, False, False)
    if t < warmup_steps:
        return StepPlan(Stage.WARMUP, True, True)
    return StepPlan(Stage.STEPS_DELAY, False,
                    (t - warmup_steps + offset) % delay_steps == delay_steps - 1)
