"""MXNet's own 2bit quantizer, called directly: the reference ssdsgd's codec is tested against.

MXNet 1.9.1 exposes no Python function that returns packed 2bit data: a kvstore quantizes
inside a push. But libmxnet.so exports the C++ class behind it,
``mxnet::kvstore::GradientCompression``, so this module builds one (constructor +
``SetTwoBitCompression``) and calls its ``Quantize`` and ``Dequantize`` on NDArrays through
ctypes, by their mangled names (Itanium ABI, x86-64 Linux). An NDArray handle is the
``NDArray*`` those methods take. ``available()`` says whether the symbols are there.
"""
import ctypes

import mxnet as mx
import numpy as np
from mxnet.base import _LIB

_NS = "_ZN5mxnet7kvstore19GradientCompression"
_SYMBOLS = {
    "ctor": _NS + "C1Ev",
    "set_2bit": _NS + "20SetTwoBitCompressionEf",
    "quantize": _NS + "8QuantizeERKNS_7NDArrayEPS2_S5_i",
    "dequantize": _NS + "10DequantizeERKNS_7NDArrayEPS2_i",
}
_OBJECT_BYTES = 256   # the object is a vtable pointer, an enum and a float; ample room


def available():
    return all(hasattr(_LIB, name) for name in _SYMBOLS.values())


class MXNet2Bit:
    """One GradientCompression object set to 2bit with ``threshold``."""

    def __init__(self, threshold):
        if not available():
            raise RuntimeError("this libmxnet does not export GradientCompression's methods")
        fn = {k: getattr(_LIB, v) for k, v in _SYMBOLS.items()}
        fn["ctor"].argtypes = [ctypes.c_void_p]
        fn["set_2bit"].argtypes = [ctypes.c_void_p, ctypes.c_float]
        fn["quantize"].argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int]
        fn["dequantize"].argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int]
        for f in fn.values():
            f.restype = None
        self._fn = fn
        self._obj = ctypes.create_string_buffer(_OBJECT_BYTES)
        self._this = ctypes.addressof(self._obj)
        fn["ctor"](self._this)
        fn["set_2bit"](self._this, threshold)

    def quantize(self, grad, residual):
        """MXNet's Quantize: returns the packed bytes and the updated residual (numpy)."""
        g = mx.nd.array(np.asarray(grad, np.float32).reshape(-1))
        r = mx.nd.array(np.asarray(residual, np.float32).reshape(-1))
        out = mx.nd.zeros((-(-g.size // 16),), dtype=np.float32)
        self._fn["quantize"](self._this, g.handle, out.handle, r.handle, 0)
        out.wait_to_read()
        r.wait_to_read()
        return out.asnumpy().view(np.uint8), r.asnumpy()

    def dequantize(self, packed, count):
        """MXNet's Dequantize of packed bytes into ``count`` float32 values."""
        packed = np.ascontiguousarray(packed, np.uint8)
        words = mx.nd.array(packed.view(np.float32), dtype=np.float32)
        out = mx.nd.zeros((count,), dtype=np.float32)
        self._fn["dequantize"](self._this, words.handle, out.handle, 0)
        out.wait_to_read()
        return out.asnumpy()
