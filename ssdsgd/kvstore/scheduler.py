"""Membership: who is in the job, their ranks and addresses, barriers, heartbeats, shutdown.

The scheduler is ps-lite's Postoffice in one process: every server and worker registers
with it, receives its rank and every server's address once all have arrived, and then sends
a heartbeat every ``heartbeat_interval``. A node silent for ``heartbeat_timeout`` is
presumed dead: the scheduler tells every other node to abort, naming it, and exits
non-zero, so nothing waits forever on a dead peer. A process its launcher saw exit is
acted on within a turn instead (``job_status.write_lost``). When every worker has
finished it tells the servers to shut down and exits 0.

What a synchronization mode needs of the scheduler besides (a quorum's relayed decisions,
preduce's groups) is its policy's (``ssdsgd/sync/scheduler_policies.py``), carried in
POLICY messages. ``scheduler_link.SchedulerLink`` is the node side of the conversation.
"""
import sys
import time

import zmq

from . import job_status, protocol as P
from .barriers import Barriers
from .chunks import ChunkError, Dealer
from .env import NodeEnv
from .removals import RemovalError, Removals, removal_refusal
from . import reregister
from .join_wiring import Joins
from .replica_map import ReplicaError, ReplicaMap
from . import sealing
from .sealing import SealError
from .security import Guard
from .. import timeline
from .liveness import StallWatch, failed
from .startup import Startup, StartupError
from .topology import (assign_ranks, by_rank, job_limit, node_name, reachable_or_why,
                       record, registration, topology, unreachable)

LOST_READ_S = 0.25      # how often the launcher's list of dead processes is read


class JobAborted(RuntimeError):
    """The job cannot go on (a peer died, the scheduler is gone, a bad configuration).
    ``said``: the node has printed it already."""
    said = False


