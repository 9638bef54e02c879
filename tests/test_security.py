"""Who may talk to a job (issue 9's security, issue 12's defect 1): the job's key file,
and ZeroMQ CURVE with ``--secure``. A process without the job's keys, or with wrong ones,
cannot register or push, and the job ends with the weights of an undisturbed run."""
import os
import re
import socket
import stat
import threading
import time

import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from livejob import LiveJob, answers, dealer, job_keys, undisturbed_weights, assert_undisturbed
from ssdsgd.kvstore import plain_handshake as PH, protocol as P
from ssdsgd.kvstore.security import Guard, JobKeys, KeyFile, SecurityError, load_keys

F32 = np.float32


# ---- the key file (in process) ----------------------------------------------------------
def test_key_file_is_private_and_round_trips(tmp_path):
    kf = KeyFile(secure=True)
    try:
        assert stat.S_IMODE(os.stat(kf.path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(kf.dir).st_mode) == 0o700
        keys = JobKeys.load(kf.path)
        assert keys.mode == "curve" and len(keys.secret) == 32
        assert set(keys.curve) == {"server_public", "server_secret", "client_public",
                                   "client_secret"}
    finally:
        kf.remove()
    assert not os.path.exists(kf.dir)
    assert JobKeys.generate(secure=False).mode == "plain"


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "curve"])
def test_the_launchers_key_files_hold_one_secret_each(secure):
    """Issue 30 item 5: a file per process, its own secret and, of everyone else, only
    what checks them (a CURVE public key; plain: a verification key valid at this
    process's port only, issue 28)."""
    names = ["scheduler", "server 0", "worker 0", "worker 1"]
    kf = KeyFile(secure, names)
    try:
        assert kf.env_for("worker", 1) == {"SSDSGD_SECRET_FILE": kf.files["worker 1"]}
        keys = {n: load_keys(kf.files[n]) for n in names}
        for name, k in keys.items():
            assert stat.S_IMODE(os.stat(kf.files[name]).st_mode) == 0o600
            assert k.identity == name and k.mode == ("curve" if secure else "plain")
            assert set(k.peers) == set(names)
            text = open(kf.files[name]).read()
            for other in names:          # no other process's secret is in this file
                if other != name:
                    secret = keys[other].own["secret"]
                    assert secret not in text
    finally:
        kf.remove()
    assert not os.path.exists(kf.dir)


def test_bad_key_files_are_one_line_errors(tmp_path):
    path = tmp_path / "keys.json"
    with pytest.raises(SecurityError, match="cannot open the job's keys"):
        JobKeys.load(str(path))
    JobKeys.generate(False).write(str(path))
    os.chmod(path, 0o644)
    with pytest.raises(SecurityError, match="has mode 0644; .* owner only"):
        JobKeys.load(str(path))
    os.chmod(path, 0o600)
    path.write_text('{"secret": "zz"}')
    with pytest.raises(SecurityError, match="not a job key file"):
        JobKeys.load(str(path))
    with pytest.raises(FileExistsError):         # a launcher never reuses a file
        JobKeys.generate(False).write(str(path))


# ---- a running job, attacked --------------------------------------------------------------
STEPS = 300
JOB_ENV = {"SSDSGD_ALGORITHM": "ssgd"}


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory):
    return undisturbed_weights(tmp_path_factory, STEPS, JOB_ENV)


def _attackers(secure, job_keys):
    """(name, configure(node)) for processes without the job's keys, or with wrong ones
    (``node``: whose port the socket connects to)."""
    other = JobKeys.generate(secure=secure is True)
    attackers = [("no keys", lambda node: None),
                 ("another job's keys", lambda node: Guard(other, print).client)]
    if secure is True:   # the nodes' public keys are public: a client key of its own is not enough
        public, secret = zmq.curve_keypair()

        def own_client_key(node):
            def configure(sock):
                sock.curve_serverkey = job_keys.peers[node].encode()
                sock.curve_publickey, sock.curve_secretkey = public, secret
            return configure
        attackers.append(("its own CURVE key", own_client_key))
    return attackers


def _attack(address, configure, frames, results, name):
    sock = dealer(address, configure)
    try:
        results[name] = answers(sock, frames, timeout=3.0)
    finally:
        sock.close(0)


