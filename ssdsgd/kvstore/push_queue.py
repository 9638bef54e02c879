"""Pushes that wait for another thread to be coded and sent, so the caller's thread does
not: ``PushQueue`` (a steps-delay push that nobody waits for, coded on a thread of its
own) and ``PushOutbox`` (``kv.pushpull``'s key-by-key pushes, sent by the I/O thread);
``PushCoder``, a push's compression with this worker's residuals, runs on either thread.

Why a thread of its own: coding a push is numpy work proportional to the model (2bit or
topk with the residuals, then the protocol's encoding), 0.6-0.8 s a step for ResNet-50's
102 MB on this machine. On the training thread it came before the next forward and
backward; on this thread it runs while MXNet's engine threads compute them (numpy and
MXNet's kernels release the GIL). One thread, first in first out, because pushes must
reach each server in the order they are numbered, with the residuals updated in that
order: a request made after a queued push (a pull, a push that is waited for, a command)
waits for the queue to empty first (``flush``), so nothing overtakes it.
"""
import collections
import threading
import time

import numpy as np

from .compression import CompressionError
from .splitting import Coded


class PushCoder:
    """The job's push compression (``spec``, a codec's settings, or None) and this
    worker's error feedback, one residual per key. The residuals change with every push,
    so pushes must be coded one at a time and in their numbered order."""

    SPARES = 2          # arrays kept per key for ``copy`` (a push in flight, the next)

    def __init__(self):
        self.spec = None
        self._residuals = None
        self._spares = {}   # key -> arrays ``copy`` may reuse (coded pushes': unused now)

    def set(self, spec):
        """Compress every later push with ``spec``; True if that is new (the servers must
        be told), False if it is already so. Once only: MXNet cannot change it either."""
        if self.spec is not None:
            if spec != self.spec:
                raise CompressionError(f"compression is already {self.spec.params()}; "
                                       f"it cannot be changed to {spec.params()}")
            return False
        return True

    def start(self, spec):
        """The servers know ``spec``: code from now on."""
        self.spec, self._residuals = spec, spec.residuals()

    def copy(self, grads):
        """(key, flat) with each array copied into one of this worker's own. When pushes
        are compressed, nothing refers to a copy once it is coded (``code(spare=True)``
        gives it back), so the copies are reused: a fresh 102 MB a step cost its page
        faults, as long as coding it on this machine. Else they are new (the messages'
        frames refer to them until the I/O thread has sent them)."""
        if self.spec is None:
            return [(key, np.array(flat)) for key, flat in grads]
        out = []
        for key, flat in grads:
            spare = self._spares.get(key)      # only this (the caller's) thread takes
            buf = spare.pop() if spare else None
            if buf is None or buf.shape != flat.shape or buf.dtype != flat.dtype:
                buf = np.empty(flat.shape, flat.dtype)
            np.copyto(buf, flat)
            out.append((key, buf))
        return out

    def code(self, entries, placement, spare=False):
        """entries (key, per-key step, flat gradient, dtype), coded for the servers'
        slices of each key if pushes are compressed (the residuals updated); ``spare``:
        the gradients are ``copy``'s, which may then be reused."""
        if self._residuals is None:
            return entries
        coded = [(key, n, Coded(self.spec.type, self._residuals.encode(
            key, flat, [(sl.offset, sl.count) for sl in placement[key]])), dtype)
            for key, n, flat, dtype in entries]
        for key, _, flat, _ in entries if spare else ():
            spares = self._spares.setdefault(key, [])
            if len(spares) < self.SPARES:
                spares.append(flat)
        return coded

    def state(self):
        """{key: residual} (copies; {} without compression): part of a worker checkpoint."""
        return {} if self._residuals is None else self._residuals.state()

    def load(self, residuals):
        if residuals and self._residuals is None:
            raise ValueError("the worker state holds compression residuals, but this job "
                             "compresses no pushes (sync.compression)")
        if self._residuals is not None:
            self._residuals.load(residuals)


