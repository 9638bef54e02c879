"""A parameter server: owns a shard of the keys, aggregates each step, applies the optimizer.

Synchronous modes (``ssgd``, ``ssd``): for every key and step the server waits for the
gradients of all N workers, sums them in rank order (never arrival order, so runs are
reproducible) and applies MXNet's optimizer once -- ``dist_sync``'s semantics, which the
spec's global update is. A reply "as of step t" is a snapshot taken the moment step t is
applied, so it is exactly w_G(t) however far other workers have run ahead.

``asgd``: every push is applied on arrival (``dist_async``'s semantics).

With a quorum (``sync.quorum`` below N, docs/spec/quorum.md) a round closes on Q workers'
pushes instead: ``ssdsgd.sync.rounds`` decides (server 0, relayed to the others by the
scheduler) and this module executes its decisions: sum a round's pushes in rank order,
apply the optimizer once, answer the replies it releases.

One thread, one ROUTER socket: a malformed or inconsistent message is answered with an
ERROR naming the problem (and its request id) and the server keeps serving. Only the job's
workers are served, each on the connection it registered (the scheduler says which
connection id is which rank), and only as that rank. The loop never blocks on one peer:
replies are sent without waiting, and what one worker can make the server hold is bounded
by the model's size and the staleness the algorithm allows (``Limits``). A worker that
stops reading its replies fails the job, saying so.
"""
import sys

import mxnet as mx
import numpy as np
import zmq

from ..mxglue import hostcopy
from ..mxglue.update_groups import sgd_call, size_groups
from ..mxglue.batch_schedule import GlobalBatchSchedule
from .compression import Compression, CompressionError, Packed2bit, sum_2bit, summable
from . import protocol as P
from .env import NodeEnv
from ..sync.groups import mean
from ..mxglue.optimizer_spec import OptimizerSpecError, build, describe, flatten_state, unflatten_state
from ..sync.rounds import RoundError, Rounds
from .scheduler import JobAborted, Rejections, SchedulerLink, bind_router
from .security import Guard
from ..settings import quorum_size
from ..sync.stage import steps_ahead_bound

AGGREGATE_KEYS = 45      # keys per multi-tensor optimizer call (MXNet's kernels take <= 45)
SNDHWM = 10_000          # replies queued for one peer before it counts as not reading
RCVHWM = 1_000           # messages read ahead from one peer (then TCP pushes back)
PENDING_INITS = 4_096    # INIT messages one worker may have waiting for rank 0's values


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


class KeyShard:
    """The server's part of one key: a flat slice of the weights and its aggregation."""
    __slots__ = ("key", "offset", "count", "dtype", "_weight", "_weight_view", "grad",
                 "_grad_view", "version", "pending", "waiting", "lent")

    def __init__(self, key, offset, values):
        self.key = key
        self.offset = offset
        self.count = values.size
        self.dtype = values.dtype
        self.weight = mx.nd.array(values, dtype=values.dtype)
        self.grad = mx.nd.zeros(values.shape, dtype=values.dtype)   # staging for the sum
        self._grad_view = None
        self.version = 0          # steps applied
        self.pending = {}         # step -> {rank: gradient}
        self.waiting = {}         # step -> [Reply] to complete when that step is applied
        self.lent = []            # replies holding a view of ``weight``: unsent, or trackers

    # Views of the two buffers, made once per array (a key of a key-by-key script is a few
    # KB: making them per step cost as much as the sum). Only while no MXNet operation on
    # the array is pending (after ``mx.nd.waitall()``).
    @property
    def weight(self):
        return self._weight

    @weight.setter
    def weight(self, nd):      # _reclaim moves the weights to a copy
        self._weight, self._weight_view = nd, None

    def weight_view(self):
        if self._weight_view is None:
            self._weight_view = hostcopy.raw_view(self._weight, self.dtype, self.count)
        return self._weight_view

    def grad_view(self):
        if self._grad_view is None:
            self._grad_view = hostcopy.raw_view(self.grad, self.dtype, self.count)
        return self._grad_view


class Reply:
    """A reply being assembled: values snapshotted per key as their step is applied."""
    __slots__ = ("ident", "req", "records", "parts", "missing", "with_state", "lr", "tracker",
                 "peer", "relay")

    def __init__(self, ident, req, n, with_state, peer, relay=False):
        self.ident, self.req, self.with_state, self.relay = ident, req, with_state, relay
        self.records, self.parts, self.missing, self.lr = [None] * n, [None] * n, n, None
        self.tracker = None       # set once sent: ZeroMQ is done with the buffers when done
        self.peer = peer
        peer.open += 1


class Averaging:
    """One partial reduce being collected (preduce): its members and, per key, the weights
    each member sent and the replies waiting for their average."""
    __slots__ = ("members", "parts", "waiting")

    def __init__(self, members):
        self.members, self.parts, self.waiting = members, {}, {}


def _summable_2bit(parts):
    """Are ``parts`` all 2bit pushes whose sum counting gives exactly (``summable``)?"""
    return all(isinstance(p, Packed2bit) for p in parts) and \
        summable(parts[0].threshold, len(parts))


