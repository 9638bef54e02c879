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


def read(nds, copy=True):
    """Flat numpy copies of ``nds``; with ``copy=False``, views of the CPU arrays' own
    buffers where possible (the caller must not let MXNet write them while in use)."""
    infos = [_dense_cpu(nd) for nd in nds]
    if any(info is not None for info in infos):
        mx.nd.waitall()
    take = np.array if copy else np.asarray
    return [take(raw_view(nd, *info)) if info else nd.asnumpy().reshape(-1)
            for nd, info in zip(nds, infos)]


def write(pairs):
    """pairs: iterable of (NDArray, numpy array with the same number of elements)."""
    direct, other = [], []
    for nd, value in pairs:
        info = _dense_cpu(nd)
        if info:
            direct.append((nd, value, info))
        else:
            other.append((nd, value))
    if direct:
        mx.nd.waitall()
        for nd, value, (dtype, size) in direct:
            fill(nd, value, dtype, size)
    for nd, value in other:
        nd[:] = np.asarray(value).reshape(nd.shape)


@contextlib.contextmanager
def edit(nds):
    """Flat numpy arrays through which ``nds`` are changed in place: views of the dense CPU
    arrays' own buffers after one engine synchronisation (no MXNet operation may touch
    them inside the block), copies of the others, written back when the block ends."""
    infos = [_dense_cpu(nd) for nd in nds]
    if any(info is not None for info in infos):
        mx.nd.waitall()
    views = [raw_view(nd, *info) if info else nd.asnumpy().reshape(-1)
             for nd, info in zip(nds, infos)]
    yield views
    for nd, info, view in zip(nds, infos, views):
        if info is None:
            nd[:] = view.reshape(nd.shape)


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
