"""Issue 30 item 4: a message bigger than anything the job sends is refused by ZeroMQ
before it is buffered. A worker's pull relay takes only pieces of relayed replies (at most
protocol.FRAGMENT_MAX data bytes each), so its frame limit no longer follows
SSDSGD_MAX_MESSAGE_BYTES (16 GiB by default): a peer holding a worker's key sent it a
256 MiB frame, and the worker had to hold all of it."""
import threading
import time

import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from conftest import node_env
from livejob import LiveJob, dealer, job_keys, job_pid, undisturbed_weights, assert_undisturbed
from ssdsgd.kvstore import protocol as P
from ssdsgd.kvstore import fragments as F
from ssdsgd.kvstore.env import NodeEnv
from ssdsgd.kvstore.security import Guard

STEPS = 300
JOB_ENV = {"SSDSGD_ALGORITHM": "ssgd", "SSDSGD_PULL_RELAY": "chain"}
BIG = 256 << 20
SERVER_BIG = 200 << 20


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


class PeakRSS:
    """The largest VmRSS of ``pid`` seen while it runs, sampled every millisecond or so
    (a frame held for a fraction of a second is seen)."""

    def __init__(self, pid):
        self.pid, self.peak, self.stop = pid, rss_kb(pid), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            try:
                self.peak = max(self.peak, rss_kb(self.pid))
            except (OSError, AssertionError):
                return
            time.sleep(0.001)

    def close(self):
        self.stop.set()
        self.thread.join(5)
        return self.peak


def send_oversized(job, node, head, size):
    """A frame of ``size`` bytes after ``head``'s header frames to ``node``'s port
    ('worker 1': its pull relay; 'server 0'), from a process holding worker 0's key, once
    the handshake admitted it; returns once ZeroMQ dropped the connection. The RSS of
    ``node``'s process in KiB: (before, the peak while sending, after)."""
    pid, _ = job_pid(job, node)
    keys = job_keys(job, "worker 0")    # an insider: worker 0's own key file
    sock = dealer(job.address(node), lambda s: Guard(keys, print).client(s, node))
    events = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    port = "relay" if node.startswith("worker") else "server"
    deadline = time.monotonic() + 30
    while not events.poll(100):             # admitted: it holds a key of the job
        assert time.monotonic() < deadline, f"the {port} never admitted worker 0's key"
    assert recv_monitor_message(events)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    time.sleep(0.5)                         # the RSS the node has when it is idle-ish
    base = rss_kb(pid)
    peak = PeakRSS(pid)
    sock.send_multipart(head[:3] + [np.ones(size, np.uint8)], copy=False)
    deadline = time.monotonic() + 60        # refused: ZeroMQ drops the connection
    while not events.poll(100):
        assert time.monotonic() < deadline, "the oversized frame was not refused"
    assert recv_monitor_message(events)["event"] == zmq.EVENT_DISCONNECTED
    time.sleep(0.5)
    highest = peak.close()
    events.close(0)
    sock.close(0)
    return base, highest, rss_kb(pid)


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    return undisturbed_weights(tmp_path_factory, STEPS, {"SSDSGD_ALGORITHM": "ssgd"})


@pytest.mark.system
def test_an_oversized_frame_to_a_workers_relay_is_refused_unbuffered(tmp_path, undisturbed):
    job = LiveJob(tmp_path, steps=STEPS, env=JOB_ENV)
    try:
        head = P.encode(P.Message(P.Kind.FRAGMENT, sender=0, req=1, meta={"of": 1}))
        base, peak, _ = send_oversized(job, "worker 1", head, BIG)
        grown = peak - base
        assert grown < (BIG >> 10) // 4, f"worker 1 buffered the frame: RSS +{grown} KiB"
        assert job.wait(timeout=300) == 0, job.text[-3000:]
    finally:
        job.kill()
    assert_undisturbed(tmp_path, undisturbed)