class PushQueue:
    """Jobs (callables: code a push and hand it to the I/O thread) run in order on one
    thread, started with the first. ``stats['time_blocked']`` counts the caller's waits.

    A job's failure (over the message limit, a codec's error, the I/O thread ended) is
    kept and raised by every later ``put`` and ``flush``: the jobs queued behind it are
    dropped, and the pushes numbered after it cannot be sent in order, so the client
    cannot go on (a push that fails on the caller's thread likewise ends the job)."""

    def __init__(self, stats, name="ssdsgd-push"):
        self.stats, self.name = stats, name
        self._jobs = collections.deque()   # the first is running while it is there
        self._cond = threading.Condition()
        self._error = None
        self._reported = False     # the error was raised to a caller
        self._closed = False
        self._thread = None

    def put(self, job, bound, after=()):
        """Queue ``job``, to run once the pending writes of ``after`` are done (NDArrays
        the caller's step updates: coding while MXNet's engine computes them would take
        the CPU from the step's own work, which the next forward pass waits for); first
        wait while ``bound`` jobs are queued or running (the steps-ahead bound: a worker
        holds no more pushes than the servers accept)."""
        with self._cond:
            self._raise()
            if len(self._jobs) >= bound:
                self._wait(lambda: len(self._jobs) < bound or self._error is not None)
                self._raise()
            if self._closed:
                raise RuntimeError("the push queue is closed")
            self._jobs.append((job, after))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self):
        """Wait until every queued job has run; raise a failure among them. A no-op on
        the queue's own thread (a job's request is already in order)."""
        if threading.current_thread() is self._thread:
            return
        with self._cond:
            if self._jobs:
                self._wait(lambda: not self._jobs)
            self._raise()

    @property
    def pending(self):
        """Jobs queued or running."""
        return len(self._jobs)

    def close(self):
        """Run what is queued, end the thread; the failure no caller has seen yet (None
        if there is none), to be reported by the one who closes."""
        with self._cond:
            self._wait(lambda: not self._jobs)
            self._closed = True
            self._cond.notify_all()
            error, self._reported = (None if self._reported else self._error), True
        if self._thread is not None:
            self._thread.join()
        return error

    def _wait(self, ready):
        """Wait (holding ``_cond``) until ``ready()``; the time counts as blocked."""
        waited = time.perf_counter()
        self._cond.wait_for(ready)
        self.stats["time_blocked"] += time.perf_counter() - waited

    def _raise(self):
        if self._error is not None:
            self._reported = True
            raise self._error

    def _run(self):
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closed)
                if not self._jobs:
                    return
                job, after = self._jobs[0]
            try:
                for nd in after:
                    nd.wait_to_read()
                job()
                error = None
            except BaseException as e:     # noqa: BLE001 - raised by the caller's next call
                error = e
            with self._cond:
                self._jobs.popleft()
                if error is not None and self._error is None:
                    self._error = error
                if self._error is not None:
                    self._jobs.clear()
                self._cond.notify_all()


class PushOutbox:
    """push_then's entries, waiting for the I/O thread, which empties the outbox every
    turn into one request per server for as many as can share one (a key twice starts
    another); each callback is called with the replies of its group. ``send(entries)``:
    the client's send path, returning the Gather of the replies."""

    def __init__(self, lock, send):
        self.lock, self.send = lock, send
        self._items = []

    def add(self, entries, callback):
        """Queue (call with ``lock`` held); True if the I/O thread must be woken."""
        self._items.append((entries, callback))
        return len(self._items) == 1

    def flush(self):
        if not self._items:     # anything queued after this read wakes the thread again
            return
        with self.lock:
            batch, self._items = self._items, []
        group, seen = [], set()
        for entries, callback in batch:
            if any(e[0] in seen for e in entries):
                self._send_group(group)
                group, seen = [], set()
            group.append((entries, callback))
            seen.update(e[0] for e in entries)
        if group:
            self._send_group(group)

    def _send_group(self, group):
        try:
            gather = self.send([e for es, _ in group for e in es])
        except Exception as e:      # e.g. over the message limit: those callers fail
            for _, callback in group:
                callback(None, e)
            return
        gather.then(lambda replies, error: [callback(replies, error) for _, callback in group])

    def fail(self, error):
        """The I/O thread ended: every queued callback gets ``error``."""
        with self.lock:
            batch, self._items = self._items, []
        for _, callback in batch:
            callback(None, error)
