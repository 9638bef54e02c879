"""A real server in process (issue 23): ``Server`` with real ``Weights``, a real MXNet
optimizer and the policy ``make_server_policy`` chooses, on real ZeroMQ sockets over
inproc. The test plays two workers (DEALERs with the connection ids the topology names)
and the scheduler (the socket the server tells it on); every message is encoded and
decoded by ``protocol.py``; nothing of ssdsgd is replaced."""
import itertools
import uuid

import mxnet as mx
import numpy as np
import pytest
import zmq

from conftest import node_env
from ssdsgd.kvstore import protocol as P
from ssdsgd.kvstore.env import NodeEnv
from ssdsgd.kvstore.server import Server
from ssdsgd.mxglue.optimizer_spec import describe
from ssdsgd.sync.server_policies import make_server_policy

F32 = np.float32
SIZES = {0: 6, 1: 70_000}        # a packed key and one of its own frame (>= 64 KiB)


class InProcessJob:
    """A ``Server`` started with a topology of ``workers`` workers; ``send`` delivers one
    message from a worker (or a stranger) and lets the server handle everything waiting."""

    def __init__(self, workers=2, limit=None, **settings):
        env = dict(node_env(1, num_workers=workers, SSDSGD_ALGORITHM="ssgd", **settings),
                   SSDSGD_ROLE="server")
        self.env = NodeEnv.from_environ({k: str(v) for k, v in env.items()})
        self.logged = []
        self.server = Server(self.env, make_server_policy, log=self.logged.append)
        ctx = zmq.Context.instance()
        where = f"inproc://server-{uuid.uuid4().hex}"
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.bind(where)
        self.scheduler = ctx.socket(zmq.PAIR)
        self.scheduler.bind(where + "-scheduler")
        to_scheduler = ctx.socket(zmq.PAIR)
        to_scheduler.connect(where + "-scheduler")
        self.ids = [bytes([1, r]) + uuid.uuid4().bytes[:14] for r in range(workers)]
        self.workers = [self._dealer(where, i) for i in self.ids]
        self.stranger = self._dealer(where, b"\x01stranger")
        self.sockets = [self.router, self.scheduler, to_scheduler, *self.workers, self.stranger]
        topology = {"rank": 0, "num_workers": workers, "num_servers": 1,
                    "workers": [i.hex() for i in self.ids]}
        self.server.start(topology, to_scheduler)
        self.server.listen(self.router, self.env.max_message_bytes if limit is None else limit)
        self.reqs = itertools.count(1)

    def _dealer(self, where, ident):
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.ROUTING_ID, ident)
        s.connect(where)
        return s

    def send(self, sock, msg):
        """``msg`` (a Message) from ``sock``; the server handles it and anything waiting."""
        msg.req = msg.req or next(self.reqs)
        sock.send_multipart(P.encode(msg))
        return self.deliver()

    def deliver(self):
        handled = 0
        while self.router.poll(1000 if not handled else 50):
            self.server.handle(self.router.recv_multipart(copy=False))
            handled += 1
        return handled

    def replies(self, sock):
        """Every message the server has sent to ``sock``, decoded."""
        out = []
        while sock.poll(200):
            out.append(P.decode(sock.recv_multipart()))
        return out

    def close(self):
        for s in self.sockets:
            s.close(0)


@pytest.fixture
def job():
    made = InProcessJob()
    yield made
    made.close()


def records(keys, step=0, ntensors=1):
    return P.make_records([(k, step, 0, SIZES[k], F32, ntensors) for k in keys])


def init(job, values):
    """Worker 0 declares both keys with ``values``, worker 1 asks for them."""
    w0, w1 = job.workers
    job.send(w0, P.Message(P.Kind.INIT, sender=0, records=records(SIZES),
                           tensors=[[values[k]] for k in SIZES]))
    job.send(w1, P.Message(P.Kind.INIT, sender=1, records=records(SIZES, ntensors=0),
                           tensors=[[] for _ in SIZES]))
    for rank, sock in enumerate(job.workers):
        (reply,) = job.replies(sock)
        assert reply.kind == P.Kind.REPLY, (rank, reply.meta)
        for k, arrays in zip(reply.records["key"], reply.tensors):
            np.testing.assert_array_equal(arrays[0], values[int(k)])


