"""The scheduler's barriers: who waits at each group's barrier (``worker``, ``server``,
``all``), the largest value any of them passed (so rank 0 can tell all a decision), and
when every member of the group is there. A pure decider (as ``removals.py``): the
scheduler sends the releases; ``liveness.failed`` reads ``waiting`` (a worker waiting at a
barrier is never the stuck one).

A barrier may carry an ``agreement`` name: its released value is kept (``agreed``), and a
node that arrives at an agreement already made (a worker that joined the job later) hears
that value at once instead of waiting: it takes what the others agreed on. The transport
does not know what the value means; the node wiring does (a join's step may depend on
it, ``ssdsgd/sync/stage.py:join_boundary``).

A barrier may name a ``step``: it waits for the workers in the job at that step (in a
job whose workers join and leave, docs/spec/membership.md rule 11); the scheduler reads
the waiting barrier's step (``steps``) to say who its members are."""


class Barriers:
    def __init__(self):
        self.waiting = {}     # group -> the connections waiting at its barrier
        self.values = {}      # group -> the largest value passed to the waiting barrier
        self.names = {}       # group -> the agreement the waiting barrier makes, if any
        self.agreed = {}      # agreement name -> the value it was released with
        self.steps = {}       # group -> the step the waiting barrier names, if any

    def arrive(self, group, ident, value, members, agreement=None, step=None):
        """Connection ``ident`` waits at ``group``'s barrier (``members``: the group's
        connections now, or at ``step``): the release ``(group, waiting, value)`` once
        every member is there, else None. At an ``agreement`` made already: ``(group,
        {ident}, its value)`` at once. ValueError: the others wait at another agreement
        or step."""
        if agreement is not None and agreement in self.agreed:
            return group, {ident}, self.agreed[agreement]
        waiting = self.waiting.setdefault(group, set())
        if waiting and self.names.get(group) != agreement:
            raise ValueError(f"a barrier of agreement {agreement!r} while the others wait at "
                             f"one of {self.names.get(group)!r}")
        if waiting and self.steps.get(group) != step:
            raise ValueError(f"a barrier of step {step} while the others wait at one of "
                             f"step {self.steps.get(group)}")
        waiting.add(ident)
        self.names[group], self.steps[group] = agreement, step
        self.values[group] = max(self.values.get(group, 0), value)
        return self._release_if_all(group, members)

    def leave(self, ident, members_of):
        """Connection ``ident`` left the job: the releases of the barriers that now have
        every member (``members_of(group)``: the group's connections now)."""
        out = []
        for group, waiting in self.waiting.items():
            waiting.discard(ident)
            release = self._release_if_all(group, members_of(group)) if waiting else None
            if release:
                out.append(release)
        return out

    def _release_if_all(self, group, members):
        waiting = self.waiting[group]
        if not waiting >= set(members):
            return None
        self.waiting[group] = set()
        value = self.values.pop(group, 0)
        name = self.names.pop(group, None)
        self.steps.pop(group, None)
        if name is not None:
            self.agreed[name] = value
        return group, waiting, value
