"""ssdsgd.mxglue.hostcopy: host views and copies of CPU NDArrays, in process."""
import threading

import mxnet as mx
import numpy as np

from ssdsgd.mxglue import engineop, hostcopy


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


def test_views_follow_the_array_each_slot_is_given():
    """The stage machine keeps what it learnt of each key's arrays (``Views``) while the
    same NDArray objects come back. A slot given another array must use that one: a
    fresh output array between steps gets the reply, the old one keeps its values."""
    views = hostcopy.Views()
    a, b = mx.nd.zeros(4), mx.nd.zeros(4)
    hostcopy.write([(a, np.full(4, 1, np.float32))], views=views, slots=[("w", 0)])
    hostcopy.write([(b, np.full(4, 2, np.float32))], views=views, slots=[("w", 0)])
    np.testing.assert_array_equal(a.asnumpy(), [1] * 4)
    np.testing.assert_array_equal(b.asnumpy(), [2] * 4)
    b += 1                                   # pending in the engine: edit and read wait
    with hostcopy.edit([b], views=views, slots=[("w", 0)]) as (vb,):
        np.testing.assert_array_equal(vb, [3] * 4)
        vb[...] *= 2
    flat, = hostcopy.read([b], views=views, slots=[("w", 0)])
    np.testing.assert_array_equal(flat, [6] * 4)
    # another slot, another array of a different size: a wrong reply is refused
    c = mx.nd.zeros(3)
    try:
        hostcopy.write([(c, np.zeros(4, np.float32))], views=views, slots=[("w", 1)])
    except ValueError as e:
        assert "4 elements into an array of 3" in str(e)
    else:
        raise AssertionError("a reply of the wrong size was written")
