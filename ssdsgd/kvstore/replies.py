"""A server's replies: assembled key by key as each key's values are ready, sent without
ever waiting, lending the weights' own buffers to ZeroMQ.

A reply carries a view of a key's weights, not a copy; before the weights change
(``reclaim``) the replies not sent yet take a copy, and a buffer ZeroMQ is still sending
is retired (kept until the send is done) while the key moves to a fresh one -- the loop
never waits on a peer. What one worker can make the server hold is bounded: its waiting
requests (``reply_bound``) and its messages ZeroMQ has not sent (``unsent_bound``); a
worker that stops reading fails the job, saying so.
"""
import numpy as np
import zmq

from . import protocol as P, sealing
from . import fragments as F
from . import piece_digests as D
from .scheduler import JobAborted
from ..timeline import RECORDER as TIMELINE, now, traced

SNDHWM = 10_000          # replies queued for one peer before it counts as not reading


class RequestError(ValueError):
    """A well-formed message the server cannot accept (unknown key, stale step, ...)."""


class Fatal(JobAborted):
    """The job cannot go on (a worker stopped reading); the server tells the scheduler."""


class Peer:
    """A worker's connection: its rank, its requests waiting for a step, its replies that
    ZeroMQ has not finished sending, its INITs waiting for rank 0's values."""
    __slots__ = ("rank", "open", "inflight", "inits")

    def __init__(self, rank):
        self.rank, self.open, self.inflight, self.inits = rank, 0, [], 0


class Reply:
    """A reply being assembled: values snapshotted per key as their step is applied.
    ``shards[i]`` is the key of slot i."""
    __slots__ = ("ident", "req", "shards", "records", "parts", "missing", "with_state", "lr",
                 "tracker", "peer", "relay", "received", "policy", "held", "wanted",
                 "needs")

    def __init__(self, ident, req, shards, with_state, peer, relay=False):
        n = len(shards)
        self.ident, self.req, self.with_state, self.relay = ident, req, with_state, relay
        self.shards = shards
        self.records, self.parts, self.missing, self.lr = [None] * n, [None] * n, n, None
        self.tracker = None       # set once sent: ZeroMQ is done with the buffers when done
        self.peer = peer
        peer.open += 1
        self.received = now()     # the timeline's queue span (Replies.sent)
        self.policy = None        # the policy's fields for this reply's meta (``note``)
        self.held = False         # a backup's reply to a copy: kept, not sent (backup.py)
        self.wanted = ()
        self.needs = []           # (key, version) of its weights (chain.py's owner waits)


