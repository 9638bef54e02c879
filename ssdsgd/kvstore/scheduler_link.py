"""A node's side of the conversation with the scheduler (``scheduler.py``): register,
heartbeats, barriers, finish."""
import os
import socket
import sys
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from . import protocol as P
from .env import NodeEnv
from .scheduler import JobAborted
from .security import Guard
from ..timeline import PROBE_S, RECORDER as TIMELINE

_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


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

    def tick(self, progress=None):
        """Send a heartbeat when due (a worker's with ``progress()``: its meta, see
        liveness.py); raise JobAborted when the scheduler went silent."""
        now = time.monotonic()
        if now - self.last_sent >= (PROBE_S if TIMELINE.probing else self.env.heartbeat_interval):
            meta = progress() if progress else None
            if TIMELINE.on:      # the echo tells the clock offset (ssdsgd/timeline.py)
                meta = dict(meta or {}, sent=time.perf_counter())
            self.send(P.Kind.HEARTBEAT, meta)
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
        if msg.kind == P.Kind.HEARTBEAT and {"sent", "time"} <= msg.meta.keys():
            TIMELINE.clock(msg.meta["sent"], time.perf_counter(), msg.meta["time"])
        if msg.kind == P.Kind.ABORT:
            raise JobAborted(f"the job was aborted: {msg.meta.get('reason')}")
        if msg.kind == P.Kind.ERROR:
            raise JobAborted(f"the scheduler refused a message of this {self.role}: "
                             f"{msg.meta.get('error')}")
        return msg