def _decoded(parts):
    """``parts`` with every packed push decoded (the float32 values the server adds)."""
    return [p.decode() if isinstance(p, Packed2bit) else p for p in parts]


class Server:
    def __init__(self, env: NodeEnv, log=None):
        self.env = env
        self.log = log or (lambda text: print(f"ssdsgd server: {text}", file=sys.stderr, flush=True))
        self.sync = env.algorithm != "asgd"
        self.ctx = zmq.Context.instance()
        self.guard = Guard.from_env(env, lambda text: self.log(text))
        self.sock, self.port = bind_router(self.ctx, env.node_host, 0, "a server", self.guard,
                                           sndhwm=SNDHWM, rcvhwm=RCVHWM,
                                           maxmsgsize=P.frame_limit(env.max_message_bytes))
        self.link = SchedulerLink(self.ctx, env, "server", env.node_host, self.port, self.guard)
        self.shards = {}
        self.model_bytes = 0
        self.optimizer = None
        self.updater = None
        self.compression = None   # the job's push compression (SET_COMPRESSION), if any
        self.pending_inits = []
        self._snapshots = {}   # (key, version) -> weights copied for replies, per message
        self._encoded = {}     # a reply's records and lr -> its encoded frames, per message
        self._relayed = []     # complete replies that may travel through a chain of workers
        self.retired = []      # (old weight NDArray, trackers of replies still sending it)
        self.rank = -1
        self.num_workers = env.num_workers
        self.removed = {}         # rank of a worker that left -> the step it is out from
        self.peers = {}        # connection id -> Peer, from the scheduler's topology
        self.steps_ahead = steps_ahead_bound(env.algorithm, env.delay_steps)
        self.quorum = quorum_size(env.quorum, env.num_workers)
        self.rounds = None     # quorum rounds (set once the rank is known), if Q < N
        self.averages = {}     # group number -> Averaging (preduce)
        self.unread = 0        # replies dropped because a stranger's queue was full
        self.rejected = Rejections(lambda text: self.log(text))
        self.log(f"listening on {env.node_host}:{self.port}; {self.guard.describe()}")

    # ---- replies -------------------------------------------------------------------
    def _send(self, ident, msg):
        """Send without ever waiting: a worker whose queue is full does not read (the job
        cannot go on without it: Fatal); a stranger's reply is dropped. ``msg``: a Message
        or its encoded frames."""
        peer = self.peers.get(ident)
        frames = msg if isinstance(msg, list) else P.encode(msg)
        try:
            tracker = self.sock.send_multipart([ident] + frames, copy=False, track=True,
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
            if len(peer.inflight) > self._unsent_bound():
                raise Fatal(f"worker {peer.rank} does not read its replies ("
                            f"{len(peer.inflight)} unsent); stopping the job")
        return tracker

    def _reply_bound(self):
        """Replies a worker can legitimately have outstanding: for every step it may be
        ahead, every chunk of a step's exchange, or one request per key (a script calling
        ``kv.pushpull`` key by key has every key in flight, as with ps-lite); plus a margin."""
        chunks = 1 + self.model_bytes // max(1, self.env.chunk_bytes)
        return (self.steps_ahead + 2) * (chunks + 1 + len(self.shards)) + 64

    def _unsent_bound(self):
        """Messages to one worker that ZeroMQ may still be sending: its replies, and the
        pieces of relayed replies (up to FRAGMENT_SHARE + 1 per reply, or one per
        FRAGMENT_MAX bytes of weights and state; docs/spec/pull_relay.md)."""
        chunks = 1 + self.model_bytes // max(1, self.env.chunk_bytes)
        pieces = chunks * (P.FRAGMENT_SHARE + 1) + 2 * self.model_bytes // P.FRAGMENT_MAX
        return self._reply_bound() + (self.steps_ahead + 2) * pieces

    def _reclaim(self, shard):
        """Before ``shard.weight`` changes: replies holding a view of it take a copy (not
        sent yet); if ZeroMQ is still sending one, the shard moves to a fresh copy and the
        old buffer is kept until the send is done -- the loop never waits on a peer."""
        busy = []
        for reply, i in shard.lent:
            if reply.tracker is None:
                reply.parts[i][0] = np.array(reply.parts[i][0])
            elif not reply.tracker.done:
                busy.append(reply.tracker)
        shard.lent.clear()
        if busy:
            self.retired.append((shard.weight, busy))
            shard.weight = shard.weight.copy()

    def _reject(self, ident, req, text):
        peer = self.peers.get(ident)
        self.rejected(text, peer and f"worker {peer.rank}")
        self._send(ident, P.Message(P.Kind.ERROR, sender=self.rank, req=req, meta={"error": text}))

    def _state_arrays(self, shard):
        if self.updater is None:
            return []
        if shard.key not in self.updater.states:
            self.updater.states[shard.key] = self.optimizer.create_state_multi_precision(
                shard.key, shard.weight)
            self.updater.states_synced[shard.key] = True
        return [a.asnumpy() for a in flatten_state(self.updater.states[shard.key])]

    def _snapshot(self, reply, i, shard):
        # The reply carries a view of the weights themselves, not a copy: ``_reclaim`` runs
        # before they change. Every worker waiting on the same step gets the same view.
        value = self._snapshots.get((shard.key, shard.version))
        if value is None:    # _apply leaves no MXNet work pending: the buffer is settled
            value = shard.weight_view()
            self._snapshots[(shard.key, shard.version)] = value
        shard.lent.append((reply, i))
        arrays = [value]
        if reply.with_state:   # copied once per step, however many workers ask for it
            state = self._snapshots.get((shard.key, shard.version, "state"))
            if state is None:
                state = self._snapshots[(shard.key, shard.version, "state")] = \
                    self._state_arrays(shard)
            arrays += state
        # The record's step is the optimizer's update count for the key (what a worker's
        # local copy continues from); it equals the steps applied unless states were loaded.
        count = shard.version
        if self.optimizer is not None:
            count = self.optimizer._index_update_count.get(shard.key, 0)
        reply.records[i] = (shard.key, count, shard.offset, shard.count, shard.dtype,
                            len(arrays))
        reply.parts[i] = arrays
        reply.missing -= 1
        if self.optimizer is not None:
            reply.lr = float(self.optimizer.learning_rate)
        self._send_when_complete(reply)

    def _forget_snapshots(self):
        """After a message: the next may change the weights the snapshots view."""
        self._send_relayed()
        self._snapshots.clear()
        self._encoded.clear()

    def _send_relayed(self):
        """sync.pull_relay: chain (docs/spec/pull_relay.md). The replies that one message
        completed and that carry the same records and lr go out once, to the lowest rank
        of them, with the rest of the chain: [[rank, request id], ...] in rank order. Each
        worker forwards it to the next, so this server's link carries one copy, not N. It
        travels as FRAGMENT messages (the REPLY's frames cut into pieces, its own request id
        0): a hop passes each piece on as it arrives, so the chain pipelines."""
        groups = {}
        for reply in self._relayed:
            groups.setdefault((tuple(reply.records), reply.lr), []).append(reply)
        self._relayed = []
        for (records, lr), replies in groups.items():
            replies.sort(key=lambda r: r.peer.rank)
            meta = {"lr": lr} if lr is not None else {}
            if len(replies) > 1:
                meta["relay"] = [[r.peer.rank, r.req] for r in replies[1:]]
            head = replies[0]
            chain = meta.pop("relay", None)
            body = P.encode(P.Message(
                P.Kind.REPLY, sender=self.rank, req=head.req if chain is None else 0,
                records=P.make_records(records), tensors=head.parts, meta=meta or None))
            if chain is None:
                pieces = [body]
            else:      # in pieces, so that each hop passes on the first while the rest come
                pieces = P.fragments(body, head.req, self.rank, {"relay": chain})
            trackers = [t for t in (self._send(head.ident, p) for p in pieces) if t is not None]
            tracker = zmq.MessageTracker(*trackers)
            for reply in replies:     # every reply's views are lent until these are sent
                reply.tracker = tracker

    def _send_when_complete(self, reply):
        """Send ``reply`` once every one of its keys has its values. The N workers of a
        step ask for the same keys at the same step: their replies are encoded once (the
        records name the update count, so equal records mean equal values within one
        message's handling) and differ only in the header's request id."""
        if reply.missing == 0:
            reply.peer.open -= 1
            if reply.relay:
                self._relayed.append(reply)
                return
            sig = (tuple(reply.records), reply.lr)
            body = self._encoded.get(sig)
            if body is None:
                body = P.encode(P.Message(
                    P.Kind.REPLY, sender=self.rank, req=reply.req,
                    records=P.make_records(reply.records), tensors=reply.parts,
                    meta={"lr": reply.lr} if reply.lr is not None else None))
                self._encoded[sig] = body
            reply.tracker = self._send(reply.ident, P.readdress(body, reply.req))
            if reply.tracker is None:          # not sent: nothing reads the views any more
                reply.tracker = zmq.MessageTracker()

    def _new_reply(self, ident, msg, n, with_state):
        peer = self.peers[ident]
        if peer.open >= self._reply_bound():
            raise RequestError(f"{peer.open} requests of worker {peer.rank} are already "
                               f"waiting; a worker has at most {self._reply_bound()}")
        return Reply(ident, msg.req, n, with_state, peer,
                     relay=bool(msg.flags & P.Flag.RELAY))

    # ---- validation ----------------------------------------------------------------
    def _shard_for(self, rec, *, with_values):
        key = int(rec["key"])
        shard = self.shards.get(key)
        if shard is None:
            raise RequestError(f"key {key} was never initialized on server {self.rank}")
        if int(rec["offset"]) != shard.offset or int(rec["count"]) != shard.count:
            raise RequestError(f"key {key}: slice [{int(rec['offset'])}, +{int(rec['count'])}) "
                               f"does not match this server's [{shard.offset}, +{shard.count})")
        if with_values and P.DTYPES[int(rec["dtype"])] != shard.dtype:
            raise RequestError(f"key {key}: dtype {P.DTYPES[int(rec['dtype'])]} but the key "
                               f"holds {shard.dtype}")
        return shard

    def _only_rank0(self, msg, what):
        if msg.sender != 0:
            raise RequestError(f"only worker 0 may send {what} (this is worker {msg.sender})")

    # ---- handlers ------------------------------------------------------------------
    def on_init(self, ident, msg):
        """Each key is declared once, by worker 0's values (the model it declares); the
        other workers' INITs wait for them, holding no tensors."""
        new = {}
        for rec, arrays in zip(P.rows(msg.records), msg.tensors):
            key = int(rec["key"])
            if key in self.shards or key in new or not arrays:
                continue
            self._only_rank0(msg, f"the initial values of key {key}")
            if len(arrays) != 1:
                raise RequestError(f"key {key}: INIT carries one tensor per key")
            new[key] = (int(rec["offset"]), arrays[0])
        peer = self.peers[ident]
        if peer.inits >= PENDING_INITS:
            raise RequestError(f"worker {peer.rank} has {peer.inits} INITs waiting already")
        for key, (offset, values) in new.items():
            self.shards[key] = KeyShard(key, offset, values)
            self.model_bytes += values.nbytes
        # Waiting INITs keep their key table only, never the tensors of the message.
        self.pending_inits.append((ident, P.Message(P.Kind.INIT, sender=msg.sender,
                                                    req=msg.req, records=msg.records)))
        peer.inits += 1
        still = []
        for ident_i, msg_i in self.pending_inits:
            if not all(int(r["key"]) in self.shards for r in msg_i.records):
                still.append((ident_i, msg_i))
                continue
            self.peers[ident_i].inits -= 1
            try:
                self._reply_now(ident_i, msg_i, with_state=False)
            except RequestError as e:     # that worker's request, not this one's
                self._reject(ident_i, msg_i.req, str(e))
        self.pending_inits = still

    def _reply_now(self, ident, msg, with_state):
        shards = [self._shard_for(rec, with_values=False) for rec in P.rows(msg.records)]
        reply = self._new_reply(ident, msg, len(shards), with_state)
        if not shards:
            reply.peer.open -= 1
            self._send(ident, P.Message(P.Kind.REPLY, sender=self.rank, req=msg.req))
        for i, shard in enumerate(shards):
            self._snapshot(reply, i, shard)

    def _between_steps(self, what):
        """Changing the optimizer while a step is half aggregated would apply two
        optimizers within one step."""
        for shard in self.shards.values():
            if shard.pending:
                raise RequestError(f"{what} while step {min(shard.pending)} of key "
                                   f"{shard.key} is being aggregated; set it between steps")

    def on_set_optimizer(self, ident, msg):
        self._only_rank0(msg, "SET_OPTIMIZER")
        self._between_steps("SET_OPTIMIZER")
        try:
            optimizer = build(msg.meta["optimizer"])
        except OptimizerSpecError as e:
            raise RequestError(f"SET_OPTIMIZER: {e}") from None
        self._use_optimizer(optimizer)
        self._send(ident, P.Message(P.Kind.ACK, sender=self.rank, req=msg.req))

    def _use_optimizer(self, optimizer):
        # Multi-tensor updates (MXNet's own multi_* kernels) for the keys of a step, in
        # calls of similar sizes (update_groups): the same arithmetic as one update per
        # key, far fewer engine calls.
        if optimizer.aggregate_num > 0:
            optimizer.aggregate_num = AGGREGATE_KEYS
        sched = optimizer.lr_scheduler
        if isinstance(sched, GlobalBatchSchedule) and sched.num_workers != self.num_workers:
            raise RequestError(f"the lr schedule's clock counts pushes of "
                               f"{sched.num_workers} workers; this job has {self.num_workers}")
        if self.rounds is not None and sched is not None and \
                not isinstance(sched, GlobalBatchSchedule):
            # a quorum's rounds hold fewer than N pushes: count the schedule in global
            # batches (from a step, where every worker has pushed that many times)
            optimizer.lr_scheduler = GlobalBatchSchedule(
                sched, self.num_workers, pushes=int(optimizer.num_update) * self.num_workers)
        elif self.rounds is None and isinstance(sched, GlobalBatchSchedule):
            optimizer.lr_scheduler = sched.inner     # Q = N: the update count is the clock
        self.optimizer = optimizer
        self.updater = mx.optimizer.get_updater(optimizer)
        self._sgd_seen = {}       # update_groups.sgd_call's knowledge of the arrays

    def on_set_compression(self, ident, msg):
        """Every worker sends the job's compression; they must agree (as they do when the
        same script calls kv.set_gradient_compression on each)."""
        try:
            spec = Compression.from_params(msg.meta["compression"])
        except CompressionError as e:
            raise RequestError(f"SET_COMPRESSION: {e}") from None
        if spec is None:
            raise RequestError("SET_COMPRESSION without a compression")
        if self.compression is not None and spec != self.compression:
            raise RequestError(f"worker {msg.sender} sets compression {spec.params()}, but the "
                               f"job compresses with {self.compression.params()}")
        self.compression = spec
        self._send(ident, P.Message(P.Kind.ACK, sender=self.rank, req=msg.req))

    def _gradient(self, rec, arrays, shard):
        """A push's gradient of ``shard``: as sent, or decoded from its compressed form."""
        code = int(rec["encoding"])
        if not code:
            return arrays[0]
        encoding = P.ENCODINGS[code]
        if shard.dtype != np.float32:
            raise RequestError(f"key {shard.key}: a compressed push for a {shard.dtype} key "
                               f"(compression needs float32)")
        if self.compression is None or encoding != self.compression.type:
            raise RequestError(f"key {shard.key}: a {encoding} push, but the job's compression "
                               f"is {self.compression.type if self.compression else 'none'}")
        try:
            return self.compression.receive(arrays[0], shard.count)
        except CompressionError as e:
            raise RequestError(f"key {shard.key}: {e}") from None

    def _check_push(self, msg):
        """Every record of a push, before anything changes: (shard, step, gradient)."""
        if len(np.unique(msg.records["key"])) != len(msg.records):
            raise RequestError("a push names a key twice")
        shards = []
        for rec, arrays in zip(P.rows(msg.records), msg.tensors):
            shard = self._shard_for(rec, with_values=not rec["encoding"])
            step = int(rec["step"])
            if len(arrays) != 1:
                raise RequestError(f"key {shard.key}: a push carries one gradient per key")
            if self.sync and self.rounds is None:
                if step < shard.version:
                    raise RequestError(f"key {shard.key}: push for step {step} from worker "
                                       f"{msg.sender}, but step {shard.version - 1} is already applied")
                if step - shard.version >= self.steps_ahead:
                    raise RequestError(
                        f"key {shard.key}: worker {msg.sender} pushed step {step}, "
                        f"{step - shard.version} steps ahead of the slowest worker; the "
                        f"{self.env.algorithm} schedule allows {self.steps_ahead - 1}")
                if msg.sender in shard.pending.get(step, ()):
                    raise RequestError(f"key {shard.key}: worker {msg.sender} pushed step {step} "
                                       "twice; the job's gradients cannot be trusted any more")
            shards.append((shard, step, self._gradient(rec, arrays, shard)))
        return shards

    def on_push(self, ident, msg):
        if self.rounds is not None:
            return self._push_to_round(ident, msg)
        shards = self._check_push(msg)
        reply = None
        if msg.flags & P.Flag.PULL:
            reply = self._new_reply(ident, msg, len(shards), bool(msg.flags & P.Flag.STATE))
        ready = []
        for i, (shard, step, grad) in enumerate(shards):
            if not self.sync:
                ready.append((shard, grad))
                continue
            shard.pending.setdefault(step, {})[msg.sender] = grad
            if reply is not None:
                shard.waiting.setdefault(step, []).append((reply, i))
            if step == shard.version and self._complete(shard.pending[step], step):
                ready.append((shard, None))
        if self.sync:
            while ready:
                self._apply([s for s, _ in ready], [self._sum(s) for s, _ in ready])
                nxt = []
                for shard, _ in ready:
                    for rep, i in shard.waiting.pop(shard.version - 1, ()):
                        self._snapshot(rep, i, shard)
                    if self._complete(shard.pending.get(shard.version, {}), shard.version):
                        nxt.append((shard, None))
                ready = nxt
        else:
            self._apply([s for s, _ in ready], [g for _, g in ready])
            if reply is not None:
                for i, (shard, _, _) in enumerate(shards):
                    self._snapshot(reply, i, shard)

    def _sum(self, shard):
        """The step's gradients of ``shard`` in rank order (summed by ``_apply``)."""
        grads = shard.pending.pop(shard.version)
        parts = [grads[r] for r in sorted(grads)]
        if len(parts) < self.num_workers:      # a worker left: keep the mean gradient
            return [np.sum(_decoded(parts), axis=0) * np.float32(self.num_workers / len(parts))]
        return parts

    def _apply(self, shards, grads):
        """grads[i]: the gradients to add up for shards[i], in rank order. The sum is
        written straight into the buffer the optimizer reads (no extra copy of big
        arrays), then MXNet's updater runs once for all keys."""
        if not shards:
            return
        for shard in shards:
            self._reclaim(shard)
        mx.nd.waitall()
        for shard, parts in zip(shards, grads):
            parts = parts if isinstance(parts, list) else [parts]
            target = shard.weight_view() if self.updater is None else shard.grad_view()
            if _summable_2bit(parts):
                sum_2bit(parts, target)
                continue
            parts = _decoded(parts)
            if len(parts) == 1:
                np.copyto(target, parts[0])
            else:
                np.add(parts[0], parts[1], out=target)
                for g in parts[2:]:
                    target += g
        if self.updater is not None:   # without an optimizer the store keeps the sum (MXNet's rule)
            for group in size_groups([s.count for s in shards], AGGREGATE_KEYS):
                keys, grads, weights = ([shards[i].key for i in group],
                                        [shards[i].grad for i in group],
                                        [shards[i].weight for i in group])
                if not sgd_call(self.optimizer, self.updater, keys, grads, weights,
                                self._sgd_seen):
                    self.updater(keys, grads, weights)
            mx.nd.waitall()   # once per step: replies then read the weights' buffers directly
        for shard in shards:
            shard.version += 1

    # ---- cluster.on_worker_failure: continue (the scheduler's MEMBERSHIP messages) --------
    def _complete(self, pushes, step):
        """Has every worker still in the job at ``step`` pushed it?"""
        return len(pushes) + sum(1 for r, s in self.removed.items()
                                 if s <= step and r not in pushes) >= self.num_workers

    def on_membership(self, meta):
        """A dead worker leaves. Asked (no from_step): answer the first step this server
        has not received from it (of any key). Told (from_step E): drop its pushes for
        steps >= E, aggregate the others from E on, and apply what is now complete."""
        rank = meta["removed"]
        if "from_step" not in meta:
            first = min((self._first_missing(shard, rank) for shard in self.shards.values()),
                        default=0)
            self.link.send(P.Kind.MEMBERSHIP, {"removed": rank, "next_step": first})
            return
        step = self.removed[rank] = meta["from_step"]
        self.log(f"worker {rank} left the job; aggregating without it from step {step}")
        ready = []
        for shard in self.shards.values():
            for t, pushes in shard.pending.items():
                if t >= step:
                    pushes.pop(rank, None)
            if self._complete(shard.pending.get(shard.version, {}), shard.version):
                ready.append(shard)
        while ready:
            self._apply(ready, [self._sum(s) for s in ready])
            nxt = []
            for shard in ready:
                for rep, i in shard.waiting.pop(shard.version - 1, ()):
                    self._snapshot(rep, i, shard)
                if self._complete(shard.pending.get(shard.version, {}), shard.version):
                    nxt.append(shard)
            ready = nxt
        self._forget_snapshots()

    @staticmethod
    def _first_missing(shard, rank):
        t = shard.version
        while rank in shard.pending.get(t, ()):
            t += 1
        return t

    def on_pull(self, ident, msg):
        shards = [self._shard_for(rec, with_values=False) for rec in P.rows(msg.records)]
        if msg.flags & P.Flag.PAUSE:
            return self._pause(ident, msg, shards)
        if self.rounds is not None:
            return self._pull_from_rounds(ident, msg, shards)
        for rec, shard in zip(P.rows(msg.records), shards):
            step = int(rec["step"])
            if self.sync and step >= shard.version and msg.sender not in shard.pending.get(step, ()):
                raise RequestError(f"key {shard.key}: worker {msg.sender} pulls step {step}, "
                                   f"which it has not pushed (step {shard.version - 1} is the "
                                   "last applied)")
        reply = self._new_reply(ident, msg, len(shards), bool(msg.flags & P.Flag.STATE))
        if not shards:
            reply.peer.open -= 1
            self._send(ident, P.Message(P.Kind.REPLY, sender=self.rank, req=msg.req))
        for i, (rec, shard) in enumerate(zip(P.rows(msg.records), shards)):
            step = int(rec["step"])
            if self.sync and step >= shard.version:     # "as of step t": wait for it
                shard.waiting.setdefault(step, []).append((reply, i))
            else:
                self._snapshot(reply, i, shard)

    # ---- quorum rounds (docs/spec/quorum.md; the decisions are ssdsgd.sync.rounds') ----
    def _push_to_round(self, ident, msg):
        """One push is one contribution (the client sends it unchunked, to every server)."""
        shards = self._check_push(msg)
        token = None
        if msg.flags & P.Flag.PULL:
            reply = self._new_reply(ident, msg, len(shards), bool(msg.flags & P.Flag.STATE))
            token = (reply, [shard for shard, _, _ in shards])
        item = [(shard, grad) for shard, _, grad in shards]
        try:
            actions = self.rounds.push(msg.sender, item, token,
                                       latest=bool(msg.flags & P.Flag.LATEST))
        except RoundError as e:
            raise RequestError(str(e)) from None
        self._execute(actions)

    def _pull_from_rounds(self, ident, msg, shards):
        """A final pull waits for the end of every worker's pushes; any other pull gets the
        newest closed round."""
        reply = self._new_reply(ident, msg, len(shards), bool(msg.flags & P.Flag.STATE))
        if not msg.flags & P.Flag.FINAL:
            return self._answer(reply, shards)
        try:
            actions = self.rounds.final(msg.sender, (reply, shards))
        except RoundError as e:
            raise RequestError(str(e)) from None
        self._execute(actions)

    def _pause(self, ident, msg, shards):
        """A worker enters a barrier: until its next push the rounds do not wait for it
        (it cannot push while it waits for the others). Answered at once, without keys."""
        if shards:
            raise RequestError(f"worker {msg.sender}: a barrier's pause names keys")
        reply = self._new_reply(ident, msg, 0, False)
        if self.rounds is not None:
            try:
                actions = self.rounds.pause(msg.sender)
            except RoundError as e:
                raise RequestError(str(e)) from None
            self._execute(actions)
        self._answer(reply, [])

    def _execute(self, actions):
        for kind, what in actions:
            if kind == "close":
                self._close_round(what)
            else:
                self._answer(*what)

    def _close_round(self, contributions):
        """Sum each key's pushes of the round in rank order, apply the optimizer once."""
        if self.optimizer is not None and isinstance(self.optimizer.lr_scheduler,
                                                     GlobalBatchSchedule):
            self.optimizer.lr_scheduler.pushes += len(contributions)
        per_key = {}
        for _, item in contributions:
            for shard, grad in item:
                per_key.setdefault(shard.key, (shard, []))[1].append(grad)
        self._apply([shard for shard, _ in per_key.values()],
                    [grads for _, grads in per_key.values()])

    def _answer(self, reply, shards):
        if not shards:
            reply.peer.open -= 1
            self._send(reply.ident, P.Message(P.Kind.REPLY, sender=self.rank, req=reply.req))
        for i, shard in enumerate(shards):
            self._snapshot(reply, i, shard)

    def _send_decisions(self):
        """The leader's decisions of this message go to the other servers (via the
        scheduler); a decision lost would stall them, so a full queue stops the job."""
        if self.rounds is None or not self.rounds.log:
            return
        text = " ".join(self.rounds.log)
        self.rounds.log.clear()
        try:
            self.link.sock.send_multipart(P.control(P.Kind.ROUND, {"log": text}),
                                          flags=zmq.NOBLOCK)
        except zmq.Again:
            raise Fatal("the scheduler does not take server 0's round decisions") from None

    def _follow(self, text):
        try:
            actions = self.rounds.follow(text) if self.rounds is not None else None
        except RoundError as e:
            raise Fatal(f"server {self.rank}: {e}") from None
        if actions is None:
            raise Fatal(f"server {self.rank} received round decisions without a quorum")
        self._execute(actions)
        self._forget_snapshots()

    def _check_average(self, msg):
        """An AVERAGE's group and its (shard, weights) records, before anything changes."""
        if self.env.algorithm != "preduce":
            raise RequestError(f"AVERAGE in a job whose algorithm is {self.env.algorithm}, "
                               "not preduce")
        members = tuple(msg.meta["members"])
        if len(members) < 2 or members[-1] >= self.num_workers or msg.sender not in members:
            raise RequestError(f"AVERAGE of group {msg.step}: members {list(members)} must be "
                               f"2 or more of the {self.num_workers} workers, the sender "
                               f"(worker {msg.sender}) among them")
        group = self.averages.get(msg.step)
        if group is not None and group.members != members:
            raise RequestError(f"AVERAGE of group {msg.step}: members {list(members)}, but "
                               f"its other members sent {list(group.members)}")
        if group is None and len(self.averages) >= self.num_workers:
            raise RequestError(f"{len(self.averages)} groups are being averaged already; a "
                               "worker is in at most one at a time")
        if len(np.unique(msg.records["key"])) != len(msg.records):
            raise RequestError("an AVERAGE names a key twice")
        shards = []
        for rec, arrays in zip(P.rows(msg.records), msg.tensors):
            shard = self._shard_for(rec, with_values=True)
            if len(arrays) != 1 or rec["encoding"]:
                raise RequestError(f"key {shard.key}: an AVERAGE carries the weights, once")
            if group is not None and msg.sender in group.parts.get(shard.key, ()):
                raise RequestError(f"key {shard.key}: worker {msg.sender} sent its weights "
                                   f"for group {msg.step} twice")
            shards.append((shard, arrays[0]))
        return members, shards

    def on_average(self, ident, msg):
        """preduce (docs/spec/preduce.md): each member of group ``msg.step`` sends its
        weights; once all have, every member gets their average, key by key."""
        members, shards = self._check_average(msg)
        reply = self._new_reply(ident, msg, len(shards), False)
        group = self.averages.setdefault(msg.step, Averaging(members))
        if not shards:
            reply.peer.open -= 1
            self._send(ident, P.Message(P.Kind.REPLY, sender=self.rank, req=msg.req))
        for i, (shard, values) in enumerate(shards):
            parts = group.parts.setdefault(shard.key, {})
            parts[msg.sender] = values
            group.waiting.setdefault(shard.key, []).append((reply, i))
            if len(parts) < len(members):
                continue
            value = mean([parts[r] for r in members])
            del group.parts[shard.key]
            for rep, j in group.waiting.pop(shard.key):
                rep.records[j] = (shard.key, msg.step, shard.offset, shard.count,
                                  shard.dtype, 1)
                rep.parts[j] = [value]
                rep.missing -= 1
                self._send_when_complete(rep)
        if not group.parts:
            del self.averages[msg.step]

    def on_get_state(self, ident, msg):
        shards = sorted(self.shards.values(), key=lambda s: s.key)
        arrays = [[s.weight.asnumpy()] + self._state_arrays(s) for s in shards]
        records = P.make_records((s.key, s.version, s.offset, s.count, s.dtype, len(a))
                                 for s, a in zip(shards, arrays))
        meta = {"optimizer": describe(self.optimizer) if self.optimizer else None}
        self._send(ident, P.Message(P.Kind.REPLY, sender=self.rank, req=msg.req,
                                    records=records, tensors=arrays, meta=meta))

    def on_set_state(self, ident, msg):
        self._only_rank0(msg, "SET_STATE")
        self._between_steps("SET_STATE")
        optimizer, updater = self.optimizer, self.updater
        if "optimizer" in msg.meta:
            try:
                optimizer = build(msg.meta["optimizer"])
            except OptimizerSpecError as e:
                raise RequestError(f"SET_STATE: {e}") from None
            updater = mx.optimizer.get_updater(optimizer)
        if updater is None:
            raise RequestError("SET_STATE before any optimizer was set")
        states = {}
        for rec, arrays in zip(P.rows(msg.records), msg.tensors):
            shard = self._shard_for(rec, with_values=True)
            template = optimizer.create_state_multi_precision(shard.key, shard.weight)
            want = len(flatten_state(template))
            if len(arrays) != want:
                raise RequestError(f"key {shard.key}: {len(arrays)} state arrays, the "
                                   f"optimizer keeps {want}")
            states[shard.key] = unflatten_state(
                template, [mx.nd.array(a, dtype=a.dtype) for a in arrays])
        if optimizer is not self.optimizer:
            self._use_optimizer(optimizer)
        for key, state in states.items():
            self.updater.states[key] = state
            self.updater.states_synced[key] = True
        self._send(ident, P.Message(P.Kind.ACK, sender=self.rank, req=msg.req))

    HANDLERS = {P.Kind.INIT: on_init, P.Kind.SET_OPTIMIZER: on_set_optimizer,
                P.Kind.PUSH: on_push, P.Kind.PULL: on_pull, P.Kind.GET_STATE: on_get_state,
                P.Kind.SET_STATE: on_set_state, P.Kind.SET_COMPRESSION: on_set_compression,
                P.Kind.AVERAGE: on_average}

    # ---- loop ----------------------------------------------------------------------
    def handle(self, frames):
        """One message. Nothing in it can stop the server: a bad one gets an ERROR with
        its request id (the worker fails, naming it); only Fatal ends the loop."""
        ident, req, kind = frames[0].bytes, 0, "a message"
        try:
            msg = P.decode(frames[1:], max_bytes=self.env.max_message_bytes)
            req, kind = msg.req, msg.kind.name
            handler = self.HANDLERS.get(msg.kind)
            if handler is None:
                raise RequestError(f"a server does not handle {msg.kind.name}")
            P.check_meta(msg.kind, msg.meta)
            peer = self.peers.get(ident)
            if peer is None:
                raise RequestError("this connection is not one of the job's workers")
            if msg.sender != peer.rank:
                raise RequestError(f"worker {peer.rank}'s connection sent a message as "
                                   f"worker {msg.sender}")
            wrong = self.guard.wrong_claim(frames[1], "worker", peer.rank)
            if wrong:       # its key is another worker's (security.py)
                raise RequestError(wrong)
            handler(self, ident, msg)
            self._send_decisions()
        except (P.ProtocolError, RequestError) as e:
            self._reject(ident, getattr(e, "req", 0) or req, str(e))
        except JobAborted:
            raise
        except Exception as e:    # noqa: BLE001 - a bug must not take the node down
            self.log(f"internal error on {kind}: {e!r}")
            self._reject(ident, req, f"internal error on {kind}: {e!r}")
        finally:
            self._forget_snapshots()

    def run(self):
        topo = self.link.register()
        self.rank = topo["rank"]
        self.peers = {bytes.fromhex(h): Peer(r) for r, h in enumerate(topo.get("workers", []))}
        if self.quorum < self.num_workers:
            self.rounds = Rounds(self.num_workers, self.quorum, self.env.max_staleness,
                                 leader=self.rank == 0, replicate=self.env.num_servers > 1,
                                 max_queued=self.steps_ahead + 2)
        self.log = (lambda text, r=self.rank: print(f"ssdsgd server {r}: {text}",
                                                     file=sys.stderr, flush=True))
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.link.sock, zmq.POLLIN)
        wait_ms = max(1, int(self.env.heartbeat_interval * 1000 / 2))
        try:
            while True:
                events = dict(poller.poll(wait_ms))
                if self.link.sock in events:
                    msg = self.link.receive()
                    if msg.kind == P.Kind.SHUTDOWN:
                        return 0
                    if msg.kind == P.Kind.MEMBERSHIP:
                        self.on_membership(msg.meta)
                    elif msg.kind == P.Kind.ROUND:
                        self._follow(msg.meta["log"])
                if self.sock in events:
                    for _ in range(64):   # drain a burst, but keep heartbeats going
                        try:
                            frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self.handle(frames)
                self.retired = [(w, ts) for w, ts in self.retired if not all(t.done for t in ts)]
                self.link.tick()
        except Fatal as e:   # the scheduler aborts the job, naming this server and why
            self.link.send(P.Kind.FINISH, {"error": str(e)})
            raise

    def close(self):
        self.sock.close(0)
        self.link.sock.close(0)
        self.guard.close()
