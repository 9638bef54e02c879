"""The spec's simulator with workers that join or leave at given steps
(docs/spec/membership.md): the oracle a job whose membership changes is compared with.

Why a sibling of ``simulate.py`` and not an option of it: ``simulate`` is the contract's
literal transcription, which the oracle tests of every fixed-N job read line by line; a
membership change adds a set of members per step, a nominal N per step, a global-batch
lr clock and a joiner's first reset, none of which a fixed job has. With no change this
module gives ``simulate``'s weights bit for bit (tests/test_simulate_membership.py), so
the two cannot drift apart unseen. It reuses ``simulate``'s server, pusher and worker.

The rules, in short (the spec page has them in full):

* M(t), the ranks in the job at step t: 0..N0-1, plus every rank that joined at a step
  <= t, minus every rank that left at a step <= t. A joiner takes the next unused rank.
* n(t), the job's nominal size: N0 plus the joins at steps <= t. A departure does not
  lower it (``on_worker_failure: continue`` keeps the mean gradient counted as n).
* Server step t: the gradients of M(t) summed in rank order, times n(t) / |M(t)| when
  someone left (the transport's float32 ``sum * scale``); then Opt once.
* The lr schedule counts global batches: pushes applied / N0 (``GlobalBatchSchedule``),
  the same clock as a quorum's (docs/spec/quorum.md rule 6); with no change it is t + 1,
  the update count.
* A joiner at step s computes g(s) at w_G(s - 1) (its pull as of s - 1). In ssd's
  steps-delay stage s must be a pull boundary ((s - T_w) mod k == 0, aligned pulls), and
  its first reset, at s, takes that pull with no history: its previous pull is the same
  weights one step earlier (the estimate's velocity starts at zero; ``exact`` gets the
  servers' state, as every pull of it does).
* The local rules scale a worker's gradient by n(t), from the step n changes.
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
    """[(M(t) as a sorted tuple, n(t)) for t in range(steps)], the changes checked."""
    members, n, out = set(range(num_workers)), num_workers, []
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
                n += 1
            else:
                if c.rank not in members or c.rank == 0:
                    raise MembershipError(f"worker {c.rank} cannot leave at step {t} (not in "
                                          "the job, or rank 0, which the job ends with)")
                members.discard(c.rank)
        out.append((tuple(sorted(members)), n))
    return out


class _MemberServer(Server):
    """``Server`` with a nominal n: a step of fewer members is their sum times n / |M|,
    and the lr clock counts pushes / N0."""

    def __init__(self, init_weights, make_optimizer, num_workers):
        super().__init__(init_weights, make_optimizer)
        sched = self.opt.lr_scheduler
        self.clock = None
        if sched is not None:
            self.clock = self.opt.lr_scheduler = GlobalBatchSchedule(sched, num_workers)

    def apply_members(self, grads, n):
        """grads: one {key: gradient} per member, in rank order."""
        if self.clock is not None:
            self.clock.pushes += len(grads)
        if len(grads) == n:
            return self.apply_step(grads)
        scale = np.float32(n / len(grads))
        mean = [{key: mx.nd.array(np.sum([g[key].asnumpy() for g in grads], axis=0)
                                  * scale, dtype=grads[0][key].dtype)
                 for key in self.weights}]
        return self.apply_step(mean)


def _check_schedule(schedule, algorithm, T_w, k, pull_schedule, steps):
    n0 = len(schedule[0][0]) if schedule else 0
    for t, (members, _) in enumerate(schedule):
        before = schedule[t - 1][0] if t else tuple(range(n0))
        joined = set(members) - set(before)
        if joined and algorithm == 'ssd' and t > T_w:
            if pull_schedule != 'aligned':
                raise MembershipError("a worker joins at a pull boundary every worker "
                                      "shares: staggered pulls have none")
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
    base_rescale = make_optimizer().rescale_grad
    workers, pushers, n_now = {}, {}, num_workers

    def make_worker(rank, weights, n):
        rule = (make_local_rule(local_rule, make_optimizer, n, glu_state, lr_local)
                if algorithm == 'ssd' else None)
        offset = rank * k // n if pull_schedule == 'staggered' else 0
        workers[rank] = Worker({key: w.copy() for key, w in weights.items()}, rule, offset)
        pushers[rank] = Pusher(compression)

    for rank in range(num_workers):
        make_worker(rank, init_weights, num_workers)
    with_state = workers[0].rule is not None and workers[0].rule.needs_state
    initial = server.pull(with_state)
    replies = {-2: replace(initial, step=-2), -1: initial}
    last = initial        # the newest reply: what a joiner pulls (as of s - 1)

    for t, (members, n) in enumerate(schedule):
        for rank in members:
            if rank not in workers:          # joins at t: the weights as of t - 1
                make_worker(rank, last.weights, n)
                if t > T_w:                  # its first reset: that pull, no history
                    workers[rank].pending = last
                    workers[rank].previous_pull = replace(last, step=last.step - 1)
        if n != n_now:                       # every local rule counts n workers from t
            for w in workers.values():
                if w.rule is not None and hasattr(w.rule, 'opt'):
                    w.rule.opt.rescale_grad = base_rescale * n
            n_now = n
        grads = {r: grad_fn(r, t, workers[r].weights) for r in members}
        server.apply_members([pushers[r](grads[r]) for r in members], n)
        if on_step is not None:
            on_step(t, server.weights)
        if t < T_w:
            last = replies[t] = server.pull(with_state)
            replies.pop(t - 2, None)
            for r in members:
                workers[r].weights = {key: w.copy() for key, w in last.weights.items()}
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
                    reply_t = last = server.pull(with_state)
                worker.pending = reply_t

    return SimResult(global_weights=server.weights,
                     worker_weights=[workers[r].weights for r in sorted(workers)],
                     push_bytes=sum(p.bytes for p in pushers.values()))
