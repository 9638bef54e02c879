"""mxglue/engineop.py: an asynchronous operation on MXNet's engine, completed from another
thread (in process, real MXNet engine)."""
import threading
import time

import mxnet as mx
import numpy as np

from ssdsgd.mxglue import engineop, hostcopy


def test_an_operation_returns_at_once_and_its_output_is_pending_until_done():
    src, out = mx.nd.ones(8), mx.nd.zeros(8)
    mx.nd.waitall()
    release = threading.Event()
    calls = []

    def run(done):
        calls.append(threading.current_thread().name)
        value = hostcopy.host_view(src) * 3      # read access: src is settled

        def later():
            release.wait(30)
            hostcopy.fill(out, value)
            done()
            done()                               # a second call must do nothing

        threading.Thread(target=later).start()

    t0 = time.monotonic()
    engineop.push(run, [src], [out])             # returns before done (released below)
    assert time.monotonic() - t0 < 10
    after = out + 1                              # queued behind the operation
    assert calls, "the operation should have run on the pushing thread"
    release.set()
    np.testing.assert_array_equal(after.asnumpy(), np.full(8, 4.0))
    src[:] = 5                                   # the write waited for the read
    np.testing.assert_array_equal(src.asnumpy(), np.full(8, 5.0))


def test_an_operation_waits_for_a_pending_write_of_what_it_reads():
    src, out = mx.nd.zeros(4), mx.nd.zeros(4)
    src[:] = 2                                   # pending (or done) write

    def run(done):
        hostcopy.fill(out, hostcopy.host_view(src) + 1)
        done()

    for _ in range(200):
        engineop.push(run, [src], [out])
    mx.nd.waitall()
    np.testing.assert_array_equal(out.asnumpy(), np.full(4, 3.0))
