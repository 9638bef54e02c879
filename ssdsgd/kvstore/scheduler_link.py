"""A node's side of the conversation with the scheduler (``scheduler.py``): register,
heartbeats, barriers, finish; and, with cluster.scheduler_restarts, taking up the
conversation again with a restarted scheduler (``reregister.py``)."""
import os
import socket
import sys
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from . import protocol as P, sealing
from .env import NodeEnv
from .reregister import wait_seconds
from .scheduler import JobAborted
from .security import Guard
from ..timeline import PROBE_S, RECORDER as TIMELINE

_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_RESTART_KINDS = {P.Kind.BARRIER, P.Kind.REJOIN}


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
        # with cluster.scheduler_restarts, a closed connection too: the scheduler died
        self.recover = env.scheduler_restarts > 0
        self.monitor = self.sock.get_monitor_socket(
            _HANDSHAKE_FAILED | (zmq.EVENT_DISCONNECTED if self.recover else 0))
        self.url = f"tcp://{env.scheduler_host}:{env.scheduler_port}"
        self.sock.connect(self.url)
        self.host, self.port = host, port
        self.last_sent = 0.0
        self.last_heard = time.monotonic()
        self.topology = None
        self.ready = False        # a worker heard the servers' addresses; a server listens
        self.passed = {}          # barrier group -> [releases received, the last value]
        self.rejoining = None     # (lost at, why) while waiting for a restarted scheduler
        self.on_rejoined = None   # called once a restarted scheduler took this node back
        self.rejoin_fields = dict  # more REJOIN fields (a worker's chunk_record report)
        self.closed = False       # the connection closed while the topology was in flight

    def secure(self, sock, server=0):
        """Before connecting ``sock`` to server ``server``: this node's id and keys."""
        sock.setsockopt(zmq.ROUTING_ID, self.routing_id)
        self.guard.client(sock, f"server {server}")

    def send(self, kind, meta=None):
        """Never blocks: if the scheduler stopped reading, ``tick`` will say so."""
        try:
            self.sock.send_multipart(sealing.of(self.sock).seal(P.control(kind, meta)),
                                     flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        self.last_sent = time.monotonic()
        if kind == P.Kind.LISTEN and meta and "port" in meta:    # a server listens
            self.port, self.ready = meta["port"], True

    def register(self):
        """Block until the scheduler sends the topology; returns it (a dict). A server
        names its host; its port comes later (LISTEN, startup.py)."""
        meta = {"role": self.role, "rank": self.env.rank, "pid": os.getpid(),
                "hostname": socket.gethostname()[:255]}
        if self.role == "server":
            meta["host"] = self.host
        elif self.port:      # a worker's port: its pull relay
            meta.update(host=self.host, port=self.port)
        if self.role == "worker":
            meta["routing_id"] = self.routing_id.hex()
        self.send(P.Kind.REGISTER, meta)
        self._registration = meta
        deadline = time.monotonic() + max(60.0, 4 * self.env.heartbeat_timeout) + 10
        where = f"{self.env.scheduler_host}:{self.env.scheduler_port}"
        try:
            return self._await_topology(deadline, where, self.monitor)
        finally:
            if not self.recover:
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
                if event == zmq.EVENT_DISCONNECTED:
                    self.closed = True     # lost: rejoin if its TOPOLOGY came first,
                    continue               # else register with its restart (below)
                raise JobAborted(
                    f"the scheduler at {where} refused this {self.role}'s connection "
                    f"({zmq.Event(event).name}): it does not hold this job's keys "
                    f"(SSDSGD_SECRET_FILE={self.env.secret_file or 'unset'}, mode "
                    f"{self.guard.mode})")
            if self.closed and not self.sock.poll(0):
                self.closed = False        # the scheduler was lost before the job started
                self._redial()
                self.send(P.Kind.REGISTER, self._registration)
            if self.sock.poll(200):
                try:
                    msg = P.receive(self._received(), max_bytes=0)
                except (P.ProtocolError, sealing.SealError) as e:
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

    def tick(self, progress=None, now_due=False):
        """Send a heartbeat when due, or at once with ``now_due`` (a worker's with
        ``progress()``: its meta, see liveness.py); raise JobAborted when the scheduler
        went silent."""
        now = time.monotonic()
        if now_due or now - self.last_sent >= (PROBE_S if TIMELINE.probing
                                               else self.env.heartbeat_interval):
            meta = progress() if progress else None
            if TIMELINE.on:      # the echo tells the clock offset (ssdsgd/timeline.py)
                meta = dict(meta or {}, sent=time.perf_counter())
            self.send(P.Kind.HEARTBEAT, meta)
        if self.recover:
            self._watch_connection(now)
        elif now - self.last_heard > self.env.heartbeat_timeout:
            raise JobAborted(f"lost the scheduler at {self.env.scheduler_host}:"
                             f"{self.env.scheduler_port}: no answer for "
                             f"{now - self.last_heard:.1f} s")

    # ---- cluster.scheduler_restarts (reregister.py) --------------------------------
    def _watch_connection(self, now):
        """The connection closed or the scheduler went silent: dial again and rejoin;
        no restarted scheduler in time: JobAborted, naming it."""
        if self.rejoining is not None:
            self._drain_monitor()     # the attempts' own drops: ZeroMQ dials again
            lost_at, why = self.rejoining
            if now - lost_at > 2 * wait_seconds(self.env):   # its start, then its wait
                raise JobAborted(
                    f"lost the scheduler at {self.env.scheduler_host}:"
                    f"{self.env.scheduler_port} ({why}) and no restarted scheduler took "
                    f"this {self.role} back within {now - lost_at:.0f} s "
                    f"(cluster.scheduler_restarts={self.env.scheduler_restarts})")
            return
        why = "its connection closed" if self.closed else None
        self.closed = False
        while self.monitor.poll(0):
            if recv_monitor_message(self.monitor)["event"] == zmq.EVENT_DISCONNECTED:
                why = "its connection closed"
        if why is None and now - self.last_heard > self.env.heartbeat_timeout:
            why = f"no answer for {now - self.last_heard:.1f} s"
        if why is not None:
            self._lost(now, why)

    def _drain_monitor(self):
        while self.monitor.poll(0):
            recv_monitor_message(self.monitor)

    def _lost(self, now, why):
        print(f"ssdsgd {self.role} {self.env.rank}: lost the scheduler ({why}); waiting for "
              "the launcher to restart it (cluster.scheduler_restarts)",
              file=sys.stderr, flush=True)
        self.rejoining = (now, why)
        self._redial()
        meta = dict(self._registration, rank=self.topology["rank"], ready=self.ready,
                    passed=self.passed, port=self.port, **self.rejoin_fields())
        self.send(P.Kind.REJOIN, meta)

    def _redial(self):
        """A new connection to the scheduler's address, with a fresh handshake (plain
        mode's is dated and single-use: a reconnect with the old one is refused)."""
        try:
            self.sock.disconnect(self.url)
        except zmq.ZMQError:
            pass
        self.guard.client(self.sock)
        self.sock.connect(self.url)

    def _restart_message(self, msg):
        """Count barrier releases; a restarted scheduler's REJOIN: back in the job."""
        if msg.kind == P.Kind.BARRIER:
            group = msg.meta.get("group", "worker")
            count = self.passed.get(group, [0, 0])[0]
            self.passed[group] = [count + 1, msg.meta.get("value", 0)]
        elif msg.kind == P.Kind.REJOIN and self.rejoining is not None:
            lost_at, why = self.rejoining
            self.rejoining = None
            self._drain_monitor()     # of the connections before this one
            print(f"ssdsgd {self.role} {self.env.rank}: rejoined the job with the "
                  f"restarted scheduler (restart {msg.meta.get('restart')}) "
                  f"{time.monotonic() - lost_at:.1f} s after losing it ({why})",
                  file=sys.stderr, flush=True)
            if self.on_rejoined is not None:
                self.on_rejoined()

    def _received(self):
        """The frames of one message from the scheduler, opened (aesgcm)."""
        return sealing.of(self.sock).open(self.sock.recv_multipart(copy=False))

    def receive(self):
        """Handle one waiting scheduler message; returns it (the caller acts on SHUTDOWN,
        BARRIER, ACK); raises JobAborted on ABORT, or when the scheduler refused what
        this node sent (nothing a node of the job sends should be refused)."""
        try:
            msg = P.receive(self._received(), max_bytes=0)
        except (P.ProtocolError, sealing.SealError) as e:
            raise JobAborted(f"the scheduler sent a malformed message: {e}") from None
        self.last_heard = time.monotonic()
        if msg.kind == P.Kind.HEARTBEAT and {"sent", "time"} <= msg.meta.keys():
            TIMELINE.clock(msg.meta["sent"], time.perf_counter(), msg.meta["time"])
        if msg.kind == P.Kind.ABORT:
            raise JobAborted(f"the job was aborted: {msg.meta.get('reason')}")
        if msg.kind == P.Kind.ERROR:
            raise JobAborted(f"the scheduler refused a message of this {self.role}: "
                             f"{msg.meta.get('error')}")
        if msg.kind in _RESTART_KINDS:
            self._restart_message(msg)
        if msg.kind == P.Kind.LISTEN and "servers" in msg.meta:
            self.ready = True
        return msg