def test_a_relayed_reply_is_bounded_by_the_request_it_answers():
    """A pull relay reassembles a reply's pieces into one buffer the first piece sizes:
    at most what a reply to that request can carry (its keys' values and optimizer state),
    not SSDSGD_MAX_MESSAGE_BYTES (16 GiB by default)."""
    request = P.make_records([(0, 5, 0, 1000, np.float32, 0), (1, 5, 0, 30, np.float64, 0)])
    values = [[np.ones(1000, np.float32)] * 3, [np.ones(30, np.float64)] * 3]   # + 2 states
    reply = P.encode(P.Message(P.Kind.REPLY, sender=0, req=9, tensors=values,
                               records=P.make_records([(0, 5, 0, 1000, np.float32, 3),
                                                       (1, 5, 0, 30, np.float64, 3)])))
    bound = F.reply_bound(request)
    raw = F.fragments(reply, 9, 0, size=4096)
    pieces = [P.decode(p) for p in raw]
    part = F.Reassembly(pieces[0], bound)
    whole = [part.add(m, p[3:]) for m, p in zip(pieces, raw)][-1]
    np.testing.assert_array_equal(P.decode(whole).tensors[1][2], np.ones(30))
    forged = P.decode(raw[0])
    forged.meta["sizes"] = forged.meta["sizes"][:-1] + [1 << 30]     # a 1 GiB reply
    with pytest.raises(P.ProtocolError, match=rf"exceeds the limit {bound} \(what a reply to "
                                              "its request can carry"):
        F.Reassembly(forged, bound)


@pytest.mark.system
def test_a_servers_limit_follows_the_model_not_the_setting(tmp_path, undisturbed):
    """Issue 30 item 4: a server's port took frames up to SSDSGD_MAX_MESSAGE_BYTES (16 GiB
    by default), because it was bound before worker 0's INIT declared the model; a 200 MiB
    message kept 190 MiB of the server's RSS after its connection closed. Worker 0 now
    states the largest message it will send when it registers, and the servers bind with
    that limit before any worker hears their addresses: a frame far above this model's is
    refused at its size header, unbuffered, and the job trains as if nobody had sent it."""
    job = LiveJob(tmp_path, steps=STEPS, env={"SSDSGD_ALGORITHM": "ssgd"})
    try:
        head = P.encode(P.Message(P.Kind.PUSH, sender=0, req=1))
        base, peak, after = send_oversized(job, "server 0", head, SERVER_BIG)
        grown, kept = peak - base, after - base
        assert grown < (SERVER_BIG >> 10) // 4, f"server 0 buffered the frame: RSS +{grown} KiB"
        assert kept < (SERVER_BIG >> 10) // 4, f"server 0 kept {kept} KiB after the drop"
        assert job.wait(timeout=300) == 0, job.text[-3000:]
    finally:
        job.kill()
    assert_undisturbed(tmp_path, undisturbed)


def test_the_jobs_limit_is_worker_0s_largest_message_within_the_setting():
    """What a worker states (``message_bound``: 8 tensors of every key, the most a message
    names, plus padding) and what the scheduler makes of it (``message_limit``)."""
    from ssdsgd.kvstore import topology as T
    assert P.message_bound([4000, 24]) == 8 * 4024 + 16
    nodes = [{"role": "server", "rank": 0, "max_message": None},
             {"role": "worker", "rank": 1, "max_message": 1 << 40},     # not worker 0's
             {"role": "worker", "rank": 0, "max_message": 70_000}]
    assert T.message_limit(nodes) == 70_000
    env = NodeEnv.from_environ(node_env(1, SSDSGD_MAX_MESSAGE_BYTES=100_000, SSDSGD_ROLE="server"))
    assert T.job_limit(env, {"max_message_bytes": 70_000}) == 70_000
    assert T.job_limit(env, {"max_message_bytes": 1 << 40}) == 100_000   # the setting bounds it
    nodes[2]["max_message"] = None                            # a store made before its model
    assert T.message_limit(nodes) is None
    assert T.job_limit(env, {}) == 100_000