def push(job, rank, step, grads, flags=P.Flag.PULL):
    return job.send(job.workers[rank], P.Message(
        P.Kind.PUSH, sender=rank, flags=flags, records=records(SIZES, step=step),
        tensors=[[grads[k]] for k in SIZES]))


def test_two_workers_pushes_give_mxnet_sgd_of_the_rank_order_sum(job):
    rng = np.random.default_rng(5)
    values = {k: rng.standard_normal(n).astype(F32) for k, n in SIZES.items()}
    init(job, values)
    optimizer = mx.optimizer.create("sgd", learning_rate=0.1, momentum=0.9, wd=1e-4)
    job.send(job.workers[0], P.Message(P.Kind.COMMAND, sender=0, meta={
        "command": "optimizer", "optimizer": describe(optimizer)}))
    assert [m.kind for m in job.replies(job.workers[0])] == [P.Kind.ACK]
    # what MXNet's own SGD does with the sum of worker 0's gradient and worker 1's
    updater = mx.optimizer.get_updater(mx.optimizer.create("sgd", learning_rate=0.1,
                                                           momentum=0.9, wd=1e-4))
    expected = {k: mx.nd.array(v) for k, v in values.items()}
    for step in range(3):
        grads = [{k: rng.standard_normal(n).astype(F32) for k, n in SIZES.items()}
                 for _ in range(2)]
        push(job, 1, step, grads[1])              # worker 1 first: the sum is in rank order
        assert job.replies(job.workers[1]) == []  # the step waits for worker 0
        push(job, 0, step, grads[0])
        for k in SIZES:
            updater(k, mx.nd.array(np.add(grads[0][k], grads[1][k])), expected[k])
        for rank, sock in enumerate(job.workers):
            (reply,) = job.replies(sock)
            assert reply.kind == P.Kind.REPLY and reply.meta["lr"] == pytest.approx(0.1)
            for k, arrays in zip(reply.records["key"], reply.tensors):
                np.testing.assert_array_equal(arrays[0], expected[int(k)].asnumpy(),
                                              err_msg=f"worker {rank}, key {k}, step {step}")
            assert reply.records["step"].tolist() == [step + 1] * len(SIZES)
    assert job.server.policy.busy() is None


def error_of(job, sock):
    (reply,) = job.replies(sock)
    assert reply.kind == P.Kind.ERROR, reply
    return reply.req, reply.meta["error"]


def test_malformed_or_unauthorized_requests_get_an_error_and_the_server_keeps_serving(job):
    values = {k: np.zeros(n, F32) for k, n in SIZES.items()}
    init(job, values)
    w0, w1 = job.workers
    cases = [   # (who sends, the frames, what the ERROR says)
        (w0, P.encode(P.Message(P.Kind.PUSH, sender=0, req=41))[:2],
         "a message has at least 3 frames"),
        (w0, [b"SSDG" + bytes(P.HEADER.size - 4)] + [b""] * 2, "protocol version 0"),
        (w0, P.encode(P.Message(P.Kind.PULL, sender=0, req=42, meta={"policy": 3})),
         "meta field 'policy' must be a JSON object"),
        (job.stranger, P.encode(P.Message(P.Kind.PULL, sender=0, req=43, records=records([0], ntensors=0),
                                          tensors=[[]])),
         "this connection is not one of the job's workers"),
        (w1, P.encode(P.Message(P.Kind.PULL, sender=0, req=44, records=records([0], ntensors=0),
                                tensors=[[]])),
         "worker 1's connection sent a message as worker 0"),
        (w0, P.encode(P.Message(P.Kind.PULL, sender=0, req=45,
                                records=P.make_records([(9, 0, 0, 4, F32, 0)]), tensors=[[]])),
         "key 9 was never initialized on server 0"),
        (w0, P.encode(P.Message(P.Kind.PUSH, sender=0, req=46, step=0,
                                records=P.make_records([(0, 0, 0, 5, F32, 1)]),
                                tensors=[[np.ones(5, F32)]])),
         "key 0: slice [0, +5) does not match this server's [0, +6)"),
        (w0, P.encode(P.Message(P.Kind.REGISTER, sender=0, req=47, meta={"role": "worker"})),
         "a server does not handle REGISTER"),
        # a chain through a worker that registered no relay would break at it (a joiner's)
        (w0, P.encode(P.Message(P.Kind.PULL, sender=0, req=48, flags=P.Flag.RELAY,
                                records=records([0], ntensors=0), tensors=[[]])),
         "worker 0 asked for a relayed reply, but it has no pull relay"),
    ]
    for sock, frames, reason in cases:
        sock.send_multipart(frames)
        assert job.deliver() == 1
        req, error = error_of(job, sock)
        assert reason in error, (reason, error)
        if len(frames) >= 3 and reason != "protocol version 0":
            assert req == P.decode(frames).req
    assert any("not a node of this job" in line for line in job.logged), job.logged
    # still serving: a step of both workers is applied and answered
    ones = {k: np.ones(n, F32) for k, n in SIZES.items()}
    push(job, 0, 0, ones)
    push(job, 1, 0, ones)
    for sock in job.workers:
        (reply,) = job.replies(sock)
        np.testing.assert_array_equal(reply.tensors[0][0], np.full(SIZES[0], 2, F32))


