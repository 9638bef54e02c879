"""Which nodes have failed though no process exited: dead (no heartbeat for
SSDSGD_HEARTBEAT_TIMEOUT) or, a worker alive but making no progress, stuck
(cluster.stall_timeout).

Heartbeats come from a worker's I/O thread, so they prove the process is alive, not that
it trains: a training thread stuck in a dead lock, a hung data loader or a device that
stopped answering keeps its heartbeats going and held an ssd job forever. So each
heartbeat also carries how many pushes the worker's training thread has made
(``progress``) and whether it says it is busy with something else (rank 0's validation).

A worker is stalled when its progress has not moved for ``timeout`` seconds (not
counting the time it said it was busy) while it holds another worker up: that one's
progress is ahead of it, or that one waits at a barrier it has not reached. This is what
tells the stuck worker from the ones waiting for it: in a synchronous step the others
have pushed the step it has not, in the steps-delay stage they run ahead until the
servers' bound stops them, and before the first step they wait at the set-up barrier.
A worker waiting at a barrier is never the stalled one. When every worker stands still
at the same count and none waits at a barrier (all waiting for a server) none of them
is the cause, and the servers' own heartbeats say whether one died.

Pure: the scheduler feeds ``StallWatch`` the heartbeats and asks ``failed`` on every
turn what to act on.
"""
from dataclasses import dataclass

from .topology import node_name


@dataclass
class _Worker:
    progress: int = 0
    since: float = 0.0        # when progress last moved (or the worker was last busy)


@dataclass(frozen=True)
class Stall:
    rank: int
    seconds: float            # without progress
    progress: int             # its pushes
    holding: str              # whom it holds up, and how

    def describe(self, timeout):
        return (f"worker {self.rank} made no progress for {self.seconds:.0f} s (its "
                f"pushes stayed at {self.progress} while {self.holding}; heartbeats "
                f"still came: presumed stuck, SSDSGD_STALL_TIMEOUT={timeout:g})")


class StallWatch:
    def __init__(self, timeout):
        self.timeout = timeout
        self.workers = {}

    def report(self, rank, progress, busy, now):
        """A worker's heartbeat: its request count and whether it is busy."""
        w = self.workers.setdefault(rank, _Worker(progress, now))
        if progress != w.progress or busy:
            w.progress, w.since = progress, now

    def leave(self, rank):
        """The worker finished or left: nobody waits for it any more."""
        self.workers.pop(rank, None)

    def stalled(self, now, waiting=()):
        """The workers stalled now (none when the watch is off); ``waiting``: the ranks
        waiting at a barrier."""
        if self.timeout <= 0 or len(self.workers) < 2:
            return []
        out = []
        for rank, w in self.workers.items():
            if rank in waiting or now - w.since <= self.timeout:
                continue
            ahead = max(o.progress for r, o in self.workers.items() if r != rank)
            held = sorted(set(waiting) - {rank})
            if w.progress < ahead:
                holding = f"another worker's reached {ahead}"
            elif held:
                holding = f"worker {', '.join(map(str, held))} waited for it at a barrier"
            else:
                continue
            out.append(Stall(rank, now - w.since, w.progress, holding))
        return out


def failed(nodes, barriers, stalls, env, now):
    """[(connection id, why)] of the nodes dead or stuck now. ``nodes``: the scheduler's
    records by connection id; ``barriers``: group -> the ids waiting at it."""
    out = [(ident, f"{node_name(n)} sent no heartbeat for {now - n['last_seen']:.1f} s "
                   f"(SSDSGD_HEARTBEAT_TIMEOUT={env.heartbeat_timeout:g}); presumed dead")
           for ident, n in nodes.items()
           if not n["finished"] and now - n["last_seen"] > env.heartbeat_timeout]
    waiting = {nodes[i]["rank"] for group in barriers.values() for i in group
               if nodes[i]["role"] == "worker"}
    by_rank = {n["rank"]: i for i, n in nodes.items() if n["role"] == "worker"}
    out += [(by_rank[s.rank], s.describe(env.stall_timeout))
            for s in stalls.stalled(now, waiting) if s.rank in by_rank]
    return out
