"""oneDNN's in-place weight layouts, and ssdsgd's reads and writes of CPU buffers.

MXNet 1.9's oneDNN convolution, deconvolution and fully connected operators, run outside
training mode (a validation pass), rewrite their weight array in place into a blocked
layout (``MKLDNNDataReorderAsync``, src/operator/nn/mkldnn/mkldnn_convolution.cc). The
next training forward has it put back in the default layout by an engine operation it
pushes while it runs, i.e. behind every operation already queued on that weight. ssdsgd
reads and writes dense CPU arrays through their buffers (``hostcopy``, the steps queued
on the engine, ``worker/deferred.py``): in that window the buffer holds the blocked
layout, so values read are not the weights and values written are scrambled by the
reorder that follows. Measured: a ResNet-20 ssgd job whose rank 0 validated after each
epoch ended with other weights on every run (tests/test_layouts.py).

So every call that can run such an operator outside training mode is counted (the
operator functions, ``CachedOp``, ``Executor.forward``: ``install``), and before ssdsgd
touches a buffer through a view it kept, it compares the count with the one of the
view's last check; if it changed, it waits for what is pending on the array and has
MXNet put it back into the default layout (``restore``: ``MXNDArrayGetData`` does that
for an array in a oneDNN layout); steps queued on the engine do the same before they are
queued (``QueuedArrays``). With no inference between steps it costs one comparison. A
view made
afresh is safe already: making one calls ``MXNDArrayGetData``. MXNet offers no call
that asks an array's layout, and none that reorders it inside an engine operation
(``MXNDArrayGetData`` waits for the array, so it deadlocks there), hence the count.
"""
import ctypes
import functools

import mxnet as mx
from mxnet import autograd
from mxnet.base import _LIB, c_str, check_call

#: The operators that rewrite their weight's layout in place when not training.
_REORDERING_OPS = ("Convolution", "Deconvolution", "FullyConnected",
                   "_contrib_quantized_conv", "_contrib_quantized_fully_connected",
                   "_sg_mkldnn_conv", "_sg_mkldnn_fully_connected")

# Calls that may have changed a layout. It starts at 1: an inference before ``install``
# (a forward pass before ssdsgd was imported) is not seen, so whoever compares it with
# the count of its last ``restore`` (0 at first) restores once.
_inferences = 1
_installed = False
_blind = False      # the calls could not be counted (see ``inferences``)


def inferences():
    """How many calls so far may have rewritten a weight's layout (with the one assumed).
    Where the calls cannot be counted (``install`` failed) every call may have: the
    number moves on each time, so every check restores (correct, and slower)."""
    if _blind:
        _note()
    return _inferences


def _note():
    global _inferences
    _inferences += 1


def _op_handles(names):
    handles = set()
    for name in names:
        h = ctypes.c_void_p()
        try:
            check_call(_LIB.NNGetOpHandle(c_str(name), ctypes.byref(h)))
        except mx.base.MXNetError:      # not in this build
            continue
        if h.value:
            handles.add(h.value)
    return handles


def install():
    """Count the calls that can rewrite a weight's layout (once per process)."""
    global _installed, _blind
    if _installed:
        return
    _installed = True
    from mxnet.executor import Executor
    from mxnet.ndarray import _internal, register

    reordering = _op_handles(_REORDERING_OPS)
    invoke = register._imperative_invoke   # noqa: SLF001 - what the operator functions call

    @functools.wraps(invoke)
    def counted_invoke(handle, *args):
        if handle in reordering and not autograd.is_training():
            _note()
        return invoke(handle, *args)

    register._imperative_invoke = counted_invoke   # noqa: SLF001

    cached_call = _internal.CachedOp.__call__

    @functools.wraps(cached_call)
    def counted_call(self, *args, **kwargs):
        if not autograd.is_training():      # a hybridized block's forward pass
            _note()
        return cached_call(self, *args, **kwargs)

    try:
        _internal.CachedOp.__call__ = counted_call
    except (TypeError, AttributeError):     # a compiled CachedOp (MXNet's cython build)
        _blind = True

    forward = Executor.forward

    @functools.wraps(forward)
    def counted_forward(self, is_train=False, **kwargs):
        if not is_train:
            _note()
        return forward(self, is_train=is_train, **kwargs)

    Executor.forward = counted_forward


def restore(nds):
    """Put the dense CPU NDArrays ``nds`` back into MXNet's default layout if an inference
    left them in a oneDNN one. It waits for what is pending on these arrays only (not
    for the whole engine: a step queued on another key may wait for a reply that only
    comes once this call returns). On a thread that may wait: never inside an engine
    operation that holds one of them."""
    # Twice: an inference operator still pending in the first round pushes its reorder
    # while it runs, after the first round's wait; the second round waits for that too.
    for _ in range(2):
        for nd in nds:
            check_call(_LIB.MXNDArrayWaitToWrite(nd.handle))
    ptr = ctypes.c_void_p()
    for nd in nds:
        # reorders an array in a oneDNN layout to the default one (and waits for it)
        check_call(_LIB.MXNDArrayGetData(nd.handle, ctypes.byref(ptr)))


class QueuedArrays:
    """What the steps queued on the engine by one worker restored last, per key: before a
    step is queued, the caller's arrays of each key are restored if an inference call
    came since, or if the key comes with other arrays than at its last restore."""

    def __init__(self):
        self._last = {}     # key -> (inferences() at its restore, its arrays)

    def before_queue(self, keyed):
        """``keyed``: (key, tuple of the caller's CPU arrays) per key of the step."""
        seen = inferences()
        stale = [(key, arrays) for key, arrays in keyed
                 if not self._restored(key, arrays, seen)]
        if stale:
            restore([nd for _, arrays in stale for nd in arrays])
            for key, arrays in stale:
                self._last[key] = (seen, arrays)

    def _restored(self, key, arrays, seen):
        last = self._last.get(key)
        return (last is not None and last[0] == seen and len(last[1]) == len(arrays)
                and all(a is b for a, b in zip(last[1], arrays)))


install()