def test_only_worker_0_may_set_the_optimizer(job):
    init(job, {k: np.zeros(n, F32) for k, n in SIZES.items()})
    spec = describe(mx.optimizer.create("sgd", learning_rate=0.5))
    job.send(job.workers[1], P.Message(P.Kind.COMMAND, sender=1, req=7, meta={
        "command": "optimizer", "optimizer": spec}))
    assert error_of(job, job.workers[1]) == (
        7, "only worker 0 may send the optimizer (this is worker 1)")
    assert job.server.weights.optimizer is None
    # without an optimizer the store keeps the sum (MXNet's rule): worker 1 changed nothing
    grads = {k: np.full(n, 3, F32) for k, n in SIZES.items()}
    push(job, 0, 0, grads)
    push(job, 1, 0, grads)
    (reply,) = job.replies(job.workers[0])
    np.testing.assert_array_equal(reply.tensors[0][0], np.full(SIZES[0], 6, F32))


def test_a_message_over_the_jobs_limit_is_refused_naming_it():
    """The topology's limit (worker 0's model), not SSDSGD_MAX_MESSAGE_BYTES, is what a
    server takes (ZeroMQ refuses bigger frames at the port; a message of several frames
    is checked whole)."""
    limit = P.message_bound([4 * SIZES[0]])
    made = InProcessJob(limit=limit)
    try:
        made.send(made.workers[0], P.Message(P.Kind.INIT, sender=0, req=3, records=records(
            SIZES), tensors=[[np.zeros(n, F32)] for n in SIZES.values()]))
        req, error = error_of(made, made.workers[0])
        assert req == 3 and error.startswith(
            f"message carries {4 * sum(SIZES.values())} data bytes, limit is {limit} "), error
        assert made.server.weights.shards == {}
    finally:
        made.close()


def test_a_worker_removed_or_leaving_gets_no_kept_buffers(job):
    """A server keeps big-frame buffers per connection (aesgcm, sealing.py); once the
    scheduler tells it a worker was removed (on_worker_failure: continue) or leaves, that
    worker's channel keeps none, and the others' still do."""
    from ssdsgd.kvstore import sealing
    channels = sealing.BinderChannels({})
    for ident in job.ids:
        channels.by_id[ident] = sealing.Channel(b"k" * 32, b"l" * 32)
    sealing.use(job.router, channels)
    job.server.on_membership({"removed": 1, "from_step": 0})
    assert [channels.by_id[i]._buffers.keeps for i in job.ids] == [True, False]
    assert "worker 1 left the job" in " ".join(job.logged)


def test_a_worker_that_leaves_gets_no_kept_buffers():
    job = InProcessJob(workers=3)
    try:
        from ssdsgd.kvstore import sealing
        channels = sealing.BinderChannels({})
        for ident in job.ids:
            channels.by_id[ident] = sealing.Channel(b"k" * 32, b"l" * 32)
        sealing.use(job.router, channels)
        job.server.on_leave({"leaving": 2})
        job.server.on_leave({"leaving": 2, "from_step": 0})
        assert [channels.by_id[i]._buffers.keeps for i in job.ids] == [True, True, False]
        assert "worker 2 leaves" in " ".join(job.logged)
    finally:
        job.close()
