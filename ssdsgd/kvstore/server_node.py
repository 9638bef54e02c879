"""A server process: the sockets and the loop around a ``server.Server``.

It binds the ROUTER the workers connect to, registers with the scheduler
(``scheduler_link``), hands the server the topology and both sockets, then reads: worker
messages go to ``Server.handle``, the scheduler's to ``Server.on_scheduler``, and the
heartbeats keep going between them. What the server decides is ``server.py``'s.
"""
import zmq

from . import protocol as P
from .env import NodeEnv
from .replies import SNDHWM, Fatal
from .scheduler import bind_router
from .scheduler_link import SchedulerLink
from .server import Server

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

    def _listen(self):
        env, guard = self.env, self.server.guard
        self.sock, port = bind_router(zmq.Context.instance(), env.node_host, 0, "a server",
                                      guard, sndhwm=SNDHWM, rcvhwm=RCVHWM,
                                      maxmsgsize=P.frame_limit(env.max_message_bytes))
        self.log(f"listening on {env.node_host}:{port}; {guard.describe()}")
        return port

    def run(self):
        port = self._listen()
        self.link = SchedulerLink(zmq.Context.instance(), self.env, "server",
                                  self.env.node_host, port, self.server.guard)
        self.server.start(self.link.register(), self.sock, self.link.sock)
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
