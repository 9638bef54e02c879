"""Membership: who is in the job, their ranks and addresses, barriers, heartbeats, shutdown.

The scheduler is ps-lite's Postoffice in one process: every server and worker registers
with it, receives its rank and every server's address once all have arrived, and then sends
a heartbeat every ``heartbeat_interval``. A node silent for ``heartbeat_timeout`` is
presumed dead: the scheduler tells every other node to abort, naming it, and exits
non-zero, so nothing waits forever on a dead peer. When every worker has finished it tells
the servers to shut down and exits 0.

``SchedulerLink`` is the node side of the same conversation.
"""
import os
import socket
import sys
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from . import job_status, protocol as P
from .env import NodeEnv
from ..sync.groups import GroupError, GroupGenerator
from .security import Guard


_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class JobAborted(RuntimeError):
    """The job cannot go on (a peer died, the scheduler is gone, a bad configuration)."""


def bind_router(ctx, host, port, what, guard=None, sndhwm=1000, rcvhwm=1000, maxmsgsize=-1):
    """A ROUTER socket bound to host:port (port 0: a free one); a clear error if taken.

    Every option is set before ``bind``: ZeroMQ applies a listening socket's options to
    the connections it accepts later, never to those already accepted (the high-water
    marks bound what one peer can queue; MAXMSGSIZE refuses a bigger frame without
    buffering it; the guard decides who may connect at all)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.MAXMSGSIZE, maxmsgsize)
    if guard is not None:
        guard.server(ctx, sock)
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


def node_name(info):
    return f"{info['role']} {info['rank']} (pid {info.get('pid', '?')} on {info.get('hostname', '?')})"


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


class Scheduler:
    def __init__(self, env: NodeEnv, log=None):
        self.env = env
        self.log = log or (lambda text: print(f"ssdsgd scheduler: {text}", file=sys.stderr, flush=True))
        self.ctx = zmq.Context.instance()
        self.guard = Guard.from_env(env, self.log)
        self.sock, self.port = bind_router(self.ctx, env.scheduler_host, env.scheduler_port,
                                           "the scheduler", self.guard,
                                           maxmsgsize=P.frame_limit(0))
        self.log(f"listening on {env.scheduler_host}:{self.port}; {self.guard.describe()}")
        self.nodes = {}           # identity (the connection) -> info dict
        self.barriers = {}        # group -> set of identities waiting
        self.barrier_values = {}  # group -> the largest value sent to the waiting barrier
        self.removals = {}        # rank of a dead worker -> {waiting: servers, step: min}
        self.started = False
        self.rejected = Rejections(self.log)
        self.groups = GroupGenerator(env.num_workers, min(env.group_size, env.num_workers)) \
            if env.algorithm == "preduce" else None

    def _send(self, ident, kind, meta=None, req=0):
        try:
            self.sock.send_multipart([ident] + P.control(kind, meta, req=req), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the peer is gone or does not read; heartbeats will tell

    def _members(self, role=None):
        return [i for i, n in self.nodes.items() if role is None or n["role"] == role]

    def _assign_ranks(self):
        for role, count in (("server", self.env.num_servers), ("worker", self.env.num_workers)):
            idents = self._members(role)
            asked = [self.nodes[i]["asked_rank"] for i in idents]
            taken = {r for r in asked if 0 <= r < count and asked.count(r) == 1}
            free = iter(sorted(set(range(count)) - taken))
            for i in idents:
                r = self.nodes[i]["asked_rank"]
                self.nodes[i]["rank"] = r if r in taken else next(free)
        by_rank = lambda role: sorted((n for n in self.nodes.values() if n["role"] == role),
                                      key=lambda n: n["rank"])
        relaying = [n for n in by_rank("worker") if n["port"]]   # sync.pull_relay: chain
        self._check_reachable(by_rank("server") + relaying)
        addresses = [[n["host"], n["port"]] for n in by_rank("server")]
        workers = [n["routing_id"] for n in by_rank("worker")]
        topology = {"num_workers": self.env.num_workers, "num_servers": self.env.num_servers,
                    "servers": addresses, "workers": workers}
        if relaying:
            topology["relays"] = [[n["host"], n["port"]] if n["port"] else None
                                  for n in by_rank("worker")]
        now = time.monotonic()
        for ident, n in self.nodes.items():
            n["last_seen"] = now
            self._send(ident, P.Kind.TOPOLOGY, dict(topology, rank=n["rank"]))
        self.started = True
        self.log(f"all {len(self.nodes)} nodes registered; job started")

    def _check_reachable(self, servers, timeout=5.0):
        """Abort naming a server whose advertised address cannot be reached (the workers
        would wait on it forever): a TCP connect to each, from the scheduler's host."""
        for n in servers:
            try:
                socket.create_connection((n["host"], n["port"]), timeout=timeout).close()
            except (OSError, TypeError, ValueError) as e:
                self._abort(f"{node_name(n)} advertised {n['host']}:{n['port']}, which the "
                            f"scheduler cannot reach ({getattr(e, 'strerror', None) or e}); "
                            "set its address with --interface or SSDSGD_NODE_HOST")

    def _record(self, abort=None):
        """The launcher's view of the job (kvstore/job_status.py)."""
        workers = [n for n in self.nodes.values() if n["role"] == "worker"]
        job_status.write(self.env.status_file, started=self.started,
                         workers=[n["asked_rank"] for n in workers],
                         finished=[n["asked_rank"] for n in workers if n["finished"]],
                         abort=abort)

    def _abort(self, reason):
        self._record(abort=reason)
        for ident in self.nodes:
            self._send(ident, P.Kind.ABORT, {"reason": reason})
        time.sleep(0.2)  # let the ABORTs leave before the context is torn down
        raise JobAborted(f"aborting the job: {reason}")

    def _register(self, ident, meta, frame):
        """REGISTER: the connection becomes the node (the guard has already checked, at
        the handshake, that the process holds a key of the job). With a key per process
        the node is the one its key names: another rank, or that rank twice, is refused."""
        role = meta["role"]
        full = {"server": self.env.num_servers, "worker": self.env.num_workers}
        if ident in self.nodes:
            raise P.ProtocolError(f"this connection already registered as "
                                  f"{self.nodes[ident]['role']}")
        who = self.guard.sender(frame)
        if who is not None:
            if meta.get("rank", -1) == -1 and who.startswith(role + " "):
                meta = dict(meta, rank=int(who.split()[1]))     # its key says which
            wrong = self.guard.wrong_claim(frame, role, meta.get("rank", -1))
            if wrong:
                raise P.ProtocolError(wrong)
            if any(n.get("who") == who for n in self.nodes.values()):
                raise P.ProtocolError(f"{who} has registered already")
        if role == "server" and not (meta.get("host") and meta.get("port")):
            raise P.ProtocolError("a server registers the host and port it listens on")
        if role == "worker" and bool(meta.get("host")) != bool(meta.get("port")):
            raise P.ProtocolError("a worker that relays pulls registers both the host and "
                                  "the port it listens on")
        if role == "worker" and not meta.get("routing_id"):
            raise P.ProtocolError("a worker registers the id of its connections to the servers")
        if role == "worker" and any(n.get("routing_id") == meta["routing_id"]
                                    for n in self.nodes.values()):
            raise P.ProtocolError("another worker registered the same connection id")
        if self.started or len(self._members(role)) >= full[role]:
            raise P.ProtocolError(f"the job already has its {full[role]} {role}s "
                                  f"(SSDSGD_NUM_{role.upper()}S={full[role]})")
        self.nodes[ident] = {"role": role, "asked_rank": meta.get("rank", -1),
                             "host": meta.get("host"), "port": meta.get("port"),
                             "pid": meta.get("pid"), "hostname": meta.get("hostname"),
                             "routing_id": meta.get("routing_id"), "who": who,
                             "rank": -1, "last_seen": time.monotonic(), "finished": False}
        if (len(self._members("server")) == self.env.num_servers
                and len(self._members("worker")) == self.env.num_workers):
            self._assign_ranks()
        self._record()

    def _handle(self, ident, msg, frame=None):
        node = self.nodes.get(ident)
        if msg.kind == P.Kind.REGISTER:
            self._register(ident, msg.meta, frame)
            return
        if node is None:
            raise P.ProtocolError(f"{msg.kind.name} from a node that never registered")
        node["last_seen"] = time.monotonic()
        if msg.kind == P.Kind.HEARTBEAT:
            self._send(ident, P.Kind.HEARTBEAT)
        elif msg.kind == P.Kind.BARRIER:
            group = msg.meta.get("group", "worker")
            members = [i for i in self._members() if group == "all" or self.nodes[i]["role"] == group]
            if ident not in members:
                raise P.ProtocolError(f"a {node['role']} cannot wait at the {group} barrier")
            waiting = self.barriers.setdefault(group, set())
            waiting.add(ident)
            value = max(self.barrier_values.get(group, 0), msg.meta.get("value", 0))
            self.barrier_values[group] = value
            if waiting >= set(members):
                for i in waiting:     # every member hears the largest value any sent
                    self._send(i, P.Kind.BARRIER, {"group": group, "value": value})
                waiting.clear()
                self.barrier_values.pop(group)
                if self.groups is not None:
                    self.groups.barrier_released()
            elif self.groups is not None and node["role"] == "worker":
                # preduce: a worker at the barrier reports no ready until it releases,
                # so the ready ones must not wait for it (sync/groups.py)
                self._group_event(self.groups.wait_at_barrier, node["rank"])
        elif msg.kind == P.Kind.MEMBERSHIP and node["role"] == "server":
            self._removal_answer(ident, msg.meta)
        elif msg.kind == P.Kind.ROUND:
            self._relay_round(node, ident, msg.meta)
        elif msg.kind == P.Kind.READY:
            self._ready(node, msg.meta.get("final", False))
        elif msg.kind == P.Kind.FINISH:
            if msg.meta.get("error"):   # everyone (the failed node too) hears it first
                self._abort(f"{node_name(node)} failed: {msg.meta['error']}")
            self._send(ident, P.Kind.ACK)
            node["finished"] = True
            self._record()
        else:
            raise P.ProtocolError(f"unexpected {msg.kind.name} at the scheduler")

    def _ready(self, node, final):
        """preduce: a worker finished a local step; tell the members of every group that
        forms who they average with (docs/spec/preduce.md)."""
        if self.groups is None or node["role"] != "worker":
            raise P.ProtocolError(f"READY from a {node['role']} in a job whose algorithm is "
                                  f"{self.env.algorithm}, not preduce")
        self._group_event(self.groups.arrive, node["rank"], final)

    def _group_event(self, event, *args):
        """Feed the group generator one event; tell each member of a group it formed."""
        try:
            formed = event(*args)
        except GroupError as e:
            raise P.ProtocolError(str(e)) from None
        by_rank = {n["rank"]: i for i, n in self.nodes.items() if n["role"] == "worker"}
        for group in formed:
            for rank in group.members:
                self._send(by_rank[rank], P.Kind.GROUP, {"group": group.number,
                                                         "members": list(group.members)})

    # ---- cluster.on_worker_failure: continue ----------------------------------------
    def _remove_worker(self, ident, silent):
        """A dead worker (not rank 0) leaves: ask every server for the first step it has
        not received from it; the smallest becomes the step from which every server
        aggregates without it (_removal_answer). Barriers no longer wait for it."""
        node = self.nodes.pop(ident)
        rank = node["rank"]
        self.log(f"worker {rank} sent no heartbeat for {silent:.1f} s; removing it from the "
                 "job (cluster.on_worker_failure: continue)")
        servers = set(self._members("server"))
        self.removals[rank] = {"waiting": servers, "step": None}
        for i in servers:
            self._send(i, P.Kind.MEMBERSHIP, {"removed": rank})
        for group, waiting in self.barriers.items():
            waiting.discard(ident)
            members = [i for i in self._members() if group == "all"
                       or self.nodes[i]["role"] == group]
            if waiting and waiting >= set(members):
                value = self.barrier_values.pop(group, 0)
                for i in waiting:
                    self._send(i, P.Kind.BARRIER, {"group": group, "value": value})
                waiting.clear()
                if self.groups is not None:
                    self.groups.barrier_released()

    def _removal_answer(self, ident, meta):
        """A server's first missing step of a removed worker; once every server has
        answered, all nodes hear the step from which the worker is out."""
        removal = self.removals.get(meta["removed"])
        if removal is None or ident not in removal["waiting"] or "next_step" not in meta:
            raise P.ProtocolError("MEMBERSHIP: not an answer to a removal")
        removal["waiting"].discard(ident)
        step = meta["next_step"]
        removal["step"] = step if removal["step"] is None else min(removal["step"], step)
        if not removal["waiting"]:
            commit = {"removed": meta["removed"], "from_step": removal["step"]}
            for i in self.nodes:
                self._send(i, P.Kind.MEMBERSHIP, commit)
            self.log(f"worker {meta['removed']} left the job; the servers aggregate the "
                     f"remaining {len(self._members('worker'))} workers from step "
                     f"{removal['step']}")

    def _relay_round(self, node, ident, meta):
        """Server 0's quorum decisions go to every other server (docs/spec/quorum.md); one
        lost would stall that server, so a server that does not take them ends the job."""
        if node["role"] != "server" or node["rank"] != 0:
            raise P.ProtocolError(f"only server 0 decides quorum rounds, not {node_name(node)}")
        frames = P.control(P.Kind.ROUND, meta)
        for other in self._members("server"):
            if other == ident:
                continue
            try:
                self.sock.send_multipart([other] + frames, flags=zmq.NOBLOCK)
            except zmq.ZMQError as e:
                self._abort(f"{node_name(self.nodes[other])} does not take the round "
                            f"decisions of server 0 ({e.strerror})")

    def _serve_one(self):
        """Read and handle one message; nothing a peer sends stops the scheduler (only a
        decision to abort the job does)."""
        frames = self.sock.recv_multipart(copy=False)
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
            for ident, n in list(self.nodes.items()):
                if not n["finished"] and now - n["last_seen"] > env.heartbeat_timeout:
                    if (env.on_worker_failure == "continue" and n["role"] == "worker"
                            and n["rank"] != 0):
                        self._remove_worker(ident, now - n["last_seen"])
                        continue
                    self._abort(f"{node_name(n)} sent no heartbeat for "
                                f"{now - n['last_seen']:.1f} s (SSDSGD_HEARTBEAT_TIMEOUT="
                                f"{env.heartbeat_timeout:g}); presumed dead")

    def close(self):
        self.sock.close(0)
        self.guard.close()