def bind_router(ctx, host, port, what, guard=None, sndhwm=1000, rcvhwm=1000, maxmsgsize=-1):
    """A ROUTER socket bound to host:port (port 0: a free one); a clear error if taken.

    Every option is set before ``bind``: the listener takes a copy of the socket's options
    when it is bound, and options set afterwards apply to no connection, later ones
    included (tests/test_message_limits.py). The high-water marks bound what one peer can
    queue; MAXMSGSIZE refuses a bigger frame without buffering it; the guard decides who
    may connect at all."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.MAXMSGSIZE, maxmsgsize)
    if guard is not None:
        guard.server(ctx, sock)
    sealing.use(sock, guard.binder_channels() if guard is not None else sealing.PLAIN_BINDER)
    try:
        if port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{host}")
    except zmq.ZMQError as e:
        sock.close()
        raise JobAborted(f"{what} cannot listen on {host}:{port}: {e.strerror}"
                         + (" (the port is in use)" if e.errno == zmq.EADDRINUSE else "")) from None
    return sock, port


class Rejections:
    """Log lines for rejected messages: the first few of each peer (a node of the job by
    its name, strangers together), then one in a thousand -- a flood of bad messages must
    not become a flood of log lines."""

    def __init__(self, log):
        self.log, self.counts = log, {}

    def __call__(self, text, who=None):
        n = self.counts[who] = self.counts.get(who, 0) + 1
        if n <= 10 or n % 1000 == 0:
            source = who or "a peer that is not a node of this job"
            self.log(f"rejected a message from {source} ({n} so far): {text}")


class Scheduler(reregister.Rejoins, Joins):
    """``make_policy(env)``: what the job's synchronization mode decides here (a
    ``ssdsgd.sync.scheduler_policies.SchedulerPolicy``; the node wiring passes it).
    A restarted one (cluster.scheduler_restarts) first takes its nodes back
    (``reregister.py``). ``join_boundary``: the stage rule's step a joiner comes in at
    (``ssdsgd.sync.stage.join_boundary``), None if the job takes no joiner
    (``join_wiring.py``)."""

    def __init__(self, env: NodeEnv, make_policy, log=None, join_boundary=None):
        self.env = env
        self.log = log or (lambda text: print(f"ssdsgd scheduler: {text}", file=sys.stderr, flush=True))
        self.ctx = zmq.Context.instance()
        self.guard = Guard.from_env(env, self.log)
        self.sock, self.port = bind_router(self.ctx, env.scheduler_host, env.scheduler_port,
                                           "the scheduler", self.guard,
                                           maxmsgsize=P.frame_limit(0))
        self.channels = sealing.of(self.sock)     # aesgcm: sealed frames (sealing.py)
        self.log(f"listening on {env.scheduler_host}:{self.port}; {self.guard.describe()}")
        self.nodes = {}           # identity (the connection) -> info dict
        self.barriers = Barriers()
        self.removals = Removals()    # cluster.on_worker_failure: continue
        # workers a heartbeat counted a push of (removals.py), kept in the status file
        self.pushing = set()
        self.replicas = ReplicaMap(env.num_servers, env.server_replicas)
        self.dealer = Dealer()        # data.assignment: dynamic (chunks.py)
        self.counts = {"server": env.num_servers, "worker": env.num_workers}
        self.started = False
        self.startup = None       # once every node registered: the servers' binding
        self.rejected = Rejections(self.log)
        self.policy = make_policy(env)
        self.stalls = StallWatch(env.stall_timeout)
        self.left = set()         # workers removed (on_worker_failure: continue)
        self._lost_read = 0.0     # when the launcher's list of dead processes was read
        self.rebuild = reregister.begin(env, self.counts, self.log)
        self.layout = None        # the topology every node heard (a joiner hears it too)
        self._init_joins(join_boundary)
        if self.rebuild is not None:
            self._restore_joins(self.rebuild.prior)
            self.replicas.dead.update(self.rebuild.replaced)
            self.pushing |= self.rebuild.pushed
        # the timeline's reference clock: its file names the host whose processes read
        # this clock (ssdsgd/timeline_merge.py)
        timeline.start_node(env, "scheduler", 0)

    def _send(self, ident, kind, meta=None, req=0):
        try:
            self.sock.send_multipart([ident] + self.channels.seal(
                ident, P.control(kind, meta, req=req)), flags=zmq.NOBLOCK)
        except (zmq.ZMQError, SealError):
            pass  # the peer is gone or does not read; heartbeats will tell

    def _members(self, role=None):
        """The connections of ``role``'s nodes (None or 'all': every node)."""
        return [i for i, n in self.nodes.items() if role in (None, "all", n["role"])]

    def _assign_ranks(self):
        """Every node registered: ranks and the topology, to every node. The servers bind
        their ports once worker 0 states its model, and only then do the workers hear
        where (``_listen``; startup.py says why)."""
        nodes = list(self.nodes.values())
        assign_ranks(nodes, self.counts)
        # the workers would wait on an unreachable relay forever
        wrong = reachable_or_why(nodes, self.env.pull_relay == "auto", self.log)
        if wrong:
            self._abort(wrong)
        layout = self.layout = topology(nodes, self.env.num_workers, self.env.num_servers)
        self.startup = Startup(self._members("server"))
        self.started = True
        self._record()     # before any node hears it (a restarted scheduler reads it)
        now = time.monotonic()
        for ident, node in self.nodes.items():
            node["last_seen"] = now
            self._send(ident, P.Kind.TOPOLOGY, dict(layout, rank=node["rank"]))
        self.log(f"all {len(self.nodes)} nodes registered; job started (the servers listen "
                 "once worker 0 states its model)")

    def _listen(self, ident, node, meta):
        """LISTEN (startup.py): worker 0's model goes to every server as the job's limit;
        after the last server's port, every worker hears where the servers listen."""
        if self.startup is None:
            raise P.ProtocolError("LISTEN before every node registered")
        try:
            step = self.startup.on_listen(ident, node, meta, self.nodes.values())
        except StartupError as e:
            raise P.ProtocolError(str(e)) from None
        if step is None:
            return
        role, out = step
        if role == "worker":      # a server the workers cannot reach: they would wait
            wrong = unreachable(by_rank(self.nodes.values(), "server"))
            if wrong:
                self._abort(wrong)
            self.log(f"every server listens; messages to the servers carry at most "
                     f"{job_limit(self.env, out)} data bytes")
        if role == "worker":
            self.listen_out = out
        members = list(self._members(role))
        if role == "worker" and self.replicas.copying:   # chain replication: each owner
            members = list(self._members("server")) + members    # connects to its backup
        for i in members:
            self._send(i, P.Kind.LISTEN, out)

    def _record(self, abort=None):
        """The launcher's view of the job (kvstore/job_status.py)."""
        workers = [n for n in self.nodes.values() if n["role"] == "worker"]
        extra, before, finished_before = self._status_extra()
        job_status.write(self.env.status_file, started=self.started,
                         workers={n["asked_rank"] for n in workers} | set(before),
                         finished={n["asked_rank"] for n in workers if n["finished"]}
                         | set(finished_before) | self.departed_done, abort=abort,
                         membership=self._membership_status(), replaced=self.replicas.dead,
                         pushed=self.pushing, **extra)

    def _abort(self, reason):
        """Say why first: once the status file holds the reason, the launcher may stop
        this process at any moment."""
        aborted = JobAborted(f"aborting the job: {reason}")
        self.log(str(aborted))
        aborted.said = True
        self._record(abort=reason)
        for ident in self.nodes:
            self._send(ident, P.Kind.ABORT, {"reason": reason})
        time.sleep(0.2)  # let the ABORTs leave before the context is torn down
        raise aborted

    def _register(self, ident, meta, frame):
        """REGISTER: the connection becomes the node (the guard has already checked, at
        the handshake, that the process holds a key of the job). With a key per process
        the node is the one its key names: another rank, or that rank twice, is refused."""
        role = meta["role"]
        joining = self._joining(role, meta, frame)
        if joining and self.rebuild is not None and not self.rebuild.done:
            raise P.ProtocolError("REGISTER: the restarted scheduler is taking the job's "
                                  "nodes back; join again once they are back")
        if self.rebuild is not None and not joining:
            try:
                self.rebuild.registered_again(meta)
            except reregister.SetUpLost as e:
                self._abort(f"restart {self.rebuild.restart}: {e}")
            raise P.ProtocolError("REGISTER: this scheduler was restarted after the job "
                                  "started; its nodes rejoin (REJOIN), none registers anew")
        if ident in self.nodes:
            raise P.ProtocolError(f"this connection already registered as "
                                  f"{self.nodes[ident]['role']}")
        if joining:
            self._join(ident, meta, frame)
            return
        who = self.guard.sender(frame)
        meta, wrong = registration(role, meta, who, self.nodes.values(), self.counts,
                                   self.started)
        if wrong:
            raise P.ProtocolError(wrong)
        self.nodes[ident] = record(meta, role, who, time.monotonic())
        if all(len(self._members(r)) == n for r, n in self.counts.items()):
            self._assign_ranks()
        self._record()

    def _handle(self, ident, msg, frame=None):
        node = self.nodes.get(ident)
        if msg.kind == P.Kind.REGISTER:
            self._register(ident, msg.meta, frame)
            return
        if msg.kind == P.Kind.REJOIN:
            self._rejoin(ident, msg.meta, frame)
            return
        if msg.kind == P.Kind.LEAVE:     # --leave dials unregistered; a server answers
            if node is None and self.rebuild is not None and not self.rebuild.done:
                raise P.ProtocolError("LEAVE: the restarted scheduler is taking the job's "
                                      "nodes back; ask again once they are back")
            self._leave(ident, msg.meta, frame)
            return
        if node is None and self.rebuild is not None:    # sent to the lost scheduler,
            self.rejected(f"{msg.kind.name} before its node rejoined; dropped")   # or a
            return       # stranger's: an ERROR could reach a node that is rejoining
        if node is None:
            raise P.ProtocolError(f"{msg.kind.name} from a node that never registered")
        node["last_seen"] = time.monotonic()
        handler = self.HANDLERS.get(msg.kind)
        if handler is None:
            raise P.ProtocolError(f"unexpected {msg.kind.name} at the scheduler")
        handler(self, ident, node, msg.meta)

    def _heartbeat(self, ident, node, meta):
        if node["role"] == "worker" and "progress" in meta:
            if meta["progress"] and node["rank"] not in self.pushing:
                self.pushing.add(node["rank"])
                self._record()     # a restarted scheduler knows it (reregister.py)
            self.stalls.report(node["rank"], meta["progress"], meta.get("busy", False),
                               node["last_seen"], meta.get("oldest"))
        self._send(ident, P.Kind.HEARTBEAT, {"sent": meta["sent"], "time": time.perf_counter()}
                   if "sent" in meta else None)    # the node's clock offset (timeline.py)

    def _barrier(self, ident, node, meta):
        group, step = meta.get("group", "worker"), meta.get("step")
        members = self._barrier_members(group, step)
        if ident not in members:
            raise P.ProtocolError(f"a {node['role']} cannot wait at the {group} barrier"
                                  + ("" if step is None else f" of step {step}"))
        if self._released_alone(ident, group):
            return
        if meta.get("agreement") in self.barriers.agreed:
            # a worker that comes to an agreement made already (a joiner) hears it alone:
            # no barrier of the others is released (barriers.py)
            self._send(ident, P.Kind.BARRIER, {"group": group, "value":
                                               self.barriers.agreed[meta["agreement"]]})
            return
        try:
            release = self.barriers.arrive(group, ident, meta.get("value", 0), members,
                                           meta.get("agreement"), step)
        except ValueError as e:
            raise P.ProtocolError(f"{node_name(node)}: {e}") from None
        if release:
            self._release(*release)
        elif node["role"] == "worker":
            self._decide(self.policy.at_barrier, node["rank"])

    def _barrier_members(self, group, step=None):
        """Who a barrier waits for: the group's nodes, but a worker whose join is still
        being decided (it takes no step before it hears its first one); at a barrier of
        a ``step`` (that of the waiting one if None), the workers in the job at that step
        only (``in_job_at``: one that joins later or left by then is not there)."""
        joining = self.admissions.pending if self.admissions else {}
        step = self.barriers.steps.get(group) if step is None else step
        return [i for i in self._members(group)
                if self.nodes[i]["role"] != "worker"
                or (self.nodes[i]["rank"] not in joining
                    and (step is None or self._in_job_at(self.nodes[i]["rank"], step)))]

    def _release(self, group, waiting, value):
        """Every member hears the largest value any sent; a join or departure that waited
        for an agreement may be decided now."""
        for i in waiting:
            self._send(i, P.Kind.BARRIER, {"group": group, "value": value})
        self.dealer.release()        # a mid-epoch checkpoint's pause ends (chunks.py)
        self.policy.barrier_released()
        self._decide_waiting()

    def _membership(self, ident, node, meta):
        if node["role"] != "server":
            raise P.ProtocolError(f"MEMBERSHIP from a {node['role']}")
        self._removal_answer(ident, meta)

    def _finish(self, ident, node, meta):
        if meta.get("error"):   # everyone (the failed node too) hears it first
            self._abort(f"{node_name(node)} failed: {meta['error']}")
        node["finished"] = True
        self.stalls.leave(node["rank"])
        self._record()      # before the ACK: a worker that heard it may be gone
        self._send(ident, P.Kind.ACK)
        self._departed_finish(ident, node)

    def _chunk(self, ident, node, meta):
        """CHUNK: the next chunk of an epoch, to whichever worker asks (chunks.py)."""
        if node["role"] != "worker":
            raise P.ProtocolError(f"CHUNK from a {node['role']}")
        try:
            answer = self.dealer.deal(node["rank"], meta)
        except ChunkError as e:
            raise P.ProtocolError(str(e)) from None
        self._send(ident, P.Kind.CHUNK, answer)

    def _policy_event(self, ident, node, meta):
        self._decide(self.policy.on_event, node["role"], node["rank"], meta)

    HANDLERS = {P.Kind.HEARTBEAT: _heartbeat, P.Kind.BARRIER: _barrier,
                P.Kind.MEMBERSHIP: _membership, P.Kind.FINISH: _finish,
                P.Kind.POLICY: _policy_event, P.Kind.LISTEN: _listen,
                P.Kind.CHUNK: _chunk, P.Kind.JOIN: Joins._join_answer}

    def _decide(self, event, *args):
        """Run a policy event; send the messages it decides (sync/scheduler_policies.py)."""
        try:
            actions = event(*args)
        except self.policy.Error as e:
            raise P.ProtocolError(str(e)) from None
        by_rank = {(n["role"], n["rank"]): i for i, n in self.nodes.items()}
        for target, which, payload in actions:
            if target == "workers":
                for rank in which:
                    if ("worker", rank) in by_rank:
                        self._send(by_rank[("worker", rank)], P.Kind.POLICY, payload)
                continue
            frames = P.control(P.Kind.POLICY, payload)
            for other in self._members("server"):
                if self.nodes[other]["rank"] == which:
                    continue
                try:
                    self.sock.send_multipart([other] + self.channels.seal(other, frames),
                                             flags=zmq.NOBLOCK)
                except zmq.ZMQError as e:
                    self._abort(f"{node_name(self.nodes[other])} does not take the policy "
                                f"messages of server {which} ({e.strerror})")

    # ---- cluster.on_worker_failure: continue ----------------------------------------
    def _removal_refused(self, rank, why):
        """Abort the job, saying why in one line, if it cannot go on without dead worker
        ``rank`` (``removals.removal_refusal``): the last worker, worker 0 before a
        heartbeat counted its first push, a chief whose part no worker still training can
        take, or one whose mode needs it still (``_choice_pending``)."""
        others = {n["rank"]: n for n in self.nodes.values()
                  if n["role"] == "worker" and n["rank"] != rank
                  and n["rank"] not in self.departed}
        wrong = removal_refusal(
            rank, set(others), {r for r, n in others.items() if not n["finished"]},
            self._choice_pending(rank, asked=False), pushed=rank in self.pushing)
        if wrong is not None:
            self._abort(f"{why}; {wrong}")

    def _remove_worker(self, ident, why):
        """A dead or stuck worker (any rank; worker 0's chief's part passes to the lowest
        rank left, which hears of the removal as every node does) leaves: ask every server
        for the first step it has not received from it; the smallest becomes the step from
        which every server aggregates without it (``removals.py``). Barriers no longer
        wait for it."""
        node = self.nodes.pop(ident)
        rank = node["rank"]
        self.stalls.leave(rank)
        self.log(f"{why}; removing it from the job (cluster.on_worker_failure: continue)")
        if not self._removed_once_joined(rank):
            self._begin_removal(rank)
        for release in self.barriers.leave(ident, self._barrier_members):
            self._release(*release)

    def _begin_removal(self, rank):
        """Ask every server for the first step it lacks from dead worker ``rank``."""
        servers = self._members("server")
        self.removals.begin(rank, servers)
        for i in servers:
            self._send(i, P.Kind.MEMBERSHIP, {"removed": rank})

    def _removal_answer(self, ident, meta):
        """A server's first missing step of a removed worker; once every server has
        answered, all nodes hear the step from which the worker is out."""
        try:
            commit = self.removals.answer(ident, meta)
        except RemovalError as e:
            raise P.ProtocolError(str(e)) from None
        if commit is not None:
            self._removed(commit)

    def _removed(self, commit):
        """Every node hears the step from which a dead worker is out."""
        self.left.add(commit["removed"])   # a restarted scheduler expects it until
        self._record()                     # then: it fails the job, rather than hang
        for i in self.nodes:
            self._send(i, P.Kind.MEMBERSHIP, commit)
        self.log(f"worker {commit['removed']} left the job; the servers aggregate the "
                 f"remaining {len(self._members('worker'))} workers from step "
                 f"{commit['from_step']}")
        self._dead_departs(commit["removed"])

    def _serve_one(self):
        """Read and handle one message; nothing a peer sends stops the scheduler (only a
        decision to abort the job does)."""
        frames = self.sock.recv_multipart(copy=False)
        try:
            frames = self.channels.open(frames)
        except SealError as e:
            self.rejected(f"a message that does not open: {e}")
            return
        ident, frames = frames[0].bytes, frames[1:]
        req = 0
        try:
            msg = P.receive(frames, max_bytes=0)
            req = msg.req
            self._handle(ident, msg, frames[0])
        except JobAborted:
            raise
        except P.ProtocolError as e:
            node = self.nodes.get(ident)
            self.rejected(str(e), node and f"{node['role']} {node['rank']}")
            self._send(ident, P.Kind.ERROR, {"error": str(e)}, req=e.req or req)
        except Exception as e:    # noqa: BLE001 - a bug must not take the job down
            self.log(f"internal error on a message (the job goes on): {e!r}")
            self._send(ident, P.Kind.ERROR, {"error": f"internal error: {e!r}"}, req=req)

    def run(self):
        """Serve until every worker finished (return 0) or a node died (JobAborted)."""
        env = self.env
        connect_timeout = max(60.0, 4 * env.heartbeat_timeout)
        connect_deadline = time.monotonic() + connect_timeout
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while True:
            if poller.poll(int(env.heartbeat_interval * 500)):
                for _ in range(64):     # a burst, then the liveness checks below
                    self._serve_one()
                    if not self.sock.poll(0):
                        break
            now = time.monotonic()
            if self._awaiting_rejoins(now):
                continue
            if not self.started:
                if now > connect_deadline:
                    have = {r: len(self._members(r)) for r in ("server", "worker")}
                    self._abort(f"only {have['server']}/{env.num_servers} servers and "
                                f"{have['worker']}/{env.num_workers} workers registered "
                                f"within {connect_timeout:.0f} s")
                continue
            workers = self._members("worker")
            if all(self.nodes[i]["finished"] for i in workers):
                for ident in self._members("server"):
                    self._send(ident, P.Kind.SHUTDOWN)
                time.sleep(0.2)
                self.log("all workers finished; job done")
                return 0
            for ident, why in (failed(self.nodes, self.barriers.waiting, self.stalls, env, now)
                               + self._seen_dead(now)):
                if ident in self.nodes:       # not removed by an earlier one of this turn
                    self._failed(ident, why)

    def _seen_dead(self, now):
        """The nodes whose process the launcher saw exit (job_status.write_lost), acted on
        as failed at once, not after the heartbeat timeout: a dead server's backup takes
        its keys (cluster.server_replicas), a dead worker leaves (on_worker_failure:
        continue). Read at most every LOST_READ_S; nothing without a status file (a
        scheduler on another host than its launcher)."""
        if not self.env.status_file or now - self._lost_read < LOST_READ_S:
            return []
        self._lost_read = now
        servers, workers = self._launcher_lost()
        dead = {("server", r) for r in servers} | {("worker", r) for r in workers}
        return [(ident, f"{node_name(n)}: its process exited (its launcher saw it)")
                for ident, n in self.nodes.items()
                if (n["role"], n["rank"]) in dead and not n["finished"]]

    def _failed(self, ident, why):
        """A node is dead or stuck: it leaves (cluster.on_worker_failure: continue, a
        worker the job can go on without, ``_removal_refused``; told to go, in case it
        still listens), or the job is aborted."""
        n = self.nodes[ident]
        if self.env.on_worker_failure == "continue" and n["role"] == "worker":
            self._removal_refused(n["rank"], why)
            self._send(ident, P.Kind.ABORT, {"reason": f"{why}; it leaves the job"})
            self._remove_worker(ident, why)
        elif n["role"] == "server" and self.env.server_replicas:
            self._promote(ident, why)
        else:
            self._abort(why)

    def _promote(self, ident, why):
        """cluster.server_replicas: 1: a dead server's backup owns its keys from now on
        (replica_map.py); every server hears it, and the new owner tells the workers."""
        dead = self.nodes[ident]["rank"]
        rebuilt = self.rebuild is not None and self.rebuild.done     # they all listened
        if not rebuilt and (self.startup is None or self.startup.waiting):
            self._abort(f"{why}; it died before every server listened (no backup has "
                        "its keys yet)")     # the workers know no server
        self._send(ident, P.Kind.ABORT, {"reason": f"{why}; its backup takes its keys"})
        del self.nodes[ident]
        self._hand_over(dead, why)
        # what waited for its answer is decided by the others' (its backup saw the same
        # pushes and answered for the keys it takes)
        for commit in self.removals.forget(ident):
            self._removed(commit)
        self._decide_without(ident)

    def _hand_over(self, dead, why):
        """Server ``dead``'s keys to its backup (or the job ends, saying why none can)."""
        try:
            owner = self.replicas.lose(dead)
        except ReplicaError as e:
            self._abort(f"{why}; {e}")
        self._record()      # before any server hears it: a restarted scheduler knows it
        for i in self._members("server"):
            self._send(i, P.Kind.PROMOTE, {"dead": dead, "owner": owner})
        self.log(f"{why}; server {owner} owns its keys from now on, and the job goes on "
                 "with no replica left (cluster.server_replicas: 1)")

    def close(self):
        self.sock.close(0)
        self.guard.close()
        timeline.RECORDER.close()
