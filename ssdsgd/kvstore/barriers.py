"""The scheduler's barriers: who waits at each group's barrier (``worker``, ``server``,
``all``), the largest value any of them passed (so rank 0 can tell all a decision), and
when every member of the group is there. A pure decider (as ``removals.py``): the
scheduler sends the releases; ``liveness.failed`` reads ``waiting`` (a worker waiting at a
barrier is never the stuck one)."""


class Barriers:
    def __init__(self):
        self.waiting = {}     # group -> the connections waiting at its barrier
        self.values = {}      # group -> the largest value passed to the waiting barrier

    def arrive(self, group, ident, value, members):
        """Connection ``ident`` waits at ``group``'s barrier (``members``: the group's
        connections now): the release ``(group, waiting, value)`` once every member is
        there, else None."""
        self.waiting.setdefault(group, set()).add(ident)
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
        return group, waiting, self.values.pop(group, 0)
