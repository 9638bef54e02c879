"""The group generator of partial reduce (docs/spec/preduce.md): which ready workers
average their models together. A pure state machine over "worker r is ready" events, so
the scheduler, the simulator and the tests run the same policy.

After Prague's group generator (Luo et al., ASPLOS'20): groups are formed only from
workers that reported ready, so no group waits for a slow worker; a worker is in at most
one group at a time (it reports ready again only once its group is done), so groups never
conflict. The choice among ready workers is ssdsgd's own, deterministic rule:

* the earliest-ready worker leads the next group (FIFO: nobody starves);
* the other members are, one by one, the ready workers that last shared a group with the
  members chosen so far the longest ago (never: first), ties by readiness order;
* a group whose members all come straight from that same group (a repeat: they hold
  nearly the same model) may be formed once, but not twice in a row while another active
  worker may still become ready; then it waits for that worker. Without this rule two
  pairs of equally fast workers would average only with each other for ever, and
  information would never mix; forbidding every repeat instead made three fast workers
  wait for a slow fourth (the pair that was last together must wait for the worker that
  is with the slow one), in an event simulation with one worker 2x slower: the fast
  workers ran at the slow one's pace, versus 1.2-1.7x faster with one repeat allowed;
* P shrinks to the number of active workers once others have finished (a group of one
  continues at once); when every worker has finished, one last group of all N averages
  every model: the job's final model.
* a worker waiting at a barrier (a checkpoint's) is away: it cannot report ready until
  every worker has reached the barrier, so it is not active until the barrier releases.
  Without this a ready worker waited for a group with workers that waited for it at the
  barrier: the job hung at its first checkpoint whenever P < N.

A restarted scheduler (cluster.scheduler_restarts) rebuilds the generator from what each
worker was told (``GroupRecord``, in its REJOIN): the groups formed, who met whom last
and the repeats follow from every worker's last group, the pairs it met and its count of
repeats; a group some members heard of and others did not (its messages lost with the
old scheduler) is owed to the others, each of whom gets it, alone, when its ready comes
again (``rebuild``). A group no member heard of was never formed: its members' readies
come again and form new groups. The ready queue is rebuilt from the readies sent again,
in the order they reach the new scheduler.
"""
import dataclasses

import numpy as np

from .. import fields as F


class GroupError(ValueError):
    """An event the generator cannot accept (a protocol error of the sender)."""


@dataclasses.dataclass(frozen=True)
class Group:
    number: int            # formation order, from 0
    members: tuple         # ranks, increasing
    final: bool = False    # the last group: every worker, after its last step
    repeat: bool = False   # its members all come straight from this same group
    to: tuple = ()         # told to these members only (a group owed after a restart)

    def message(self):
        """The POLICY payload that tells a member of it (sync/events.py "group")."""
        return {"event": "group", "group": self.number, "members": list(self.members),
                "repeat": self.repeat, "final": self.final}


def _report_ok(v):
    if not isinstance(v, dict) or set(v) != {"last", "repeat", "final", "repeats", "met"}:
        return False
    last, met = v["last"], v["met"]
    if last is not None and not (isinstance(last, list) and len(last) == 2
                                 and F.int_in(0, F.MAX_STEP)(last[0])
                                 and F.RANKS[0](last[1])):
        return False
    if not (F.BOOL[0](v["repeat"]) and F.BOOL[0](v["final"])
            and F.int_in(0, F.MAX_STEP)(v["repeats"]) and isinstance(met, list)
            and len(met) <= F.MAX_RANK):
        return False
    if not all(isinstance(m, list) and len(m) == 2 and F.WORKER[0](m[0])
               and F.int_in(0, F.MAX_STEP)(m[1]) for m in met):
        return False
    return len({m[0] for m in met}) == len(met)


#: the check of a worker's group report (a REJOIN's ``policy``: scheduler_policies.py)
REPORT = (_report_ok, "a worker's group report {last, repeat, final, repeats, met}")


