"""sync.pull_relay: chain (docs/spec/pull_relay.md), the worker's part: a server sends a
reply once, in pieces, to the first worker of a chain, and each worker passes every piece
on to the next before it uses it. A transport feature: it moves pieces of replies and
knows no algorithm. The I/O thread owns its sockets."""
import zmq

from . import protocol as P
from . import fragments as F
from .scheduler import JobAborted


def asks_relay(kind, flags):
    """May the reply to this request be relayed (a pull, or a push that pulls)?"""
    return kind == P.Kind.PULL or (kind == P.Kind.PUSH and bool(flags & P.Flag.PULL))


class PullRelay:
    """Pieces of relayed replies: checked, passed on, put back together, delivered.

    ``sock``: the ROUTER other workers relay to (None without the relay); ``send``:
    the I/O thread's sending function (it counts the bytes)."""

    def __init__(self, ctx, env, requests, stats, send, sock=None, guard=None):
        self.ctx, self.env, self.requests, self.stats = ctx, env, requests, stats
        self.send, self.sock, self.guard = send, sock, guard
        self.rank, self.num_workers, self.relays, self.link_id = None, 0, None, None
        self._ranks = {}       # connection id of a worker of the job -> its rank
        self._out = {}         # worker rank -> DEALER to its relay
        self._pieces = {}      # request id -> F.Reassembly of its relayed reply

    def join(self, topology, link_id):
        """The job's workers and their relays, once the scheduler sent the topology."""
        self.rank, self.num_workers = topology["rank"], topology["num_workers"]
        self.relays, self.link_id = topology.get("relays"), link_id
        self._ranks = {bytes.fromhex(h): r for r, h in enumerate(topology.get("workers", []))}

    def receive(self, limit):
        """Replies another worker of the job passes on (at most ``limit`` a call). Only the job's processes can
        connect (the guard); a message from one of them that is not a server's reply to a
        request this worker sent to that server is a fault of the job: it aborts."""
        for _ in range(limit):
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident, frames = frames[0].bytes, frames[1:]
            rank = self._ranks.get(ident)
            if rank is None or self.guard.wrong_claim(frames[0], "worker", rank):
                continue         # not a worker of this job (a reconnect or a stranger)
            self.stats["messages_received"] += 1
            self.stats["bytes_received"] += sum(len(f.buffer) for f in frames)
            self.stats["replies_relayed_in"] += 1
            try:
                msg = P.decode(frames, max_bytes=self.env.max_message_bytes)
                P.check_meta(msg.kind, msg.meta)
            except P.ProtocolError as e:
                raise JobAborted(f"worker {rank} relayed a malformed message: {e}") from None
            if msg.kind != P.Kind.FRAGMENT:
                raise JobAborted(f"worker {rank} relayed a {msg.kind.name}; only pieces of "
                                 "a server's reply are relayed")
            self.on_fragment(frames, msg, msg.sender, f"worker {rank}")

    def on_fragment(self, frames, msg, server, source):
        """A piece of a relayed reply: passed on first, then added to its reply; the
        reply is delivered once its last piece is in. Only pieces of a reply to a request
        this worker sent to that server are taken (bounded: one buffer per request)."""
        expected, bound = self.requests.sent_to(msg.req)
        if expected is None or expected != msg.sender:
            raise JobAborted(f"{source} sent a piece of server {msg.sender}'s reply to "
                             f"request {msg.req}, which this worker did not send to that "
                             "server")
        if msg.meta.get("relay"):
            self._forward(frames, msg)
        try:
            part = self._pieces.get(msg.req)
            if part is None:
                part = self._pieces[msg.req] = F.Reassembly(
                    msg, min(bound, self.env.max_message_bytes))
            whole = part.add(msg, frames[3:])
            if whole is None:
                return
            del self._pieces[msg.req]
            reply = P.decode(whole, max_bytes=self.env.max_message_bytes)
            P.check_meta(reply.kind, reply.meta)
        except P.ProtocolError as e:
            raise JobAborted(f"{source} sent a malformed piece of a reply: {e}") from None
        if reply.kind != P.Kind.REPLY or reply.sender != msg.sender:
            raise JobAborted(f"{source} relayed a {reply.kind.name} of server {reply.sender} "
                             f"as server {msg.sender}'s reply")
        reply.req = msg.req        # the pieces' request id is this worker's
        self.requests.deliver(reply, server)

    def _forward(self, frames, msg):
        """Pass a piece of a relayed reply on to the next worker of its chain, before
        using it."""
        (rank, req), rest = msg.meta["relay"][0], msg.meta["relay"][1:]
        if rank == self.rank or rank >= self.num_workers or not self.relays \
                or self.relays[rank] is None:
            raise JobAborted(f"server {msg.sender} asked this worker to relay its reply to "
                             f"worker {rank}, which has no pull relay")
        sock = self._out.get(rank)
        if sock is None:
            sock = self._out[rank] = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, int(self.env.heartbeat_timeout * 1000))
            sock.setsockopt(zmq.ROUTING_ID, self.link_id)
            if self.guard is not None:
                self.guard.client(sock, f"worker {rank}")
            host, port = self.relays[rank]
            sock.connect(f"tcp://{host}:{port}")
        meta = {k: v for k, v in msg.meta.items() if k != "relay"}
        if rest:
            meta["relay"] = rest
        self.send(sock, F.forward(frames, req, meta))
        self.stats["replies_relayed_out"] += 1

    def close(self):
        for s in self._out.values():
            s.close()   # LINGER flushes what is passed on (bounded by the heartbeat timeout)
        if self.sock is not None:
            self.sock.close(0)
        if self.guard is not None:
            self.guard.close()
