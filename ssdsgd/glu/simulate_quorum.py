"""Single-process reference for quorum rounds (docs/spec/quorum.md), the oracle of the
distributed runs with ``sync.quorum`` below N.

Unlike ``simulate`` (every step waits for all N, so the order of arrivals does not
matter) a quorum's result depends on who is late, so the input is the order in which the
servers receive the workers' messages: ``arrivals``, a list of ranks, each occurrence
being that worker's next message -- its pushes of steps 0 .. steps-1 (each worker's own
count with dynamic data, whose chunk order the run recorded), then its final
pull. Or ``delays``: each worker's seconds per step, from which the order is made on a
virtual clock (the order injected delays produce; returned in the result).

``sync.quorum: auto`` waits for every worker but those its leader excused, by timing the
simulator does not have; ``excusals`` are the leader's decisions as it recorded them
(the run's ``quorum_auto`` changes: worker, out or in, from which round), so with quorum
N the rounds close as the leader closed them.

A transcription of the spec, sharing nothing with ssdsgd.sync.rounds: the server's
round rules, and every worker's steps as the stage machine runs them (a worker blocked
on a reply cannot send its next message; an order that asks it to is an error).
"""
from collections import deque
from dataclasses import dataclass

from .rules import make_local_rule
from .simulate import Server


@dataclass
class QuorumResult:
    global_weights: dict     # the final weights every worker ends with
    worker_weights: list     # each worker's weights before its final pull
    arrivals: list           # the order the servers received the messages
    rounds: list             # the ranks of each closed round
    applied: list            # per worker: pushes applied (each exactly once)


class Ticket:
    """A reply a worker waits for; ``reply`` is the snapshot taken when it is released."""
    reply = None


class _ScheduleInBatches:
    """The spec's lr under a quorum: the schedule at (pushes applied, this round's
    included) / N, the global batches trained on, not at the round number."""

    def __init__(self, inner, rounds):
        self.inner, self.rounds = inner, rounds

    def __call__(self, num_update):
        return self.inner(self.rounds.pushes / self.rounds.n)


class RoundServer:
    """The spec's rounds: Q distinct workers close a round (fewer once fewer can still
    come), at most one push per worker per round, a late push joins the open round, and a
    round waits while an active worker outside it holds weights more than s rounds old."""

    def __init__(self, server, num_workers, quorum, max_staleness, with_state, excusals=()):
        self.server, self.n, self.q, self.s = server, num_workers, quorum, max_staleness
        self.excusals = deque(sorted(excusals))   # (round, worker, out): from that round on
        self.excused = set()
        self.with_state = with_state
        self.pushes = 0                 # applied so far: the lr schedule's clock is pushes / N
        if (quorum < num_workers or excusals) and server.opt.lr_scheduler is not None:
            server.opt.lr_scheduler = _ScheduleInBatches(server.opt.lr_scheduler, self)
        self.open, self.queued = {}, [deque() for _ in range(num_workers)]
        self.active, self.base = set(range(num_workers)), [-1] * num_workers
        self.asked, self.period = [-1] * num_workers, [1] * num_workers
        self.received, self.applied = [0] * num_workers, [0] * num_workers
        self.waiting, self.finals, self.rounds = [], [], []

    def push(self, rank, grads, ticket, latest):
        index = self.received[rank]
        self.received[rank] += 1
        if rank in self.open:
            self.queued[rank].append(grads)
        else:
            self.open[rank] = grads
        if ticket is not None:
            self.waiting.append((rank, index, ticket, latest))
            if self.asked[rank] >= 0:     # its pull period: pushes between two replies
                self.period[rank] = index - self.asked[rank]
            self.asked[rank] = index
        self._settle()

    def final(self, rank, ticket):
        self.active.discard(rank)
        self.finals.append(ticket)
        self._settle()

    def _settle(self):
        while True:
            for item in list(self.waiting):
                rank, index, ticket, latest = item
                limit = self.applied[rank] + (latest and rank in self.open)
                if index < limit:
                    ticket.reply = self.server.pull(self.with_state)
                    self.base[rank] = len(self.rounds) - 1
                    self.waiting.remove(item)
            if not self._closes():
                break
            ranks = sorted(self.open)
            self.pushes += len(ranks)
            self.server.apply_step([self.open[r] for r in ranks])
            for r in ranks:
                self.applied[r] += 1
            self.rounds.append(ranks)
            self.open = {r: q.popleft() for r, q in enumerate(self.queued) if q}
        if not self.active and not self.open and not any(self.queued):
            for ticket in self.finals:
                ticket.reply = self.server.pull(False)
            self.finals = []

    def _closes(self):
        r = len(self.rounds)
        while self.excusals and self.excusals[0][0] <= r:
            _, worker, out = self.excusals.popleft()
            (self.excused.add if out else self.excused.discard)(worker)
        if not self.open:
            return False
        possible = self.active | set(self.open)
        if self.excused:        # auto: every worker that can come but the excused ones
            if not possible - self.excused <= set(self.open):
                return False
        elif len(self.open) < min(self.q, len(possible)):
            return False
        return all(r - self.base[j] <= self.s * self.period[j]
                   for j in self.active - set(self.open))


