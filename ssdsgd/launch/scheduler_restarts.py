"""cluster.scheduler_restarts: the launcher starts a dead scheduler again, in place.

The scheduler holds no training state: the servers hold the weights, the workers their
own. So when its process dies the launcher starts it again at the same address and port,
with the same key file (the job's other processes still hold its public key, or in plain
mode their verification keys for it), and ``SSDSGD_SCHEDULER_RESTART`` set to the
restart's number. The servers and workers notice the loss, dial again and re-register
with the ranks they have; the new scheduler rebuilds the job from them
(``ssdsgd/kvstore/reregister.py``). No server or worker is restarted.

At most ``budget`` restarts; past that, a dead scheduler fails the job as before. A
scheduler that dies when every server and worker has already exited 0 (the shutdown
was over) ends nothing: the job's result is complete.
"""
import time

from ..kvstore import job_status
from .hosts import role_label


class SchedulerRestarts:
    """``start(n, servers_lost)``: the scheduler started again as restart ``n`` (a
    process object), told which servers the launcher saw die;
    ``status``: the launcher's view of the scheduler's status file (job.JobStatus);
    ``where``: its address, for the log line."""

    def __init__(self, budget, start, status, where, log):
        self.budget, self.start, self.status, self.where, self.log = (
            budget, start, status, where, log)
        self.used = 0
        self.accepted = set()     # dead schedulers that ended nothing (after the shutdown)
        self.pending = None       # (restart, the time it died) until its rebuild is done
        self.told = set()         # (role, rank) the restarted scheduler was told are dead

    def take(self, failed, procs, describe):
        """True if the failures are a dead scheduler this handles: restarted (``procs``
        gets the new process in its place) or, after the shutdown, accepted."""
        if not self.budget or len(failed) != 1 or failed[0].role != "scheduler":
            return False
        dead = failed[0]
        if self.status.abort_reason():      # it ended the job on purpose, naming why
            return False
        if all(p.poll() is not None for p in procs if p.role != "scheduler"):
            if all(p.poll() == 0 for p in procs if p.role != "scheduler"):
                self.log(f"the scheduler (pid {dead.pid}) {describe(dead.poll())} after "
                         "every server and worker finished; the job's result is complete")
                self.accepted.add(dead)
                return True
            return False
        if self.used >= self.budget:
            self.log(f"the scheduler died again after {self.used} restart(s) "
                     f"(cluster.scheduler_restarts={self.budget}); giving up")
            return False
        self.used += 1
        died = time.monotonic()
        # the nodes it saw die: with replicas, the servers' backups take their keys at once
        self.told = _dead(procs)
        servers, workers = self._ranks()
        job_status.write_lost(self.status.path, self.used, servers, workers)
        procs[procs.index(dead)] = self.start(self.used, servers)
        self.log(f"the scheduler (pid {dead.pid}) {describe(dead.poll())}; restarting it at "
                 f"{self.where} with its keys (restart {self.used} of {self.budget}); the "
                 "servers and workers go on")
        self.pending = (self.used, died)
        return True

    def _ranks(self):
        """(servers, workers) told dead, each sorted."""
        return tuple(sorted(r for role, r in self.told if role == kind)
                     for kind in ("server", "worker"))

    def poll(self, procs):
        """Every turn: the servers and workers seen dead since the scheduler in force
        started, told to it (job_status.write_lost, for its restart number: 0 for the
        first), so that it acts on them at once rather than after its heartbeat timeout;
        a restarted one reads them while it rebuilds too. Once a restarted scheduler says
        every node is back: one line, what happened and how long it took."""
        dead = _dead(procs)
        if dead - self.told:
            self.told |= dead
            job_status.write_lost(self.status.path, self.used, *self._ranks())
        if self.pending is None:
            return
        restart, died = self.pending
        rebuilt = self.status.read().get("rebuilt") or {}
        if rebuilt.get("restart") != restart:
            return
        self.pending = None
        nodes = [p for p in procs if p.role != "scheduler" and p.poll() is None]
        self.log(f"scheduler restart {restart}: {len(nodes)} servers and workers "
                 f"re-registered and the job goes on, none restarted "
                 f"({time.monotonic() - died:.1f} s after the scheduler died; "
                 f"{', '.join(f'{role_label(p.role, p.rank)} pid {p.pid}' for p in nodes)})")


def _dead(procs):
    """(role, rank) of the servers that died and of the workers that failed (a worker
    that exited 0 finished)."""
    return ({("server", p.rank) for p in procs if p.role == "server" and p.poll() is not None}
            | {("worker", p.rank) for p in procs if p.role == "worker"
               and p.poll() not in (None, 0)})
