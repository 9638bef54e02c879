"""MXNet's SGD-with-momentum update of small keys in numpy, on the arrays' own buffers.

Before any arithmetic, an MXNet operator call costs about 60 us plus 3 us an array in the
C API (shape and type inference, engine bookkeeping). On ResNet-20's 65 keys the local
rule spent 2.1 ms of CPU a step in seven ``multi_sgd_mom_update`` calls. The same
arithmetic in numpy costs 1.05 ms (bench: docs/benchmarks/small_steps.md). On a machine
whose cores the job's processes share, that is a step's time.

The operations follow MXNet 1.9's ``SGDMomKernel`` and ``MultiSGDKernel``
(src/operator/optimizer_op-inl.h) one float32 rounding at a time:

    mom = momentum * mom - (lr * wd) * w - (lr * rescale_grad) * grad      (no clipping)
    mom = momentum * mom - (lr * wd) * w - lr * clip(rescale_grad * grad)  (clipping)
    w = w + mom

So the weights are MXNet's bit for bit (tests/test_glu_rules.py compares them with the
Updater's). Other cases keep MXNet's operator, which is multi-threaded and one pass over
memory: keys above HOST_MAX elements, other devices and dtypes, other optimizers, SGD
without momentum (another kernel) and multi-precision.
"""
import contextlib

import mxnet as mx
import numpy as np

from ..mxglue import hostcopy

HOST_MAX = 1 << 16      # elements: above this, MXNet's one-pass kernel costs less


class HostSGD:
    """``update(opt, updater, keys, weights, grads)`` for the keys it can take."""

    def __init__(self):
        self.views = hostcopy.Views()
        self._scratch = {}      # key -> two float32 buffers of its size

    @staticmethod
    def applies(opt):
        return (type(opt) is mx.optimizer.SGD and opt.momentum > 0
                and not opt.multi_precision)

    def take(self, updater, key, weight, grad):
        """Can ``key`` be updated here? Its state must exist (made by a reset) and all
        three arrays be dense float32 on the CPU, with at most HOST_MAX elements."""
        state = updater.states.get(key)
        if state is None or not updater.states_synced.get(key):
            return False
        for slot, nd in (("w", weight), ("g", grad), ("m", state)):
            info = self.views.info((slot, key), nd)     # (dtype, size) or None
            if info is None or info[0] != np.float32 or info[1] > HOST_MAX:
                return False
        return True

    def update(self, opt, updater, keys, weights, grads, held=False):
        """The Updater's step for ``keys`` (all taken): the same bookkeeping
        (``_update_count``, ``_get_lrs``, ``_get_wds``) and the kernel's arithmetic.
        ``held``: inside an engine operation that holds the arrays (no wait)."""
        opt._update_count(keys)                   # noqa: SLF001 - as the Updater does
        lrs, wds = opt._get_lrs(keys), opt._get_wds(keys)   # noqa: SLF001
        momentum, rescale = np.float32(opt.momentum), np.float32(opt.rescale_grad)
        # SGD passes clip_gradient when it is set and not 0; the kernel clips when >= 0
        clip = opt.clip_gradient
        clip = np.float32(clip) if clip and clip >= 0 else None
        arrays, slots = [], []
        for key, weight, grad in zip(keys, weights, grads):
            arrays += [weight, grad, updater.states[key]]
            slots += [("w", key), ("g", key), ("m", key)]
        edit = (contextlib.nullcontext(hostcopy.held(arrays, views=self.views, slots=slots))
                if held else hostcopy.edit(arrays, views=self.views, slots=slots))
        with edit as flat:
            for i, key in enumerate(keys):
                w, g, m = flat[3 * i:3 * i + 3]
                lr, wd = np.float32(lrs[i]), np.float32(wds[i])
                r, t = self._buffers(key, w.size)
                if clip is None:
                    np.multiply(g, lr * rescale, out=r)
                else:
                    np.multiply(g, rescale, out=r)
                    np.clip(r, -clip, clip, out=r)
                    r *= lr
                m *= momentum
                np.multiply(w, lr * wd, out=t)
                m -= t
                m -= r
                w += m

    def _buffers(self, key, size):
        pair = self._scratch.get(key)
        if pair is None or pair[0].size != size:
            pair = self._scratch[key] = (np.empty(size, np.float32), np.empty(size, np.float32))
        return pair
