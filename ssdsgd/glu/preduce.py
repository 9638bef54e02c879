"""Single-process reference of partial reduce (the oracle; spec: docs/spec/preduce.md).

Given the sequence of groups the scheduler formed (or the order in which workers reported
ready, replayed through the same group generator), the result is fixed: worker i's j-th
group averages its weights after its j-th local step, and that step started from its
(j-1)-th group's average. Groups are processed in formation order, which respects every
worker's own order, so timing cannot change the weights -- which is what the distributed
run is tested against.
"""
from dataclasses import dataclass

import mxnet as mx

from ..sync.groups import Group, mean, replay


@dataclass
class PreduceResult:
    worker_weights: list   # [{key: NDArray}] per worker, after its last group
    local_weights: list    # [{key: NDArray}] per worker, before the final group
    groups: list           # the Groups, in formation order


def simulate_preduce(init_weights, grad_fn, make_optimizer, num_workers, steps, *,
                     groups=None, arrivals=None, group_size=2):
    """grad_fn(worker, step, weights) -> raw gradients; ``steps``: local steps of each
    worker (an int or one per rank). Give ``groups`` (Groups or member tuples in
    formation order, the final group of all workers last) or ``arrivals`` (ranks in the
    order they report ready, replayed through the generator with ``group_size``)."""
    steps = [steps] * num_workers if isinstance(steps, int) else list(steps)
    if groups is None:
        groups = replay(arrivals, num_workers, group_size, steps)
    groups = [g if isinstance(g, Group) else Group(n, tuple(g), len(g) == num_workers
                                                    and n == len(groups) - 1)
              for n, g in enumerate(groups)]
    weights = [{k: w.copy() for k, w in init_weights.items()} for _ in range(num_workers)]
    updaters = [mx.optimizer.get_updater(make_optimizer()) for _ in range(num_workers)]
    done = [0] * num_workers       # local steps taken
    local = None
    for group in groups:
        if group.final:
            local = [{k: w.copy() for k, w in ws.items()} for ws in weights]
        for m in group.members:
            if group.final:
                if done[m] != steps[m]:
                    raise ValueError(f"final group {group.number}: worker {m} took "
                                     f"{done[m]} of its {steps[m]} steps")
                continue
            if done[m] >= steps[m]:
                raise ValueError(f"group {group.number}: worker {m} has no step left")
            grads = grad_fn(m, done[m], weights[m])
            for key in weights[m]:
                updaters[m](key, grads[key], weights[m][key])
            done[m] += 1
        if len(group.members) > 1:
            for key in init_weights:
                value = mean([weights[m][key].asnumpy() for m in group.members])
                for m in group.members:
                    weights[m][key] = mx.nd.array(value, dtype=value.dtype)
    if local is None:
        raise ValueError("the groups end without the final group of every worker")
    return PreduceResult(weights, local, groups)


def arrival_groups(records):
    """The group sequence a job formed, from each worker's (group number, members) list."""
    seen = {}
    for worker_groups in records:
        for number, members in worker_groups:
            if seen.setdefault(int(number), tuple(members)) != tuple(members):
                raise ValueError(f"group {number} has two member lists")
    numbers = sorted(seen)
    if numbers != list(range(len(numbers))):
        raise ValueError(f"groups {sorted(set(range(max(numbers) + 1)) - set(numbers))} "
                         "are missing")
    return [seen[n] for n in numbers]

