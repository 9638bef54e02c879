"""Synchronous steps queued on MXNet's engine (``StageMachine.step_deferred``): ssgd's
and asgd's ``kv.pushpull`` as an asynchronous engine operation, as ps-lite's is.

Apart from the stage machine because it is the one part of a worker that runs on two
threads: a step is queued on the caller's thread and completed on the client's I/O
thread, which writes the reply into the outputs and the key's record and keeps the first
failure for the caller's next call (``DeferredSteps.settle``). The rest of the machine
runs on the caller's thread alone and settles these steps before it touches a key.

A script that calls ``kv.pushpull`` key by key passes the same gradient and output arrays
every round, and an NDArray's device, shape, dtype and buffer never change while it
exists. So what the queued operation needs -- which arrays it reads and writes, as the
engine's C call takes them, and numpy views of their buffers -- is worked out once per
key and kept while the caller passes the same arrays (``KeyOp.matches``): about a third of
a key's Python cost on the calling thread, and a plain numpy copy of the reply instead of
one through ctypes on the I/O thread.
"""
import math
import threading

import mxnet as mx
import numpy as np

from ..mxglue import engineop, hostcopy, layout
from ..timeline import RECORDER as TIMELINE, now

#: The timeline's lane of a whole step queued on the engine: its wait for the round is
#: the engine's, not the training thread's (docs/training.md, "The timeline").
ENGINE_LANE = "engine"


def device_sum(nd_list):
    """The worker's gradient of a key: the sum over its devices."""
    if len(nd_list) == 1:
        return nd_list[0]
    return mx.nd.add_n(*[x.as_in_context(nd_list[0].context) for x in nd_list])


class KeyOp:
    """The arrays of one key's queued pushpull.

    ``grad``: the CPU array the push reads (the gradient, or its sum over devices or its
    copy from a GPU); ``dests``: the CPU arrays the reply is written into; ``staged``:
    (CPU array, output on another device) pairs copied after the operation. Views of the
    CPU buffers are taken inside the operation (``grad_view``, ``write``), where the
    engine guarantees nothing else touches those arrays."""
    __slots__ = ("key", "grad_list", "outs", "grad", "dtype", "size", "dests", "staged",
                 "reusable", "arrays", "callers_cpu", "_grad_view", "_dest_views")

    def __init__(self, key, shape, grad_list, outs):
        self.key, self.grad_list, self.outs = key, tuple(grad_list), \
            None if outs is None else tuple(outs)
        grad = device_sum(grad_list)
        on_cpu, got, self.dtype = hostcopy.describe(grad)
        if got != shape:
            raise ValueError(f"key {key}: a gradient of shape {got} for a key of shape {shape}")
        self.size = math.prod(shape)
        self.grad = grad if on_cpu else grad.copyto(mx.cpu())
        self.dests, self.staged = [], []
        stage = None
        for out in (outs if outs is not None else grad_list):
            on_cpu, got, dtype = hostcopy.describe(out)
            if got != shape:
                raise ValueError(f"key {key}: an output of shape {got} for a key of shape "
                                 f"{shape}")
            if on_cpu:
                self.dests.append((out, dtype))
                continue
            if stage is None:       # one CPU array for all of the key's other outputs
                stage = mx.nd.empty(shape, ctx=mx.cpu(), dtype=dtype)
                self.dests.append((stage, dtype))
            self.staged.append((stage, out))
        # Kept for the next call only if it holds no array made for this call.
        self.reusable = len(self.grad_list) == 1 and on_cpu and self.grad is grad_list[0] \
            and not self.staged
        self.arrays = engineop.Arrays(*_reads_writes([self])) if self.reusable else None
        self._grad_view = self._dest_views = None
        # The caller's CPU arrays, whose layout an inference pass may change (layout.py);
        # the arrays made here never go through an operator that does.
        self.callers_cpu = tuple(nd for nd in (*self.grad_list, *(self.outs or ()))
                                 if nd.context.device_type == "cpu")

    def matches(self, grad_list, outs):
        """Does a call with these arrays queue what this op does?"""
        if len(grad_list) != 1 or grad_list[0] is not self.grad_list[0]:
            return False
        if outs is None or self.outs is None:
            return outs is None and self.outs is None
        return len(outs) == len(self.outs) and all(a is b for a, b in zip(outs, self.outs))

    def grad_view(self):
        """A flat view of the gradient's buffer (inside the operation only)."""
        if self._grad_view is None or not self.reusable:
            self._grad_view = hostcopy.raw_view(self.grad, self.dtype, self.size)
        return self._grad_view

    def write(self, value):
        """The reply's values into every destination (inside the operation only)."""
        if value.size != self.size:
            raise ValueError(f"key {self.key}: a reply of {value.size} values for a key of "
                             f"{self.size}")
        if self._dest_views is None or not self.reusable:
            self._dest_views = [hostcopy.raw_view(nd, dtype, self.size)
                                for nd, dtype in self.dests]
        for view in self._dest_views:
            np.copyto(view, value, casting="unsafe")


def _reads_writes(ops):
    """The arrays an operation for ``ops`` reads and writes (an array written is not also
    listed as read: the engine takes each array once)."""
    writes = {nd.handle.value: nd for op in ops for nd, _ in op.dests}
    reads = {nd.handle.value: nd for op in ops if op.grad.handle.value not in writes
             for nd in (op.grad,)}
    return list(reads.values()), list(writes.values())


def engine_arrays(ops):
    """The ``engineop.Arrays`` of one operation for ``ops`` (built once for a lone
    reusable op)."""
    if len(ops) == 1 and ops[0].arrays is not None:
        return ops[0].arrays
    return engineop.Arrays(*_reads_writes(ops))