class Worker:
    """One worker's stage machine: what it holds and the reply it waits for."""

    def __init__(self, rank, weights, rule):
        self.rank, self.weights, self.rule, self.t = rank, weights, rule, 0
        self.value = self.prev = None   # the newest and the previous global weights received
        self.blocked = None             # (Ticket, what to do once it is released)
        self.pending = None             # the pull requested at t - 1 (steps delay)
        self.seeded = False
        self.done = False

    def remember(self, reply):
        self.prev = self.value if self.value is not None else reply
        self.value = reply

    def reset(self):
        """Spec step 3 with the global weights' dates in rounds (the update count)."""
        p, q = self.value, self.prev
        between = p.num_update - q.num_update
        for key in self.weights:
            self.weights[key] = p.weights[key].copy()
            self.rule.reset(key, p.weights[key],
                            prev_global_weight=(q if between > 0 else p).weights[key],
                            steps_between=max(between, 1), state=p.state.get(key),
                            lr=p.lr, num_update=p.num_update)
        self.seeded = True


class QuorumSim:
    def __init__(self, init_weights, grad_fn, make_optimizer, num_workers, steps, quorum,
                 max_staleness, algorithm, warmup_steps, delay_steps, local_rule, glu_state,
                 lr_local, excusals=()):
        if algorithm not in ('ssd', 'ssgd'):
            raise ValueError(f"algorithm must be ssd or ssgd; got {algorithm!r}")
        # steps: every worker's, or each worker's own (dynamic data: the chunks it trained)
        self.steps = list(steps) if isinstance(steps, (list, tuple)) else [steps] * num_workers
        if len(self.steps) != num_workers:
            raise ValueError(f"steps: {len(self.steps)} counts for {num_workers} workers")
        self.grad_fn, self.k = grad_fn, delay_steps
        self.T_w = max(self.steps) if algorithm == 'ssgd' else warmup_steps
        rules = [make_local_rule(local_rule, make_optimizer, num_workers, glu_state, lr_local)
                 if algorithm == 'ssd' else None for _ in range(num_workers)]
        with_state = algorithm == 'ssd' and rules[0].needs_state
        self.rs = RoundServer(Server(init_weights, make_optimizer), num_workers, quorum,
                              max_staleness, with_state, excusals)
        initial = self.rs.server.pull(with_state)
        self.workers = [Worker(i, {k: w.copy() for k, w in init_weights.items()}, rules[i])
                        for i in range(num_workers)]
        for w in self.workers:
            w.remember(initial)
        self.arrivals = []

    def ready(self, rank):
        w = self.workers[rank]
        return not w.done and w.blocked is None and not (
            w.t == self.steps[rank] and w.pending is not None and w.pending.reply is None)

    def arrive(self, rank):
        """Worker ``rank``'s next message reaches the servers."""
        if not self.ready(rank):
            raise ValueError(f"arrival {len(self.arrivals)}: worker {rank} cannot send now "
                             f"(done, or waiting for a reply)")
        self.arrivals.append(rank)
        w = self.workers[rank]
        if w.t == self.steps[rank]:       # the final pull (the last pending one awaited)
            w.done, ticket = True, Ticket()
            self.rs.final(rank, ticket)   # may close a round it held: the others go on
        else:
            self._step(w)
        for other in self.workers:
            self._continue(other)

    def _step(self, w):
        """Worker ``w`` pushes its step t and blocks on what that step waits for."""
        rank = w.rank
        t, sync = w.t, w.t < self.T_w
        wants = sync or (t - self.T_w) % self.k == self.k - 1
        grads = self.grad_fn(rank, t, w.weights)
        ticket = Ticket() if wants else None
        w.blocked = (ticket if sync else w.pending, (grads, sync, ticket))
        self.rs.push(rank, grads, ticket, latest=False)   # once its round closed (rule 3)

    def _continue(self, w):
        """The rest of a worker's step once the reply it waits for (if any) is there."""
        if w.blocked is None or (w.blocked[0] is not None and w.blocked[0].reply is None):
            return
        waited, (grads, sync, ticket) = w.blocked
        w.blocked = None
        if sync:
            w.remember(waited.reply)
            w.weights = {k: v.copy() for k, v in waited.reply.weights.items()}
        else:
            if waited is not None:
                w.remember(waited.reply)
                w.reset()
            elif not w.seeded:
                w.reset()
            for key in w.weights:
                w.rule.update(key, w.weights[key], grads[key])
            w.pending = ticket
        w.t += 1


