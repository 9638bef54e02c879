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

from . import protocol as P
from .env import NodeEnv


class JobAborted(RuntimeError):
    """The job cannot go on (a peer died, the scheduler is gone, a bad configuration)."""


def bind_router(ctx, host, port, what):
    """A ROUTER socket bound to host:port (port 0: a free one); a clear error if taken."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
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


class Scheduler:
    def __init__(self, env: NodeEnv, log=None):
        self.env = env
        self.log = log or (lambda text: print(f"ssdsgd scheduler: {text}", file=sys.stderr, flush=True))
        self.ctx = zmq.Context.instance()
        self.sock, self.port = bind_router(self.ctx, env.scheduler_host, env.scheduler_port,
                                           "the scheduler")
        self.nodes = {}           # identity -> info dict
        self.barriers = {}        # group -> set of identities waiting
        self.started = False

    def _send(self, ident, kind, meta=None):
        try:
            self.sock.send_multipart([ident] + P.control(kind, meta), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the peer is gone; heartbeats will tell

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
        servers = sorted((n for n in self.nodes.values() if n["role"] == "server"),
                         key=lambda n: n["rank"])
        self._check_reachable(servers)
        addresses = [[n["host"], n["port"]] for n in servers]
        now = time.monotonic()
        for ident, n in self.nodes.items():
            n["last_seen"] = now
            self._send(ident, P.Kind.TOPOLOGY, {
                "rank": n["rank"], "num_workers": self.env.num_workers,
                "num_servers": self.env.num_servers, "servers": addresses})
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

    def _abort(self, reason):
        for ident in self.nodes:
            self._send(ident, P.Kind.ABORT, {"reason": reason})
        time.sleep(0.2)  # let the ABORTs leave before the context is torn down
        raise JobAborted(f"aborting the job: {reason}")

    def _handle(self, ident, msg):
        node = self.nodes.get(ident)
        if msg.kind == P.Kind.REGISTER:
            role = msg.meta.get("role")
            full = {"server": self.env.num_servers, "worker": self.env.num_workers}
            if role not in full:
                raise P.ProtocolError(f"REGISTER with unknown role {role!r}")
            if self.started or len(self._members(role)) >= full[role]:
                self._send(ident, P.Kind.ERROR, {
                    "error": f"the job already has its {full[role]} {role}s "
                             f"(SSDSGD_NUM_{role.upper()}S={full[role]})"})
                return
            self.nodes[ident] = {"role": role, "asked_rank": int(msg.meta.get("rank", -1)),
                                 "host": msg.meta.get("host"), "port": msg.meta.get("port"),
                                 "pid": msg.meta.get("pid"), "hostname": msg.meta.get("hostname"),
                                 "rank": -1, "last_seen": time.monotonic(), "finished": False}
            if (len(self._members("server")) == self.env.num_servers
                    and len(self._members("worker")) == self.env.num_workers):
                self._assign_ranks()
            return
        if node is None:
            raise P.ProtocolError(f"{msg.kind.name} from a node that never registered")
        node["last_seen"] = time.monotonic()
        if msg.kind == P.Kind.HEARTBEAT:
            self._send(ident, P.Kind.HEARTBEAT)
        elif msg.kind == P.Kind.BARRIER:
            group = msg.meta.get("group", "worker")
            members = [i for i in self._members() if group == "all" or self.nodes[i]["role"] == group]
            waiting = self.barriers.setdefault(group, set())
            waiting.add(ident)
            if waiting >= set(members):
                for i in waiting:
                    self._send(i, P.Kind.BARRIER, {"group": group})
                waiting.clear()
        elif msg.kind == P.Kind.FINISH:
            if msg.meta.get("error"):   # everyone (the failed worker too) hears it first
                self._abort(f"{node_name(node)} failed: {msg.meta['error']}")
            self._send(ident, P.Kind.ACK)
            node["finished"] = True
        else:
            raise P.ProtocolError(f"unexpected {msg.kind.name} at the scheduler")

    def run(self):
        """Serve until every worker finished (return 0) or a node died (JobAborted)."""
        env = self.env
        connect_timeout = max(60.0, 4 * env.heartbeat_timeout)
        connect_deadline = time.monotonic() + connect_timeout
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while True:
            if poller.poll(int(env.heartbeat_interval * 500)):
                frames = self.sock.recv_multipart(copy=False)
                ident, frames = frames[0].bytes, frames[1:]
                try:
                    self._handle(ident, P.decode(frames, max_bytes=0))
                except P.ProtocolError as e:
                    self.log(f"rejected a message: {e}")
                    self._send(ident, P.Kind.ERROR, {"error": str(e)})
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
            for ident, n in self.nodes.items():
                if not n["finished"] and now - n["last_seen"] > env.heartbeat_timeout:
                    self._abort(f"{node_name(n)} sent no heartbeat for "
                                f"{now - n['last_seen']:.1f} s (SSDSGD_HEARTBEAT_TIMEOUT="
                                f"{env.heartbeat_timeout:g}); presumed dead")

    def close(self):
        self.sock.close(0)


class SchedulerLink:
    """A node's DEALER to the scheduler: register, heartbeats, barriers, finish.

    Not thread-safe: it belongs to the one thread that polls it (the server's loop, the
    worker's I/O thread)."""

    def __init__(self, ctx, env: NodeEnv, role, host=None, port=None):
        self.env = env
        self.role = role
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(f"tcp://{env.scheduler_host}:{env.scheduler_port}")
        self.host, self.port = host, port
        self.last_sent = 0.0
        self.last_heard = time.monotonic()
        self.topology = None

    def send(self, kind, meta=None):
        self.sock.send_multipart(P.control(kind, meta))
        self.last_sent = time.monotonic()

    def register(self):
        """Block until the scheduler sends the topology; returns it (a dict)."""
        self.send(P.Kind.REGISTER, {"role": self.role, "rank": self.env.rank, "host": self.host,
                                    "port": self.port, "pid": os.getpid(),
                                    "hostname": socket.gethostname()})
        deadline = time.monotonic() + max(60.0, 4 * self.env.heartbeat_timeout) + 10
        where = f"{self.env.scheduler_host}:{self.env.scheduler_port}"
        while time.monotonic() < deadline:
            if self.sock.poll(200):
                msg = P.decode(self.sock.recv_multipart(), max_bytes=0)
                if msg.kind == P.Kind.TOPOLOGY:
                    self.topology = msg.meta
                    self.last_heard = time.monotonic()
                    return msg.meta
                if msg.kind in (P.Kind.ERROR, P.Kind.ABORT):
                    raise JobAborted(f"the scheduler at {where} refused this {self.role}: "
                                     f"{msg.meta.get('error') or msg.meta.get('reason')}")
        raise JobAborted(f"no topology from the scheduler at {where} in time; is it running and are all "
                         f"{self.env.num_workers} workers and {self.env.num_servers} servers started?")

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
        BARRIER, ACK); raises JobAborted on ABORT."""
        msg = P.decode(self.sock.recv_multipart(), max_bytes=0)
        self.last_heard = time.monotonic()
        if msg.kind == P.Kind.ABORT:
            raise JobAborted(f"the job was aborted: {msg.meta.get('reason')}")
        return msg