class DeferredSteps:
    """The steps queued on the engine since the last ``settle`` and their first failure.
    ``keys``: the machine's key -> ``KeyRecord`` (each record keeps its key's last
    ``KeyOp``, and takes the reply as the newest global weights, as of the step
    ``dated(reply, t)`` says: the machine's rule, t or a quorum's rounds closed).
    ``quorum``: the machine's; a quorum's step is one contribution to a round, sent to
    every server in one message and not cut (docs/spec/quorum.md): ``client.push``'s
    path, not the outbox's, which groups key-by-key calls."""

    def __init__(self, client, keys, dated, quorum):
        self.client, self.keys = client, keys
        self.dated = dated           # (reply, step) -> the step its weights are as of
        self.quorum = quorum
        self.queued = False          # steps queued on MXNet's engine since the last settle
        self.error = None            # the first failure of one of them, raised next call
        self.layouts = layout.QueuedArrays()   # what was restored last, per key

    @staticmethod
    def can_queue(entries):
        """Dense arrays only, where MXNet's engine takes an operation from outside."""
        return engineop.available() and all(
            type(nd) is mx.nd.NDArray for _, grads, outs in entries
            for nd in list(grads) + list(outs or []))

    def queue(self, entries, t, priority, timed=False):
        """Queue step ``t`` (see ``StageMachine.step_deferred``); ``timed``: a whole
        step, which the pipeline pieces' tuner times as it leaves, and which the timeline
        records on the lane ``engine`` (``pull`` with ``waits_for`` t, from the moment the
        engine runs the operation to the reply written; inside it ``push`` and ``blocked``,
        the wait for the round that the next forward pass shares)."""
        self.raise_error()
        ops = [self._key_op(key, grad_list, outs) for key, grad_list, outs in entries]
        if len(ops) > 1 and len({op.key for op in ops}) < len(ops):
            raise ValueError("a key appears twice in one pushpull")

        spans = StepSpans(t) if timed and TIMELINE.on else None
        # The operation reads and writes the arrays' buffers; one in a oneDNN layout since
        # an inference pass must be put back first, here: inside the operation MXNet cannot
        # (mxglue/layout.py).
        self.layouts.before_queue((op.key, op.callers_cpu) for op in ops)

        if self.quorum:         # the final pull writes the final model into the outputs
            for op in ops:
                if op.outs is not None:
                    self.keys[op.key].outs = list(op.outs)

        def run(done):
            if spans is not None:
                spans.began()
            try:
                then = lambda replies, error: self._done(t, ops, replies, error, done, spans)
                grads = [(op.key, op.grad_view()) for op in ops]
                if self.quorum:
                    self.client.push(t, grads, pull=True).then(then)
                else:
                    if timed:
                        self.client.mark_step()
                    self.client.push_then(grads, then)
                if spans is not None:
                    spans.pushed()
            except Exception as e:
                self._done(t, ops, None, e, done)

        engineop.push_arrays(run, engine_arrays(ops), priority)
        for op in ops:
            for src, out in op.staged:
                src.copyto(out)
        self.queued = True

    def _key_op(self, key, grad_list, outs):
        """The key's ``KeyOp`` for these arrays: the last one if they are the same."""
        record = self.keys.get(key)
        if record is None:
            raise KeyError(f"key {key} was never initialized (call init or broadcast first)")
        op = record.deferred
        if op is not None and op.matches(grad_list, outs):
            return op
        op = KeyOp(key, record.shape, grad_list, outs)
        record.deferred = op if op.reusable else None
        return op

    def _done(self, t, ops, replies, error, done, spans=None):
        """On the I/O thread: the reply into the outputs, then the engine is told.
        ``spans``: the step's timeline spans, told when its reply arrived and was
        written."""
        if spans is not None:
            spans.arrived()
        try:
            if error is None:
                for op in ops:
                    reply = replies[op.key]
                    self.keys[op.key].remember(reply, self.dated(reply, t))
                    op.write(reply.value)
        except Exception as e:
            error = e
        finally:
            if error is not None and self.error is None:
                self.error = error
            if spans is not None and error is None:
                spans.written()
            done()

    def raise_error(self):
        """Raise the failure of a step queued on the engine (once)."""
        error, self.error = self.error, None
        if error is not None:
            raise error

    def settle(self):
        """Wait for the steps queued on the engine (their replies are written by the I/O
        thread, so this cannot wait on itself) and raise a failure among them."""
        if self.queued:
            mx.nd.waitall()
            self.queued = False
        self.raise_error()


class StepSpans:
    """The timeline's spans of one whole step queued on the engine, on the lane
    ``engine``: ``pull`` (waits_for t) from the moment the engine runs the step to its
    reply written, holding ``push`` (until ``push_then`` returned) and ``blocked`` (from
    then to the reply). The engine's thread and the I/O thread each learn half of the
    times, in either order (a reply can come before ``push_then`` returns): whichever
    learns the last records all three, so they nest."""
    __slots__ = ("t", "lock", "times")

    def __init__(self, t):
        self.t, self.lock, self.times = t, threading.Lock(), {}

    def began(self):
        self.times["began"] = now()

    def pushed(self):
        self._at("pushed")

    def arrived(self):
        self.times["arrived"] = now()

    def written(self):
        self._at("written")

    def _at(self, name):
        with self.lock:
            self.times[name] = now()
            if not {"pushed", "written"} <= set(self.times):
                return
        times = self.times
        pushed = min(times["pushed"], times["arrived"])
        TIMELINE.span("push", times["began"], pushed, lane=ENGINE_LANE, key="step",
                      value=self.t)
        TIMELINE.span("blocked", pushed, times["arrived"], lane=ENGINE_LANE)
        TIMELINE.span("pull", times["began"], times["written"], lane=ENGINE_LANE,
                      key="waits_for", value=self.t)