@pytest.mark.system
@pytest.mark.parametrize("secure", [False, True, "aesgcm"], ids=["plain", "curve", "aesgcm"])
def test_processes_without_the_job_keys_are_refused(tmp_path, undisturbed, secure):
    # with the pulls relayed (docs/spec/pull_relay.md) a worker listens too; the relayed
    # job must still end on the undisturbed (unrelayed) job's weights
    job = LiveJob(tmp_path, steps=STEPS, env=dict(JOB_ENV, SSDSGD_PULL_RELAY="chain"),
                  secure=secure, held=True)
    try:
        scheduler, server = job.address("scheduler"), job.address("server 0")
        relay = job.address("worker 1")
        keyfile = next(line for line in job.lines if "listening" in line)
        assert {False: "not encrypted", True: "encrypted (CURVE)",
                "aesgcm": "encrypted (AES-256-GCM on every frame)"}[secure] in keyfile
        register = P.control(P.Kind.REGISTER, {"role": "worker", "rank": 1,
                                               "routing_id": os.urandom(16).hex()})
        push = P.encode(P.Message(P.Kind.PUSH, flags=P.Flag.PULL, sender=1, req=3,
                                  records=P.make_records([(0, 50, 0, 4, F32, 1)]),
                                  tensors=[[np.full(4, 1e6, F32)]]))
        forged = P.encode(P.Message(P.Kind.REPLY, sender=0, req=5,
                                    records=P.make_records([(0, 50, 0, 4, F32, 1)]),
                                    tensors=[[np.full(4, 1e6, F32)]]))
        # "its own CURVE key" knows the job's server key (public, as if published): the
        # test reads it from the job's file
        results, threads = {}, []
        for name, configure in _attackers(secure, job_keys(job) if secure else None):
            for where, address, frames in (("scheduler", scheduler, register),
                                           ("server 0", server, push),
                                           ("worker 1", relay, forged)):
                t = threading.Thread(target=_attack, args=(address, configure(where), frames,
                                                           results, f"{name} -> {where}"))
                t.start()
                threads.append(t)
        # the control: a process of the job (worker 0's key, acting as worker 1) sending
        # the same messages is answered (refused) within the 3 s the others get
        insider, controls, checks = job_keys(job, "worker 0"), {}, []
        for where, address, frames in (("scheduler", scheduler, register),
                                       ("server 0", server, push)):
            t = threading.Thread(target=_attack, args=(
                address, lambda sock, w=where: Guard(insider, print).client(sock, w), frames,
                controls, where))
            t.start()
            checks.append(t)
        for t in threads + checks:
            t.join(30)
        assert all(controls.get(w) is not None for w in ("scheduler", "server 0")), controls
        assert len(results) == len(threads) and all(r is None for r in results.values()), results
        job.release()
        assert job.wait() == 0, job.text[-3000:]
    finally:
        job.kill()
    assert "refused a connection" in job.text     # the ZAP handler said whom it refused
    assert_undisturbed(tmp_path, undisturbed)


