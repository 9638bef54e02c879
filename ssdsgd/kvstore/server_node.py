"""A server process: the sockets and the loop around a ``server.Server``.

It registers with the scheduler (``scheduler_link``), hands the server the topology, waits
for the job's message limit, binds the ROUTER the workers connect to with it, says where
(LISTEN), then reads: worker messages go to ``Server.handle``, the scheduler's to
``Server.on_scheduler``, and the heartbeats keep going between them. What the server
decides is ``server.py``'s.

The port's message limit is the job's: worker 0's model, within SSDSGD_MAX_MESSAGE_BYTES,
which the scheduler's LISTEN brings (``startup.py``). ZeroMQ gives a listening port the
options it had when bound, so the port is bound once that limit is known, and only
then: a port the server registered and bound again later could be taken by another
process in between.
"""
import zmq

from . import protocol as P
from .env import NodeEnv
from .replies import SNDHWM, Fatal
from .scheduler import bind_router
from .scheduler_link import SchedulerLink
from .server import Server
from .snapshots import Snapshots
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

    def _bind(self, max_bytes):
        self.sock, port = bind_router(zmq.Context.instance(), self.env.node_host, 0,
                                      "a server", self.server.guard, sndhwm=SNDHWM,
                                      rcvhwm=RCVHWM, maxmsgsize=P.frame_limit(max_bytes))
        return port

    def run(self):
        env = self.env
        self.link = SchedulerLink(zmq.Context.instance(), env, "server", env.node_host, None,
                                  self.server.guard)
        topo = self.link.register()
        timeline.start_node(env, "server", topo["rank"])   # if SSDSGD_TIMELINE (timeline.py)
        self.server.start(topo, self.link.sock)
        # cluster.scheduler_restarts: a quorum leader's decisions wait while it is lost
        self.server.scheduler_lost = lambda: self.link.rejoining is not None
        self.link.on_rejoined = self.server.rejoined
        self.server.weights.snapshots = Snapshots.from_env(env, topo["rank"])
        try:
            limit = self._await_limit()
            if limit is None:
                return 0
            port = self._bind(limit)     # the job's limit, before any worker knows the port
            self.server.listen(self.sock, limit)
            self.log(f"listening on {env.node_host}:{port}, messages of up to {limit} data "
                     f"bytes; {self.server.guard.describe()}")
            self.link.send(P.Kind.LISTEN, {"port": port})     # the workers may come
            return self._serve()
        except Fatal as e:   # the scheduler aborts the job, naming this server and why
            self.link.send(P.Kind.FINISH, {"error": str(e)})
            raise

    def _await_limit(self):
        """Heartbeats and the scheduler's messages until it says the job's limit (worker 0
        stated its model, startup.py); None if the job ended first."""
        wait_ms = max(1, int(self.env.heartbeat_interval * 1000 / 2))
        while True:
            if self.link.sock.poll(wait_ms):
                msg = self.link.receive()
                if msg.kind == P.Kind.SHUTDOWN:
                    return None
                if msg.kind == P.Kind.LISTEN:
                    return job_limit(self.env, msg.meta)
                self.server.on_scheduler(msg)
            self.link.tick()

    def _serve(self):
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.link.sock, zmq.POLLIN)
        wait_ms = max(1, int(self.env.heartbeat_interval * 1000 / 2))
        chain = self.server.chain_out     # cluster.server_replicas: 1 (chain.py)
        polled = None                     # its connection to the backup, once made
        while True:
            if chain is not None and chain.sock is not polled:
                if polled is not None:
                    poller.unregister(polled)
                polled = chain.sock
                if polled is not None:
                    poller.register(polled, zmq.POLLIN)
            events = dict(poller.poll(wait_ms))
            if self.link.sock in events:
                msg = self.link.receive()
                if msg.kind == P.Kind.SHUTDOWN:
                    return 0
                if msg.kind == P.Kind.LISTEN and "servers" in msg.meta:
                    self.server.connect_backup(zmq.Context.instance(), msg.meta["servers"])
                else:
                    self.server.on_scheduler(msg)
            if polled is not None and polled in events and chain.sock is polled:
                self.server.from_backup()
            if self.sock in events:
                for _ in range(BURST):   # drain a burst, but keep heartbeats going
                    try:
                        frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self.server.handle(frames)
                    del frames   # a refused message's memory goes back now, not when the
                    # next message arrives (an idle server held a refused 192 MiB message)
            self.server.tick()
            self.link.tick()

    def close(self):
        snapshots = self.server.weights.snapshots
        if snapshots is not None:      # the last weights and the pushes applied
            snapshots.close(self.server.weights.shards)
        chain = self.server.chain_out
        if chain is not None:
            chain.lost()
        for sock in (self.sock, self.link and self.link.sock):
            if sock is not None:
                sock.close(0)
        self.server.guard.close()
        timeline.RECORDER.close()
