"""A steps-delay push that does not pull is coded and sent off the training thread
(ssdsgd/kvstore/push_queue.py, issue 25): the step returns once the gradients are copied,
and the compression (residuals, 2bit) and the protocol's encoding run on the push queue's
thread while the next step computes. What must still hold: the queue is first in first
out and bounded, a request made after a queued push waits for it, and a failure on that
thread is raised by the worker's next call, never lost.

The first tests drive ``PushQueue`` alone with events; the system tests run a real
scheduler and server (processes) and a WorkerClient and StageMachine in this process,
with the coding held at a gate (an event) to see which thread codes and when."""
import threading

import mxnet as mx
import numpy as np
import pytest

import jobs
from conftest import node_env
from ssdsgd.kvstore.client import WorkerClient
from ssdsgd.kvstore.compression import Compression, CompressionError
from ssdsgd.kvstore.env import NodeEnv
from ssdsgd.kvstore.push_queue import PushCoder, PushQueue
from ssdsgd.launch.job import free_port
from ssdsgd.mxglue.optimizer_spec import describe
from ssdsgd.worker.machine import StageMachine

DEADLINE = 30.0         # s any wait below may take before the test fails


class Held:
    """A job that waits for ``release``; ``started``/``done`` say how far it got and
    ``log`` the order the jobs ran in."""

    def __init__(self, name, log, error=None):
        self.name, self.log, self.error = name, log, error
        self.started, self.release, self.done = (threading.Event() for _ in range(3))

    def __call__(self):
        self.started.set()
        assert self.release.wait(DEADLINE)
        self.log.append(self.name)
        self.done.set()
        if self.error is not None:
            raise self.error


def _in_thread(fn):
    """Run ``fn`` on a thread; (thread, event set once it returned, its exception box)."""
    returned, box = threading.Event(), []

    def run():
        try:
            fn()
        except BaseException as e:      # noqa: BLE001 - the test looks at it
            box.append(e)
        returned.set()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, returned, box


# ---- the queue alone ------------------------------------------------------------------------
def test_put_returns_before_the_job_runs_and_jobs_run_in_order():
    stats, log = {"time_blocked": 0.0}, []
    q = PushQueue(stats)
    a, b = Held("a", log), Held("b", log)
    q.put(a, bound=3)
    q.put(b, bound=3)
    assert a.started.wait(DEADLINE) and not a.done.is_set() and q.pending == 2
    _, flushed, _ = _in_thread(q.flush)
    assert not flushed.wait(0.05)           # flush waits for both
    b.release.set()
    a.release.set()
    assert flushed.wait(DEADLINE) and log == ["a", "b"] and q.pending == 0
    assert q.close() is None


def test_a_job_starts_once_the_arrays_it_comes_after_are_written():
    """``after``: the step's local update on MXNet's engine (wait_to_read), which the next
    forward pass waits for: the coding does not take the CPU from it."""
    class Pending:
        def __init__(self):
            self.written = threading.Event()

        def wait_to_read(self):
            assert self.written.wait(DEADLINE)
    q, log = PushQueue({"time_blocked": 0.0}), []
    update, job = Pending(), Held("push", log)
    job.release.set()
    q.put(job, bound=3, after=[update])      # returns at once
    assert not job.started.wait(0.05)
    update.written.set()
    q.flush()
    assert log == ["push"]
    q.close()


def test_a_full_queue_blocks_the_caller_and_counts_the_wait():
    stats, log = {"time_blocked": 0.0}, []
    q = PushQueue(stats)
    jobs_ = [Held(str(i), log) for i in range(3)]
    q.put(jobs_[0], bound=2)
    q.put(jobs_[1], bound=2)
    _, returned, _ = _in_thread(lambda: q.put(jobs_[2], bound=2))
    assert jobs_[0].started.wait(DEADLINE)
    assert not returned.wait(0.05) and q.pending == 2     # the bound holds it
    jobs_[0].release.set()
    assert returned.wait(DEADLINE)
    assert stats["time_blocked"] > 0
    for j in jobs_[1:]:
        j.release.set()
    q.flush()
    assert log == ["0", "1", "2"]
    q.close()


def test_a_failure_on_the_queues_thread_is_raised_by_the_next_call_and_stays():
    stats, log = {"time_blocked": 0.0}, []
    q = PushQueue(stats)
    bad, behind = Held("bad", log, ValueError("over the limit")), Held("behind", log)
    q.put(bad, bound=3)
    q.put(behind, bound=3)
    bad.release.set()
    behind.release.set()
    with pytest.raises(ValueError, match="over the limit"):
        q.flush()
    assert log == ["bad"]          # what was queued behind it is dropped, not sent
    with pytest.raises(ValueError, match="over the limit"):
        q.put(Held("later", log), bound=3)      # the pushes after it cannot go in order
    assert q.close() is None       # raised already: not reported twice


