"""The two optimizers of localsgd and diloco (docs/spec/localsgd_diloco.md), as MXNet
builds them: the servers' outer step and each worker's own (inner) copy of the Trainer's
optimizer. The worker and the simulator both take them from here, so both run the same
arithmetic.

The servers sum the N workers' model deltas d_i = w_G - w_i in rank order and, with
``rescale_grad = 1/N``, the outer optimizer sees their mean. localsgd: SGD with lr 1 and
neither momentum nor wd, so w_G <- w_G - mean(d_i), the mean of the workers' models.
diloco: MXNet's NAG (Nesterov) with ``sync.outer_lr`` and ``sync.outer_momentum``
(DiLoCo's 0.7 and 0.9), no wd.
"""
import mxnet as mx

from ..sync.registry import ALGORITHMS


def outer_optimizer(algorithm, num_workers, outer_lr=0.7, outer_momentum=0.9):
    """The servers' optimizer after the warm-up, for ``num_workers`` deltas a sync."""
    kind, mean = ALGORITHMS[algorithm].outer, 1.0 / num_workers
    if kind == "average":
        return mx.optimizer.SGD(learning_rate=1.0, momentum=0.0, wd=0.0, rescale_grad=mean)
    if kind == "nesterov":
        return mx.optimizer.NAG(learning_rate=outer_lr, momentum=outer_momentum, wd=0.0,
                                rescale_grad=mean)
    raise ValueError(f"algorithm {algorithm} has no outer step (localsgd and diloco have)")


def inner_copy(optimizer, num_workers):
    """``optimizer`` (a fresh copy of the Trainer's, as the servers got it) made the
    worker's own: its gradient stands for the whole step, as the N gradients the servers
    sum in the warm-up (``rescale_grad`` x N, as glu's local copy), so a local step is a
    single-machine step on the worker's own batch with the Trainer's lr, wd and schedule."""
    optimizer.rescale_grad = optimizer.rescale_grad * num_workers
    return optimizer


def seed(optimizer, updater, key, weight, state_arrays, update_count):
    """Start the worker's copy for ``key`` where the servers' warm-up left it: their
    optimizer state (flat arrays; none: a fresh state) and update count (the lr
    schedule and Adam's bias correction continue from it)."""
    from ..mxglue.optimizer_spec import flatten_state
    optimizer._set_current_context(weight.context.device_id)   # noqa: SLF001
    state = optimizer.create_state_multi_precision(key, weight)
    slots = flatten_state(state)
    if state_arrays:
        if len(state_arrays) != len(slots):
            raise ValueError(f"key {key}: the servers sent {len(state_arrays)} optimizer "
                             f"state arrays, the worker's copy keeps {len(slots)}")
        for slot, value in zip(slots, state_arrays):
            slot[:] = mx.nd.array(value.reshape(slot.shape), ctx=slot.context,
                                  dtype=slot.dtype)
    updater.states[key] = state
    updater.states_synced[key] = True
    if update_count:
        optimizer._index_update_count[key] = int(update_count)   # noqa: SLF001
        optimizer.num_update = max(optimizer.num_update, int(update_count))