class SchedulerLink:
    """A node's DEALER to the scheduler: register, heartbeats, barriers, finish.

    It also gives the node its identity towards the servers: ``routing_id``, registered
    with the scheduler, which tells the servers which connection is which worker;
    ``secure(sock, server)`` prepares a socket to a server with it and this node's keys.

    Not thread-safe: it belongs to the one thread that polls it (the server's loop, the
    worker's I/O thread)."""

    def __init__(self, ctx, env: NodeEnv, role, host=None, port=None, guard=None):
        self.env = env
        self.role = role
        self.guard = guard or Guard.from_env(env, lambda text: print(
            f"ssdsgd {role}: {text}", file=sys.stderr, flush=True))
        self.routing_id = b"\x01" + os.urandom(15)   # a leading 0 byte is ZeroMQ's own ids
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.guard.client(self.sock)
        # watched from before the connection exists: a refused handshake can happen before
        # register() waits, and its event must not be missed
        self.monitor = self.sock.get_monitor_socket(_HANDSHAKE_FAILED)
        self.sock.connect(f"tcp://{env.scheduler_host}:{env.scheduler_port}")
        self.host, self.port = host, port
        self.last_sent = 0.0
        self.last_heard = time.monotonic()
        self.topology = None

    def secure(self, sock, server=0):
        """Before connecting ``sock`` to server ``server``: this node's id and keys."""
        sock.setsockopt(zmq.ROUTING_ID, self.routing_id)
        self.guard.client(sock, f"server {server}")

    def send(self, kind, meta=None):
        """Never blocks: if the scheduler stopped reading, ``tick`` will say so."""
        try:
            self.sock.send_multipart(P.control(kind, meta), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        self.last_sent = time.monotonic()

    def register(self):
        """Block until the scheduler sends the topology; returns it (a dict)."""
        meta = {"role": self.role, "rank": self.env.rank, "pid": os.getpid(),
                "hostname": socket.gethostname()[:255]}
        if self.role == "server" or self.port:   # a worker's port: its pull relay
            meta.update(host=self.host, port=self.port)
        if self.role == "worker":
            meta["routing_id"] = self.routing_id.hex()
        self.send(P.Kind.REGISTER, meta)
        deadline = time.monotonic() + max(60.0, 4 * self.env.heartbeat_timeout) + 10
        where = f"{self.env.scheduler_host}:{self.env.scheduler_port}"
        try:
            return self._await_topology(deadline, where, self.monitor)
        finally:
            self._stop_monitor()

    def _stop_monitor(self):
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(0)
            self.monitor = None

    def _await_topology(self, deadline, where, monitor):
        while time.monotonic() < deadline:
            if monitor.poll(0):
                event = recv_monitor_message(monitor)["event"]
                raise JobAborted(
                    f"the scheduler at {where} refused this {self.role}'s connection "
                    f"({zmq.Event(event).name}): it does not hold this job's keys "
                    f"(SSDSGD_SECRET_FILE={self.env.secret_file or 'unset'}, mode "
                    f"{self.guard.mode})")
            if self.sock.poll(200):
                try:
                    msg = P.receive(self.sock.recv_multipart(), max_bytes=0)
                except P.ProtocolError as e:
                    raise JobAborted(f"the scheduler at {where} sent a malformed message: "
                                     f"{e}") from None
                if msg.kind == P.Kind.TOPOLOGY:
                    self.topology = msg.meta
                    self.last_heard = time.monotonic()
                    return msg.meta
                if msg.kind in (P.Kind.ERROR, P.Kind.ABORT):
                    raise JobAborted(f"the scheduler at {where} refused this {self.role}: "
                                     f"{msg.meta.get('error') or msg.meta.get('reason')}")
        raise JobAborted(f"no topology from the scheduler at {where} in time; is it running "
                         f"and are all {self.env.num_workers} workers and "
                         f"{self.env.num_servers} servers started?")

    def tick(self):
        """Send a heartbeat when due; raise JobAborted when the scheduler went silent."""
        now = time.monotonic()
        if now - self.last_sent >= self.env.heartbeat_interval:
            self.send(P.Kind.HEARTBEAT)
        if now - self.last_heard > self.env.heartbeat_timeout:
            raise JobAborted(f"lost the scheduler at {self.env.scheduler_host}:"
                             f"{self.env.scheduler_port}: no answer for "
                             f"{now - self.last_heard:.1f} s")

    def receive(self):
        """Handle one waiting scheduler message; returns it (the caller acts on SHUTDOWN,
        BARRIER, ACK); raises JobAborted on ABORT, or when the scheduler refused what
        this node sent (nothing a node of the job sends should be refused)."""
        try:
            msg = P.receive(self.sock.recv_multipart(), max_bytes=0)
        except P.ProtocolError as e:
            raise JobAborted(f"the scheduler sent a malformed message: {e}") from None
        self.last_heard = time.monotonic()
        if msg.kind == P.Kind.ABORT:
            raise JobAborted(f"the job was aborted: {msg.meta.get('reason')}")
        if msg.kind == P.Kind.ERROR:
            raise JobAborted(f"the scheduler refused a message of this {self.role}: "
                             f"{msg.meta.get('error')}")
        return msg
