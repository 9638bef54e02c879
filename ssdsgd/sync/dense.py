"""The dense modes: every worker's gradient of every step (``ssgd``, ``ssd``: dist_sync's
semantics, within SSD's steps-ahead bound), or each push on arrival (``asgd``: dist_async's).

Synchronous: for every key and step the policy waits for the gradients of all N workers
(or of those still in the job, docs/reliability.md's on_worker_failure: continue) and asks
for their sum in rank order -- never arrival order, so runs are reproducible -- and one
optimizer update. A reply "as of step t" is answered the moment step t is applied, so it
is exactly w_G(t) however far other workers have run ahead.
"""
from .policy import PolicyError, ServerPolicy


class DenseSync(ServerPolicy):
    """ssgd and ssd: a step of a key is applied once every worker in the job pushed it."""

    def __init__(self, num_workers, steps_ahead, algorithm, averaging=None, joins=False):
        super().__init__(num_workers, steps_ahead, algorithm, averaging)
        # a job that takes joiners counts its lr schedule in global batches (pushes / N,
        # docs/spec/membership.md rule 3): a step of N + 1 members is (N + 1) / N of one.
        # The clock moves once per step, when its first key is applied.
        self.global_batches = joins
        self.counted = -1      # the last step whose pushes the clock counted
        self.pending = {}      # key -> {step: {rank: gradient}}
        self.waiting = {}      # key -> {step: [(token, slot)]} to answer once it is applied
        self.joined = {}       # rank of a worker that joined -> the step it pushes from
        self.holds = {}        # rank of a joiner being decided -> the step this server held
        self.departing = {}    # rank of a leaver being decided -> the step this server held
        self.departed = set()  # ranks whose departure was decided (their data left)

    def declare(self, key):
        super().declare(key)
        self.pending.setdefault(key, {})
        self.waiting.setdefault(key, {})

    def push(self, rank, items, token, latest=False):
        for key, step, _ in items:
            self._check_push(rank, key, step)
        ready = []
        for slot, (key, step, grad) in enumerate(items):
            self.pending[key].setdefault(step, {})[rank] = grad
            if token is not None:
                self.waiting[key].setdefault(step, []).append((token, slot))
            if step == self.version[key] and self._complete(self.pending[key][step], step):
                ready.append(key)
        return self._drain(ready)

    def _check_push(self, rank, key, step):
        version = self.version[key]
        if step < self.joined.get(rank, 0):
            raise PolicyError(f"key {key}: worker {rank} pushed step {step}, but it joined "
                              f"the job from step {self.joined[rank]}")
        if step < version:
            raise PolicyError(f"key {key}: push for step {step} from worker {rank}, but "
                              f"step {version - 1} is already applied")
        if step - version >= self.steps_ahead:
            raise PolicyError(f"key {key}: worker {rank} pushed step {step}, "
                              f"{step - version} steps ahead of the slowest worker; the "
                              f"{self.algorithm} schedule allows {self.steps_ahead - 1}")
        if rank in self.pending[key].get(step, ()):
            raise PolicyError(f"key {key}: worker {rank} pushed step {step} twice; the "
                              "job's gradients cannot be trusted any more")

    def has_push(self, rank, key, step):
        return step < self.version.get(key, 0) or rank in self.pending.get(key, {}).get(step, ())

    def pull(self, rank, items, token, final=False):
        for key, step in items:
            if rank in self.joined and step == self.joined[rank] - 1:
                continue     # a joiner's first pull: the weights it starts from
            if rank in self.holds and step >= self.holds[rank] - 1:
                continue     # the same, before the scheduler's decision reached here
            if step >= self.version[key] and rank not in self.pending[key].get(step, ()):
                raise PolicyError(f"key {key}: worker {rank} pulls step {step}, which it has "
                                  f"not pushed (step {self.version[key] - 1} is the last "
                                  "applied)")
        if not items:
            return [("answer", token, None)]
        actions = []
        for slot, (key, step) in enumerate(items):
            if step >= self.version[key]:        # "as of step t": wait for it
                self.waiting[key].setdefault(step, []).append((token, slot))
            else:
                actions.append(("answer", token, slot))
        return actions

    def _complete(self, pushes, step):
        """Has every worker still in the job at ``step`` pushed it (none, while a join
        or a departure is being decided from a step at or before it)?"""
        held = list(self.holds.values()) + list(self.departing.values())
        if held and step >= min(held):
            return False
        joined = sum(1 for s in self.joined.values() if s <= step)
        return len(pushes) + sum(1 for r, s in self.removed.items()
                                 if s <= step and r not in pushes) >= self.n + joined

    def _drain(self, ready):
        """Apply the ready keys' steps, answer what waited for them, and go on while the
        next step of any of them is complete too (the one "apply, then answer, until
        nothing is ready" loop of a push and of a departure)."""
        actions = []
        while ready:
            step = max(self.version[key] for key in ready)
            sums = [self._sum(key) for key in ready]
            pushes = 0
            if self.global_batches and step > self.counted:
                pushes, self.counted = len(sums[0][1]), step
            actions.append(self._apply(sums, pushes))
            nxt = []
            for key in ready:
                version = self.version[key]
                actions += [("answer", token, slot)
                            for token, slot in self.waiting[key].pop(version - 1, ())]
                if self._complete(self.pending[key].get(version, {}), version):
                    nxt.append(key)
            ready = nxt
        return actions

    def _sum(self, key):
        """The step's gradients of ``key`` in rank order; after a departure or a join,
        their mean counted as N workers' (the sum times N / pushes; N: the job's first
        size, so the lr keeps its meaning, docs/spec/membership.md)."""
        grads = self.pending[key].pop(self.version[key])
        parts = [grads[r] for r in sorted(grads)]
        scale = self.n / len(parts) if len(parts) != self.n else None
        return (key, parts, scale)

    def first_missing(self, rank):
        def first(key):
            t = self.version[key]
            while rank in self.pending[key].get(t, ()):
                t += 1
            return t
        # a joiner lacks nothing before its join step (rule 10)
        return max(min((first(key) for key in self.version), default=0),
                   self.joined.get(rank, 0))

    def leave(self, rank, from_step):
        """Drop its pushes for steps >= ``from_step``, aggregate the others from then on,
        and apply what is now complete. A dead worker's later departure (rule 10) keeps
        the earlier step: its pushes stopped there."""
        self.removed[rank] = min(from_step, self.removed.get(rank, from_step))
        ready = []
        for key, pending in self.pending.items():
            for t, pushes in pending.items():
                if t >= from_step:
                    pushes.pop(rank, None)
            if self._complete(pending.get(self.version[key], {}), self.version[key]):
                ready.append(key)
        return self._drain(ready)

    def hold(self, rank):
        """Worker ``rank`` asks to join: the first step no push of any key has reached,
        and from it on nothing is applied until ``admit`` (the scheduler takes every
        server's answer and admits from a step no server has applied;
        ssdsgd/kvstore/joins.py)."""
        if rank in self.joined or rank in self.holds or rank < self.n:
            raise PolicyError(f"worker {rank} is in the job already, or joining")
        self.holds[rank] = free = self._first_free()
        return free

    def _first_free(self):
        """The first step no push of any key has reached."""
        return max((max([self.version[k]] + [t + 1 for t in self.pending[k]])
                    for k in self.version), default=0)

    def hold_departure(self, rank):
        """Worker ``rank`` asks to leave: as ``hold``, until ``depart``. A worker the
        servers dropped when it died (``leave``) may still depart: in a job that takes
        joiners its data leaves at a step every worker hears of in time (rule 10)."""
        member = rank < self.n or rank in self.joined
        if not member or rank in self.departing or rank in self.departed:
            raise PolicyError(f"worker {rank} is not in the job, or leaving already")
        # a joiner pushes one step at least (its join step), so the replies of the steps
        # from the held one on reach it too before its last (docs/spec/membership.md)
        free = max(self._first_free(), self.joined.get(rank, -1) + 1)
        self.departing[rank] = free
        return free

    def depart(self, rank, from_step):
        """Worker ``rank`` pushes the steps before ``from_step`` only: those close with
        it, the ones from it on without it (their mean counted as N workers', rule 2)."""
        self._decided(self.departing, rank, from_step, "leaves", "leave")
        self.departed.add(rank)
        return self.leave(rank, from_step)

    def _decided(self, held, rank, from_step, verb, infinitive):
        """The scheduler's decision for a change this server held for (``held``), from a
        step it has not applied; the hold is released."""
        if rank not in held:
            raise PolicyError(f"worker {rank} {verb}, but this server was not asked to "
                              "hold for it")
        if any(v > from_step for v in self.version.values()):
            raise PolicyError(f"worker {rank} cannot {infinitive} from step {from_step}: "
                              f"step {max(self.version.values()) - 1} is already applied")
        del held[rank]

    def admit(self, rank, from_step):
        """Worker ``rank`` pushes from ``from_step`` on: the steps before it close
        without it, the ones from it on wait for it too; apply what is complete now."""
        self._decided(self.holds, rank, from_step, "is admitted", "join")
        self.joined[rank] = from_step
        ready = [key for key, pending in self.pending.items()
                 if self._complete(pending.get(self.version[key], {}), self.version[key])]
        return self._drain(ready)

    def busy(self):
        for key, pending in self.pending.items():
            if pending:
                return key, min(pending)
        return None


class Async(ServerPolicy):
    """asgd: every push is applied on arrival, and every pull answered at once."""

    def push(self, rank, items, token, latest=False):
        actions = [self._apply([(key, [grad], None) for key, _, grad in items])]
        if token is not None:
            actions += [("answer", token, slot) for slot in range(len(items))]
        return actions

    def pull(self, rank, items, token, final=False):
        if not items:
            return [("answer", token, None)]
        return [("answer", token, slot) for slot in range(len(items))]
