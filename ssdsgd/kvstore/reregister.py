"""A restarted scheduler rebuilds the job from the nodes that re-register (REJOIN).

The launcher restarts a dead scheduler at the same address and port, with the same key
file (cluster.scheduler_restarts; ssdsgd/launch/scheduler_restarts.py). Each server and
worker notices the loss (its connection closes, or the heartbeat replies stop:
``scheduler_link.py``), dials again with a fresh handshake and sends REJOIN: the fields of
its REGISTER, the rank it has, whether its set-up is over (``ready``) and how many
barriers of each group it has passed, with the last value. Nothing else a node holds
lives only in the scheduler, so from these and the status file the lost scheduler wrote
(which workers finished, left or had pushed) the new one rebuilds:

* membership: every server and every worker that neither finished nor left must come
  back within ``wait_s``; one that does not is failed as a silent node is
  (``cluster.on_worker_failure``). A finished worker still waiting for its FINISH's
  acknowledgement may come back too.
* barriers: a node re-sends the barrier it waits at once the scheduler has taken it back.
  A node that has passed fewer barriers of a group than another had missed a release the
  lost scheduler sent to the others only: it is released alone, with the value they
  got. The others' barrier completes when all are there, as always: exactly once.
* the answers wait: REJOIN is answered when every expected node is back, so no barrier
  is counted over a part of the job.

A scheduler lost during the set-up is handled by who saw what: before it recorded the
job's start, each node registers again with the new one (``SchedulerLink.register``);
after that but before every node had its rank (it registers again) or every worker
heard where the servers listen, the rebuild fails naming the cause (``SetUpLost``), and
``--max-restarts`` restarts the job.
With cluster.server_replicas, the servers replaced by their backups are in the status
file (written before any server hears of it): they are not expected, and a second
server death ends the job as it would have. A quorum leader's decisions are numbered and
sent again after the rebuild (``sync/decision_log.py``). Dynamic data's cursor is
rebuilt from what each worker reports it got (``chunk_record.py``, ``Dealer.rebuild``).
Preduce's groups from what each worker was told of its own (``sync/groups.py``,
``GroupRecord``, ``GroupGenerator.rebuild``), a group whose message some members lost
being owed to them.
"""
import time

from . import job_status, protocol as P
from .chunks import ChunkError
from .security import claim_error
from .topology import record


class RejoinError(ValueError):
    """A REJOIN this scheduler cannot take, or a rebuild that cannot be done (one line)."""


def wait_seconds(env):
    """How long a restarted scheduler waits for every node (a node waits twice this for
    it: the launcher's restart, then its wait for the slowest node)."""
    return max(30.0, 2 * env.heartbeat_timeout)