class _Port:
    """A ROUTER bound with ``keys`` (its own context: one ZAP handler per context), whose
    handshakes the test makes: real sockets, in process; ``lines``: what its gate said."""

    def __init__(self, keys):
        self.ctx, self.lines = zmq.Context(), []
        self.guard = Guard(keys, self.lines.append)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.guard.server(self.ctx, self.router)
        self.port = self.router.bind_to_random_port("tcp://127.0.0.1")

    def handshake(self, configure, port=None):
        """Does a connection configured by ``configure(sock)`` get through?"""
        sock = self.ctx.socket(zmq.DEALER)
        events = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED
                                         | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        configure(sock)
        sock.connect(f"tcp://127.0.0.1:{port or self.port}")
        try:
            assert events.poll(10_000), "no handshake within 10 s"
            return recv_monitor_message(events)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        finally:
            sock.disable_monitor()
            events.close(0)
            sock.close(0)

    def said(self, text, timeout=10):
        """The gate's line with ``text`` (it logs from its own thread)."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert time.monotonic() < deadline, (text, self.lines)
            time.sleep(0.02)
        return next(line for line in self.lines if text in line)

    def close(self):
        self.router.close(0)
        self.guard.close()
        self.ctx.term()


def _handshake(bound_keys, peer_keys, peer):
    """Does a connection holding ``peer_keys`` get through the handshake of a port bound
    with ``bound_keys`` (whose identity is ``peer``)? Real sockets, in process."""
    port = _Port(bound_keys)
    try:
        return port.handshake(lambda sock: Guard(peer_keys, print).client(sock, peer)), \
            port.lines
    finally:
        port.close()


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "curve"])
def test_only_the_roles_that_connect_to_a_port_are_admitted(secure):
    """Workers connect to servers and to each other's relays, servers and workers to the
    scheduler; a stolen scheduler's or server's file opens no server or relay port."""
    names = ["scheduler", "server 0", "server 1", "worker 0", "worker 1"]
    kf = KeyFile(secure, names)
    try:
        keys = {n: load_keys(kf.files[n]) for n in names}
        for port_of, peer, admitted in (("server 0", "worker 1", True),
                                        ("server 0", "server 1", False),
                                        ("server 0", "scheduler", False),
                                        ("worker 1", "worker 0", True),
                                        ("worker 1", "server 0", False),
                                        ("scheduler", "server 1", True),
                                        ("scheduler", "worker 0", True)):
            ok, lines = _handshake(keys[port_of], keys[peer], port_of)
            assert ok == admitted, (port_of, peer, lines)
            if not admitted:
                assert f"it holds {peer}'s key, and no {peer.split()[0]} connects" in lines[0]
    finally:
        kf.remove()


# ---- plain mode: a captured handshake is worth nothing (issue 28, item 2) ----------------
class _Recorder:
    """A TCP proxy for one connection between a real client and a real binder; keeps the
    bytes of both directions (what an on-path listener captures)."""

    def __init__(self, upstream):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(20)
        self.port, self.upstream = self.listener.getsockname()[1], upstream
        self.sent, self.received, self.socks = bytearray(), bytearray(), []
        self.pumps = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        up = socket.create_connection(("127.0.0.1", self.upstream), timeout=20)
        self.socks = [conn, up]
        for a, b, into in ((conn, up, self.sent), (up, conn, self.received)):
            t = threading.Thread(target=_pump, args=(a, b, into), daemon=True)
            t.start()
            self.pumps.append(t)

    def close(self):
        for s in self.socks + [self.listener]:
            s.close()
        for t in self.pumps:
            t.join(10)


def _pump(src, dst, into):
    while True:
        try:
            data = src.recv(65536)
            if not data:
                return
            into += data
            dst.sendall(data)
        except OSError:
            return


def _hello(captured):
    """The username and password of the PLAIN HELLO command in a client's bytes (ZMTP 3:
    the command's name, then each field after its one-byte length)."""
    i = captured.index(b"\x05HELLO") + 6
    user = captured[i + 1:i + 1 + captured[i]]
    i += 1 + captured[i]
    return bytes(user), bytes(captured[i + 1:i + 1 + captured[i]])


