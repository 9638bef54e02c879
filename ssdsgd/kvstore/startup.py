"""How a job starts once every node registered (issue 30 item 4): a server binds the port
the workers connect to only once the job's message limit is known, and the workers hear
the servers' addresses only once every server listens with it.

Why this order. ZeroMQ gives a listening port the options it had when bound: MAXMSGSIZE
set afterwards applies to no connection, not even later ones
(tests/test_message_limits.py), so the limit must exist before the bind. The limit is
worker 0's model's (``protocol.message_bound``), and worker 0 may learn its model only
after it joined: MXNet's fit.py creates the store first, for the rank, and hands it to
``mod.fit`` later. Binding a first port to register and then the same port again with
the limit left a moment in which another process could take the server's address.

The steps, each a message:

1. every node gets its TOPOLOGY (ranks; no server listens yet);
2. worker 0 states the largest message it will send (LISTEN ``{max_message}``; an empty
   LISTEN when it knows no model): when it joins with its model, when its store is
   handed one (``Module.fit(kvstore=kv)``, ``gluon.Trainer(kvstore=kv)``), at the latest
   before its first message to a server or its first wait for another worker;
3. every server gets LISTEN ``{max_message_bytes}`` (nothing: SSDSGD_MAX_MESSAGE_BYTES),
   binds a port of its own with that limit and answers LISTEN ``{port}``;
4. once every server listens, every worker gets LISTEN ``{servers, max_message_bytes}``;
   a worker's first message to a server waits for it.

No port is given up and bound again, and no worker connects before the limit exists.
``Startup`` is the scheduler's part, a pure decider (as ``removals.py``): the scheduler
sends what it decides. ``WorkerStart`` is a worker's: the statement and the wait.
"""

from . import protocol as P
from .topology import job_limit, servers


class StartupError(ValueError):
    """A LISTEN that is not the next step of the start."""


class Startup:
    def __init__(self, servers):
        """``servers``: the scheduler's connections of the job's servers."""
        self.limit = None           # worker 0's statement, as the servers get it
        self.waiting = set(servers)     # servers not yet listening

    def on_listen(self, ident, node, meta, nodes):
        """A LISTEN from ``node`` (the scheduler's record of connection ``ident``; ``nodes``:
        all its records): (the role to send LISTEN to, its meta) or None. Worker 0's
        statement goes to the servers as the job's limit; after the last server's port,
        the limit and every server's address go to the workers."""
        if node["role"] == "worker":
            return "server", self._stated(node, meta)
        if self.limit is None or ident not in self.waiting or set(meta) != {"port"}:
            raise StartupError("LISTEN: a server says the port it listens on, once, after "
                               "the scheduler told it the job's message limit")
        node["port"] = meta["port"]
        self.waiting.discard(ident)
        if self.waiting:
            return None
        return "worker", dict(self.limit, servers=servers(nodes))

    def _stated(self, node, meta):
        if node["rank"] != 0:
            raise StartupError("LISTEN: only worker 0 states the job's model (this is "
                               f"worker {node['rank']})")
        if self.limit is not None:
            raise StartupError("LISTEN: worker 0 has stated its model already")
        if set(meta) - {"max_message"}:
            raise StartupError("LISTEN: worker 0 states its largest message "
                               "(max_message), nothing else")
        self.limit = {"max_message_bytes": meta["max_message"]} if meta else {}
        return self.limit


class WorkerStart:
    """A worker's side of the start (``io``: its I/O thread, whose ``listening`` future
    the scheduler's LISTEN resolves, and whose ``topology`` then holds the servers'
    addresses and the job's limit). Worker 0 states its model once; no worker sends a
    server anything before every server listens."""

    def __init__(self, env, rank, io, requests):
        self.env, self.io, self.requests = env, io, requests
        self.stated = rank != 0           # only worker 0's model sets the limit
        # the servers refuse bigger messages, so a worker checks its own against it first
        self.max_message_bytes = self.limit = None

    def declare_model(self, key_bytes):
        """The model is known now (``key_bytes``: the bytes of each key; None: none is).
        Worker 0 states the largest message it will send a server (``message_bound``),
        once: later calls, and other ranks', change nothing. Worker 0 states "no model"
        before its first message to a server or wait for another worker if it was never
        told one, so no worker waits for the servers' addresses for ever."""
        if self.stated:
            return
        self.stated = True
        bound = P.message_bound(key_bytes) if key_bytes else 0
        self.io.send("scheduler", P.control(P.Kind.LISTEN,
                                            {"max_message": bound} if bound else None))

    def await_servers(self):
        """Before a message to a server: once, worker 0 states its model (none, if it was
        never declared) and every worker waits until every server listens."""
        if self.max_message_bytes is not None:
            return
        self.declare_model(None)
        self.requests.wait(self.io.listening)
        self.max_message_bytes = job_limit(self.env, self.io.topology)
        self.limit = None if self.max_message_bytes == self.env.max_message_bytes else (
            f"the job's limit of {self.max_message_bytes} data bytes, set by the model "
            "worker 0 stated before its first message (protocol.message_bound; "
            "docs/reliability.md): a key added since is not in it; hand the store the "
            "whole model first (as gluon.Trainer and Module do)")
