"""The spec's simulator with workers that join or leave at given steps
(docs/spec/membership.md): the oracle a job whose membership changes is compared with.

Why a sibling of ``simulate.py`` and not an option of it: ``simulate`` is the contract's
literal transcription, which the oracle tests of every fixed-N job read line by line; a
membership change adds a set of members per step, a global-batch lr clock and a
joiner's first reset, none of which a fixed job has. With no change this module gives
``simulate``'s weights bit for bit (tests/test_simulate_membership.py), so the two
cannot drift apart unseen. It reuses ``simulate``'s server, pusher and worker.

The rules, in short (the spec page has them in full):

* M(t), the ranks in the job at step t: 0..N-1 (N: the job's first size), plus every
  rank that joined at a step <= t, minus every rank that left at a step <= t. A joiner
  takes the next unused rank.
* Server step t: the gradients of M(t) summed in rank order; when |M(t)| != N, that sum
  times N / |M(t)| (the transport's float32 ``sum * scale``): the members' mean gradient
  counted as N workers', so the lr keeps its meaning whoever joins or leaves (the rule
  ``on_worker_failure: continue`` already follows); then Opt once.
* The lr schedule counts global batches: pushes applied / N (``GlobalBatchSchedule``),
  the same clock as a quorum's (docs/spec/quorum.md rule 6); with no change it is t + 1,
  the update count.
* A joiner at step s computes g(s) at w_G(s - 1) (its pull as of s - 1). In ssd's
  steps-delay stage s must be a pull boundary ((s - T_w) mod k == 0, aligned pulls), and
  its first reset, at s, takes that pull with no history: its previous pull is the same
  weights one step earlier (the estimate's velocity starts at zero; ``exact`` gets the
  servers' state, as every pull of it does).
* The local rules keep scaling a worker's gradient by N: the servers' step still stands
  for N gradients.
"""
from dataclasses import dataclass, replace

import mxnet as mx
import numpy as np

from ..mxglue.batch_schedule import GlobalBatchSchedule
from .rules import make_local_rule
from .simulate import Pusher, Server, SimResult, Worker, _checked


@dataclass(frozen=True)
class Change:
    """Worker ``rank`` joins (pushes from ``step`` on) or leaves (pushes steps before
    ``step`` only)."""
    step: int
    event: str     # 'join' | 'leave'
    rank: int


class MembershipError(ValueError):
    """A schedule of changes the rules do not allow (the reason names the change)."""


def members_by_step(num_workers, changes, steps):
    """[M(t) as a sorted tuple for t in range(steps)], the changes checked."""
    members, out = set(range(num_workers)), []
    ever = set(members)
    by_step = {}
    for c in sorted(changes, key=lambda c: (c.step, c.event != 'leave', c.rank)):
        if c.event not in ('join', 'leave'):
            raise MembershipError(f"a change is 'join' or 'leave', not {c.event!r}")
        if not 0 <= c.step < steps:
            raise MembershipError(f"{c.event} of worker {c.rank} at step {c.step}, outside "
                                  f"the run's steps 0..{steps - 1}")
        by_step.setdefault(c.step, []).append(c)
    for t in range(steps):
        for c in by_step.get(t, ()):
            if c.event == 'join':
                if c.rank != len(ever):
                    raise MembershipError(f"worker {c.rank} joins at step {t}, but a joiner "
                                          f"takes the next unused rank, {len(ever)}")
                members.add(c.rank)
                ever.add(c.rank)
            else:
                if c.rank not in members or members == {c.rank}:
                    raise MembershipError(f"worker {c.rank} cannot leave at step {t} (not in "
                                          "the job, or its last worker, which the job ends "
                                          "with)")
                members.discard(c.rank)
        out.append(tuple(sorted(members)))
    return out


