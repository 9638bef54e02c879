"""Asynchronous operations on MXNet's engine, as ps-lite's kvstore queues its push and pull.

``push(run, reads, writes)`` queues ``run(done)`` behind every pending write of ``reads``
and every pending access of ``writes`` and returns at once; ``writes`` stay pending (a
later ``wait_to_read`` or operator waits) until ``done()`` is called, from any thread
(the worker's I/O thread, when a reply has been written into them). So a script that
calls ``kv.pushpull`` key by key has every key on the wire at once and waits once.

MXNet 1.9's C API (``MXEnginePushAsyncND``) calls ``run``'s C function with a pointer to
a ``CallbackOnComplete`` that lives only during that call: its three pointers (function,
engine, operation) are copied out, and ``done`` calls the function with them later. The
operation is ``FnProperty::kAsync``: the engine runs it on the pushing thread when its
inputs are ready (no hand-over to an engine thread), else on an engine thread later.

``done`` cannot pass an error to the engine (that needs a C++ ``dmlc::Error``): a failed
operation completes normally and the caller reports the failure itself (the stage machine
raises it at the next kvstore call). Under ``NaiveEngine`` every operation must complete
before the push returns, so ``available()`` is False there and callers stay synchronous.
"""
import ctypes
import itertools
import os
import sys
import threading

from mxnet.base import _LIB, check_call

_ASYNC_FUNC = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
# Called with the GIL held (it only updates the engine's bookkeeping and queues the
# operations it unblocks for the engine's threads).
_ON_COMPLETE = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_CPU = (ctypes.c_int * 2)(1, 0)             # mxnet::Context{kCPU, 0}
_ASYNC_PROP = ctypes.c_int(4)               # mxnet::FnProperty::kAsync
_NAME = b"ssdsgd_kvstore"
_CPU_P = ctypes.cast(ctypes.pointer(_CPU), ctypes.c_void_p)
_ASYNC_PROP_P = ctypes.cast(ctypes.pointer(_ASYNC_PROP), ctypes.c_void_p)

_ops = {}                   # operation id -> (run, the arrays it must keep alive)
_ids = itertools.count(1)   # 0 would arrive as a NULL pointer
_completers = {}            # the engine's completion function (an address) -> callable


_AVAILABLE = os.environ.get("MXNET_ENGINE_TYPE", "") != "NaiveEngine"   # read once by MXNet
# Called without releasing the GIL (PyDLL): the operation usually runs at once, on this
# thread, in Python (``_execute``); releasing the GIL around the call would hand it to the
# I/O thread and wait for it back, at every push.
_PUSH = ctypes.PyDLL(_LIB._name).MXEnginePushAsyncND
_PUSH.restype = ctypes.c_int
_PUSH.argtypes = [
    _ASYNC_FUNC, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
    ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
    ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_bool]


def available():
    """True where the engine runs operations asynchronously (not ``NaiveEngine``)."""
    return _AVAILABLE


class Done:
    """The engine's completion of one operation; the first call completes it, later calls
    do nothing (the engine must never hear twice of one operation)."""
    __slots__ = ("_callback", "_lock")

    def __init__(self, callback):
        self._callback = callback
        self._lock = threading.Lock()

    def __call__(self):
        with self._lock:
            callback, self._callback = self._callback, None
        if callback is not None:
            function, engine, operation = callback
            call = _completers.get(function)
            if call is None:       # one engine function completes every operation
                call = _completers[function] = _ON_COMPLETE(function)
            call(engine, operation, None)


@_ASYNC_FUNC
def _execute(_run_context, on_complete, op_id):
    done = Done(tuple((ctypes.c_void_p * 3).from_address(on_complete)))
    run, _ = _ops.pop(op_id, (None, None))
    try:
        run(done)
    except BaseException as e:      # must not escape into C; run reports its own errors
        print(f"ssdsgd: an engine operation failed: {e!r}", file=sys.stderr, flush=True)
        done()


class Arrays:
    """The read and written arrays of an operation, as the engine's C call takes them,
    built once for arrays that are queued again and again (kv.pushpull key by key: the
    same gradient and output every round); it keeps them alive."""
    __slots__ = ("keep", "const", "n_const", "mutable", "n_mutable")

    def __init__(self, reads, writes):
        self.keep = list(reads) + list(writes)
        self.const = (ctypes.c_void_p * len(reads))(*[nd.handle.value for nd in reads])
        self.mutable = (ctypes.c_void_p * len(writes))(*[nd.handle.value for nd in writes])
        self.n_const, self.n_mutable = len(reads), len(writes)


def push(run, reads, writes, priority=0):
    """Queue ``run(done)`` with CPU NDArrays ``reads`` (read) and ``writes`` (written);
    ``run`` must see to it that ``done()`` is called once ``writes`` hold their values
    (or the operation failed), else every later access of ``writes`` waits forever."""
    push_arrays(run, Arrays(reads, writes), priority)


def push_arrays(run, arrays, priority=0):
    """``push`` with the arrays of an ``Arrays`` (no array may be in both lists)."""
    op_id = next(_ids)
    _ops[op_id] = (run, arrays)
    try:
        check_call(_PUSH(
            _execute, op_id, None, _CPU_P, arrays.const, arrays.n_const, arrays.mutable,
            arrays.n_mutable, _ASYNC_PROP_P, priority, _NAME, False))
    except BaseException:
        _ops.pop(op_id, None)
        raise
