"""Single-process reference of localsgd and diloco (the oracle; spec:
docs/spec/localsgd_diloco.md), a literal transcription of the spec's steps. It shares with
the system only what the spec names: the servers' rank-order sum (``simulate.Server``) and
the two optimizers (``outer.py``).

Within a step t of the warm-up (t < T_w) every worker computes g_i(t) at w_G(t - 1), the
servers apply Opt to the rank-order sum, every worker takes w_G(t). After it, every
worker's own copy of Opt (``outer.inner_copy``; its state and update count those of the
servers' Opt after the warm-up) steps on its own gradient, and when (t - T_w) mod H =
H - 1 the servers apply the outer optimizer to the rank-order sum of the deltas
d_i = w_G - w_i, and every worker takes the new w_G. At the end the steps since the last
sync are synced once more.
"""
from dataclasses import dataclass

import mxnet as mx

from .outer import inner_copy, outer_optimizer, seed
from .simulate import Server


@dataclass
class PeriodicResult:
    global_weights: dict   # {key: NDArray}: w_G after the final sync
    worker_weights: list   # [{key: NDArray}] per worker, after its last local step
    syncs: int             # outer steps the servers applied


def simulate_periodic(init_weights, grad_fn, make_optimizer, num_workers, steps, *,
                      algorithm="localsgd", warmup_steps=0, sync_period=1, outer_lr=0.7,
                      outer_momentum=0.9):
    """grad_fn(worker, step, weights) -> raw gradients; make_optimizer() -> a fresh copy
    of the Trainer's optimizer (rescale_grad 1 / global batch, as the servers get it)."""
    if sync_period < 1:
        raise ValueError(f"sync_period must be >= 1; got {sync_period}")
    n, H, T_w = num_workers, sync_period, warmup_steps
    server = Server(init_weights, make_optimizer)
    weights = [_copy(init_weights) for _ in range(n)]
    updaters, since_sync, syncs = None, 0, 0

    def sync():
        deltas = [{k: server.weights[k] - w[k] for k in w} for w in weights]
        server.apply_step(deltas)
        for i in range(n):
            weights[i] = _copy(server.weights)

    for t in range(steps):
        grads = [grad_fn(i, t, weights[i]) for i in range(n)]
        if t < T_w:
            server.apply_step(grads)
            for i in range(n):
                weights[i] = _copy(server.weights)
            continue
        if updaters is None:
            updaters = _start(server, algorithm, make_optimizer, n, outer_lr, outer_momentum)
        for i in range(n):
            for key in weights[i]:
                updaters[i](key, grads[i][key], weights[i][key])
        since_sync += 1
        if (t - T_w) % H == H - 1:
            sync()
            since_sync, syncs = 0, syncs + 1
    local = [_copy(w) for w in weights]
    if since_sync:
        sync()
        syncs += 1
    return PeriodicResult(global_weights=server.weights, worker_weights=local, syncs=syncs)


def _start(server, algorithm, make_optimizer, n, outer_lr, outer_momentum):
    """The end of the warm-up: every worker's copy continues the servers' Opt (its state
    and update count), and the servers take the outer optimizer."""
    reply = server.pull(with_state=True)
    updaters = []
    for _ in range(n):
        opt = inner_copy(make_optimizer(), n)
        updater = mx.optimizer.get_updater(opt)
        for key, w in server.weights.items():
            seed(opt, updater, key, w, reply.state[key] if server.steps_applied else [],
                 server.steps_applied)
        updaters.append(updater)
    server.opt = outer_optimizer(algorithm, n, outer_lr, outer_momentum)
    server.updater = mx.optimizer.get_updater(server.opt)
    return updaters


def _copy(weights):
    return {k: w.copy() for k, w in weights.items()}
