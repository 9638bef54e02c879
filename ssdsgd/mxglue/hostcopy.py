"""Copy numpy data into many CPU NDArrays with one engine synchronisation, not one each.

``nd[:] = array`` waits on MXNet's engine for every array (about 80 us here); for a step
of 160 small parameters that costs more than the network. After one ``mx.nd.waitall()``
nothing is pending on any array, so the bytes can be copied straight into each array's
buffer (0.8 ms for those 160 instead of 15 ms). Arrays on other devices (GPUs) or with
other storage types take MXNet's ordinary path.
"""
import contextlib
import ctypes
import math

import mxnet as mx
import numpy as np
from mxnet.base import _LIB, check_call
from mxnet.ndarray.ndarray import _DTYPE_MX_TO_NP, _int64_enabled
from mxnet.ndarray.sparse import BaseSparseNDArray

from . import layout

# The same library, called without releasing the GIL: these calls only read an array's
# metadata, and where a worker's main thread and I/O thread both run Python (kv.pushpull
# key by key), each release would hand the GIL over and wait for it back.
_HELD = ctypes.PyDLL(_LIB._name)


def _data_pointer(nd):
    ptr = ctypes.c_void_p()
    check_call(_HELD.MXNDArrayGetData(nd.handle, ctypes.byref(ptr)))
    return ptr.value


def describe(nd):
    """(on the CPU, shape, numpy dtype) of an NDArray, without releasing the GIL."""
    dev_type, dev_id, ndim, dtype = ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    check_call(_HELD.MXNDArrayGetContext(nd.handle, ctypes.byref(dev_type), ctypes.byref(dev_id)))
    if _int64_enabled():
        pdata = ctypes.POINTER(ctypes.c_int64)()
        check_call(_HELD.MXNDArrayGetShapeEx64(nd.handle, ctypes.byref(ndim), ctypes.byref(pdata)))
    else:
        pdata = ctypes.POINTER(ctypes.c_int)()
        check_call(_HELD.MXNDArrayGetShapeEx(nd.handle, ctypes.byref(ndim), ctypes.byref(pdata)))
    check_call(_HELD.MXNDArrayGetDType(nd.handle, ctypes.byref(dtype)))
    return dev_type.value == 1, tuple(pdata[:ndim.value]), np.dtype(_DTYPE_MX_TO_NP[dtype.value])


def host_view(nd):
    """A numpy view of a CPU NDArray's buffer. Only valid while nothing is pending on the
    array in MXNet's engine: call ``mx.nd.waitall()`` first and issue no MXNet operation
    on it while the view is in use."""
    if nd.context.device_type != "cpu" or nd.stype != "default":
        raise ValueError("host_view needs a dense CPU NDArray")
    dtype = np.dtype(nd.dtype)
    raw = (ctypes.c_char * (nd.size * dtype.itemsize)).from_address(_data_pointer(nd))
    return np.frombuffer(raw, dtype).reshape(nd.shape)


def raw_view(nd, dtype, size):
    """A flat numpy view of a CPU NDArray's buffer whose dtype and size the caller has
    checked (``host_view`` without its checks: one call into MXNet, not five)."""
    dtype = np.dtype(dtype)
    raw = (ctypes.c_char * (size * dtype.itemsize)).from_address(_data_pointer(nd))
    return np.frombuffer(raw, dtype)


def _dense_cpu(nd):
    """(dtype, size) of a dense CPU NDArray, whose buffer is read and written directly;
    None for another device or storage type (MXNet's ordinary path)."""
    if isinstance(nd, BaseSparseNDArray):
        return None
    on_cpu, shape, dtype = describe(nd)
    return (dtype, math.prod(shape)) if on_cpu else None


