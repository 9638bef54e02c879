"""sync.pull_relay: chain (docs/spec/pull_relay.md), the worker's part: a server sends a
reply once, in pieces, to the first worker of a chain, and each worker passes every piece
on to the next before it uses it. A piece that came through another worker is checked
against the digests the server sent this worker itself (``piece_digests``) before it is
used or passed on. A transport feature: it moves pieces of replies and knows no
algorithm. The I/O thread owns its sockets."""
import sys
import time

import numpy as np
import zmq

from . import protocol as P, sealing
from . import fragments as F
from . import piece_digests as D
from .topology import relay_address
from .scheduler import JobAborted
from ..timeline import RECORDER as TIMELINE


class RelayFault(JobAborted):
    """A fault this worker found in a relayed piece or its digests: the job's own
    processes misbehave. The I/O thread tells the scheduler before it stops, so every
    node names it (docs/spec/pull_relay.md)."""


def asks_relay(kind, flags):
    """May the reply to this request be relayed (a pull, or a push that pulls)?"""
    return kind == P.Kind.PULL or (kind == P.Kind.PUSH and bool(flags & P.Flag.PULL))


class PullRelay:
    """Pieces of relayed replies: checked, passed on, put back together, delivered.

    ``sock``: the ROUTER other workers relay to (None without the relay); ``send``:
    the I/O thread's sending function (it counts the bytes)."""

    def __init__(self, ctx, env, requests, stats, send, sock=None, guard=None, deliver=None):
        self.ctx, self.env, self.requests, self.stats = ctx, env, requests, stats
        self.deliver = deliver or requests.deliver    # a whole reply, as the server's are
        self.send, self.sock, self.guard = send, sock, guard
        self.rank, self.num_workers, self.relays, self.link_id = None, 0, None, None
        self._ranks = {}       # connection id of a worker of the job -> its rank
        self._out = {}         # worker rank -> DEALER to its relay
        self._pieces = {}      # request id -> F.Reassembly of its relayed reply
        self._checks = {}      # request id -> D.Expected: the server's digests, held pieces

    def join(self, topology, link_id):
        """The job's workers and their relays, once the scheduler sent the topology."""
        self.rank, self.num_workers = topology["rank"], topology["num_workers"]
        if self.env.tamper_relay == self.rank and self.sock is not None:
            print(f"ssdsgd worker {self.rank}: SSDSGD_TAMPER_RELAY={self.rank}: this worker "
                  "alters every piece it relays (a test's fault injection, never for a real "
                  "job)", file=sys.stderr, flush=True)
        if self.env.drop_relay == self.rank and self.sock is not None:
            print(f"ssdsgd worker {self.rank}: SSDSGD_DROP_RELAY={self.rank}: this worker "
                  "passes on nothing it should relay (a test's fault injection, never for a "
                  "real job)", file=sys.stderr, flush=True)
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
            try:
                frames = sealing.of(self.sock).open(frames)
            except sealing.SealError as e:
                raise RelayFault(f"a relayed message does not open: {e}") from None
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
                raise RelayFault(f"worker {rank} relayed a malformed message: {e}") from None
            if msg.kind != P.Kind.FRAGMENT:
                raise RelayFault(f"worker {rank} relayed a {msg.kind.name}; only pieces of "
                                 "a server's reply are relayed")
            self.on_fragment(frames, msg, msg.sender, f"worker {rank}", relayer=rank)

    def on_fragment(self, frames, msg, server, source, relayer=None):
        """A piece of a relayed reply, from its server (``relayer`` None: taken as it
        comes) or passed on by worker ``relayer`` (taken once it matches the server's
        digest; held until the digests are in). Only pieces of a reply to a request this
        worker sent to that server are taken (bounded: one buffer per request)."""
        expected, bound, keys = self.requests.sent_to(msg.req)
        if expected is None or expected != msg.sender:
            raise RelayFault(f"{source} sent a piece of server {msg.sender}'s reply to "
                             f"request {msg.req}, which this worker did not send to that "
                             "server")
        if relayer is None:
            return self._take(frames, msg, server, source, msg.meta.get("relay"), bound)
        check = self._check(msg.req, msg.sender, bound, keys)
        try:
            held = check.hold(frames, msg, relayer)
        except P.ProtocolError as e:
            raise RelayFault(str(e)) from None
        self._release(check, held, server, bound)

    def on_digest(self, msg, server):
        """Server ``server``'s digests of the pieces of its reply to request ``msg.req``
        that reach this worker through another: the pieces held for them are checked and
        taken."""
        expected, bound, keys = self.requests.sent_to(msg.req)
        if expected is None or expected != server:
            raise RelayFault(f"server {server} sent the digests of its reply to request "
                             f"{msg.req}, which this worker did not send to it or has had "
                             "answered")
        check = self._check(msg.req, server, bound, keys)
        try:
            held = check.given(msg)
        except P.ProtocolError as e:
            raise RelayFault(str(e)) from None
        self._release(check, held, server, bound)

    def overdue(self):
        """Stop the job, naming the worker, if one holds up pieces this worker waits for
        (``Expected.overdue``). The bound is a heartbeat interval longer than a silent
        node's, so a worker that died or hangs is named by its heartbeats first."""
        for check in self._checks.values():
            error = check.overdue(self.env.heartbeat_timeout + self.env.heartbeat_interval)
            if error:
                raise RelayFault(error)

    def _check(self, req, server, bound, keys):
        """The digests' check of request ``req``'s relayed reply (one per request this
        worker sent and has not had answered)."""
        check = self._checks.get(req)
        if check is None:
            check = self._checks[req] = D.Expected(
                server, min(bound, self.env.max_message_bytes), keys)
        return check

    def _release(self, check, pieces, server, bound):
        """Check ``pieces`` (in order) against ``check``, their server's digests, and
        take those that match; a mismatch names the worker that passed the piece on."""
        for frames, msg, relayer in pieces:
            t0 = time.perf_counter()
            error = check.mismatch(msg, frames[3:], relayer)
            TIMELINE.span("digest", t0)
            self.stats["digest_s"] += time.perf_counter() - t0
            if error:
                raise RelayFault(error)
            if check.done:
                self._checks.pop(msg.req, None)
            self._take(frames, msg, server, f"worker {relayer}", check.relay, bound)

    def _take(self, frames, msg, server, source, relay, bound):
        """A piece known to be its server's: passed on first (to ``relay``'s first
        worker), then added to its reply; the reply is delivered once its last piece is
        in."""
        if relay:
            self._forward(frames, msg, relay)
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
            raise RelayFault(f"{source} sent a malformed piece of a reply: {e}") from None
        if reply.kind != P.Kind.REPLY or reply.sender != msg.sender:
            raise RelayFault(f"{source} relayed a {reply.kind.name} of server {reply.sender} "
                             f"as server {msg.sender}'s reply")
        reply.req = msg.req        # the pieces' request id is this worker's
        self.deliver(reply, server)

    def _forward(self, frames, msg, relay):
        """Pass a piece of a relayed reply on to the next worker of its chain ``relay``,
        before using it."""
        (rank, req), rest = relay[0], relay[1:]
        address = relay_address(self.relays, rank)
        if rank == self.rank or address is None:
            raise RelayFault(f"server {msg.sender} asked this worker to relay its reply to "
                             f"worker {rank}, which has no pull relay")
        sock = self._out.get(rank)
        if sock is None:
            sock = self._out[rank] = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, int(self.env.heartbeat_timeout * 1000))
            sock.setsockopt(zmq.ROUTING_ID, self.link_id)
            if self.guard is not None:
                self.guard.client(sock, f"worker {rank}")
            host, port = address
            sock.connect(f"tcp://{host}:{port}")
        meta = {k: v for k, v in msg.meta.items() if k != "relay"}
        if rest:
            meta["relay"] = rest
        out = F.forward(frames, req, meta)
        if self.env.tamper_relay == self.rank:      # TEST ONLY: a forged relay
            out = _tampered(out)
        if self.env.drop_relay == self.rank:        # TEST ONLY: a relay that holds it up
            return
        self.send(sock, out)
        self.stats["replies_relayed_out"] += 1

    def close(self):
        for s in self._out.values():
            s.close()   # LINGER flushes what is passed on (bounded by the heartbeat timeout)
        if self.sock is not None:
            self.sock.close(0)
        if self.guard is not None:
            self.guard.close()


def _tampered(frames):
    """TEST ONLY (``SSDSGD_TAMPER_RELAY``): a piece as a worker that alters what it
    relays would pass it on: the top bit of every 4th byte of its last data frame flipped
    (the signs of float32 weights that start there). The next worker must refuse it."""
    last = np.frombuffer(P.frame_buffer(frames[-1]), np.uint8).copy()
    last[3::4] ^= 0x80
    return list(frames[:-1]) + [last.tobytes()]
