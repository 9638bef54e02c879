"""preduce's averages on a server (docs/spec/preduce.md): each member of a group sends its
weights of every key; once all have, every member gets their mean (``groups.mean``, in
the members' rank order), key by key. A worker is in at most one group at a time, so at
most N groups are being collected."""
from .groups import mean
from .policy import PolicyError


class Collecting:
    """One group being averaged: its members and, per key, the weights each member sent
    and the replies waiting for their average."""
    __slots__ = ("members", "parts", "waiting")

    def __init__(self, members):
        self.members, self.parts, self.waiting = members, {}, {}


class GroupAverages:
    def __init__(self, num_workers):
        self.n = num_workers
        self.groups = {}       # group number -> Collecting

    def average(self, rank, number, members, items, token):
        """Member ``rank`` of group ``number`` sends ``items`` ``[(key, values)]``, slot i
        of ``token`` being item i."""
        group = self._check(rank, number, tuple(members), [key for key, _ in items])
        group = group or self.groups.setdefault(number, Collecting(tuple(members)))
        actions = [] if items else [("answer", token, None)]
        for slot, (key, values) in enumerate(items):
            parts = group.parts.setdefault(key, {})
            parts[rank] = values
            group.waiting.setdefault(key, []).append((token, slot))
            if len(parts) < len(group.members):
                continue
            value = mean([parts[r] for r in group.members])
            del group.parts[key]
            actions += [("fill", tok, i, number, value) for tok, i in group.waiting.pop(key)]
        if not group.parts:
            del self.groups[number]
        return actions

    def _check(self, rank, number, members, keys):
        """The group being collected (None: a new one), if this average fits it."""
        if len(members) < 2 or members[-1] >= self.n or rank not in members:
            raise PolicyError(f"average of group {number}: members {list(members)} must be "
                              f"2 or more of the {self.n} workers, the sender (worker "
                              f"{rank}) among them")
        group = self.groups.get(number)
        if group is not None and group.members != members:
            raise PolicyError(f"average of group {number}: members {list(members)}, but its "
                              f"other members sent {list(group.members)}")
        if group is None and len(self.groups) >= self.n:
            raise PolicyError(f"{len(self.groups)} groups are being averaged already; a "
                              "worker is in at most one at a time")
        for key in keys:
            if group is not None and rank in group.parts.get(key, ()):
                raise PolicyError(f"key {key}: worker {rank} sent its weights for group "
                                  f"{number} twice")
        return group