class Views:
    """What ``read``, ``write`` and ``edit`` learn of an array, kept per slot (a name the
    caller gives, e.g. a key's gradient) while the same NDArray object comes back.

    A Trainer passes the same parameter, gradient and state arrays every step, and an
    NDArray's device, shape, dtype and buffer never change; asking MXNet for them (about
    4 us an array) cost a steps-delay step of ResNet-20 shapes ~130 asks, most of a reset.
    A slot holds its last array, so the view of its buffer stays valid, and forgets it
    when another array comes: at most one array per slot is kept alive. Slot None (an
    array made afresh each step, e.g. a sum over devices) and arrays on other devices
    are not kept."""

    def __init__(self):
        # slot -> [array, (dtype, size) or None, view or None, layout.inferences() when
        # the view was made]
        self._memo = {}

    def info(self, slot, nd):
        """(numpy dtype, size) of a dense CPU array, None for another device or storage."""
        return self._entry(slot, nd)[1]

    def _entry(self, slot, nd):
        entry = self._memo.get(slot) if slot is not None else None
        if entry is None or entry[0] is not nd:
            entry = [nd, _dense_cpu(nd), None, 0]
            if slot is not None and entry[1] is not None:   # other devices: not kept
                self._memo[slot] = entry
        return entry


def _entries(nds, views, slots):
    """[array, info, view, count] per array (``Views._memo``): from ``views`` by slot, or
    worked out afresh."""
    if views is None:
        return [[nd, _dense_cpu(nd), None, 0] for nd in nds]
    return [views._entry(slot, nd) for slot, nd in zip(slots, nds)]   # noqa: SLF001


def _view(entry):
    """The host view of a dense CPU entry's buffer (after an engine synchronisation).
    Made again after an inference pass, which may have left the array in a oneDNN layout:
    making it puts the array back into the default one (mxglue/layout.py)."""
    seen = layout.inferences()
    if entry[2] is None or entry[3] != seen:
        entry[2], entry[3] = raw_view(entry[0], *entry[1]), seen
    return entry[2]


def read(nds, copy=True, views=None, slots=None):
    """Flat numpy copies of ``nds``; with ``copy=False``, views of the CPU arrays' own
    buffers where possible (the caller must not let MXNet write them while in use).
    ``views`` and ``slots``: a ``Views`` and each array's slot in it."""
    entries = _entries(nds, views, slots)
    if any(e[1] is not None for e in entries):
        mx.nd.waitall()
    take = np.array if copy else np.asarray
    return [take(_view(e)) if e[1] else e[0].asnumpy().reshape(-1) for e in entries]


def write(pairs, views=None, slots=None):
    """pairs: iterable of (NDArray, numpy array with the same number of elements)."""
    pairs = list(pairs)
    entries = _entries([nd for nd, _ in pairs], views, slots)
    if any(e[1] is not None for e in entries):
        mx.nd.waitall()
    for e, (nd, value) in zip(entries, pairs):
        if e[1] is None:
            nd[:] = np.asarray(value).reshape(nd.shape)
            continue
        view, value = _view(e), np.asarray(value)
        if value.size != view.size:
            raise ValueError(f"cannot copy {value.size} elements into an array of {view.size}")
        view[...] = value.reshape(-1)


@contextlib.contextmanager
def edit(nds, views=None, slots=None):
    """Flat numpy arrays through which ``nds`` are changed in place: views of the dense CPU
    arrays' own buffers after one engine synchronisation (no MXNet operation may touch
    them inside the block), copies of the others, written back when the block ends."""
    entries = _entries(nds, views, slots)
    if any(e[1] is not None for e in entries):
        mx.nd.waitall()
    flat = [_view(e) if e[1] else e[0].asnumpy().reshape(-1) for e in entries]
    yield flat
    for e, view in zip(entries, flat):
        if e[1] is None:
            e[0][:] = view.reshape(e[0].shape)


def held(nds, views=None, slots=None):
    """Flat views of dense CPU arrays' own buffers without waiting on the engine: only
    inside an engine operation that holds every one of them (it reads or writes them),
    where waiting would wait for the operation itself."""
    entries = _entries(nds, views, slots)
    if any(e[1] is None for e in entries):
        raise ValueError("held views need dense CPU arrays")
    return [_view(e) for e in entries]


def fill(nd, value, dtype=None, size=None):
    """Copy ``value`` into a dense CPU NDArray's buffer now, without waiting on the engine:
    only after ``mx.nd.waitall()`` or inside an engine operation that writes ``nd``.
    ``dtype`` and ``size``: the array's, if the caller knows them."""
    dtype = nd.dtype if dtype is None else dtype
    size = nd.size if size is None else size
    src = np.ascontiguousarray(value, dtype=dtype)
    if src.size != size:
        raise ValueError(f"cannot copy {src.size} elements into an array of {size}")
    ctypes.memmove(_data_pointer(nd), src.ctypes.data, src.nbytes)
