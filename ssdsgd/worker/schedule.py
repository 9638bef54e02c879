"""Which stage a step is in and whether it pulls: pure functions of the step index.

The spec fixes the reset points, so the whole schedule is known in advance: warm-up steps
(t < T_w) and every step of ``ssgd``/``asgd`` push and wait for the weights; a steps-delay
step pushes without waiting and requests the global weights when (t - T_w) mod k = k - 1,
to be waited for one step later.
"""
import dataclasses

WARMUP, DELAY, SYNC, ASYNC = "warmup", "steps_delay", "ssgd", "asgd"


@dataclasses.dataclass(frozen=True)
class StepPlan:
    stage: str
    synchronous: bool   # push and wait for w_G(t) in this step
    request_pull: bool  # ask for w_G(t) with the push (waited for at t + 1 when asynchronous)


def plan(t, algorithm, warmup_steps, delay_steps):
    if algorithm == "asgd":
        return StepPlan(ASYNC, True, True)
    if algorithm == "ssgd":
        return StepPlan(SYNC, True, True)
    if t < warmup_steps:
        return StepPlan(WARMUP, True, True)
    return StepPlan(DELAY, False, (t - warmup_steps) % delay_steps == delay_steps - 1)