def _timed_order(sim, delays):
    """The order that per-step delays produce on a virtual clock: a worker's next push
    leaves its delay after it could go on (its final pull at once); ties by rank."""
    n = len(sim.workers)
    free = [float(d) for d in delays]
    while not all(w.done for w in sim.workers):
        ready = [i for i in range(n) if sim.ready(i)]
        if not ready:
            raise ValueError("no worker can send: the rules deadlock")
        i = min(ready, key=lambda r: (free[r], r))
        now = free[i]
        before = [sim.ready(r) for r in range(n)]
        sim.arrive(i)
        for r in range(n):
            if sim.ready(r) and (r == i or not before[r]):
                last = sim.workers[r].t == sim.steps[r]
                free[r] = now + (1e-6 if last else float(delays[r]))


def simulate_quorum(init_weights, grad_fn, make_optimizer, num_workers, steps, *, quorum,
                    max_staleness, arrivals=None, delays=None, algorithm='ssd',
                    warmup_steps=0, delay_steps=1, local_rule='glu', glu_state='estimate',
                    lr_local=None, excusals=()):
    """grad_fn(worker, step, weights) -> raw grads; steps: every worker's count, or a
    list of each worker's (dynamic data, docs/spec/dynamic_data.md: the batches the
    scheduler dealt it, which ``grad_fn`` maps to their data); quorum: Q, an int (1 <= Q <= N);
    excusals: (round, worker, out) -- worker left out of the rounds from that round on
    (out), or waited for again (not out); ``auto_excusals`` reads them from a record."""
    if (arrivals is None) == (delays is None):
        raise ValueError("give exactly one of arrivals and delays")
    if not 1 <= quorum <= num_workers:
        raise ValueError(f"quorum must be in 1..{num_workers}; got {quorum}")
    sim = QuorumSim(init_weights, grad_fn, make_optimizer, num_workers, steps, quorum,
                    max_staleness, algorithm, warmup_steps, delay_steps, local_rule,
                    glu_state, lr_local, excusals)
    if delays is not None:
        _timed_order(sim, delays)
    else:
        for rank in arrivals:
            sim.arrive(rank)
    if not all(w.done for w in sim.workers):
        raise ValueError("the arrivals end before every worker's final pull")
    return QuorumResult(global_weights=sim.rs.server.weights,
                        worker_weights=[w.weights for w in sim.workers],
                        arrivals=sim.arrivals, rounds=sim.rs.rounds,
                        applied=list(sim.rs.applied))


def auto_excusals(record):
    """The excusals of a ``quorum_auto`` record (a run's summary; a worker's metrics)."""
    return [(c["round"], c["worker"], c["change"] == "out") for c in record["changes"]]
