"""The worker's side of the wire: one I/O thread that owns every socket.

ZeroMQ sockets belong to one thread, and SSD-SGD needs pushes and pulls in flight while
the main thread computes, so all socket work happens on a background thread: the main
thread hands it encoded messages and gets ``Future``s back. The same thread keeps the
heartbeats going while the main thread computes, and turns a scheduler ABORT (a dead peer)
or a silent scheduler into an exception on every waiting future, so nothing waits forever.

``exchange`` splits per-key arrays over the servers by the key placement (slices of big
keys included), one message per server, and ``Gather.wait`` puts the replies back together.
"""
import concurrent.futures
import itertools
import queue
import sys
import threading
import time

import numpy as np
import zmq

from . import protocol as P
from .scheduler import JobAborted, SchedulerLink
from .sharding import Placement


class ServerError(RuntimeError):
    """A server rejected a request; the message says why."""


class KeyReply:
    __slots__ = ("value", "state", "version", "lr")

    def __init__(self, value, state, version, lr):
        self.value, self.state, self.version, self.lr = value, state, version, lr


class Gather:
    """The replies of one request sent to several servers, reassembled per key."""

    def __init__(self, client, futures, sizes, dtypes):
        self.client, self.futures, self.sizes, self.dtypes = client, futures, sizes, dtypes

    def done(self):
        return all(f.done() for f in self.futures)

    def wait(self):
        out, waited = {}, time.perf_counter()
        for fut in self.futures:
            msg = self.client.wait(fut)
            lr = msg.meta.get("lr") if msg.meta else None
            for rec, arrays in zip(msg.records, msg.tensors):
                key = int(rec["key"])
                off, n = int(rec["offset"]), int(rec["count"])
                kr = out.get(key)
                if kr is None and n == self.sizes[key]:     # one piece: keep the received buffer
                    out[key] = KeyReply(arrays[0], list(arrays[1:]), int(rec["step"]), lr)
                    continue
                if kr is None:
                    size, dt = self.sizes[key], self.dtypes[key]
                    kr = out[key] = KeyReply(np.empty(size, dt),
                                             [np.empty(size, dt) for _ in arrays[1:]],
                                             int(rec["step"]), lr)
                kr.value[off:off + n] = arrays[0]
                for dst, src in zip(kr.state, arrays[1:]):
                    dst[off:off + n] = src
                kr.version = min(kr.version, int(rec["step"]))
        self.client.stats["time_blocked"] += time.perf_counter() - waited
        return out


