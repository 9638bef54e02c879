"""A server rejects malformed or inconsistent messages with a reason and keeps serving.

The test process itself is the job's one worker (a real WorkerClient on real sockets); the
scheduler and the server are separate processes."""
import socket
import time

import numpy as np
import pytest
import zmq

import jobs
from conftest import node_env
from ssdsgd.kvstore import protocol as P
from ssdsgd.kvstore.client import ServerError, WorkerClient
from ssdsgd.kvstore.env import NodeEnv
from ssdsgd.kvstore.sharding import Slice
from ssdsgd.launch.job import free_port

pytestmark = pytest.mark.system


@pytest.fixture
def one_server():
    port = free_port()
    env = node_env(port, num_workers=1, num_servers=1, SSDSGD_ALGORITHM="ssgd",
                   SSDSGD_HEARTBEAT_TIMEOUT=10)
    sched, server = jobs.node("scheduler", env), jobs.node("server", env)
    client = WorkerClient(NodeEnv.from_environ(dict(env, SSDSGD_ROLE="worker")))
    yield client, sched, server
    client.close()


def _raw_request(address, frames):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    s.send_multipart(frames)
    assert s.poll(10_000), "the server did not answer a malformed message"
    reply = P.decode(s.recv_multipart())
    s.close()
    return reply


def test_malformed_frames_are_rejected_and_the_server_keeps_serving(one_server):
    client, sched, server = one_server
    client.start.await_servers()
    host, port = client.topology["servers"][0]
    address = f"tcp://{host}:{port}"
    good = P.encode(P.Message(P.Kind.PULL, sender=0, req=5))
    cases = [
        ([b"hello"], "at least 3 frames"),
        ([b"SSDX" + bytes(good[0])[4:], good[1], good[2]], "bad magic"),
        ([bytes(good[0]), b"\x01\x02", b""], "key table"),
        ([bytes(good[0]), bytes(good[1]), b"{oops"], "JSON"),
        (P.encode(P.Message(P.Kind.TOPOLOGY, sender=0)), "does not handle TOPOLOGY"),
    ]
    for frames, reason in cases:
        reply = _raw_request(address, [bytes(f) for f in frames])
        assert reply.kind == P.Kind.ERROR and reason in reply.meta["error"], reply.meta
    # bytes that are not even ZeroMQ: the connection is dropped, nothing else happens
    with socket.create_connection((host, port)) as raw:
        raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)))
        time.sleep(0.2)
    assert server.poll() is None

    # a well-formed request about a key that does not exist: a clear error, no state change
    client.placement.place(0, 4)
    with pytest.raises(ServerError, match="never initialized"):
        client.exchange(P.Kind.PUSH, [(0, 0, np.ones(4, np.float32), np.float32)],
                        flags=P.Flag.PULL).wait()

    # and the server still serves real work: init, then a push answered with the sum
    client.exchange(P.Kind.INIT, [(0, 0, np.zeros(4, np.float32), np.float32)]).wait()
    reply = client.exchange(P.Kind.PUSH, [(0, 0, np.arange(4, dtype=np.float32), np.float32)],
                            flags=P.Flag.PULL).wait()
    np.testing.assert_array_equal(reply[0].value, np.arange(4, dtype=np.float32))
    with pytest.raises(ServerError, match="already applied"):
        client.exchange(P.Kind.PUSH, [(0, 0, np.ones(4, np.float32), np.float32)],
                        flags=P.Flag.PULL).wait()
    client.placement.slices[0] = [Slice(0, 0, 5)]   # a worker that thinks key 0 has 5 elements
    with pytest.raises(ServerError, match="does not match"):
        client.exchange(P.Kind.PUSH, [(0, 1, np.ones(5, np.float32), np.float32)],
                        flags=P.Flag.PULL).wait()
    assert server.poll() is None and sched.poll() is None


def test_job_shuts_down_cleanly_when_the_worker_finishes(one_server):
    client, sched, server = one_server
    client.close()
    assert sched.wait(timeout=20) == 0
    assert server.wait(timeout=20) == 0


def test_a_big_step_is_pipelined_in_chunks_and_reassembled():
    port = free_port()
    env = node_env(port, num_workers=1, num_servers=1, SSDSGD_ALGORITHM="ssgd",
                   SSDSGD_CHUNK_BYTES=64)
    jobs.node("scheduler", env), jobs.node("server", env)
    client = WorkerClient(NodeEnv.from_environ(dict(env, SSDSGD_ROLE="worker")))
    try:
        for key in range(10):
            client.placement.place(key, 8)
        values = [np.full(8, key, np.float32) for key in range(10)]
        client.exchange(P.Kind.INIT, [(k, 0, v, np.float32) for k, v in enumerate(values)]).wait()
        sent = client.stats["messages_sent"]
        reply = client.exchange(P.Kind.PUSH, [(k, 0, v * 2, np.float32)
                                              for k, v in enumerate(values)],
                                flags=P.Flag.PULL).wait()
        assert client.stats["messages_sent"] - sent == 5     # 10 keys x 32 B in 64 B chunks
        for key in range(10):
            np.testing.assert_array_equal(reply[key].value, np.full(8, 2 * key, np.float32))
    finally:
        client.close()