class Replies:
    """Sending replies and lending them the weights (``weights``: the server's
    ``Weights``), for one ROUTER socket whose workers are ``peers``."""

    def __init__(self, sock, weights, env, log):
        self.sock, self.weights, self.env, self.log = sock, weights, env, log
        self.rank = -1
        self.peers = {}         # connection id -> Peer, from the scheduler's topology
        self.steps_ahead = 1    # the policy's steps-ahead bound, once it is chosen
        self.unread = 0         # replies dropped because a stranger's queue was full
        self.retired = []       # (old weight NDArray, trackers of replies still sending it)
        self._snapshots = {}    # (key, version) -> weights copied for replies, per message
        self._encoded = {}      # a reply's records and lr -> its encoded frames, per message
        # every join and departure decided, {"joins" | "leaves": [[rank, from_step],
        # ...]}: on every reply sent from then on, which is how the workers hear of it in
        # time (docs/spec/membership.md rule 6; a new object per change, so encoded
        # replies differ)
        self.changes = None
        self._relayed = []      # complete replies that may travel through a chain of workers
        self.hold = None        # takes the complete held replies (backup.Backup.hold)
        # cluster.server_replicas: 1: takes a complete reply whose weights' step its
        # backup has not acknowledged yet (chain.ChainOwner.must_wait); None: none waits
        self.gate = None
        self.lr_of = None       # the same: the lr a reply of a shard carries (server.py)

    # ---- sending -------------------------------------------------------------------
    @traced("send")
    def send(self, ident, msg):
        """Send without ever waiting: a worker whose queue is full does not read (the job
        cannot go on without it: Fatal); a stranger's reply is dropped. ``msg``: a Message
        or its encoded frames."""
        peer = self.peers.get(ident)
        frames = msg if isinstance(msg, list) else P.encode(msg)
        try:
            tracker = self.sock.send_multipart(
                [ident] + sealing.of(self.sock).seal(ident, frames), copy=False, track=True,
                flags=zmq.NOBLOCK)
        except zmq.Again:
            if peer is not None:
                raise Fatal(f"worker {peer.rank} does not read its replies ({SNDHWM} queued); "
                            "stopping the job") from None
            self.unread += 1
            if self.unread in (1, 10) or self.unread % 10_000 == 0:
                self.log(f"dropped {self.unread} replies so far to peers that do not read them "
                         f"({SNDHWM} queued; not nodes of this job)")
            return None
        except zmq.ZMQError as e:
            self.log(f"could not reply to {'worker %d' % peer.rank if peer else 'a peer'} "
                     f"(it left?): {e.strerror}")
            return None
        if peer is not None:
            peer.inflight = [t for t in peer.inflight if not t.done]
            peer.inflight.append(tracker)
            if len(peer.inflight) > self.unsent_bound():
                raise Fatal(f"worker {peer.rank} does not read its replies ("
                            f"{len(peer.inflight)} unsent); stopping the job")
        return tracker

    def gone(self, rank):
        """Worker ``rank`` left or leaves: its connection keeps no buffers for replies."""
        for ident, peer in self.peers.items():
            if peer.rank == rank:
                sealing.of(self.sock).release(ident)

    @staticmethod
    def sent(reply):
        """The timeline's ``queue`` span of a request: from its handling to its reply, the
        time the server held it (waiting for the other workers' pushes, applying)."""
        if TIMELINE.on:
            TIMELINE.span("queue", reply.received, lane=f"queue w{reply.peer.rank}",
                          key="req", value=reply.req)

    def empty(self, ident, req, kind=P.Kind.REPLY):
        """A reply (or ACK) without keys."""
        self.send(ident, P.Message(kind, sender=self.rank, req=req))

    def reply_bound(self):
        """Replies a worker can legitimately have outstanding: for every step it may be
        ahead, every chunk of a step's exchange, or one request per key (a script calling
        ``kv.pushpull`` key by key has every key in flight, as with ps-lite); plus a margin."""
        chunks = 1 + self.weights.model_bytes // max(1, self.env.chunk_bytes)
        return (self.steps_ahead + 2) * (chunks + 1 + len(self.weights.shards)) + 64

    def unsent_bound(self):
        """Messages to one worker that ZeroMQ may still be sending: its replies, and the
        pieces of relayed replies (up to FRAGMENT_SHARE + 1 per reply, or one per
        FRAGMENT_MAX bytes of weights and state; docs/spec/pull_relay.md)."""
        model_bytes = self.weights.model_bytes
        chunks = 1 + model_bytes // max(1, self.env.chunk_bytes)
        pieces = chunks * (F.FRAGMENT_SHARE + 1) + 2 * model_bytes // F.FRAGMENT_MAX
        return self.reply_bound() + (self.steps_ahead + 2) * pieces

    # ---- assembling ----------------------------------------------------------------
    def new(self, ident, req, shards, with_state, relay=False):
        """A reply to worker ``ident``'s request ``req`` for ``shards``, if it may have
        one more waiting."""
        peer = self.peers[ident]
        if peer.open >= self.reply_bound():
            raise RequestError(f"{peer.open} requests of worker {peer.rank} are already "
                               f"waiting; a worker has at most {self.reply_bound()}")
        return Reply(ident, req, shards, with_state, peer, relay=relay)

    @staticmethod
    def release(reply):
        """A reply that will never be answered (its request was refused)."""
        reply.peer.open -= 1

    def answer(self, reply, slot):
        """Slot ``slot`` of ``reply`` (None: every slot) gets its key's weights as now."""
        if slot is not None:
            return self._snapshot(reply, slot, reply.shards[slot])
        if not reply.shards:
            reply.peer.open -= 1
            policy = self._policy(reply)
            self.send(reply.ident, P.Message(P.Kind.REPLY, sender=self.rank, req=reply.req,
                                             meta=None if policy is None else
                                             {"policy": policy}))
        for i, shard in enumerate(reply.shards):
            self._snapshot(reply, i, shard)

    def _policy(self, reply):
        """The ``policy`` meta of ``reply``: the policy's note and the membership changes
        decided."""
        if self.changes is None:
            return reply.policy
        return self.changes if reply.policy is None else dict(reply.policy, **self.changes)

    def announce(self, rank, from_step, field):
        """Worker ``rank`` joins (``field`` ``joins``) or leaves (``leaves``) from
        ``from_step``: every reply from now on says so."""
        changes = dict(self.changes or {})
        changes[field] = changes.get(field, []) + [[rank, from_step]]
        self.changes = changes

    @staticmethod
    def note(reply, fields):
        """``reply`` carries the policy's ``fields`` (a JSON object) as its ``policy`` meta."""
        reply.policy = fields

    def fill(self, reply, slot, step, value):
        """Slot ``slot`` of ``reply`` gets ``value`` (a group's average), stamped ``step``."""
        shard = reply.shards[slot]
        reply.records[slot] = (shard.key, step, shard.offset, shard.count, shard.dtype, 1)
        reply.parts[slot] = [value]
        reply.missing -= 1
        self._send_when_complete(reply)

    def _snapshot(self, reply, i, shard):
        # Every worker waiting on the same step gets the same view of the weights.
        value = self._snapshots.get((shard.key, shard.version))
        if value is None:    # an update leaves no MXNet work pending: the buffer is settled
            value = shard.weight_view()
            self._snapshots[(shard.key, shard.version)] = value
        shard.lent.append((reply, i))
        if self.gate is not None:
            reply.needs.append((shard.key, shard.version))
        arrays = [value]
        if reply.with_state:   # copied once per step, however many workers ask for it
            state = self._snapshots.get((shard.key, shard.version, "state"))
            if state is None:
                state = self._snapshots[(shard.key, shard.version, "state")] = \
                    self.weights.state_arrays(shard)
            arrays += state
        reply.records[i] = (shard.key, self.weights.update_count(shard), shard.offset,
                            shard.count, shard.dtype, len(arrays))
        reply.parts[i] = arrays
        reply.missing -= 1
        lr = self.weights.learning_rate() if self.lr_of is None else self.lr_of(shard)
        if lr is not None:
            reply.lr = lr
        self._send_when_complete(reply)

    def _send_when_complete(self, reply):
        """Send ``reply`` once every one of its keys has its values. The N workers of a
        step ask for the same keys at the same step: their replies are encoded once (the
        records name the update count, so equal records mean equal values within one
        message's handling) and differ only in the header's request id."""
        if reply.missing != 0:
            return
        reply.peer.open -= 1
        if reply.held:
            if self.hold(reply):
                return
            reply.held = False     # its owner died since the copy came: answered here
        if self.gate is not None and self.gate(reply):
            return
        self.dispatch(reply)

    def dispatch(self, reply):
        """Send complete ``reply`` (or keep it for its relay chain)."""
        if reply.relay:
            self._relayed.append(reply)
            return
        sig = (tuple(reply.records), reply.lr, id(reply.policy), id(self.changes))
        body = self._encoded.get(sig)
        if body is None:
            meta = {"lr": reply.lr} if reply.lr is not None else {}
            policy = self._policy(reply)
            if policy is not None:
                meta["policy"] = policy
            body = P.encode(P.Message(
                P.Kind.REPLY, sender=self.rank, req=reply.req,
                records=P.make_records(reply.records), tensors=reply.parts,
                meta=meta or None))
            self._encoded[sig] = body
        reply.tracker = self.send(reply.ident, P.readdress(body, reply.req))
        self.sent(reply)
        if reply.tracker is None:          # not sent: nothing reads the views any more
            reply.tracker = zmq.MessageTracker()

    def forget(self):
        """After a message: the next may change the weights the snapshots view."""
        self._send_relayed()
        self._snapshots.clear()
        self._encoded.clear()

    def _send_relayed(self):
        """sync.pull_relay: chain (docs/spec/pull_relay.md). The replies that one message
        completed and that carry the same records, lr and policy field go out once, to the
        lowest rank of them, with the rest of the chain: [[rank, request id], ...] in rank
        order. Each worker forwards it to the next, so this server's link carries one copy,
        not N. It travels as FRAGMENT messages (the REPLY's frames cut into pieces, its own
        request id 0): a hop passes each piece on as it arrives, so the chain pipelines."""
        groups = {}
        for reply in self._relayed:
            # the signature of a direct reply's bytes (_send_when_complete): a relayed
            # reply carries the membership changes decided, as a direct one does
            sig = (tuple(reply.records), reply.lr, id(reply.policy), id(self.changes))
            groups.setdefault(sig, []).append(reply)
        self._relayed = []
        for (records, lr, _, _), replies in groups.items():
            replies.sort(key=lambda r: r.peer.rank)
            meta = {"lr": lr} if lr is not None else {}
            policy = self._policy(replies[0])
            if policy is not None:
                meta["policy"] = policy
            chain = [[r.peer.rank, r.req] for r in replies[1:]] or None
            head = replies[0]
            body = P.encode(P.Message(
                P.Kind.REPLY, sender=self.rank, req=head.req if chain is None else 0,
                records=P.make_records(records), tensors=head.parts, meta=meta or None))
            if chain is None:
                pieces = [body]
            else:      # in pieces, so that each hop passes on the first while the rest come
                pieces = F.fragments(body, head.req, self.rank, {"relay": chain})
                self._send_digests(pieces, replies)
            trackers = [t for t in (self.send(head.ident, p) for p in pieces) if t is not None]
            tracker = zmq.MessageTracker(*trackers)
            for reply in replies:     # every reply's views are lent until these are sent
                reply.tracker = tracker
                self.sent(reply)

    @traced("digest")
    def _send_digests(self, pieces, replies):
        """Every worker of a chain but the first gets the reply's pieces through another
        worker: this server sends it, on its own connection, the digests of the pieces and
        the rest of the chain after it, so it can refuse a piece altered on the way, and the
        worker that passes the pieces on to it, so it can name that worker if they stop
        coming (``piece_digests``; docs/spec/pull_relay.md). Sent before the pieces."""
        digests = D.of_pieces(pieces)
        for i, reply in enumerate(replies[1:], 2):
            meta = {"digests": digests, "from": replies[i - 2].peer.rank}
            if i < len(replies):
                meta["relay"] = [[r.peer.rank, r.req] for r in replies[i:]]
            self.send(reply.ident, P.Message(P.Kind.DIGEST, sender=self.rank, req=reply.req,
                                             meta=meta))

    # ---- lending -------------------------------------------------------------------
    def reclaim(self, shard):
        """Before ``shard.weight`` changes: replies holding a view of it take a copy (not
        sent yet), one copy for all that hold the same view (``lend`` lends one snapshot
        per version: N workers' pulls of a step share it); if ZeroMQ is still sending one,
        the shard moves to a fresh copy and the old buffer is kept until the send is
        done."""
        busy, copies = [], {}
        for reply, i in shard.lent:
            if reply.held or reply.tracker is None:    # a backup's held replies too
                view = reply.parts[i][0]
                copy = copies.get(id(view))
                if copy is None:
                    copy = copies[id(view)] = (view, np.array(view))   # keeps view alive
                reply.parts[i][0] = copy[1]
            elif not reply.tracker.done:
                busy.append(reply.tracker)
        shard.lent.clear()
        if busy:
            self.retired.append((shard.weight, busy))
            shard.weight = shard.weight.copy()

    def prune_retired(self):
        self.retired = [(w, ts) for w, ts in self.retired if not all(t.done for t in ts)]