class Rebuild:
    """The restarted scheduler's part: who is expected, who is back, the barriers they
    passed. ``prior``: the last status the lost scheduler wrote; ``counts``: role ->
    how many the job has."""

    def __init__(self, prior, counts, restart, now, wait_s, lost=()):
        self.prior = prior
        self.restart, self.began, self.deadline = restart, now, now + wait_s
        self.finished = set(prior.get("finished", ()))
        self.left = set(prior.get("left", ()))
        self.workers = set(prior.get("workers", ()))
        self.pushed = set(prior.get("pushed", ()))    # workers known to have pushed
        # workers that joined the job (docs/spec/membership.md): ranks above the first
        self.joined = {r for r, _ in (prior.get("membership") or {}).get("joined", ())}
        # cluster.server_replicas: servers whose backups own their keys (dead, not expected)
        self.replaced = {dead: owner for dead, owner in prior.get("replaced", ())}
        # ... and those the launcher saw die since (their backups take their keys)
        self.lost = sorted(set(lost) - set(self.replaced))
        self.expected = {("server", r) for r in range(counts["server"])
                         if r not in self.replaced and r not in self.lost} | {
            ("worker", r) for r in set(range(counts["worker"])) | self.joined
            if r not in self.finished | self.left}
        self.counts = counts
        self.back = {}        # (role, rank) -> connection
        self.passed = {}      # connection -> {group: [passed, value]}
        self.asked = set()    # (connection, group): its first barrier since, answered
        self.chunks = {}      # worker rank -> the chunks it got (dynamic data), or None
        self.policy_reports = {}   # worker rank -> its policy's record (preduce's), or None
        self.gone = set()     # workers the launcher saw die (on_worker_failure: continue)
        self.done = False

    def take(self, ident, meta, who):
        """A REJOIN's node record fields (the caller completes the record), or
        RejoinError naming why it cannot come back."""
        role, rank = meta.get("role"), meta.get("rank", -1)
        if role is None or not (0 <= rank < self.counts.get(role, 0)
                                or role == "worker" and rank in self.joined):
            raise RejoinError(f"REJOIN names no {role or 'role'} rank of this job")
        wrong = claim_error(who, role, rank)
        if wrong:
            raise RejoinError(wrong)
        if (role, rank) in self.back:
            raise RejoinError(f"{role} {rank} has rejoined already")
        if role == "worker" and rank in self.left:
            raise RejoinError(f"worker {rank} left the job before the scheduler was lost")
        if role == "server" and rank in self.lost:
            raise RejoinError(f"server {rank} was seen dead by its launcher")
        if role == "server" and rank in self.replaced:
            raise RejoinError(f"server {rank} was replaced by server {self.replaced[rank]} "
                              "(its backup) before the scheduler was lost")
        if not meta.get("ready"):
            raise SetUpLost.of(f"{role} {rank}", "heard where the servers listen"
                               if role == "worker" else "bound its port")
        self.back[(role, rank)] = ident
        self.passed[ident] = dict(meta.get("passed") or {})
        if role == "worker":
            self.chunks[rank] = meta.get("chunks")     # dynamic data (chunk_record.py)
            self.policy_reports[rank] = meta.get("policy")    # preduce (sync/groups.py)
        return role, rank, role == "worker" and rank in self.finished

    def registered_again(self, meta):
        """A REGISTER while rebuilding: its node never got its rank (the lost scheduler
        recorded the start before that node heard its TOPOLOGY), so the set-up was lost:
        SetUpLost naming it. Once rebuilt, None: the caller refuses it as a stray."""
        if self.done:
            return None
        role, rank = meta.get("role"), meta.get("rank", -1)
        who = f"{role} {rank}" if isinstance(rank, int) and rank >= 0 else f"a {role}"
        raise SetUpLost.of(who, "received its rank")

    def missing(self):
        return sorted(self.expected - set(self.back))

    def lose(self, ranks, workers=()):
        """Servers and workers the launcher saw die while this rebuild waits
        (job_status.read_lost): the servers not back and not replaced are lost as if
        named at the start; the workers expected, not back, are ``gone`` (removed once
        the others are back). Returns (new servers, new workers)."""
        new = sorted(r for r in set(ranks) - set(self.lost) - set(self.replaced)
                     if r < self.counts["server"] and ("server", r) not in self.back)
        self.lost = sorted(set(self.lost) | set(new))
        self.expected -= {("server", r) for r in new}
        gone = sorted(r for r in set(workers) - self.gone
                      if ("worker", r) in self.expected - set(self.back))
        self.gone |= set(gone)
        self.expected -= {("worker", r) for r in gone}
        return new, gone

    def complete(self):
        return not self.missing()

    def behind(self, ident, group):
        """The value of the barrier of ``group`` that connection ``ident`` waits at if the
        lost scheduler had released it to the others (it passed fewer than another);
        None if it waits at the one the others wait at. Asked once per node and group:
        its first barrier after the rebuild."""
        if (ident, group) in self.asked:
            return None
        self.asked.add((ident, group))
        if any(self.back.get(("worker", r)) == ident for r in self.joined):
            # a joiner passed only the barriers after its join: its count does not
            # compare with the first workers' (it waits with the others; membership.md)
            return None
        mine = self.passed.get(ident, {}).get(group, [0, 0])
        most = max((p.get(group, [0, 0]) for i, p in self.passed.items() if i != ident),
                   key=lambda p: p[0], default=[0, 0])
        # a node that passed none of a group since the lost scheduler has no entry: the
        # others' counts are compared with 0
        return most[1] if most[0] > mine[0] else None

    def summary(self, now):
        return {"restart": self.restart, "seconds": round(now - self.began, 3)}


