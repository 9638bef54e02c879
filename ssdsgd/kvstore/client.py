"""The worker's side of the wire: a KVWorker-like API (ps-lite's) over one I/O thread.

What the layers above see (``Gather``: the replies of one request, to be waited for):

    init(keys, values)                  place keys on the servers; rank 0's values win -> Gather
    push(step, grads, pull=, state=)    a step's gradients; with ``pull`` the reply is w_G
                                        as of this step (and the optimizer state) -> Gather
    pull(keys, latest=, state=)         w_G as of this worker's last push (or the latest) -> Gather
    set_optimizer(spec), get_state(), set_state(states, spec)    every server -> Gather
    set_compression(spec)               every later push compressed (and every server told)
    barrier(), close(error)
    ready(final=) -> (group number, members)    preduce: wait for the scheduler's group
    average(group, members, weights)    preduce: the members' average of weights -> Gather

The client numbers each key's pushes (the per-key step a server aggregates by), splits
every request over the servers by the key placement (slices of big keys included), and
``Gather.wait`` puts the replies back together: nothing above builds a message. With
compression (docs/spec/compression.md) it keeps this worker's residual per key and sends
each push's slices in their compressed form.

ZeroMQ sockets belong to one thread, and SSD-SGD needs pushes and pulls in flight while
the main thread computes, so all socket work happens on a background thread: the main
thread hands it encoded messages and gets futures back. The same thread keeps the
heartbeats going while the main thread computes, and turns a scheduler ABORT (a dead peer)
or a silent scheduler into an exception on every waiting future, so nothing waits forever.
"""
import concurrent.futures
import dataclasses
import itertools
import queue
import sys
import threading
import time

import numpy as np
import zmq

from . import protocol as P
from .compression import CompressionError
from .scheduler import JobAborted, SchedulerLink, bind_router
from .security import Guard
from .piece_tuner import PieceTuner
from .sharding import Placement
from ..settings import pipeline_pieces, quorum_size


class ServerError(RuntimeError):
    """A server rejected a request; the message says why."""


class KeyReply:
    __slots__ = ("value", "state", "version", "lr")

    def __init__(self, value, state, version, lr):
        self.value, self.state, self.version, self.lr = value, state, version, lr


@dataclasses.dataclass
class _Key:
    dtype: np.dtype
    pushes: int = 0     # the per-key step of the next push


PIECE_MIN = 128 << 10      # a pipelined piece is about this big or more (Python per message)
# Messages the I/O thread reads from one socket in one turn: then it serves the others
# (heartbeats, its servers' replies), so no peer can hold it by sending without pause.
RECV_PER_TURN = 64


