"""Single-process reference implementation of SSD-SGD (the oracle; spec: ssd-sgd.md).

The distributed system must equal this step for step, so it is a literal transcription of
the spec's server and worker steps, with nothing shared with ssdsgd/worker except the
local rules and the push codec. Within one step t the order is: every worker computes its
gradient (step 1) and pushes it (step 2); the server applies step t; then every worker
does steps 3-5. A pull "as of step t" is answered by a snapshot taken right after the
server applied t. With compression (docs/spec/compression.md) a push carries the
worker's compressed gradient, which the server decodes before the rank-order sum, while
the local rule still gets the worker's own uncompressed gradient.

    python -m ssdsgd.glu.simulate --workers 4 --k 2,5,10 --rules glu,sgd,none
trains a small MLP on scikit-learn's digits and prints test accuracy per (rule, k).
"""
import argparse
import json
import time
from dataclasses import dataclass, replace

import mxnet as mx

from ..kvstore.compression import Compression
from .rules import flatten_state, make_local_rule


@dataclass
class SimResult:
    global_weights: dict   # {key: NDArray}, w_G(steps - 1)
    worker_weights: list   # [{key: NDArray}] per worker, after the last local update
    push_bytes: int = 0    # gradient bytes all workers pushed (compressed size if any)


@dataclass
class PullReply:
    """What a pull as of step t returns (exact state only if the rule asks for it)."""
    step: int
    weights: dict
    state: dict
    lr: float
    num_update: int


class Server:
    """One synchronous update per step: sum the N gradients in rank order, apply Opt once."""

    def __init__(self, init_weights, make_optimizer):
        self.weights = {k: w.copy() for k, w in init_weights.items()}
        self.opt = make_optimizer()
        self.updater = mx.optimizer.get_updater(self.opt)
        self.steps_applied = 0

    def apply_step(self, grads):
        """grads: one {key: gradient} per worker, indexed by rank."""
        for key, weight in self.weights.items():
            acc = grads[0][key].copy()
            for g in grads[1:]:
                acc += g[key]
            self.updater(key, acc, weight)
        self.steps_applied += 1

    def pull(self, with_state):
        """The reply to a pull as of the last applied step (copies: the server moves on)."""
        state = {}
        if with_state:
            for key, w in self.weights.items():
                s = self.updater.states.get(key)
                if s is None:  # no update applied yet: the optimizer's initial state
                    s = self.opt.create_state_multi_precision(key, w)
                state[key] = [a.copy() for a in flatten_state(s)]
        return PullReply(step=self.steps_applied - 1,
                         weights={k: w.copy() for k, w in self.weights.items()},
                         state=state, lr=self.opt.learning_rate,
                         num_update=self.steps_applied)


class Pusher:
    """One worker's pushes: its gradients as the servers decode them (the identity
    without compression), with the worker's own error-feedback residuals."""

    def __init__(self, compression):
        self.spec = compression
        self.residuals = compression.residuals() if compression is not None else None
        self.bytes = 0

    def __call__(self, grads, compress=True):
        if self.spec is None or not compress:
            self.bytes += sum(g.size * g.dtype(0).itemsize for g in grads.values())
            return grads
        out = {}
        for key, g in grads.items():
            (payload,) = self.residuals.encode(key, g.asnumpy().reshape(-1))
            self.bytes += payload.nbytes
            out[key] = mx.nd.array(self.spec.decode(payload, g.size).reshape(g.shape),
                                   dtype=g.dtype)
        return out


class Worker:
    """One worker: its local weights w_i and, in the steps-delay stage, its local rule,
    the pull it requested at t - 1 and the reply of its previous reset (t_q); steps 3-5."""

    def __init__(self, weights, rule, offset):
        self.weights, self.rule, self.offset = weights, rule, offset
        self.pending = None          # the pull requested at t - 1
        self.previous_pull = None    # the reply of the previous reset (t_q)

    def reset(self):
        """3. reset to the reply of the pull requested at t - 1 (if there was one)."""
        if self.pending is None:
            return
        p, q = self.pending, self.previous_pull
        for key in self.weights:
            local, self.weights[key] = self.weights[key], p.weights[key].copy()
            self.rule.reset(key, p.weights[key], prev_global_weight=q.weights[key],
                            steps_between=p.step - q.step, state=p.state.get(key),
                            lr=p.lr, num_update=p.num_update, local_weight=local)
        self.previous_pull, self.pending = p, None

    def local_update(self, grads):
        """4. local update with g_i(t)."""
        for key in self.weights:
            self.rule.update(key, self.weights[key], grads[key])

    def requests_pull(self, t, T_w, k):
        """5. request the global weights as of step t when (t - T_w) mod k = k - 1, o_i
        steps earlier in each period if the pulls are staggered."""
        return (t - T_w + self.offset) % k == k - 1