def begin(env, counts, log):
    """The rebuild a restarted scheduler does (None: a first start, or a scheduler lost
    before the job started, whose nodes register again)."""
    if env.scheduler_restart <= 0:
        return None
    try:
        prior = job_status.read(env.status_file) if env.status_file else None
    except job_status.StatusError as e:
        log(f"restart {env.scheduler_restart}: the lost scheduler's status is unreadable "
            f"({e}); the nodes register again")
        prior = None
    if not prior or not prior["started"]:
        log(f"restart {env.scheduler_restart}: the lost scheduler had not started the job; "
            "the nodes register again")
        return None
    lost = [int(r) for r in (env.servers_lost or "").split(",") if r
            and int(r) < counts["server"]] if env.server_replicas else []
    rebuild = Rebuild(prior, counts, env.scheduler_restart, time.monotonic(),
                      wait_seconds(env), lost)
    replaced = "".join(f"server {dead} replaced by server {owner}; "
                       for dead, owner in sorted(rebuild.replaced.items()))
    replaced += "".join(f"server {r} lost (its launcher saw it die); " for r in rebuild.lost)
    log(f"restart {env.scheduler_restart}: rebuilding the job from the nodes that "
        f"re-register ({len(rebuild.expected)} expected; {replaced}workers finished "
        f"before: {sorted(rebuild.finished) or 'none'}, left: "
        f"{sorted(rebuild.left) or 'none'})")
    return rebuild


class SetUpLost(RejoinError):
    """The scheduler was lost before every node was set up: the job cannot go on."""

    @classmethod
    def of(cls, who, missed):
        """``who`` (e.g. 'worker 0') had not done ``missed`` when the scheduler was lost."""
        return cls(f"the scheduler was lost during the job's set-up: {who} had not "
                   f"{missed}; a restarted scheduler rebuilds only a job that was set up "
                   "(restart the job: --max-restarts)")


