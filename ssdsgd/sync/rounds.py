"""Quorum rounds (docs/spec/quorum.md): which pushes make round r, when it closes, and when
a reply that waits on the rounds may go. The one place that decides; the server executes.

Pure logic over opaque items (a push's gradients) and reply tokens. Every call returns
the actions to execute, in order: ``("close", [(rank, item), ...])`` (rank order) and
``("reply", token)``, so each reply's snapshot is taken exactly between the rounds the
decision puts it.

The leader (server 0) decides and writes each decision to ``log``; with S > 1 servers
the scheduler relays the log to the followers, which replay it (``follow``), so every
server closes round r with the same contributions and answers a reply after the same
round. A worker's pushes reach every server in the same order (one connection each), so
"worker j's next push" names the same push everywhere.

Whom a round waits for is the rule's (``quorum_rules``: a fixed Q, or auto's late
workers); the leader logs auto's changes too (``x3``: worker 3 excused from the next
round on, ``w3``: waited for again), so a follower knows who is excused.
"""
import re
from collections import deque

from .quorum_rules import FixedQuorum

_ENTRY = re.compile(r"c(\d+(?:\.\d+)*)|a(\d+)\.(\d+)|([xw])(\d+)")


class RoundError(ValueError):
    """A push or a decision the rounds cannot take (the job cannot go on correctly)."""


