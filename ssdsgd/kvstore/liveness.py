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
and none waits at a barrier, none of them is the cause: they wait for a server. A
server that died stops its heartbeats; one whose process lives but answers nothing (a
quorum follower that never got a round's decision, a process frozen while the heartbeat
timeout is long) would hold the job forever. So a worker's heartbeat also says which
server its oldest unanswered request went to and how long ago (``oldest``), and when
every worker has stood still for the timeout (none busy, none at a barrier, none behind
the others) while one has waited longer than that for a server, that server is treated
as failed (``stuck_server``): the job ends naming it, or its backup takes its keys.

Pure: the scheduler feeds ``StallWatch`` the heartbeats and asks ``failed`` on every
turn what to act on.
"""
from dataclasses import dataclass

from .topology import node_name


@dataclass
class _Worker:
    progress: int = 0
    since: float = 0.0        # when progress last moved (or the worker was last busy)
    oldest: tuple | None = None   # (server, when its oldest unanswered request was sent)


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


@dataclass(frozen=True)
class StuckServer:
    server: int
    rank: int                 # the worker that has waited longest for it
    seconds: float            # how long
    progress: int             # the pushes every worker stayed at (the smallest)

    def describe(self, timeout, name=None):
        """``name``: the server's (pid and host, when the caller knows them)."""
        name = name or f"server {self.server}"
        return (f"{name} has not answered worker {self.rank}'s request for "
                f"{self.seconds:.0f} s while no worker made progress (their pushes stayed "
                f"at {self.progress}; none waits at a barrier): presumed stuck, "
                f"SSDSGD_STALL_TIMEOUT={timeout:g}")


class StallWatch:
    def __init__(self, timeout):
        self.timeout = timeout
        self.workers = {}

    def report(self, rank, progress, busy, now, oldest=None):
        """A worker's heartbeat: its request count, whether it is busy and ``oldest``:
        (server, seconds waited) of its oldest unanswered request, or None."""
        w = self.workers.setdefault(rank, _Worker(progress, now))
        if progress != w.progress or busy:
            w.progress, w.since = progress, now
        w.oldest = None if oldest is None else (oldest[0], now - oldest[1])

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

    def stuck_server(self, now, waiting=()):
        """The server every worker stands still for (None when the watch is off, a worker
        moved, is busy, waits at a barrier or is stalled, or nobody waited that long)."""
        if self.timeout <= 0 or not self.workers or waiting or self.stalled(now, waiting):
            return None
        if any(now - w.since <= self.timeout for w in self.workers.values()):
            return None
        sent, rank, server = min(((w.oldest[1], rank, w.oldest[0])
                                  for rank, w in self.workers.items() if w.oldest),
                                 default=(now, None, None))
        if now - sent <= self.timeout:
            return None
        return StuckServer(server, rank, now - sent,
                           min(w.progress for w in self.workers.values()))


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
    stuck = stalls.stuck_server(now, waiting)
    by_server = {n["rank"]: i for i, n in nodes.items() if n["role"] == "server"}
    if stuck is not None and stuck.server in by_server:
        ident = by_server[stuck.server]
        out.append((ident, stuck.describe(env.stall_timeout, node_name(nodes[ident]))))
    return out