class WorkerClient:
    def __init__(self, env):
        self.env = env
        self.ctx = zmq.Context.instance()
        self.stats = {"bytes_sent": 0, "bytes_received": 0, "messages_sent": 0,
                      "messages_received": 0, "time_blocked": 0.0}
        self._commands = queue.SimpleQueue()
        self._futures = {}
        self._req = itertools.count(1)
        self._lock = threading.Lock()
        self._failure = None
        self._stopping = False
        self._ready = threading.Event()
        addr = f"inproc://ssdsgd-wake-{id(self)}"
        self._wake_in = self.ctx.socket(zmq.PAIR)
        self._wake_in.bind(addr)
        self._wake_out = self.ctx.socket(zmq.PAIR)
        self._wake_out.connect(addr)
        self._barrier = None
        self._finished = None
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

    # ---- main-thread API -------------------------------------------------------------
    def _submit(self, target, msg, want_reply):
        if self._failure is not None:
            raise self._failure
        fut = None
        with self._lock:
            msg.req = next(self._req)
            msg.sender = self.rank
            frames = P.encode(msg)
            P.check_size(frames, self.env.max_message_bytes)   # else the server drops it unread
            if want_reply:
                fut = concurrent.futures.Future()
                self._futures[msg.req] = fut
            self._commands.put((target, frames))
            self._wake_out.send(b"")
        return fut

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

    def request(self, server, msg):
        return self._submit(server, msg, True)

    def post(self, server, msg):
        self._submit(server, msg, False)

    def exchange(self, kind, entries, *, step=0, flags=0, meta=None, reply=True):
        """Send each server the slices it owns of every key: one message per server, or,
        when a server's part of the step exceeds ``SSDSGD_CHUNK_BYTES``, consecutive
        messages of about that size, so the server applies and answers the first keys
        while the rest are still arriving (both directions of its link busy, as ps-lite's
        per-key messages achieve, with far fewer messages).

        entries: (key, per-key step, flat array or None for "no tensor" (a pull), dtype);
        every key must be placed already."""
        per_server = {}
        sizes, dtypes = {}, {}
        for key, kstep, array, dtype in entries:
            size = sum(sl.count for sl in self.placement[key])
            sizes[key], dtypes[key] = size, np.dtype(dtype)
            for sl in self.placement[key]:
                chunks = per_server.setdefault(sl.server, [[[], [], 0]])
                nbytes = sl.count * dtypes[key].itemsize
                if chunks[-1][0] and chunks[-1][2] + nbytes > self.env.chunk_bytes:
                    chunks.append([[], [], 0])
                recs, tens, _ = chunk = chunks[-1]
                chunk[2] += nbytes
                if array is None:
                    recs.append((key, kstep, sl.offset, sl.count, dtype, 0))
                    tens.append([])
                else:
                    recs.append((key, kstep, sl.offset, sl.count, dtype, 1))
                    tens.append([array[sl.offset:sl.offset + sl.count]])
        futures = []
        for server in sorted(per_server):
            for recs, tens, _ in per_server[server]:
                msg = P.Message(kind, flags=flags, step=step, records=P.make_records(recs),
                                tensors=tens, meta=meta)
                fut = self._submit(server, msg, reply)
                if fut is not None:
                    futures.append(fut)
        return Gather(self, futures, sizes, dtypes) if reply else None

    def _scheduler_call(self, kind, meta, attr):
        fut = concurrent.futures.Future()
        setattr(self, attr, fut)
        with self._lock:
            self._commands.put(("scheduler", P.control(kind, meta)))
            self._wake_out.send(b"")
        waited = time.perf_counter()
        try:
            return self.wait(fut)
        finally:
            self.stats["time_blocked"] += time.perf_counter() - waited

    def barrier(self):
        """Wait until every worker has reached the barrier."""
        if self._failure is not None:
            raise self._failure
        self._scheduler_call(P.Kind.BARRIER, {"group": "worker"}, "_barrier")

    def close(self, error=None):
        """Tell the scheduler this worker is done (or failed, with ``error``), flush what is
        queued, stop the thread."""
        if self._thread.is_alive() and self._failure is None:
            try:
                self._scheduler_call(P.Kind.FINISH, {"error": error} if error else None,
                                     "_finished")
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

    # ---- the I/O thread ---------------------------------------------------------------
    def _fail(self, exc):
        self._failure = exc
        with self._lock:
            futures, self._futures = list(self._futures.values()), {}
        for fut in futures + [self._barrier, self._finished]:
            if fut is not None and not fut.done():
                fut.set_exception(exc)

    def _run(self):
        sockets = []
        link = None
        try:
            link = SchedulerLink(self.ctx, self.env, "worker")
            self.topology = link.register()
            for host, port in self.topology["servers"]:
                s = self.ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.SNDHWM, 0)
                s.setsockopt(zmq.RCVHWM, 0)
                s.setsockopt(zmq.LINGER, int(self.env.heartbeat_timeout * 1000))
                link.secure(s)     # this worker's connection id and the job's keys
                s.connect(f"tcp://{host}:{port}")
                sockets.append(s)
        except Exception as e:   # registration failed: report it to the constructor
            self._failure = e if isinstance(e, JobAborted) else JobAborted(str(e))
            self._ready.set()
            for s in sockets + ([link.sock] if link else []):
                s.close(0)
            self._wake_in.close(0)
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(self._wake_in, zmq.POLLIN)
        poller.register(link.sock, zmq.POLLIN)
        for s in sockets:
            poller.register(s, zmq.POLLIN)
        index = {s: i for i, s in enumerate(sockets)}
        wait_ms = max(1, int(self.env.heartbeat_interval * 1000 / 2))
        try:
            while True:
                events = dict(poller.poll(wait_ms))
                if self._wake_in in events:
                    while self._wake_in.poll(0):
                        self._wake_in.recv()
                while True:
                    try:
                        target, frames = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    sock = link.sock if target == "scheduler" else sockets[target]
                    sock.send_multipart(frames, copy=False)
                    self.stats["messages_sent"] += 1
                    self.stats["bytes_sent"] += sum(len(f) if isinstance(f, bytes) else f.nbytes
                                                    for f in frames)
                if link.sock in events:
                    msg = link.receive()
                    if msg.kind == P.Kind.BARRIER and self._barrier is not None:
                        self._barrier.set_result(msg)
                    elif msg.kind == P.Kind.ACK and self._finished is not None:
                        self._finished.set_result(msg)
                        link.sock.close(0)  # done with the scheduler: no more heartbeats
                        link = None
                        break
                for s in sockets:
                    if s in events:
                        self._receive(s, index[s])
                link.tick()
                if self._stopping:
                    break
        except JobAborted as e:
            print(f"ssdsgd worker {self.rank_or_unknown}: {e}", file=sys.stderr, flush=True)
            self._fail(e)
        except Exception as e:  # a bug here must not leave the main thread waiting
            self._fail(JobAborted(f"the worker's I/O thread failed: {e!r}"))
        finally:
            for s in sockets:
                s.close()   # LINGER flushes queued pushes (bounded by the heartbeat timeout)
            if link is not None:
                link.sock.close(0)
            self._wake_in.close(0)

    @property
    def rank_or_unknown(self):
        return self.topology["rank"] if self.topology else "?"

    def _receive(self, sock, server):
        while True:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.stats["messages_received"] += 1
            self.stats["bytes_received"] += sum(len(f.buffer) for f in frames)
            try:
                msg = P.decode(frames)
            except P.ProtocolError as e:
                raise JobAborted(f"server {server} sent a malformed message: {e}") from None
            with self._lock:
                fut = self._futures.pop(msg.req, None)
            if fut is None:
                if msg.kind == P.Kind.ERROR:   # refused a message that wanted no reply
                    raise JobAborted(f"server {server} refused a message of this worker: "
                                     f"{msg.meta.get('error')}")
                continue
            if msg.kind == P.Kind.ERROR:
                fut.set_exception(ServerError(f"server {server}: {msg.meta.get('error')}"))
            else:
                fut.set_result(msg)
