"""ssdsgd.kvstore.hostcopy: host views and copies of CPU NDArrays, in process."""
import threading

import mxnet as mx
import numpy as np

from ssdsgd.kvstore import engineop, hostcopy


def test_edit_waits_for_pending_writes_and_changes_the_arrays_in_place():
    """The worker's reset edits its parameters and state through ``edit``: the views must
    hold what MXNet's engine was still writing, and writes must land in the arrays."""
    a, b = mx.nd.zeros((2, 3)), mx.nd.zeros((4,), dtype='float16')
    mx.nd.waitall()

    def run(done):          # an engine operation that writes ``a`` 0.3 s later
        def later():
            threading.Event().wait(0.3)
            hostcopy.fill(a, np.arange(6, dtype=np.float32))
            done()
        threading.Thread(target=later).start()

    engineop.push(run, [], [a])
    a_after = a + 1                          # queued behind it
    with hostcopy.edit([a, b]) as (va, vb):
        assert va.shape == (6,) and vb.dtype == np.float16
        np.testing.assert_array_equal(va, np.arange(6))
        va[...] = -va
        vb[1:3] = 7
    np.testing.assert_array_equal(a.asnumpy(), -np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(a_after.asnumpy(), np.arange(6).reshape(2, 3) + 1)
    np.testing.assert_array_equal(b.asnumpy(), [0, 7, 7, 0])