class _MemberServer(Server):
    """``Server`` of a job that started with N workers: a step of another number of
    members is their sum times N / |M|, and the lr clock counts pushes / N."""

    def __init__(self, init_weights, make_optimizer, num_workers):
        super().__init__(init_weights, make_optimizer)
        self.n = num_workers
        sched = self.opt.lr_scheduler
        self.clock = None
        if sched is not None:
            self.clock = self.opt.lr_scheduler = GlobalBatchSchedule(sched, num_workers)

    def apply_members(self, grads):
        """grads: one {key: gradient} per member, in rank order."""
        if self.clock is not None:
            self.clock.pushes += len(grads)
        if len(grads) == self.n:
            return self.apply_step(grads)
        scale = np.float32(self.n / len(grads))
        mean = [{key: mx.nd.array(np.sum([g[key].asnumpy() for g in grads], axis=0)
                                  * scale, dtype=grads[0][key].dtype)
                 for key in self.weights}]
        return self.apply_step(mean)


def _check_schedule(schedule, algorithm, T_w, k, pull_schedule, steps):
    n0 = len(schedule[0]) if schedule else 0
    for t, members in enumerate(schedule):
        before = schedule[t - 1] if t else tuple(range(n0))
        joined = set(members) - set(before)
        if joined and algorithm == 'ssd' and t > T_w and pull_schedule == 'aligned':
            if (t - T_w) % k:
                raise MembershipError(f"worker {min(joined)} joins at step {t}, not a pull "
                                      f"boundary (steps T_w + m k = {T_w} + m x {k})")


def simulate_membership(init_weights, grad_fn, make_optimizer, num_workers, steps, changes,
                        algorithm='ssd', warmup_steps=0, delay_steps=1, local_rule='glu',
                        glu_state='estimate', lr_local=None, compression=None,
                        pull_schedule='aligned', on_step=None):
    """``simulate`` with ``changes`` (``Change``s) to who is in the job. grad_fn(rank,
    step, weights) -> raw grads, called for the members of that step only. Returns a
    ``SimResult`` whose ``worker_weights`` has one entry per rank ever in the job (a
    worker that left keeps its weights of its last step)."""
    compression = _checked(algorithm, delay_steps, pull_schedule, compression)
    k, T_w = delay_steps, (steps if algorithm == 'ssgd' else warmup_steps)
    schedule = members_by_step(num_workers, changes, steps)
    _check_schedule(schedule, algorithm, T_w, k, pull_schedule, steps)
    server = _MemberServer(init_weights, make_optimizer, num_workers)
    workers, pushers = {}, {}

    def make_worker(rank, weights):
        rule = (make_local_rule(local_rule, make_optimizer, num_workers, glu_state, lr_local)
                if algorithm == 'ssd' else None)
        offset = rank * k // num_workers if pull_schedule == 'staggered' else 0
        workers[rank] = Worker({key: w.copy() for key, w in weights.items()}, rule, offset)
        pushers[rank] = Pusher(compression)

    for rank in range(num_workers):
        make_worker(rank, init_weights)
    with_state = workers[0].rule is not None and workers[0].rule.needs_state
    initial = server.pull(with_state)
    replies = {-2: replace(initial, step=-2), -1: initial}

    for t, members in enumerate(schedule):
        for rank in members:
            if rank not in workers:          # joins at t: the weights as of t - 1
                first = server.pull(with_state)
                make_worker(rank, first.weights)
                if t > T_w:                  # its first reset: that pull, no history
                    workers[rank].pending = first
                    workers[rank].previous_pull = replace(first, step=first.step - 1)
        grads = {r: grad_fn(r, t, workers[r].weights) for r in members}
        server.apply_members([pushers[r](grads[r]) for r in members])
        if on_step is not None:
            on_step(t, server.weights)
        if t < T_w:
            replies[t] = server.pull(with_state)
            replies.pop(t - 2, None)
            for r in members:
                workers[r].weights = {key: w.copy() for key, w in replies[t].weights.items()}
            continue
        if t == T_w:
            for r in members:
                workers[r].pending, workers[r].previous_pull = replies[T_w - 1], replies[T_w - 2]
        reply_t = None
        for r in members:
            worker = workers[r]
            worker.reset()
            worker.local_update(grads[r])
            if worker.requests_pull(t, T_w, k):
                if reply_t is None:
                    reply_t = server.pull(with_state)
                worker.pending = reply_t

    return SimResult(global_weights=server.weights,
                     worker_weights=[workers[r].weights for r in sorted(workers)],
                     push_bytes=sum(p.bytes for p in pushers.values()))