def _checked(algorithm, delay_steps, pull_schedule, compression):
    """The arguments' checks; returns the compression as a Compression (or None)."""
    if compression is not None and not hasattr(compression, 'residuals'):
        compression = Compression.from_params(compression)
    if algorithm not in ('ssd', 'ssgd'):
        raise ValueError(f"algorithm must be ssd or ssgd in the simulator; got {algorithm!r}")
    if delay_steps < 1:
        raise ValueError(f"delay_steps must be >= 1; got {delay_steps}")
    if pull_schedule not in ('aligned', 'staggered'):
        raise ValueError(f"pull_schedule must be aligned or staggered; got {pull_schedule!r}")
    return compression


def simulate(init_weights, grad_fn, make_optimizer, num_workers, steps, algorithm='ssd',
             warmup_steps=0, delay_steps=1, local_rule='glu', glu_state='estimate',
             lr_local=None, compression=None, on_step=None, pull_schedule='aligned',
             compress_from=0):
    """Run the spec for `steps` global steps; grad_fn(worker, step, weights) -> raw grads.
    pull_schedule: 'aligned' (the spec) or 'staggered' (docs/spec/staggered_pulls.md).
    compression: None, kv.set_gradient_compression's dict, or a Compression; pushes of
    steps before ``compress_from`` are not compressed (``sync.compression: auto`` decides
    at the end of the warm-up: compress_from = T_w).
    on_step(t, global_weights), if given, sees w_G(t) right after the server applied step t
    (for learning curves; it must not modify the arrays)."""
    compression = _checked(algorithm, delay_steps, pull_schedule, compression)
    k, T_w = delay_steps, (steps if algorithm == 'ssgd' else warmup_steps)
    N = num_workers
    server = Server(init_weights, make_optimizer)
    pushers = [Pusher(compression) for _ in range(N)]
    weights = [{key: w.copy() for key, w in init_weights.items()} for _ in range(N)]
    # ssgd never updates locally, so it needs (and validates) no local rule.
    rules = [make_local_rule(local_rule, make_optimizer, N, glu_state, lr_local)
             if algorithm == 'ssd' else None for _ in range(N)]
    with_state = rules[0] is not None and rules[0].needs_state
    # Worker i requests o_i steps earlier in each period (staggered: o_i = floor(i k / N)).
    workers = [Worker(weights[i], rules[i], i * k // N if pull_schedule == 'staggered' else 0)
               for i in range(N)]

    # w_G(t) for t < 0 is the initial weights. Warm-up replies are kept for the last two
    # steps: at the first steps-delay step the pull of step T_w - 1 acts as the pull
    # requested at t - 1, and its t_q is the step before it.
    initial = server.pull(with_state)
    replies = {-2: replace(initial, step=-2), -1: initial}

    for t in range(steps):
        # 1. every worker computes g_i(t) at its local weights; 2. pushes it.
        grads = [grad_fn(i, t, worker.weights) for i, worker in enumerate(workers)]
        # Server: decode, wait for all N, sum in rank order, apply Opt once.
        server.apply_step([push(g, t >= compress_from) for push, g in zip(pushers, grads)])
        if on_step is not None:
            on_step(t, server.weights)

        if t < T_w:
            # Warm-up: plain synchronous SGD, wait for w_G(t).
            replies[t] = server.pull(with_state)
            replies.pop(t - 2, None)
            for worker in workers:
                worker.weights = {key: w.copy() for key, w in replies[t].weights.items()}
            continue
        if t == T_w:
            for worker in workers:
                worker.pending, worker.previous_pull = replies[T_w - 1], replies[T_w - 2]

        reply_t = None
        for worker, g in zip(workers, grads):
            worker.reset()                              # 3.
            worker.local_update(g)                      # 4.
            if worker.requests_pull(t, T_w, k):         # 5.
                if reply_t is None:
                    reply_t = server.pull(with_state)
                worker.pending = reply_t

    return SimResult(global_weights=server.weights,
                     worker_weights=[worker.weights for worker in workers],
                     push_bytes=sum(p.bytes for p in pushers))


# ---------------------------------------------------------------------------------------
# CLI: a digits MLP trained in-process, one accuracy per (rule, k) and for ssgd.

def _digits(seed):
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return train_test_split(x, y.astype(np.float32), test_size=0.25, random_state=seed,
                            stratify=y)


def _mlp(hidden, seed):
    mx.random.seed(seed)
    net = mx.gluon.nn.HybridSequential()
    net.add(mx.gluon.nn.Dense(hidden, activation='relu'), mx.gluon.nn.Dense(10))
    net.initialize(mx.init.Xavier())
    net(mx.nd.zeros((1, 64)))
    return net


def _experiment(args):
    """Returns init_weights, grad_fn, accuracy(weights) for the digits MLP."""
    import numpy as np
    x_tr, x_te, y_tr, y_te = _digits(args.seed)
    net = _mlp(args.hidden, args.seed)
    params = list(net.collect_params().values())
    init = {key: p.data().copy() for key, p in enumerate(params)}
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    b, n = args.batch, args.workers
    per_epoch = len(x_tr) // (b * n)
    orders = {}

    def load(weights):
        for key, p in enumerate(params):
            p.set_data(weights[key])

    def grad_fn(worker, step, weights):
        epoch, j = divmod(step, per_epoch)
        if epoch not in orders:
            orders[epoch] = np.random.RandomState(args.seed + epoch).permutation(len(x_tr))
        # Each worker gets its own disjoint shard of the step's global batch.
        idx = orders[epoch][(j * n + worker) * b:(j * n + worker + 1) * b]
        load(weights)
        with mx.autograd.record():
            loss = loss_fn(net(mx.nd.array(x_tr[idx])), mx.nd.array(y_tr[idx]))
        loss.backward()
        return {key: p.grad().copy() for key, p in enumerate(params)}

    def accuracy(weights):
        load(weights)
        pred = net(mx.nd.array(x_te)).argmax(axis=1).asnumpy()
        return float((pred == y_te).mean())

    return init, grad_fn, accuracy


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--workers', type=int, default=4)
    ap.add_argument('--k', default='2,5,10', help='comma-separated delays')
    ap.add_argument('--rules', default='glu,sgd,none', help='comma-separated local rules')
    ap.add_argument('--glu-states', default='estimate,exact,corrected',
                    help='comma-separated glu_state values, one glu row each')
    ap.add_argument('--optimizer', default='sgd', help='any mx.optimizer name')
    ap.add_argument('--lr', type=float, default=0.05)
    ap.add_argument('--momentum', type=float, default=0.9)
    ap.add_argument('--wd', type=float, default=1e-4)
    ap.add_argument('--steps', type=int, default=150)
    ap.add_argument('--warmup', type=int, default=10)
    ap.add_argument('--batch', type=int, default=16, help='per-worker batch size')
    ap.add_argument('--hidden', type=int, default=64)
    ap.add_argument('--seed', type=int, default=0)
    ap.add_argument('--compression', type=json.loads, default=None,
                    help='push compression for every row, e.g. \'{"type": "2bit", "threshold": 0.5}\'')
    args = ap.parse_args(argv)
    init, grad_fn, accuracy = _experiment(args)

    def make_optimizer():
        kw = dict(learning_rate=args.lr, wd=args.wd, rescale_grad=1.0 / args.batch)
        if args.optimizer in ('sgd', 'nag'):
            kw['momentum'] = args.momentum
        return mx.optimizer.create(args.optimizer, **kw)

    def run(**kw):
        res = simulate(init, grad_fn, make_optimizer, args.workers, args.steps,
                       warmup_steps=args.warmup, compression=args.compression, **kw)
        return accuracy(res.global_weights)

    start = time.time()
    ks = [int(k) for k in args.k.split(',')]
    print(f"digits MLP, N={args.workers}, {args.optimizer} lr={args.lr} "
          f"momentum={args.momentum} wd={args.wd}, batch {args.batch}/worker, "
          f"{args.steps} steps, warm-up {args.warmup}, compression {args.compression}; "
          f"test accuracy of w_G")
    rows = [(rule, state) for rule in args.rules.split(',')
            for state in (args.glu_states.split(',') if rule == 'glu' else ['estimate'])]
    print(f"{'rule':<14}" + ''.join(f"{'k=' + str(k):>8}" for k in ks))
    print(f"{'ssgd':<14}{run(algorithm='ssgd'):>8.3f}")
    for rule, state in rows:
        accs = [run(delay_steps=k, local_rule=rule, glu_state=state) for k in ks]
        name = f"glu/{state}" if rule == 'glu' else rule
        print(f"{name:<14}" + ''.join(f"{a:>8.3f}" for a in accs))
    print(f"({time.time() - start:.1f} s)")


if __name__ == '__main__':
    main()
