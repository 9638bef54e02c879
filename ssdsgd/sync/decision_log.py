"""The leader's round decisions, numbered, so a restarted scheduler loses none of them
(docs/spec/quorum.md, "A restarted scheduler").

Server 0 decides a quorum's rounds and the scheduler passes its decisions on to the other
servers. A scheduler that dies takes with it what it had not passed on, and server 0 goes
on deciding while it is down. So every decision (one entry of the ``log`` text) has a
number: a message carries its entries and the number of the first (``first``). Server 0
keeps its last ``KEPT`` entries, holds what it decides while its scheduler is lost, and
sends every kept entry again once the restarted scheduler has every node back; a follower
applies each entry once, in order, skipping those it has, and names a gap (entries it can
no longer get) instead of replaying past it.
"""
from collections import deque

from .events import MAX_LOG, PolicyError

KEPT = 1 << 16      # entries server 0 keeps to send again (each a few bytes)


class DecisionLog:
    """Server 0's side: number what it decides, keep the last ``kept`` entries."""

    def __init__(self, kept=KEPT):
        self.entries = deque(maxlen=kept)
        self.total = 0       # entries decided so far: the next one's number

    def add(self, text):
        """Number the entries of ``text``; the number of its first."""
        first, entries = self.total, text.split()
        self.entries.extend(entries)
        self.total += len(entries)
        return first

    def kept(self):
        """[(first, text)]: every kept entry, in messages of at most MAX_LOG characters."""
        out, first, batch, size = [], self.total - len(self.entries), [], 0
        for entry in self.entries:
            if batch and size + len(entry) + 1 > MAX_LOG:
                out.append((first, " ".join(batch)))
                first, batch, size = first + len(batch), [], 0
            batch.append(entry)
            size += len(entry) + 1
        if batch:
            out.append((first, " ".join(batch)))
        return out


class Followed:
    """Another server's side: how many of server 0's entries it applied."""

    def __init__(self):
        self.applied = 0

    def take(self, first, text):
        """The entries of a message whose first is number ``first`` that were not applied
        yet, as text ('' if none); PolicyError if entries before it never came."""
        if first > self.applied:
            raise PolicyError(
                f"server 0's round decisions {self.applied} to {first - 1} never came (lost "
                f"with a scheduler that died, and server 0 keeps its last {KEPT} only)")
        entries = text.split()[self.applied - first:]
        self.applied += len(entries)
        return " ".join(entries)