# ---------------------------------------------------------------------------------------
# CLI: the digits MLP of ``simulate``, a job that grows against one that does not.

def digits_join(workers=2, join_at=None, epochs=3, warmup=10, k=5, seed=0, lr=0.1,
                batch=16, hidden=64):
    """Test accuracy of w_G after ``epochs`` of digits: ``workers`` workers, and one more
    joining at step ``join_at`` (None: no join), ssd with ``k`` (0: ssgd). The data
    follows ``ssdsgd.sync.membership``: the same budget of samples either way. The lr is
    for the mean gradient of the global batch, as in ssdsgd's training program
    (rescale_grad 1 / (N b))."""
    from types import SimpleNamespace
    from ..sync.membership import Membership
    from .simulate import _digits, _mlp
    x_tr, x_te, y_tr, y_te = _digits(seed)
    net = _mlp(hidden, seed)
    params = list(net.collect_params().values())
    init = {key: p.data().copy() for key, p in enumerate(params)}
    loss_fn = mx.gluon.loss.SoftmaxCrossEntropyLoss()
    per_epoch = len(x_tr) // (batch * workers) * workers
    data = Membership(workers, per_epoch, epochs * per_epoch)
    changes = []
    if join_at is not None:
        data.join(workers, join_at)
        changes = [Change(join_at, 'join', workers)]
    orders = {}

    def load(weights):
        for key, p in enumerate(params):
            p.set_data(weights[key])

    def grad_fn(rank, step, weights):
        epoch, c = data.chunk(rank, step)
        if epoch not in orders:
            orders[epoch] = np.random.RandomState(seed + epoch).permutation(len(x_tr))
        idx = orders[epoch][c * batch:(c + 1) * batch]
        load(weights)
        with mx.autograd.record():
            loss = loss_fn(net(mx.nd.array(x_tr[idx])), mx.nd.array(y_tr[idx]))
        loss.backward()
        return {key: p.grad().copy() for key, p in enumerate(params)}

    def make_optimizer():
        return mx.optimizer.SGD(learning_rate=lr, momentum=0.9, wd=1e-4,
                                rescale_grad=1.0 / (batch * workers))

    kw = (dict(algorithm='ssgd') if not k else
          dict(algorithm='ssd', warmup_steps=warmup, delay_steps=k))
    res = simulate_membership(init, grad_fn, make_optimizer, workers, data.end(), changes,
                              **kw)
    load(res.global_weights)
    pred = net(mx.nd.array(x_te)).argmax(axis=1).asnumpy()
    return SimpleNamespace(accuracy=float((pred == y_te).mean()), steps=data.end())


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description="digits MLP: a job one worker joins against "
                                             "the job of that many workers from the start")
    ap.add_argument('--workers', type=int, default=2, help='workers at the start')
    ap.add_argument('--join', type=int, required=True, help='the step one more joins at')
    ap.add_argument('--k', type=int, default=5, help='delay steps (0: ssgd)')
    ap.add_argument('--warmup', type=int, default=10)
    ap.add_argument('--epochs', type=int, default=3)
    args = ap.parse_args(argv)
    common = dict(epochs=args.epochs, warmup=args.warmup, k=args.k)
    full = digits_join(args.workers + 1, **common)
    grown = digits_join(args.workers, join_at=args.join, **common)
    print(f"{args.workers + 1} workers throughout: accuracy {full.accuracy:.3f} in "
          f"{full.steps} steps; {args.workers} + 1 joining at step {args.join}: "
          f"{grown.accuracy:.3f} in {grown.steps} steps")


if __name__ == '__main__':
    main()