def _cut(items, chunk_bytes, pieces=1):
    """items: (record, tensors, bytes) -> [[records, tensors, bytes], ...] of about
    ``chunk_bytes``, or of 1/pieces of the part if that is smaller (not below PIECE_MIN)."""
    if chunk_bytes:
        total = sum(nbytes for _, _, nbytes in items)
        chunk_bytes = min(chunk_bytes, max(PIECE_MIN, -(-total // pieces)))
    chunks = [[[], [], 0]]
    for rec, tensors, nbytes in items:
        if chunk_bytes and chunks[-1][0] and chunks[-1][2] + nbytes > chunk_bytes:
            chunks.append([[], [], 0])
        chunk = chunks[-1]
        chunk[0].append(rec)
        chunk[1].append(tensors)
        chunk[2] += nbytes
    return chunks


class Gather:
    """The replies of one request sent to several servers, reassembled per key.

    ``wait()`` returns {key: KeyReply}; afterwards ``meta`` holds the replies' meta
    (e.g. the servers' optimizer description in a GET_STATE reply)."""

    def __init__(self, client, futures, sizes, dtypes):
        self.client, self.futures, self.sizes, self.dtypes = client, futures, sizes, dtypes
        self.meta = {}

    def wait(self):
        out, waited = {}, time.perf_counter()
        for fut in self.futures:
            self._take(out, self.client.wait(fut))
        self.client.stats["time_blocked"] += time.perf_counter() - waited
        return out

    def then(self, callback):
        """Without waiting: ``callback(replies, None)`` once every reply is in, or
        ``callback(None, error)``, called once, on the thread that resolves the last
        future (the I/O thread; the caller's if all are already resolved)."""
        left, lock = [len(self.futures)], threading.Lock()

        def one(_):
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            try:
                out = {}
                for fut in self.futures:
                    self._take(out, fut.result())
            except Exception as e:
                callback(None, e)
                return
            callback(out, None)

        if not self.futures:
            callback({}, None)
        for fut in self.futures:
            fut.add_done_callback(one)

    def _take(self, out, msg):
        for name, value in (msg.meta or {}).items():
            if value is not None:
                self.meta.setdefault(name, value)
        lr = msg.meta.get("lr") if msg.meta else None
        for rec, arrays in zip(P.rows(msg.records), msg.tensors):
            self._place(out, rec, arrays, lr)

    def _place(self, out, rec, arrays, lr):
        key, off, n = int(rec["key"]), int(rec["offset"]), int(rec["count"])
        if key not in self.sizes:
            raise ServerError(f"a server replied with key {key}, which this worker never "
                              "initialized")
        kr = out.get(key)
        if kr is None and n == self.sizes[key]:     # one piece: keep the received buffer
            out[key] = KeyReply(arrays[0], list(arrays[1:]), int(rec["step"]), lr)
            return
        if kr is None:
            size, dt = self.sizes[key], self.dtypes[key]
            kr = out[key] = KeyReply(np.empty(size, dt), [np.empty(size, dt) for _ in arrays[1:]],
                                     int(rec["step"]), lr)
        kr.value[off:off + n] = arrays[0]
        for dst, src in zip(kr.state, arrays[1:]):
            dst[off:off + n] = src
        kr.version = min(kr.version, int(rec["step"]))


def _tensors(arrays):
    """An entry's tensors: None (none, e.g. a pull), one flat array, or a list of them."""
    if arrays is None:
        return []
    return list(arrays) if isinstance(arrays, (list, tuple)) else [arrays]


@dataclasses.dataclass
class Coded:
    """An entry's compressed gradient: one payload per slice of the key's placement."""
    encoding: str
    payloads: list


class WorkerClient:
    def __init__(self, env):
        self.env = env
        self.ctx = zmq.Context.instance()
        self.stats = {"bytes_sent": 0, "bytes_received": 0, "messages_sent": 0,
                      "messages_received": 0, "time_blocked": 0.0,
                      "replies_relayed_in": 0, "replies_relayed_out": 0}
        self._commands = queue.SimpleQueue()
        self._futures = {}       # request id -> Future of a server's reply
        self._control = {}       # scheduler reply kind (BARRIER, ACK) -> Future
        self._keys = {}          # key -> _Key
        self._req = itertools.count(1)
        self._lock = threading.Lock()
        self._failure = None
        self._stopping = False
        self._ended = False      # the I/O thread has ended: no request can be answered
        self._outbox = []        # push_then's (entries, callback), sent by the I/O thread
        # sync.pull_relay: chain (docs/spec/pull_relay.md), set up by the I/O thread
        self._relay_in = None    # ROUTER: replies other workers pass on to this one
        self._relay_out = {}     # worker rank -> DEALER to its relay
        self._relay_ranks = {}   # connection id of a worker of the job -> its rank
        self._reply_from = {}    # request id -> server, of requests whose reply may be relayed
        self._pieces = {}        # request id -> P.Reassembly of its relayed reply
        self._guard = None
        self._ready = threading.Event()
        addr = f"inproc://ssdsgd-wake-{id(self)}"
        self._wake_in = self.ctx.socket(zmq.PAIR)
        self._wake_in.bind(addr)
        self._wake_out = self.ctx.socket(zmq.PAIR)
        self._wake_out.connect(addr)
        self.topology = None
        self._thread = threading.Thread(target=self._run, name="ssdsgd-io", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise self._failure
        self.rank = self.topology["rank"]
        self.num_workers = self.topology["num_workers"]
        self.num_servers = self.topology["num_servers"]
        self.placement = Placement(self.num_servers, env.bigarray_bound)
        # With a quorum (docs/spec/quorum.md) a push is one contribution to a round: one
        # message per server, to every server, so every server counts the same pushes.
        # (The settings refuse a quorum with asgd and with relayed pulls.)
        self.quorum = quorum_size(env.quorum, self.num_workers) < self.num_workers
        self.relays = self.topology.get("relays")
        self.compression = None   # pushes are compressed with it (set_compression)
        self.left = []            # workers that left the job (cluster.on_worker_failure)
        self._residuals = None    # this worker's error feedback, one residual per key
        # SSDSGD_PIPELINE_PIECES: fixed, or timed on this worker's pulling pushes (auto)
        self.pieces = PieceTuner(pipeline_pieces(env.pipeline_pieces))
        self.stats["pipeline_pieces"] = self.pieces.value

    # ---- the API -----------------------------------------------------------------------
    def init(self, keys, values=None):
        """keys: (key, size, dtype) in the same order on every worker (it decides the
        placement); values: their flat initial values (only rank 0's are taken) or None.
        The reply is the values every worker starts from."""
        for key, size, dtype in keys:
            self.placement.place(key, size, np.dtype(dtype).itemsize)
            self._keys.setdefault(key, _Key(np.dtype(dtype)))
        values = [None] * len(keys) if values is None else values
        return self.exchange(P.Kind.INIT, [(key, 0, value, dtype) for (key, _, dtype), value
                                           in zip(keys, values)])

    def push(self, step, grads, *, pull=False, state=False, latest=False):
        """grads: (key, flat gradient) of one step of this worker. With ``pull`` the reply
        (a Gather; else None) holds the weights once the step is applied (with ``latest``,
        a quorum's newest closed round), with ``state`` also the optimizer state, lr and
        update count. With compression each key is coded with this worker's residual (so
        the arrays may be reused as soon as this returns)."""
        flags = (P.Flag.PULL if pull else P.Flag.NONE) | (P.Flag.STATE if state else P.Flag.NONE)
        if pull and not self.quorum:        # a timed step (a quorum's pushes are not cut)
            self.pieces.mark()
            self.stats["pipeline_pieces"] = self.pieces.value
        if pull and latest:
            flags |= P.Flag.LATEST
        entries, keys = self._push_entries(grads)
        gather = self.exchange(P.Kind.PUSH, entries, step=step, flags=flags, reply=pull,
                               every=self.quorum)
        for k in keys:
            k.pushes += 1
        return gather

    def push_then(self, grads, callback):
        """``push(step, grads, pull=True).then(callback)`` for callers that queue key by key
        (``kv.pushpull`` outside a Trainer step): the entries wait in an outbox that the I/O
        thread empties whenever it wakes, into one message per server (chunked), so the
        keys queued while it was busy travel together and the servers answer them
        together; ps-lite sends a message per key, which costs far more in Python."""
        with self._lock:      # numbered and queued in one order, whichever thread calls
            if self._failure is not None:
                raise self._failure
            if self._ended:
                raise JobAborted("the worker's I/O thread has stopped; the job is over")
            entries, keys = self._push_entries(grads)
            for k in keys:
                k.pushes += 1
            wake = not self._outbox
            self._outbox.append((entries, callback))
            if wake:
                self._wake()

    @property
    def codes_pushes(self):
        """Are pushes compressed? Then ``push`` has read the gradients when it returns,
        and the caller may hand it views of buffers it rewrites later (no copy)."""
        return self._residuals is not None

    def _push_entries(self, grads):
        """A push's entries (compressed with this worker's residuals if set) and keys."""
        keys = [self._key(key) for key, _ in grads]
        entries = [(key, k.pushes, flat, flat.dtype) for (key, flat), k in zip(grads, keys)]
        if self._residuals is not None:
            entries = [(key, n, Coded(self.compression.type, self._residuals.encode(
                key, flat, [(sl.offset, sl.count) for sl in self.placement[key]])), dtype)
                for key, n, flat, dtype in entries]
        return entries, keys

    def pull(self, keys, *, latest=False, state=False, final=False):
        """The weights of ``keys`` as of this worker's last push of each (or the latest).
        ``final`` (quorum): this worker is done; the reply waits for every worker's end
        and holds the final weights (sent to every server: each must hear it)."""
        if not (latest or final or self.quorum):       # kv.pull after kv.push: a timed step
            self.pieces.mark()
            self.stats["pipeline_pieces"] = self.pieces.value
        entries = []
        for key in keys:
            k = self._key(key)
            entries.append((key, -1 if latest else k.pushes - 1, None, k.dtype))
        flags = (P.Flag.STATE if state else P.Flag.NONE) | (P.Flag.FINAL if final else P.Flag.NONE)
        return self.exchange(P.Kind.PULL, entries, flags=flags, every=final)

    def set_optimizer(self, spec):
        """Every server rebuilds the optimizer from its description (optimizer_spec)."""
        return self._every_server(P.Kind.SET_OPTIMIZER, meta={"optimizer": spec})

    def set_compression(self, spec):
        """Compress every later push with ``spec`` (a Compression) and tell every server
        (each worker does; the servers check that they agree). Once only: MXNet cannot
        change or unset it either."""
        if self.compression is not None:
            if spec != self.compression:
                raise CompressionError(f"compression is already {self.compression.params()}; "
                                       f"it cannot be changed to {spec.params()}")
            return
        self._every_server(P.Kind.SET_COMPRESSION, meta={"compression": spec.params()}).wait()
        self.compression, self._residuals = spec, spec.residuals()

    def residuals(self):
        """This worker's compression residuals {key: flat float32} ({} without
        compression): part of a worker's checkpoint."""
        return {} if self._residuals is None else self._residuals.state()

    def load_residuals(self, residuals):
        if residuals and self._residuals is None:
            raise ValueError("the worker state holds compression residuals, but this job "
                             "compresses no pushes (sync.compression)")
        if self._residuals is not None:
            self._residuals.load(residuals)

    def get_state(self):
        """Every key's weights and optimizer state (``Gather.meta['optimizer']``: the
        servers' optimizer description)."""
        return self._every_server(P.Kind.GET_STATE)

    def set_state(self, states, spec):
        """states: key -> flat optimizer state arrays (none for a key without state); every
        server takes its slices and the optimizer ``spec``."""
        entries = []
        for key in self.placement.slices:
            arrays = states.get(key, [])
            entries.append((key, 0, arrays, arrays[0].dtype if arrays else self._keys[key].dtype))
        return self._every_server(P.Kind.SET_STATE, entries, meta={"optimizer": spec})

    def barrier(self, value=0):
        """Wait until every worker has reached the barrier; returns the largest ``value``
        (an integer >= 0) any worker passed (so rank 0 can tell all a decision)."""
        if self._failure is not None:
            raise self._failure
        if self.quorum:
            # the servers must not wait for this worker's pushes while it waits here for
            # the others (docs/spec/quorum.md, rule 2a): a slow one may need them to close
            # the round of its own push before it can reach the barrier
            self.exchange(P.Kind.PULL, [], flags=P.Flag.PAUSE, every=True).wait()
        msg = self._scheduler_call(P.Kind.BARRIER, {"group": "worker", "value": int(value)},
                                   P.Kind.BARRIER)
        return int((msg.meta or {}).get("value", 0))

    def ready(self, final=False):
        """preduce: report this worker's local step done (``final``: its last) and wait
        for the group the scheduler forms with it: (group number, member ranks)."""
        if self._failure is not None:
            raise self._failure
        meta = self._scheduler_call(P.Kind.READY, {"final": final}, P.Kind.GROUP).meta
        return meta["group"], tuple(meta["members"])

    def average(self, group, members, weights):
        """preduce: weights: (key, flat weights); every member of ``group`` sends its own,
        and each server answers with the members' average of its slices."""
        entries = [(key, group, flat, flat.dtype) for key, flat in weights]
        for key, _ in weights:
            self._key(key)
        return self.exchange(P.Kind.AVERAGE, entries, step=group,
                             meta={"members": list(members)})

    def close(self, error=None):
        """Tell the scheduler this worker is done (or failed, with ``error``), flush what is
        queued, stop the thread."""
        if self._thread.is_alive() and self._failure is None:
            try:
                self._scheduler_call(P.Kind.FINISH, {"error": error} if error else None,
                                     P.Kind.ACK)
            except JobAborted:
                pass
        self._stopping = True
        with self._lock:
            try:
                self._wake_out.send(b"", flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._thread.join(timeout=self.env.heartbeat_timeout + 5)
        self._wake_out.close(0)

    def wait(self, fut):
        """The future's result. Never waits on a future nobody will resolve: if the I/O
        thread has failed or ended (a race with a request made just then), raise why."""
        while True:
            try:
                return fut.result(timeout=1.0)
            except concurrent.futures.TimeoutError:
                if self._failure is not None:
                    raise self._failure from None
                if not self._thread.is_alive():
                    raise JobAborted("the worker's I/O thread has stopped; the job is over") \
                        from None

    # ---- requests to the servers --------------------------------------------------------
    def _key(self, key):
        k = self._keys.get(key)
        if k is None:
            raise KeyError(f"key {key} was never initialized (call init or broadcast first)")
        return k

    def exchange(self, kind, entries, *, step=0, flags=0, meta=None, reply=True, every=False):
        """The one request every call above is made of (tests also use it to send what a
        correct worker never would): send each server the slices it owns of every key, one
        message per server, or, when a server's part exceeds ``SSDSGD_CHUNK_BYTES``,
        consecutive messages of about that size, so the server applies and answers the
        first keys while the rest are still arriving (both directions of its link busy, as
        ps-lite's per-key messages achieve, with far fewer messages).

        entries: (key, per-key step, tensors (see ``_tensors``) or a ``Coded`` gradient,
        dtype); every key must be placed already. ``every``: exactly one message to every
        server, keys for it or not (a quorum's contributions and final pulls)."""
        messages = self._split(entries, None if every else self.env.chunk_bytes)
        if every:
            for server in range(self.num_servers):
                messages.setdefault(server, [[[], [], 0]])
        sizes = {key: sum(sl.count for sl in self.placement[key]) for key, _, _, _ in entries}
        dtypes = {key: np.dtype(dtype) for key, _, _, dtype in entries}
        if self.relays and reply and not every and (
                kind == P.Kind.PULL or (kind == P.Kind.PUSH and flags & P.Flag.PULL)):
            flags |= P.Flag.RELAY
        futures = self._send(kind, messages, step=step, flags=flags, meta=meta, reply=reply)
        return Gather(self, futures, sizes, dtypes) if reply else None

    def _every_server(self, kind, entries=(), meta=None):
        """One message to every server, keys or not (each must act on ``meta``), unchunked."""
        messages = self._split(entries, None)
        for server in range(self.num_servers):
            messages.setdefault(server, [[[], [], 0]])
        futures = self._send(kind, messages, meta=meta)
        sizes = {key: sum(sl.count for sl in slices) for key, slices in self.placement.slices.items()}
        dtypes = {key: k.dtype for key, k in self._keys.items()}
        return Gather(self, futures, sizes, dtypes)

    def _split(self, entries, chunk_bytes):
        """{server: [[records, tensors, bytes], ...]}: each server's slices of the entries,
        cut into messages of about ``chunk_bytes`` (None: one message per server). With
        pieces P > 1 (``self.pieces``) a part smaller than P chunks is still cut into P
        messages, of about PIECE_MIN bytes or more: the server answers the first while the
        rest arrive, so a small model's pushes and replies overlap on the link as ps-lite's
        per-key messages do. It pays on slow links and costs the server's CPU per message on
        fast ones, so by default each worker picks P by timing its steps (piece_tuner)."""
        per_server = {}
        for key, kstep, arrays, dtype in entries:
            coded = arrays if isinstance(arrays, Coded) else None
            arrays, itemsize = ([] if coded else _tensors(arrays)), np.dtype(dtype).itemsize
            for i, sl in enumerate(self.placement[key]):
                items = per_server.setdefault(sl.server, [])
                if coded:
                    items.append(((key, kstep, sl.offset, sl.count, dtype, 1, coded.encoding),
                                  [coded.payloads[i]], coded.payloads[i].nbytes))
                    continue
                items.append(((key, kstep, sl.offset, sl.count, dtype, len(arrays)),
                              [a[sl.offset:sl.offset + sl.count] for a in arrays],
                              sl.count * itemsize))
        return {server: _cut(items, chunk_bytes, self.pieces.value)
                for server, items in per_server.items()}

    def _send(self, kind, messages, *, step=0, flags=0, meta=None, reply=True):
        futures = []
        for server in sorted(messages):
            for recs, tens, _ in messages[server]:
                msg = P.Message(kind, flags=flags, step=step, records=P.make_records(recs),
                                tensors=tens, meta=meta)
                fut = self._submit(server, msg, reply)
                if fut is not None:
                    futures.append(fut)
        return futures

    def _submit(self, target, msg, want_reply):
        if self._failure is not None:
            raise self._failure
        fut = None
        with self._lock:
            if self._failure is not None:   # _fail took the futures: none would resolve
                raise self._failure
            if self._ended:
                raise JobAborted("the worker's I/O thread has stopped; the job is over")
            msg.req = next(self._req)
            msg.sender = self.rank
            frames = P.encode(msg)
            P.check_size(frames, self.env.max_message_bytes)   # else the server drops it unread
            if want_reply:
                fut = concurrent.futures.Future()
                self._futures[msg.req] = fut
                if msg.flags & P.Flag.RELAY:
                    self._reply_from[msg.req] = (target, P.reply_bound(msg.records))
            self._commands.put((target, frames))
            self._wake()
        return fut

    def _wake(self):
        """Wake the I/O thread (called with ``_lock`` held: the socket is not thread-safe).
        Never blocks: a full pipe means wake-ups are pending already, and blocking here
        while the I/O thread waits for ``_lock`` to hand over a reply deadlocked both."""
        try:
            self._wake_out.send(b"", flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _scheduler_call(self, kind, meta, reply_kind):
        fut = concurrent.futures.Future()
        with self._lock:
            self._control[reply_kind] = fut
            self._commands.put(("scheduler", P.control(kind, meta)))
            self._wake()
        waited = time.perf_counter()
        try:
            return self.wait(fut)
        finally:
            self.stats["time_blocked"] += time.perf_counter() - waited

    # ---- the I/O thread ---------------------------------------------------------------
    def _run(self):
        try:
            link, sockets = self._connect()
        except Exception as e:   # registration failed: report it to the constructor
            self._failure = e if isinstance(e, JobAborted) else JobAborted(str(e))
            self._wake_in.close(0)
            return
        finally:
            self._ready.set()
        try:
            self._serve(link, sockets)
        except JobAborted as e:
            print(f"ssdsgd worker {self.rank_or_unknown}: {e}", file=sys.stderr, flush=True)
            self._fail(e)
        except Exception as e:  # a bug here must not leave the main thread waiting
            self._fail(JobAborted(f"the worker's I/O thread failed: {e!r}"))
        finally:
            for s in sockets + list(self._relay_out.values()):
                s.close()   # LINGER flushes queued pushes (bounded by the heartbeat timeout)
            if self._relay_in is not None:
                self._relay_in.close(0)
            if self._guard is not None:
                self._guard.close()
            link.sock.close(0)
            self._wake_in.close(0)
            self._abandon()

    def _abandon(self):
        """The thread ends: fail what still waits for a reply (an engine operation waits
        on its future's callback, not on ``wait``'s poll of the thread)."""
        with self._lock:
            self._ended = True
            futures = list(self._futures.values()) + list(self._control.values())
            self._futures, self._control = {}, {}
            outbox, self._outbox = self._outbox, []
        error = self._failure or JobAborted("the worker's I/O thread has stopped; the job "
                                            "is over")
        for fut in futures:
            if not fut.done():
                fut.set_exception(error)
        for _, callback in outbox:
            callback(None, error)

    def _connect(self):
        """Register with the scheduler (with the address of this worker's pull relay, if
        it has one) and open a DEALER to every server."""
        host = port = None
        if self.env.pull_relay == "chain":
            self._guard = Guard.from_env(self.env, lambda text: print(
                f"ssdsgd worker: {text}", file=sys.stderr, flush=True))
            self._relay_in, port = bind_router(
                self.ctx, self.env.node_host, 0, "a worker's pull relay", self._guard,
                maxmsgsize=P.relay_frame_limit())
            host = self.env.node_host
            print(f"ssdsgd worker: pull relay listening on {host}:{port}; "
                  f"{self._guard.describe()}", file=sys.stderr, flush=True)
        link = SchedulerLink(self.ctx, self.env, "worker", host, port, self._guard)
        sockets = []
        try:
            self.topology = link.register()
            self._link_id = link.routing_id
            self._relay_ranks = {bytes.fromhex(h): r
                                 for r, h in enumerate(self.topology.get("workers", []))}
            for server, (host, port) in enumerate(self.topology["servers"]):
                s = self.ctx.socket(zmq.DEALER)
                sockets.append(s)
                s.setsockopt(zmq.SNDHWM, 0)
                s.setsockopt(zmq.RCVHWM, 0)
                s.setsockopt(zmq.LINGER, int(self.env.heartbeat_timeout * 1000))
                link.secure(s, server)     # this worker's connection id and keys
                s.connect(f"tcp://{host}:{port}")
        except Exception:
            for s in sockets + [link.sock]:
                s.close(0)
            raise
        return link, sockets

    def _serve(self, link, sockets):
        """Poll until ``close``: send what the main thread queued, hand replies to their
        futures, keep the heartbeats going."""
        poller = zmq.Poller()
        for s in [self._wake_in, link.sock] + sockets:
            poller.register(s, zmq.POLLIN)
        if self._relay_in is not None:
            poller.register(self._relay_in, zmq.POLLIN)
        wait_ms = max(1, int(self.env.heartbeat_interval * 1000 / 2))
        while True:
            events = dict(poller.poll(wait_ms))
            if self._wake_in in events:
                for _ in range(RECV_PER_TURN):
                    try:
                        self._wake_in.recv(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
            self._send_queued(link, sockets)
            self._send_outbox(sockets)
            if link.sock in events and self._on_scheduler(link):
                return      # the scheduler acknowledged FINISH: no more heartbeats
            for server, s in enumerate(sockets):
                if s in events:
                    self._receive(s, server)
            if self._relay_in in events:
                self._receive_relayed()
            link.tick()
            if self._stopping:
                return

    def _send_queued(self, link, sockets):
        while True:
            try:
                target, frames = self._commands.get_nowait()
            except queue.Empty:
                return
            self._sent(link.sock if target == "scheduler" else sockets[target], frames)

    def _sent(self, sock, frames):
        sock.send_multipart(frames, copy=False)
        self.stats["messages_sent"] += 1
        self.stats["bytes_sent"] += sum(
            len(f) if isinstance(f, bytes) else len(f.buffer) if isinstance(f, zmq.Frame)
            else f.nbytes for f in frames)

    def _send_outbox(self, sockets):
        """push_then's entries, one request per server for as many as can share one (a
        key twice starts another), each callback called with the replies of its group."""
        if not self._outbox:     # anything queued after this read wakes the thread again
            return
        with self._lock:
            batch, self._outbox = self._outbox, []
        group, seen = [], set()
        for entries, callback in batch:
            if any(e[0] in seen for e in entries):
                self._send_group(group, sockets)
                group, seen = [], set()
            group.append((entries, callback))
            seen.update(e[0] for e in entries)
        if group:
            self._send_group(group, sockets)

    def _send_group(self, group, sockets):
        entries = [e for es, _ in group for e in es]
        futures = []
        try:
            messages = self._split(entries, self.env.chunk_bytes)
            for server in sorted(messages):
                for recs, tens, _ in messages[server]:
                    msg = P.Message(P.Kind.PUSH, flags=P.Flag.PULL,
                                    records=P.make_records(recs), tensors=tens)
                    fut = concurrent.futures.Future()
                    with self._lock:
                        msg.req, msg.sender = next(self._req), self.rank
                        self._futures[msg.req] = fut
                    futures.append(fut)
                    frames = P.encode(msg)
                    P.check_size(frames, self.env.max_message_bytes)
                    self._sent(sockets[server], frames)
        except Exception as e:      # e.g. over the message limit: those callers fail
            for fut in futures:
                if not fut.done():
                    fut.set_exception(e)
            for _, callback in group:
                callback(None, e)
            return
        sizes = {key: sum(sl.count for sl in self.placement[key]) for key, _, _, _ in entries}
        dtypes = {key: np.dtype(dtype) for key, _, _, dtype in entries}
        Gather(self, futures, sizes, dtypes).then(
            lambda replies, error: [callback(replies, error) for _, callback in group])

    def _on_scheduler(self, link):
        """A scheduler message: resolve the barrier or finish it answers. True after the
        acknowledgement of FINISH."""
        msg = link.receive()
        if msg.kind == P.Kind.MEMBERSHIP and "from_step" in msg.meta:
            self.left.append({"rank": msg.meta["removed"], "from_step": msg.meta["from_step"],
                              "time": time.time()})
            return False
        with self._lock:
            fut = self._control.pop(msg.kind, None)
        if fut is None:
            return False
        fut.set_result(msg)
        return msg.kind == P.Kind.ACK

    def _receive(self, sock, server):
        for _ in range(RECV_PER_TURN):
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.stats["messages_received"] += 1
            self.stats["bytes_received"] += sum(len(f.buffer) for f in frames)
            try:
                msg = P.decode(frames)
                if msg.kind == P.Kind.FRAGMENT:
                    P.check_meta(msg.kind, msg.meta)
            except P.ProtocolError as e:
                raise JobAborted(f"server {server} sent a malformed message: {e}") from None
            if msg.kind == P.Kind.FRAGMENT:
                self._on_fragment(frames, msg, server, f"server {server}")
            else:
                self._deliver(msg, server)

    def _deliver(self, msg, server):
        """A server's answer (received from it, or relayed) to the future that waits."""
        with self._lock:
            fut = self._futures.pop(msg.req, None)
            self._reply_from.pop(msg.req, None)
        if fut is None:
            if msg.kind == P.Kind.ERROR:   # refused a message that wanted no reply
                raise JobAborted(f"server {server} refused a message of this worker: "
                                 f"{msg.meta.get('error')}")
            return
        if msg.kind == P.Kind.ERROR:
            fut.set_exception(ServerError(f"server {server}: {msg.meta.get('error')}"))
        else:
            fut.set_result(msg)

    # ---- sync.pull_relay: chain (docs/spec/pull_relay.md) ------------------------------
    def _receive_relayed(self):
        """Replies another worker of the job passes on. Only the job's processes can
        connect (the guard); a message from one of them that is not a server's reply to a
        request this worker sent to that server is a fault of the job: it aborts."""
        for _ in range(RECV_PER_TURN):
            try:
                frames = self._relay_in.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            ident, frames = frames[0].bytes, frames[1:]
            rank = self._relay_ranks.get(ident)
            if rank is None or self._guard.wrong_claim(frames[0], "worker", rank):
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
            self._on_fragment(frames, msg, msg.sender, f"worker {rank}")

    def _on_fragment(self, frames, msg, server, source):
        """A piece of a relayed reply: passed on first, then added to its reply; the
        reply is delivered once its last piece is in. Only pieces of a reply to a request
        this worker sent to that server are taken (bounded: one buffer per request)."""
        with self._lock:
            expected, bound = self._reply_from.get(msg.req, (None, 0))
        if expected is None or expected != msg.sender:
            raise JobAborted(f"{source} sent a piece of server {msg.sender}'s reply to "
                             f"request {msg.req}, which this worker did not send to that "
                             "server")
        if msg.meta.get("relay"):
            self._forward(frames, msg)
        try:
            part = self._pieces.get(msg.req)
            if part is None:
                part = self._pieces[msg.req] = P.Reassembly(
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
        self._deliver(reply, server)

    def _forward(self, frames, msg):
        """Pass a piece of a relayed reply on to the next worker of its chain, before
        using it."""
        (rank, req), rest = msg.meta["relay"][0], msg.meta["relay"][1:]
        if rank == self.rank or rank >= self.num_workers or not self.relays \
                or self.relays[rank] is None:
            raise JobAborted(f"server {msg.sender} asked this worker to relay its reply to "
                             f"worker {rank}, which has no pull relay")
        sock = self._relay_out.get(rank)
        if sock is None:
            sock = self._relay_out[rank] = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, int(self.env.heartbeat_timeout * 1000))
            sock.setsockopt(zmq.ROUTING_ID, self._link_id)
            if self._guard is not None:
                self._guard.client(sock, f"worker {rank}")
            host, port = self.relays[rank]
            sock.connect(f"tcp://{host}:{port}")
        meta = {k: v for k, v in msg.meta.items() if k != "relay"}
        if rest:
            meta["relay"] = rest
        self._sent(sock, P.forward(frames, req, meta))
        self.stats["replies_relayed_out"] += 1

    def _fail(self, exc):
        self._failure = exc
        with self._lock:
            futures = list(self._futures.values()) + list(self._control.values())
            self._futures, self._control = {}, {}
        for fut in futures:
            if not fut.done():
                fut.set_exception(exc)

    @property
    def failure(self):
        """Why the I/O thread stopped (a JobAborted), or None while it serves."""
        return self._failure

    @property
    def rank_or_unknown(self):
        return self.topology["rank"] if self.topology else "?"
