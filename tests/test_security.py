"""Who may talk to a job (issue 9's security, issue 12's defect 1): the job's key file,
and ZeroMQ CURVE with ``--secure``. A process without the job's keys, or with wrong ones,
cannot register or push, and the job ends with the weights of an undisturbed run."""
import os
import stat
import threading

import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from livejob import LiveJob, answers, dealer, job_keys, undisturbed_weights, assert_undisturbed
from ssdsgd.kvstore import protocol as P
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
    """Issue 30 item 5: a file per process, its own secret and only the public half (a
    token's hash, a CURVE public key) of everyone else's."""
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
                    secret = keys[other].own["secret" if secure else "token"]
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
    other = JobKeys.generate(secure=True) if secure else JobKeys.generate(secure=False)
    attackers = [("no keys", lambda node: None),
                 ("another job's keys", lambda node: Guard(other, print).client)]
    if secure:    # the nodes' public keys are public: a client key of its own is not enough
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
@pytest.mark.parametrize("secure", [False, True], ids=["plain", "curve"])
def test_processes_without_the_job_keys_are_refused(tmp_path, undisturbed, secure):
    # with the pulls relayed (docs/spec/pull_relay.md) a worker listens too; the relayed
    # job must still end on the undisturbed (unrelayed) job's weights
    job = LiveJob(tmp_path, steps=STEPS, env=dict(JOB_ENV, SSDSGD_PULL_RELAY="chain"),
                  secure=secure)
    try:
        scheduler, server = job.address("scheduler"), job.address("server 0")
        relay = job.address("worker 1")
        keyfile = next(line for line in job.lines if "listening" in line)
        assert ("encrypted (CURVE)" if secure else "not encrypted") in keyfile
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
        assert job.wait() == 0, job.text[-3000:]
    finally:
        job.kill()
    assert "refused a connection" in job.text     # the ZAP handler said whom it refused
    assert_undisturbed(tmp_path, undisturbed)


def _handshake(bound_keys, peer_keys, peer):
    """Does a connection holding ``peer_keys`` get through the handshake of a port bound
    with ``bound_keys`` (whose identity is ``peer``)? Real sockets, in process."""
    ctx, lines = zmq.Context(), []       # its own: one ZAP handler per context
    guard = Guard(bound_keys, lines.append)
    router = ctx.socket(zmq.ROUTER)
    guard.server(ctx, router)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    sock = ctx.socket(zmq.DEALER)
    events = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED
                                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    Guard(peer_keys, print).client(sock, peer)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        assert events.poll(10_000), "no handshake within 10 s"
        return recv_monitor_message(events)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED, lines
    finally:
        sock.disable_monitor()
        events.close(0)
        sock.close(0)
        router.close(0)
        guard.close()
        ctx.term()


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
