"""The worker's requests in flight: their numbers, the futures that wait for the servers'
replies (and the scheduler's), and ``Gather``, which puts one request's replies back
together per key. One lock orders numbering and queuing whichever thread asks; a failure
of the I/O thread reaches every waiting future, so nothing waits forever."""
import collections
import concurrent.futures
import itertools
import threading
import time

import numpy as np

from . import protocol as P
from .scheduler import JobAborted
from ..timeline import RECORDER as TIMELINE

ENDED = "the worker's I/O thread has stopped; the job is over"


class ServerError(RuntimeError):
    """A server rejected a request; the message says why."""


class KeyReply:
    __slots__ = ("value", "state", "version", "lr")

    def __init__(self, value, state, version, lr):
        self.value, self.state, self.version, self.lr = value, state, version, lr


def await_reply(table, kind, item, queued):
    """``item`` waits in ``table`` for the scheduler's next ``kind``: after those already
    waiting (``queued``: the scheduler answers a node's requests in order), else instead
    of them. The caller holds the lock that guards ``table``."""
    if queued:
        table.setdefault(kind, collections.deque()).append(item)
    else:
        table[kind] = collections.deque([item])


def take_oldest(table, kind):
    """The oldest item of ``table`` waiting for ``kind`` (removed), or None."""
    waiting = table.get(kind)
    if not waiting:
        return None
    item = waiting.popleft()
    if not waiting:
        del table[kind]
    return item


class Requests:
    """Request id -> the future of its reply (and, for a reply that may be relayed, the
    server it was sent to); scheduler reply kind -> its futures, oldest first (one at a
    time, but for ``queued`` kinds: the scheduler answers a node's requests in order)."""

    def __init__(self, stats):
        self.stats = stats
        self.lock = threading.RLock()
        self.failure = None      # why the I/O thread stopped (a JobAborted)
        self.ended = False       # the I/O thread has ended: no request can be answered
        self.alive = lambda: True   # is the I/O thread running (set by its owner)
        self._futures = {}
        self._control = {}
        self._reply_from = {}
        # request id -> (server, copied to its backup, when sent), oldest first
        self._server_of = {}
        self._req = itertools.count(1)

    def check_open(self):
        """Raise why no request can be answered any more (call with ``lock`` held)."""
        if self.failure is not None:   # fail() took the futures: none would resolve
            raise self.failure
        if self.ended:
            raise JobAborted(ENDED)

    def number(self, msg, sender):
        msg.req, msg.sender = next(self._req), sender

    def expect(self, req, relayed_from=None, server=None, copied=False):
        """The future of request ``req``'s reply; ``relayed_from``: (server, byte bound,
        keys) of a reply other workers may pass on (its pieces are taken only as that
        server's, and only up to the bound; the keys name it in errors). ``server``: where
        it goes; ``copied``: its backup got a copy (cluster.server_replicas)."""
        fut = concurrent.futures.Future()
        with self.lock:
            self._futures[req] = fut
            if server is not None:
                self._server_of[req] = (server, copied, time.monotonic())
            if relayed_from is not None:
                self._reply_from[req] = relayed_from
        return fut

    def expect_control(self, reply_kind, queued=False):
        """The future of the scheduler's next ``reply_kind``; ``queued``: after those
        already expected (else it replaces them)."""
        fut = concurrent.futures.Future()
        with self.lock:
            await_reply(self._control, reply_kind, fut, queued)
        return fut

    def take_control(self, kind):
        """The oldest future expecting ``kind``, or None."""
        with self.lock:
            return take_oldest(self._control, kind)

    def sent_to(self, req):
        """(server, byte bound, keys) of request ``req``, if its reply may be relayed;
        else (None, 0, ())."""
        with self.lock:
            return self._reply_from.get(req, (None, 0, ()))

    def deliver(self, msg, server):
        """A server's answer (received from it, or relayed) to the future that waits."""
        with self.lock:
            fut = self._futures.pop(msg.req, None)
            self._reply_from.pop(msg.req, None)
            self._server_of.pop(msg.req, None)
        if fut is None:
            if msg.kind == P.Kind.ERROR:   # refused a message that wanted no reply
                raise JobAborted(f"server {server} refused a message of this worker: "
                                 f"{msg.meta.get('error')}")
            return
        if msg.kind == P.Kind.ERROR:
            fut.set_exception(ServerError(f"server {server}: {msg.meta.get('error')}"))
        else:
            fut.set_result(msg)

    def oldest(self):
        """[server, seconds waited] of the oldest request no reply has answered, or None:
        the heartbeat's ``oldest``, which tells the scheduler which server the worker
        waits for when no worker moves (liveness.py)."""
        with self.lock:
            first = next(iter(self._server_of.values()), None)
        return None if first is None else [first[0], time.monotonic() - first[2]]

    def server_lost(self, server, error):
        """``server`` died and its backup took over: the requests it was sent that its
        backup got no copy of get ``error``; the backup answers the others."""
        with self.lock:
            lost = [req for req, (s, copied, _) in self._server_of.items()
                    if s == server and not copied]
            futures = [self._futures.pop(req, None) for req in lost]
            for req in lost:
                self._server_of.pop(req, None)
        for fut in futures:
            if fut is not None and not fut.done():
                fut.set_exception(error)
        return len(lost)

    def fail(self, exc):
        """The I/O thread failed: every waiting future and every later request get ``exc``."""
        with self.lock:
            self.failure = exc
        self._fail_waiting(exc)

    def end(self, error):
        """The I/O thread ended: every waiting future gets ``error``; no later request is
        taken."""
        with self.lock:
            self.ended = True
        self._fail_waiting(error)

    def _fail_waiting(self, exc):
        with self.lock:
            futures = list(self._futures.values()) + [
                fut for waiting in self._control.values() for fut in waiting]
            self._futures, self._control, self._server_of = {}, {}, {}
        for fut in futures:
            if not fut.done():
                fut.set_exception(exc)

    def wait(self, fut):
        """The future's result. Never waits on a future nobody will resolve: if the I/O
        thread has failed or ended (a race with a request made just then), raise why."""
        while True:
            try:
                return fut.result(timeout=1.0)
            except concurrent.futures.TimeoutError:
                if self.failure is not None:
                    raise self.failure from None
                if not self.alive():
                    raise JobAborted(ENDED) from None


class Gather:
    """The replies of one request sent to several servers, reassembled per key.

    ``wait()`` returns {key: KeyReply}; afterwards ``meta`` holds the replies' meta
    (e.g. the servers' optimizer description in a get_state reply)."""

    def __init__(self, requests, futures, sizes, dtypes):
        self.requests, self.futures, self.sizes, self.dtypes = requests, futures, sizes, dtypes
        self.meta = {}

    def wait(self):
        out, waited = {}, time.perf_counter()
        for fut in self.futures:
            self._take(out, self.requests.wait(fut))
        end = time.perf_counter()
        self.requests.stats["time_blocked"] += end - waited
        TIMELINE.span("blocked", waited, end)
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