def _raw_replay(port, captured):
    """Send a captured client's bytes as a client sends them (ZMTP: the signature, the
    rest of the greeting once the binder's signature came, the commands once its greeting
    came); what the binder answers until it closes the connection (bounded: 10 s)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        answer = b""
        try:
            for part, wait_for in ((captured[:10], 10), (captured[10:64], 64),
                                   (captured[64:], None)):
                s.sendall(part)
                while wait_for is None or len(answer) < wait_for:
                    chunk = s.recv(65536)
                    if not chunk:
                        return answer
                    answer += chunk
        except OSError:
            pass
    return answer


def _plain(user, password):
    def configure(sock):
        sock.plain_username, sock.plain_password = user, password
    return configure


def test_a_captured_plain_handshake_is_refused_when_replayed():
    """A real worker's connection to a real server port, through a proxy that records it:
    the bytes replayed to the same port, or the HELLO's username and password in a fresh
    ZeroMQ client (to that port or another node's), are refused; so is a handshake made
    outside the window. The client's own next connection is admitted."""
    names = ["scheduler", "server 0", "server 1", "worker 0"]
    kf = KeyFile(False, names)
    keys = {n: load_keys(kf.files[n]) for n in names}
    server0, server1 = _Port(keys["server 0"]), _Port(keys["server 1"])
    try:
        proxy = _Recorder(server0.port)
        client = server0.ctx.socket(zmq.DEALER)
        Guard(keys["worker 0"], print).client(client, "server 0")
        client.connect(f"tcp://127.0.0.1:{proxy.port}")
        client.send(b"step 0")
        assert server0.router.poll(10_000), server0.lines
        frames = server0.router.recv_multipart(copy=False)
        assert frames[1].bytes == b"step 0" and frames[1].get("User-Id") == "worker 0"
        client.close(0)
        proxy.close()
        captured = bytes(proxy.sent)
        assert b"\x07WELCOME" in proxy.received          # the original was admitted
        answer = _raw_replay(server0.port, captured)
        assert len(answer) >= 64 and b"\x07WELCOME" not in answer, answer   # greeting only
        assert server0.said("replays a handshake already admitted")
        user, password = _hello(captured)
        assert user.startswith(b"worker 0;")
        assert not server0.handshake(_plain(user, password))
        assert not server1.handshake(_plain(user, password))       # made for server 0
        assert server1.said("wrong PLAIN handshake MAC")
        secret = bytes.fromhex(keys["worker 0"].own["secret"])
        old = PH.credentials(secret, "worker 0", "server 0", now=time.time() - 1000)
        assert not server0.handshake(_plain(*old))
        assert re.search(r"dated -100[01] s from this host's clock \(at most 120 s\)",
                         server0.said("dated"))
        assert server0.handshake(lambda s: Guard(keys["worker 0"], print).client(s, "server 0"))
    finally:
        server0.close()
        server1.close()
        kf.remove()


def test_the_replay_window_is_bounded():
    """In process: a nonce is admitted once; past the window it is forgotten (and its
    handshake refused as too old); at capacity, new handshakes are refused."""
    now = 1_000_000.0
    window = PH.ReplayWindow(window=120, capacity=2)
    hello = [PH.credentials(b"s", "worker 0", "server 0", now=now) for _ in range(3)]
    key = PH.verification_key(b"s", "server 0")
    check = [(u.decode(), p.decode()) for u, p in hello]
    assert window.check(key, *check[0], "server 0", now=now) is None
    assert "replays" in window.check(key, *check[0], "server 0", now=now + 1)
    assert window.check(key, *check[1], "server 0", now=now + 2) is None
    assert "no more are remembered" in window.check(key, *check[2], "server 0", now=now + 3)
    assert "dated" in window.check(key, *check[0], "server 0", now=now + 121)
    assert len(window._seen) == 0           # both expired at now + 120
    assert "wrong PLAIN handshake MAC" in window.check(key, check[2][0], "0" * 64,
                                                       "server 0", now=now)
    assert "wrong PLAIN handshake MAC" in window.check(key, *check[2], "server 1", now=now)


# ---- the pull relay's worker-to-worker sockets (issue 28, item 3) ------------------------
def _connects(address, configure, frames=None):
    """Does a DEALER configured by ``configure`` get through the handshake at ``address``
    (it sends ``frames`` as soon as it may)? Bounded: 10 s."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    events = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED
                                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                     | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                     | zmq.EVENT_DISCONNECTED)
    if configure is not None:
        configure(sock)
    sock.connect(address)
    try:
        if frames is not None:
            sock.send_multipart([bytes(f) for f in frames])     # queued until admitted
        assert events.poll(10_000), f"no handshake with {address} within 10 s"
        return recv_monitor_message(events)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    finally:
        sock.disable_monitor()
        events.close(0)
        sock.close(0)


RELAYED = dict(JOB_ENV, SSDSGD_PULL_RELAY="chain")


@pytest.mark.system
@pytest.mark.parametrize("secure", [False, True, "aesgcm"], ids=["plain", "curve", "aesgcm"])
def test_a_stray_connection_to_a_workers_relay_is_refused(tmp_path, tmp_path_factory, secure):
    """3 workers with relayed pulls: each relay port (bound with the job's keys like every
    other port, kvstore/io_thread.py) refuses at the handshake a process without the job's
    keys, or with another job's, that would hand it a forged piece of a reply; a process of
    the job gets through (the control); the job ends with the weights of the same job
    undisturbed."""
    undisturbed = undisturbed_weights(tmp_path_factory, STEPS, RELAYED, n=3)
    job = LiveJob(tmp_path, n=3, steps=STEPS, env=RELAYED, secure=secure, held=True)
    try:
        forged = P.encode(P.Message(P.Kind.REPLY, sender=0, req=5,
                                    records=P.make_records([(0, 50, 0, 4, F32, 1)]),
                                    tensors=[[np.full(4, 1e6, F32)]]))
        other = JobKeys.generate(secure=secure is True)
        insider = job_keys(job, "worker 0")
        admitted = {}
        for node in ("worker 1", "worker 2"):
            address = job.address(node)
            strays = [("no keys", None),
                      ("another job's keys", lambda s, n=node: Guard(other, print).client(s, n))]
            if secure is True:   # the relay's public key (public) and a client key of its own
                strays.append(("its own CURVE key",
                               _attackers(True, insider)[-1][1](node)))
            for name, configure in strays:
                admitted[f"{name} -> {node}"] = _connects(address, configure, forged)
        assert _connects(job.address("worker 2"),
                         lambda s: Guard(insider, print).client(s, "worker 2"))
        assert not any(admitted.values()), admitted
        job.release()
        assert job.wait() == 0, job.text[-3000:]
    finally:
        job.kill()
    assert "refused a connection" in job.text
    assert_undisturbed(tmp_path, undisturbed)
