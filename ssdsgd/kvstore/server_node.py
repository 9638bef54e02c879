"""A server process: the sockets and the loop around a ``server.Server``.

It binds the ROUTER the workers connect to, registers with the scheduler
(``scheduler_link``), hands the server the topology and both sockets, then reads: worker
messages go to ``Server.handle``, the scheduler's to ``Server.on_scheduler``, and the
heartbeats keep going between them. What the server decides is ``server.py``'s.

The port's message limit is the job's, which the topology brings (worker 0's model, within
SSDSGD_MAX_MESSAGE_BYTES). ZeroMQ gives a listening port the options it had when bound,
so the port is bound twice: first with the limit of control messages, to register its
address (no worker knows it yet), then, once the topology came, again on the same address
with the job's limit; a BARRIER of group server tells the scheduler, which only then sends
the workers the servers' addresses.
"""
import time

import zmq

from . import protocol as P
from .env import NodeEnv
from .replies import SNDHWM, Fatal
from .scheduler import JobAborted, bind_router
from .scheduler_link import SchedulerLink
from .server import Server
from .topology import job_limit
from .. import timeline

RCVHWM = 1_000           # messages read ahead from one peer (then TCP pushes back)
BURST = 64               # worker messages read in a row before the heartbeats' turn


class ServerNode:
    """``make_policy(env, rank)``: the server's synchronization policy (``Server``).
    Construction takes no network action; ``run`` does."""

    def __init__(self, env: NodeEnv, make_policy, log=None):
        self.env = env
        self.server = Server(env, make_policy, log)
        self.sock = self.link = None

    def log(self, text):
        self.server.log(text)

    def _bind(self, port, max_bytes):
        self.sock, port = bind_router(zmq.Context.instance(), self.env.node_host, port,
                                      "a server", self.server.guard, sndhwm=SNDHWM,
                                      rcvhwm=RCVHWM, maxmsgsize=P.frame_limit(max_bytes))
        return port

    def _rebind(self, port, max_bytes, timeout=5.0):
        """The same port again, with the job's limit (the old socket's close is
        asynchronous: the address may be busy for a moment)."""
        self.sock.close(0)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._bind(port, max_bytes)
            except JobAborted:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def run(self):
        env = self.env
        port = self._bind(0, 0)      # control messages only, until the job's limit is known
        self.link = SchedulerLink(zmq.Context.instance(), env, "server", env.node_host, port,
                                  self.server.guard)
        topo = self.link.register()
        timeline.start_node(env, "server", topo["rank"])   # if SSDSGD_TIMELINE (timeline.py)
        limit = job_limit(env, topo)
        self._rebind(port, limit)
        self.log(f"listening on {env.node_host}:{port}, messages of up to {limit} data "
                 f"bytes; {self.server.guard.describe()}")
        self.server.start(topo, self.sock, self.link.sock)
        self.link.send(P.Kind.BARRIER, {"group": "server"})    # listening: workers may come
        try:
            return self._serve()
        except Fatal as e:   # the scheduler aborts the job, naming this server and why
            self.link.send(P.Kind.FINISH, {"error": str(e)})
            raise

    def _serve(self):
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.link.sock, zmq.POLLIN)
        wait_ms = max(1, int(self.env.heartbeat_interval * 1000 / 2))
        while True:
            events = dict(poller.poll(wait_ms))
            if self.link.sock in events:
                msg = self.link.receive()
                if msg.kind == P.Kind.SHUTDOWN:
                    return 0
                self.server.on_scheduler(msg)
            if self.sock in events:
                for _ in range(BURST):   # drain a burst, but keep heartbeats going
                    try:
                        frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self.server.handle(frames)
            self.server.tick()
            self.link.tick()

    def close(self):
        for sock in (self.sock, self.link and self.link.sock):
            if sock is not None:
                sock.close(0)
        self.server.guard.close()
        timeline.RECORDER.close()
