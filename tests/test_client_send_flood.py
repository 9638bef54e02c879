"""The worker's I/O thread sends at most SEND_PER_TURN queued messages a turn
(ssdsgd/kvstore/io_thread.py), as it reads at most RECV_PER_TURN from a socket: a sender
that keeps its queue full cannot hold it from its heartbeats and its servers' replies.
Real processes (a scheduler, a server), a real WorkerClient in this process; threads keep
its send queue full for several heartbeat timeouts. Were the queue drained without a
bound, the thread would not leave it while the flood outpaced it: no heartbeat, and the
scheduler would presume the worker dead. (A test of that unbounded drain depends on which
thread the interpreter runs: it failed the job on a loaded machine and not on a quiet
one, so it is not kept.)"""
import threading
import time

import numpy as np
import pytest

import jobs
from conftest import node_env
from ssdsgd.kvstore import protocol as P
from ssdsgd.kvstore.client import WorkerClient
from ssdsgd.kvstore.env import NodeEnv
from ssdsgd.launch.job import free_port

pytestmark = pytest.mark.system
F32 = np.float32
TIMEOUT = 5.0          # SSDSGD_HEARTBEAT_TIMEOUT of the job (3 s: the flooded server,
                       # starved of CPU by other suites on 2 cores, was once presumed dead)
FLOOD = 2 * TIMEOUT    # seconds the queue is kept full
FULL = 500             # the flooder tops the queue up to this many messages


def _start(tmp_path, env, role):
    return jobs.node(role, env, merge=True, log=tmp_path / f"{role}.log")


def _flood(client, frames, stop, counts):
    """Keep FULL messages of ``frames`` for server 0 queued: one more as soon as one is
    sent (between checks it lets the other threads run)."""
    while not stop.is_set():
        if client.io.backlog < FULL:
            client.io.send(0, frames)
            counts["queued"] += 1
        else:
            counts["full"] += 1
            time.sleep(0)


def _job(tmp_path):
    env = node_env(free_port(), SSDSGD_ALGORITHM="ssgd", SSDSGD_HEARTBEAT_INTERVAL="0.1",
                   SSDSGD_HEARTBEAT_TIMEOUT=str(TIMEOUT))
    _start(tmp_path, env, "scheduler")
    _start(tmp_path, env, "server")
    client = WorkerClient(NodeEnv.from_environ(dict(env, SSDSGD_ROLE="worker")))
    client.init([(0, 4, F32)], [np.arange(4, dtype=F32)]).wait()
    return client


def _flood_for(client, seconds):
    """Keep the client's send queue full for ``seconds``; the flood's counts and how
    many messages the client received meanwhile. The messages: a pull of the latest
    weights nobody waits for (the server answers, the reply is dropped: no future)."""
    msg = P.Message(P.Kind.PULL, records=P.make_records([(0, -1, 0, 4, F32, 0)]),
                    tensors=[[]])
    client.requests.number(msg, client.rank)
    frames = P.encode(msg)
    stop, counts = threading.Event(), {"queued": 0, "full": 0}
    received = client.stats["messages_received"]
    flooder = threading.Thread(target=_flood, args=(client, frames, stop, counts),
                               daemon=True)
    flooder.start()
    try:
        time.sleep(seconds)     # the flood is live all along: the callers assert it
    finally:
        stop.set()
        flooder.join(10)
    return counts, client.stats["messages_received"] - received


def test_a_full_send_queue_does_not_stop_the_heartbeats(tmp_path):
    client = _job(tmp_path)
    try:
        counts, received = _flood_for(client, FLOOD)
        # the queue was full for several heartbeat timeouts (the I/O thread sent many
        # times what it holds), and the thread kept reading the server's replies meanwhile
        assert counts["full"] > 1000 and counts["queued"] > 4 * FULL, counts
        assert received > 100, client.stats
        assert client.barrier() == 0        # the job is alive: the scheduler answers
        assert client.failure is None
    finally:
        client.close()
    assert "presumed dead" not in (tmp_path / "scheduler.log").read_text()