class Rejoins:
    """The scheduler's REJOIN handling (a part of ``scheduler.Scheduler``, kept here):
    take each node back, answer them all once every expected one is back, give up naming
    the missing ones at the deadline."""

    def _rejoin(self, ident, meta, frame):
        rebuild = self.rebuild
        if rebuild is None or rebuild.done:
            raise P.ProtocolError(
                "REJOIN: this scheduler is not rebuilding a job (it was not restarted, or "
                "every node is back already); a node that lost it cannot come back")
        if ident in self.nodes:
            raise P.ProtocolError("this connection already rejoined")
        try:
            role, rank, finished = rebuild.take(ident, meta, self.guard.sender(frame))
        except SetUpLost as e:
            self._abort(f"restart {rebuild.restart}: {e}")
        except RejoinError as e:
            raise P.ProtocolError(str(e)) from None
        node = record(meta, role, self.guard.sender(frame), time.monotonic())
        node.update(rank=rank, asked_rank=rank, finished=finished)
        self.nodes[ident] = node
        if rebuild.complete():
            self._rebuilt()

    def _rebuilt(self):
        """Every expected node is back: the job goes on (each hears it; the ones waiting
        at a barrier send it again)."""
        rebuild, now = self.rebuild, time.monotonic()
        rebuild.done, self.started = True, True
        self.startup = None
        for ident, node in self.nodes.items():
            node["last_seen"] = now
            self._send(ident, P.Kind.REJOIN, {"restart": rebuild.restart,
                                              "waited": now - rebuild.began})
        self._record()
        try:
            said = self.dealer.rebuild(rebuild.chunks,
                                       rebuild.finished - set(rebuild.chunks))
        except ChunkError as e:
            self._abort(f"restart {rebuild.restart}: dynamic data cannot go on: {e}")
        if said:
            self.log(f"restart {rebuild.restart}: {said}")
        try:
            said = self.policy.rebuild(rebuild.policy_reports)
        except self.policy.Error as e:
            self._abort(f"restart {rebuild.restart}: the job's policy cannot go on: {e}")
        if said:
            self.log(f"restart {rebuild.restart}: {said}")
        if self.lost_decisions:       # the servers hold for a decision nobody will send
            self._abort(f"restart {rebuild.restart}: the scheduler was lost while the join "
                        f"or departure of worker(s) {self.lost_decisions} was being decided; "
                        "a restarted scheduler does not decide it again (--max-restarts "
                        "restarts the job from its last checkpoint)")
        self.log(f"restart {rebuild.restart}: all {len(self.nodes)} nodes re-registered "
                 f"{now - rebuild.began:.1f} s after this scheduler started; the job goes on")
        for rank in rebuild.lost:     # cluster.server_replicas: as for a server that died
            self._hand_over(rank, f"server {rank} died while the scheduler was down (its "
                                  "launcher saw it)")
        for rank in sorted(rebuild.gone):    # cluster.on_worker_failure: continue
            self._remove_lost(rank, "died while the scheduler was down (its launcher saw it)")

    def _remove_lost(self, rank, why):
        """Worker ``rank`` did not come back: it leaves, as a silent worker does (or the
        job ends, saying why it cannot go on without it: ``_removal_refused``)."""
        self._removal_refused(rank, f"worker {rank} {why}")
        self.log(f"worker {rank} {why}; removing it from the job "
                 "(cluster.on_worker_failure: continue)")
        self.stalls.leave(rank)
        self._begin_removal(rank)

    def _launcher_lost(self):
        """(servers, workers) the launcher saw die (job_status.write_lost, for this
        scheduler's restart number) that the job goes on without: servers with
        cluster.server_replicas, workers with on_worker_failure: continue."""
        if not self.env.status_file:
            return [], []
        servers, workers = job_status.read_lost(self.env.status_file,
                                                self.env.scheduler_restart)
        return (servers if self.env.server_replicas else [],
                list(workers) if self.env.on_worker_failure == "continue"
                else [])

    def _awaiting_rejoins(self, now):
        """True while the rebuild waits; aborts the job at its deadline, naming who did
        not come back."""
        rebuild = self.rebuild
        if rebuild is None or rebuild.done:
            return False
        if self.env.status_file:
            lost, gone = rebuild.lose(*self._launcher_lost())
            for role, rank in [("server", r) for r in lost] + [("worker", r) for r in gone]:
                self.log(f"restart {rebuild.restart}: {role} {rank} lost (its launcher saw "
                         "it die while this scheduler rebuilt the job); not waited for")
            if (lost or gone) and rebuild.complete():
                self._rebuilt()
                return False
        if now <= rebuild.deadline:
            return True
        missing = rebuild.missing()
        waited = f"within {rebuild.deadline - rebuild.began:.0f} s"
        gone = [rank for role, rank in missing if role == "worker"
                and self.env.on_worker_failure == "continue"]
        # cluster.server_replicas: a server's backup takes its keys, as for a dead one
        replaced = [rank for role, rank in missing if role == "server"
                    and self.env.server_replicas][:1]
        if len(gone) + len(replaced) < len(missing):
            who = ", ".join(f"{role} {rank}" for role, rank in missing)
            self._abort(f"restart {rebuild.restart}: {who} did not re-register with the "
                        f"restarted scheduler {waited}")
        self._rebuilt()
        for rank in replaced:
            self._hand_over(rank, f"server {rank} did not re-register with the restarted "
                                  f"scheduler {waited}")
        for rank in gone:     # cluster.on_worker_failure: continue
            self._remove_lost(rank, f"did not re-register with the restarted scheduler "
                                    f"{waited}")
        return False

    def _released_alone(self, ident, group):
        """A re-sent barrier the lost scheduler had released to the others: release it
        alone (True); False: it waits with the others."""
        if self.rebuild is None:
            return False
        value = self.rebuild.behind(ident, group)
        if value is None:
            return False
        self._send(ident, P.Kind.BARRIER, {"group": group, "value": value})
        return True

    def _status_extra(self):
        """The status fields a restarted scheduler keeps from the lost one."""
        rebuild = self.rebuild
        if rebuild is None:      # a first start, or one whose nodes registered anew
            restart = self.env.scheduler_restart
            anew = {"restart": restart, "seconds": None} if restart and self.started else None
            return {"left": sorted(self.left), "rebuilt": anew}, (), ()
        return ({"left": sorted(self.left | rebuild.left),
                 "rebuilt": rebuild.summary(time.monotonic()) if rebuild.done else None},
                rebuild.workers, rebuild.finished)