def test_a_failure_nobody_saw_is_returned_by_close():
    q = PushQueue({"time_blocked": 0.0})
    bad = Held("bad", [], CompressionError("float64"))
    bad.release.set()
    q.put(bad, bound=1)
    assert bad.done.wait(DEADLINE)
    error = q.close()
    assert isinstance(error, CompressionError)


def test_the_copies_of_coded_pushes_are_reused_and_the_others_are_not():
    """A compressed push's copy is unused once coded (its codes are new arrays); an
    uncompressed one is the message's frame until the I/O thread sent it."""
    class Slice:
        offset, count = 0, 32
    coder, grad = PushCoder(), np.arange(32, dtype=np.float32)
    first = coder.copy([(0, grad)])[0][1]
    assert not np.shares_memory(first, grad) and coder.copy([(0, grad)])[0][1] is not first
    coder.start(Compression.from_params({"type": "2bit"}))
    first = coder.copy([(0, grad)])[0][1]
    np.testing.assert_array_equal(first, grad)
    coder.code([(0, 0, first, first.dtype)], {0: [Slice]}, spare=True)
    again = coder.copy([(0, grad + 1)])[0][1]
    assert again is first and again[0] == 1         # the same array, the new values
    coder.code([(0, 1, again, again.dtype)], {0: [Slice]})       # not given back
    assert coder.copy([(0, grad)])[0][1] is not first


# ---- a worker on a live job -------------------------------------------------------------
SHAPE = (256, 64)


class Gate:
    """Holds the client's coding of a push until ``release`` and records the thread of
    each coding."""

    def __init__(self, client):
        self.code, self.threads = client.coder.code, []
        self.started, self.release, self.done = (threading.Event() for _ in range(3))
        client.coder.code = self

    def __call__(self, entries, placement, spare=False):
        self.threads.append(threading.current_thread().name)
        self.started.set()
        assert self.release.wait(DEADLINE)
        out = self.code(entries, placement, spare)
        self.done.set()
        return out


def _worker(tmp_path, **settings):
    env = node_env(free_port(), SSDSGD_ALGORITHM="ssd", SSDSGD_WARMUP_STEPS=0,
                   SSDSGD_DELAY_STEPS=3, SSDSGD_LOCAL_RULE="glu", SSDSGD_GLU_STATE="exact",
                   SSDSGD_HEARTBEAT_TIMEOUT=20, **settings)
    for role in ("scheduler", "server"):
        jobs.node(role, env, merge=True, log=tmp_path / f"{role}.log")
    return WorkerClient(NodeEnv.from_environ(dict(env, SSDSGD_ROLE="worker")))


@pytest.mark.system
def test_a_steps_delay_step_with_2bit_returns_before_its_push_is_coded(tmp_path):
    client = _worker(tmp_path)
    try:
        machine = StageMachine(client, client.env)
        spec = describe(mx.optimizer.create("sgd", learning_rate=0.1, momentum=0.9))
        machine.set_optimizer(spec)
        client.set_optimizer(spec).wait()
        client.set_compression(Compression.from_params({"type": "2bit", "threshold": 0.5}))
        weight = mx.nd.zeros(SHAPE)
        machine.init_keys([(0, mx.nd.ones(SHAPE), [weight])])
        grad = mx.nd.array(np.random.RandomState(0).uniform(-1, 1, SHAPE))
        machine.step([(0, [grad], [weight])])   # step 0: its push does not pull
        client.pushes.flush()                   # (coded once the local update is written)
        gate = Gate(client)
        # step 1 neither: it returns while its coding is held at the gate
        _, returned, box = _in_thread(lambda: machine.step([(0, [grad], [weight])]))
        assert returned.wait(DEADLINE) and not box, box
        assert gate.started.wait(DEADLINE) and not gate.done.is_set()
        assert gate.threads == ["ssdsgd-push"] and client.pushes.pending == 1
        # step 2 pulls: its push waits for step 1's, then is coded on the training thread
        t, pulled, box = _in_thread(lambda: machine.step([(0, [grad], [weight])]))
        assert not pulled.wait(0.05)
        gate.release.set()
        assert pulled.wait(DEADLINE) and not box, box
        assert gate.threads == ["ssdsgd-push", t.name]
        machine.step([(0, [grad], [weight])])   # step 3 waits for the pull and resets
        client.pushes.flush()
        assert client.pushes.pending == 0 and machine.counts["pushes"] == 4
        machine.finish()
    finally:
        client.close()


@pytest.mark.system
def test_an_error_while_coding_a_queued_push_is_raised_by_the_next_call(tmp_path):
    client = _worker(tmp_path)
    try:
        client.init([(0, 8, np.float64)], [np.zeros(8)]).wait()
        client.set_compression(Compression.from_params({"type": "2bit"}))
        client.push_later(0, [(0, np.ones(8))], bound=3)     # 2bit refuses float64
        with pytest.raises(CompressionError, match="float32"):
            client.pull([0]).wait()
        with pytest.raises(CompressionError, match="float32"):
            client.push(1, [(0, np.ones(8))])                 # and every later call
    finally:
        client.close()