class GroupRecord:
    """What one worker was told of its groups (its I/O thread feeds it each "group"
    message as it arrives; ``report`` goes in its REJOIN to a restarted scheduler)."""

    def __init__(self, rank):
        self.rank = rank
        self.last = None          # [number, members] of its last group
        self.repeat = self.final = False    # that group's flags
        self.repeats = 0          # its last groups in a row that were repeats
        self.met = {}             # other rank -> the number of the last group with it

    def received(self, meta):
        """A "group" message; a malformed one is left to the caller's check."""
        number, members = meta.get("group"), meta.get("members")
        if not (F.int_in(0, F.MAX_STEP)(number) and F.RANKS[0](members)
                and self.rank in members):
            return
        self.last = [number, list(members)]
        self.repeat, self.final = bool(meta.get("repeat")), bool(meta.get("final"))
        self.repeats = self.repeats + 1 if self.repeat else 0
        for other in members:
            if other != self.rank:
                self.met[other] = number

    def report(self):
        return {"last": self.last, "repeat": self.repeat, "final": self.final,
                "repeats": self.repeats, "met": [[r, n] for r, n in sorted(self.met.items())]}


class GroupGenerator:
    def __init__(self, num_workers, group_size):
        if not 1 <= group_size <= num_workers:
            raise GroupError(f"group size {group_size} with {num_workers} workers")
        self.n, self.p = num_workers, group_size
        self.ready = []        # ranks waiting for a group, in the order they reported
        self.finished = set()  # ranks that reported their final ready
        self.away = set()      # ranks waiting at a barrier (not ready until it releases)
        self.last = {}         # rank -> members of its last group
        self.met = {}          # (i, j), i < j -> number of the last group holding both
        self.repeats = {}      # rank -> how many of its last groups in a row were repeats
        self.formed = 0
        self.done = False
        self.owed = {}         # rank -> the group it is owed after a restart (rebuild)

    def arrive(self, rank, final=False):
        """Worker ``rank`` is ready (``final``: after its last step); the groups formed."""
        if not 0 <= rank < self.n:
            raise GroupError(f"worker {rank} is not one of the {self.n} workers")
        if rank in self.owed:
            group = self.owed[rank]
            if group.final != final:
                raise GroupError(f"worker {rank} is owed group {group.number} "
                                 f"({'the final one' if group.final else 'not final'}), "
                                 f"but its ready is {'final' if final else 'not final'}")
            del self.owed[rank]
            return [dataclasses.replace(group, to=(rank,))]
        if rank in self.ready or rank in self.finished:
            raise GroupError(f"worker {rank} reported ready twice without being grouped")
        if rank in self.away:
            raise GroupError(f"worker {rank} reported ready while waiting at a barrier")
        (self.finished.add if final else self.ready.append)(rank)
        return self._form()

    def wait_at_barrier(self, rank):
        """Worker ``rank`` waits at a barrier; the groups formed now that it is away."""
        if rank in self.ready:
            raise GroupError(f"worker {rank} waits at a barrier while ready for a group")
        self.away.add(rank)
        return self._form()

    def barrier_released(self):
        """Every worker passed the barrier: they are active again."""
        self.away.clear()

    def _form(self):
        groups = []
        active = self.n - len(self.finished | self.away)
        while active and len(self.ready) >= min(self.p, active):
            members = self._choose(min(self.p, active), active)
            if members is None:
                break
            groups.append(self._record(members, final=False))
        if len(self.finished) == self.n and not self.done:
            self.done = True
            groups.append(self._record(tuple(range(self.n)), final=True))
        return groups

    def _choose(self, size, active):
        chosen = [self.ready[0]]
        candidates = self.ready[1:]
        while len(chosen) < size:
            best = min(candidates, key=lambda c: (max(self._met(c, m) for m in chosen),
                                                  candidates.index(c)))
            chosen.append(best)
            candidates.remove(best)
        members = tuple(sorted(chosen))
        if (self._repeat(members) and active > len(self.ready)
                and all(self.repeats.get(m, 0) >= 1 for m in members)):
            return None        # a second repeat in a row: wait for someone else
        return members

    def _repeat(self, members):
        return len(members) > 1 and all(self.last.get(m) == members for m in members)

    def _met(self, i, j):
        return self.met.get((min(i, j), max(i, j)), -1)

    def rebuild(self, reports):
        """A new generator (a restarted scheduler's) from every worker's ``GroupRecord``
        report (rank -> report, or None); one line saying what it rebuilt. The caller
        has checked each report's types (REPORT)."""
        known = self._heard(reports)
        for rank, rep in reports.items():
            if not rep:
                continue
            if rep["last"] is not None:
                self.last[rank] = tuple(rep["last"][1])
                self.repeats[rank] = rep["repeats"]
            for other, number in rep["met"]:
                if other >= self.n:
                    raise GroupError(f"worker {rank} reports it met worker {other}: "
                                     f"not one of the {self.n} workers")
                pair = (min(rank, other), max(rank, other))
                self.met[pair] = max(self.met.get(pair, -1), number)
        for number, group in sorted(known.items()):
            for m in group.members:
                rep = reports.get(m)
                if rep and rep["last"] is not None and rep["last"][0] >= number:
                    continue
                self.owed[m] = group          # formed, its message to m lost
                self._joins(m, group)
            self._meet(group)
        self.formed = max(known) + 1 if known else 0
        self.done = any(g.final for g in known.values())
        owed = "; ".join(f"worker {r} is owed group {g.number}"
                         for r, g in sorted(self.owed.items()))
        return (f"preduce: {self.formed} groups formed before the loss"
                + (f"; {owed} (its message was lost)" if owed else ""))

    def _heard(self, reports):
        """number -> Group of every group some member heard of (its last one)."""
        known = {}
        for rank, rep in sorted(reports.items()):
            if not rep or rep["last"] is None:
                continue
            number, members = rep["last"][0], tuple(rep["last"][1])
            if members[-1] >= self.n:
                raise GroupError(f"worker {rank} reports group {number} of workers "
                                 f"{list(members)}: not one of the {self.n} workers")
            if rank not in members:
                raise GroupError(f"worker {rank} reports group {number} of workers "
                                 f"{list(members)}, without itself")
            group = Group(number, members, rep["final"], rep["repeat"])
            if known.setdefault(number, group) != group:
                raise GroupError(f"group {number} has two member lists or flags in the "
                                 f"workers' reports: {known[number]} and {group}")
        return known

    def _record(self, members, final):
        group = Group(self.formed, members, final, self._repeat(members))
        self.formed += 1
        for m in members:
            self._joins(m, group)
            if m in self.ready:
                self.ready.remove(m)
        self._meet(group)
        return group

    def _joins(self, rank, group):
        """Worker ``rank`` is in ``group``: its last group, and its repeats in a row."""
        self.repeats[rank] = self.repeats.get(rank, 0) + 1 if group.repeat else 0
        self.last[rank] = group.members

    def _meet(self, group):
        """Every pair of ``group``'s members last met in it (or later)."""
        for a in group.members:
            for b in group.members:
                if a < b:
                    self.met[(a, b)] = max(self.met.get((a, b), -1), group.number)


def replay(arrivals, num_workers, group_size, steps):
    """The groups the generator forms for ``arrivals``, the ranks in the order they report
    ready; worker r's report after ``steps`` (an int or one per rank) local steps is its
    final one. A worker reporting again before its group formed is an error."""
    steps = [steps] * num_workers if isinstance(steps, int) else list(steps)
    count = [0] * num_workers
    gen, groups = GroupGenerator(num_workers, group_size), []
    for rank in arrivals:
        groups += gen.arrive(rank, final=count[rank] == steps[rank])
        count[rank] += 1
    return groups


def mean(parts):
    """A group's average of one key (numpy arrays in the members' rank order): summed in
    that order as the arrays' dtype, then divided by their number. The servers and the
    simulator both call this."""
    acc = np.array(parts[0], copy=True)
    for part in parts[1:]:
        acc += part
    acc /= acc.dtype.type(len(parts))
    return acc
