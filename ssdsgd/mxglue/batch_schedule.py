"""The servers' lr schedule under a quorum, counted in global batches.

MXNet's schedulers take the optimizer's update count. With ``sync.quorum`` below N a
round holds fewer than N pushes, so more rounds close than there are steps (majority of
4: 4/3 as many; solo: up to N times) and a schedule of updates would reach its end early
(docs/spec/quorum.md, "The lr schedule counts global batches"). This wrapper asks the
user's scheduler at (pushes applied, the current round's included) / N instead: the
number of global batches trained on, which is the round number when every round is full.
"""


class GlobalBatchSchedule:
    """Wraps one of mx.lr_scheduler's schedulers; the server counts ``pushes``. A saved
    optimizer state describes both (optimizer_spec), so a resumed job keeps the clock."""

    def __init__(self, inner, num_workers, pushes=0):
        self.inner, self.num_workers, self.pushes = inner, num_workers, pushes

    def __call__(self, num_update):
        return self.inner(self.pushes / self.num_workers)

    @property
    def base_lr(self):
        return self.inner.base_lr

    @base_lr.setter
    def base_lr(self, value):
        self.inner.base_lr = value
