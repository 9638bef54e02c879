"""Issue 30, item 3: a flood on a worker's pull relay port (docs/spec/pull_relay.md) from a
process that holds the job's keys but is no worker of the job. The worker's I/O thread
reads at most a bounded number of messages per socket and turn, so its heartbeats, its
servers' replies and its training go on; the flooder is held back by the relay's
high-water mark and its messages are dropped unread (not a worker of the job)."""
import threading
import time

import pytest
import zmq

from livejob import LiveJob, dealer, job_keys, undisturbed_weights, assert_undisturbed
from ssdsgd.kvstore.security import Guard

STEPS = 300
JOB_ENV = {"SSDSGD_ALGORITHM": "ssgd"}


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    return undisturbed_weights(tmp_path_factory, STEPS, JOB_ENV)


def _flood(address, keys, stop, counts):
    """Send small messages to ``address`` as fast as the worker lets us, until ``stop``."""
    sock = dealer(address, lambda s: Guard(keys, print).client(s, "worker 1"))
    sock.setsockopt(zmq.SNDHWM, 1000)
    frame = b"x" * 64
    try:
        while not stop.is_set():
            try:
                sock.send(frame, flags=zmq.NOBLOCK)
                counts["sent"] += 1
            except zmq.Again:              # the worker's relay pushes back
                counts["held"] += 1
                sock.poll(10, zmq.POLLOUT)
    finally:
        sock.close(0)


@pytest.mark.system
def test_a_flood_on_a_workers_relay_port_does_not_stop_the_job(tmp_path, undisturbed):
    job = LiveJob(tmp_path, steps=STEPS, env=dict(JOB_ENV, SSDSGD_PULL_RELAY="chain",
                                                  SSDSGD_HEARTBEAT_TIMEOUT="10"),
                  held=True)
    stop, counts = threading.Event(), {"sent": 0, "held": 0}
    flooders = []
    try:
        relay, keys = job.address("worker 1"), job_keys(job, "worker 0")
        flooders = [threading.Thread(target=_flood, args=(relay, keys, stop, counts),
                                     daemon=True) for _ in range(2)]
        for t in flooders:
            t.start()
        deadline = time.monotonic() + 60      # the flood is on while the job is held
        while counts["sent"] < 10_000:
            assert time.monotonic() < deadline and job.proc.poll() is None, \
                f"the flood never started: {counts}\n{job.text[-3000:]}"
            time.sleep(0.05)
        job.release()                         # the job trains under the flood
        code = job.wait(timeout=300)
        assert code == 0, job.text[-3000:]
    finally:
        stop.set()
        for t in flooders:
            t.join(10)
        job.kill()
    assert "presumed dead" not in job.text
    # the flood was live all along: more messages than the relay holds, and pushed back
    assert counts["sent"] > 10_000 and counts["held"] > 0, counts
    assert_undisturbed(tmp_path, undisturbed)