class Rounds:
    def __init__(self, num_workers, quorum, max_staleness, *, leader=True, replicate=False,
                 max_queued=64, max_pending=1 << 20):
        """``quorum``: Q, an int, or a rule of ``quorum_rules`` (whom a round waits for)."""
        self.rule = FixedQuorum(quorum) if isinstance(quorum, int) else quorum
        if not 1 <= self.rule.quorum <= num_workers:
            raise RoundError(f"quorum {self.rule.quorum} for {num_workers} workers")
        self.n, self.q, self.s = num_workers, self.rule.quorum, max_staleness
        self.leader, self.replicate = leader, replicate and leader
        self.max_queued, self.max_pending = max_queued, max_pending
        self.closed = 0                  # rounds closed; the open round is number ``closed``
        self.members = {}                # leader: rank -> item in the open round
        self.queues = [deque() for _ in range(num_workers)]   # received, in no round yet
        self.received = [0] * num_workers
        self.applied = [0] * num_workers  # pushes of each worker in closed rounds
        self.active = set(range(num_workers))   # workers that have not sent their final pull
        self.paused = set()              # leader: workers in a barrier, until their next push
        self.base = [-1] * num_workers   # leader: newest round whose weights each worker got
        self.asked = [-1] * num_workers  # leader: each worker's last push that wanted a reply
        self.period = [1] * num_workers  # leader: pushes between its last two such pushes
        self.waiting = []                # leader: (rank, push index, token, latest)
        self.tokens = {}                 # follower: (rank, push index) -> token
        self.finals = []                 # tokens of final pulls
        self.log = []                    # leader: decisions not yet sent to the followers
        self.pending = deque()           # follower: decisions not yet replayed
        self.excused = set()             # workers the rule does not wait for (auto)
        self.decided = []                # leader: the rule's changes the policy did not take

    # ---- what a server calls -----------------------------------------------------------
    def push(self, rank, item, token=None, latest=False):
        """Worker ``rank``'s next push; ``token``: a reply wanted once the push's round
        closed (``latest``: once the push is in the open round, with the newest round)."""
        if rank not in self.active:
            raise RoundError(f"worker {rank} pushed after its final pull")
        if len(self.queues[rank]) >= self.max_queued:
            raise RoundError(f"worker {rank} has {len(self.queues[rank])} pushes waiting for "
                             "a round; the schedule allows fewer")
        index = self.received[rank]
        self.received[rank] += 1
        self.paused.discard(rank)
        if not self.leader:
            self.queues[rank].append(item)
            if token is not None:
                self.tokens[(rank, index)] = token
            return self._replay()
        if rank in self.members:
            self.queues[rank].append(item)
        else:
            self.members[rank] = item
            self.rule.joined(rank)
        if token is not None:
            self.waiting.append((rank, index, token, latest))
            if self.asked[rank] >= 0:
                self.period[rank] = index - self.asked[rank]
            self.asked[rank] = index
        return self._settle()

    def final(self, rank, token):
        """Worker ``rank`` is done: its pushes are all sent before this. The reply goes
        once every worker is done and every push is in a closed round."""
        if rank not in self.active:
            raise RoundError(f"worker {rank} sent its final pull twice")
        self.active.discard(rank)
        self.finals.append(token)
        return self._settle() if self.leader else self._replay()

    def pause(self, rank):
        """Worker ``rank`` waits at a barrier: no push of it can come until the others
        are there too, so until its next push rounds close without waiting for it (rule
        2a, as for a finished worker) and its staleness does not hold them (2b). Once
        every worker is in it the barrier is complete (each waits for its pause's answer
        before it enters): the pauses end, so that the first worker back does not close
        a round alone."""
        if rank not in self.active:
            raise RoundError(f"worker {rank} entered a barrier after its final pull")
        if not self.leader:
            return []
        self.paused.add(rank)
        actions = self._settle()
        if self.active <= self.paused:
            self.paused.clear()
        return actions

    def follow(self, text):
        """A follower: the leader's decisions, as its ``log`` entries joined by spaces."""
        if self.leader:
            raise RoundError("the leader received another server's decisions")
        for entry in text.split():
            m = _ENTRY.fullmatch(entry)
            if m is None:
                raise RoundError(f"a malformed round decision {entry[:40]!r}")
            if m.group(1) is not None:
                ranks = [int(r) for r in m.group(1).split(".")]
                if any(r >= self.n for r in ranks) or len(set(ranks)) != len(ranks):
                    raise RoundError(f"round decision {entry[:40]!r} names ranks twice or "
                                     f"beyond {self.n - 1}")
                self.pending.append(("c", ranks))
            elif m.group(4) is not None:
                if int(m.group(5)) >= self.n:
                    raise RoundError(f"round decision {entry[:40]!r} names a rank beyond "
                                     f"{self.n - 1}")
                self.pending.append((m.group(4), int(m.group(5))))
            else:
                self.pending.append(("a", int(m.group(2)), int(m.group(3))))
        if len(self.pending) > self.max_pending:
            raise RoundError(f"{len(self.pending)} round decisions wait for pushes that do "
                             "not arrive")
        return self._replay()

    # ---- the leader's rules ----------------------------------------------------------------
    def _may_reply(self, rank, index, latest):
        if latest:     # the push is in the open round or a closed one (not queued)
            return index < self.applied[rank] + (rank in self.members)
        return index < self.applied[rank]

    def _may_close(self):
        """The workers the rule waits for (Q distinct ones, fewer if fewer can still come:
        finished or in a barrier; auto: all of those but the excused), and no worker
        outside the round (and not in a barrier) is left with weights more than s of its
        pull periods old (s rounds in ssgd and warm-up, s k in steps delay)."""
        if not self.members:
            return False
        if not self.rule.complete(set(self.members), self._possible()):
            return False
        return all(self.closed - self.base[j] <= self.s * self.period[j]
                   for j in self.active - self.paused if j not in self.members)

    def _possible(self):
        """The workers that are in the open round or can still come to it."""
        return (self.active - self.paused) | set(self.members)

    def _settle(self):
        actions = []
        while True:
            still = []
            for rank, index, token, latest in self.waiting:
                if not self._may_reply(rank, index, latest):
                    still.append((rank, index, token, latest))
                    continue
                actions.append(("reply", token))
                self.base[rank] = self.closed - 1
                if self.replicate:
                    self.log.append(f"a{rank}.{index}")
            self.waiting = still
            if not self._may_close():
                break
            contributions, possible = sorted(self.members.items()), self._possible()
            self.members = {}
            actions.append(self._close(contributions))
            self._observe({r for r, _ in contributions}, possible)
            self.members = {j: q.popleft() for j, q in enumerate(self.queues) if q}
            for rank in self.members:     # a push that waited for this round joins it now
                self.rule.joined(rank)
        return actions + self._finals()

    def _observe(self, members, possible):
        """The rule's changes after a round (auto: who is excused from the next on)."""
        for change in self.rule.closed(members, possible, self.closed - 1):
            rank, out = change["worker"], change["change"] == "out"
            (self.excused.add if out else self.excused.discard)(rank)
            self.decided.append(change)
            if self.replicate:
                self.log.append(f"{'x' if out else 'w'}{rank}")

    def _close(self, contributions):
        for rank, _ in contributions:
            self.applied[rank] += 1
        self.closed += 1
        if self.replicate:
            self.log.append("c" + ".".join(str(r) for r, _ in contributions))
        return ("close", contributions)

    def _finals(self):
        done = not self.active and not self.members and not any(self.queues)
        if not done or not self.finals:
            return []
        tokens, self.finals = self.finals, []
        return [("reply", token) for token in tokens]

    # ---- a follower ------------------------------------------------------------------------
    def _replay(self):
        actions = []
        while self.pending:
            entry = self.pending[0]
            if entry[0] == "c":
                if any(not self.queues[j] for j in entry[1]):
                    break
                actions.append(self._close([(j, self.queues[j].popleft()) for j in entry[1]]))
            elif entry[0] in "xw":
                (self.excused.add if entry[0] == "x" else self.excused.discard)(entry[1])
            else:
                _, rank, index = entry
                if self.received[rank] <= index:
                    break
                token = self.tokens.pop((rank, index), None)
                if token is not None:
                    actions.append(("reply", token))
            self.pending.popleft()
        return actions + self._finals()
