"""A launched job the test can watch while it runs (its output read line by line) and
attack: where its scheduler and server listen, and hostile peers to send them messages."""
from pathlib import Path

import numpy as np
import zmq

import jobs
from conftest import PY, SCRIPTS, load_npz
from ssdsgd.kvstore import protocol as P, sealing
from ssdsgd.kvstore.security import load_keys


class LiveJob(jobs.Job):
    """``launch/dist.py -n N -s S [--secure] -- python tests/scripts/ssd_worker.py ...``,
    started (tests/jobs.py), stdout and stderr merged."""

    #: the step a ``held`` job's workers wait before: after the first, where the Trainer
    #: made its store (every node listens, worker relays too)
    HOLD_STEP = 5

    def __init__(self, out, n=2, s=1, steps=300, env=None, secure=False, script_args=(),
                 held=False):
        """``secure``: False, True (CURVE) or a cipher (``aesgcm``, ``curve``).
        ``held``: every worker waits before HOLD_STEP until :meth:`release` (at most
        300 s; the weights do not change), so the job is surely still running while the
        test probes it: a job paced or left to run by itself ended under a probe on a
        loaded CI machine."""
        cipher = "curve" if secure is True else secure
        args = ["-n", n, "-s", s] + (["--secure", "--cipher", cipher] if secure else [])
        for k, v in (env or {}).items():
            args += ["--env", f"{k}={v}"]
        args += ["--", PY, SCRIPTS / "ssd_worker.py", "--out", out, "--steps", steps,
                 *script_args] + (["--hold-at", self.HOLD_STEP] if held else [])
        super().__init__([PY, str(jobs.ROOT / "launch" / "dist.py"), *map(str, args)],
                         merge=True)
        self.run_dir = Path(out)    # the script's --out (self.out: its output lines)

    def release(self):
        """Let a ``held`` job go on."""
        (self.run_dir / "release").touch()

    def address(self, node="server 0", timeout=120):
        """tcp://host:port where ``node`` ('scheduler', 'server 0', 'worker 1': its pull
        relay) listens."""
        return self.listening(node, timeout)

    def wait(self, timeout=240):
        return super().wait(timeout)

    def kill(self):
        self.close(grace=0)


def dealer(address, configure=None):
    """A DEALER connected to ``address``; ``configure(sock)`` runs before connect."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 100_000)
    if configure is not None:
        configure(s)
    s.connect(address)
    return s


def answers(sock, frames, timeout=2.0):
    """Send; the decoded answer, or None if nothing came back within ``timeout``. A
    socket a Guard prepared seals and opens its frames (aesgcm; a no-op otherwise)."""
    channel = sealing.of(sock)
    try:
        sock.send_multipart(channel.seal([bytes(f) for f in frames]), flags=zmq.NOBLOCK)
    except zmq.Again:
        return None
    if not sock.poll(int(timeout * 1000)):
        return None
    return P.decode(channel.open(sock.recv_multipart(copy=False)))


def job_pid(job, node="server 0"):
    """The pid of a running job's ``node`` ('scheduler', 'server 0', 'worker 1'), and its
    environment."""
    role, _, rank = node.partition(" ")
    pid = job.process(role, rank or "0")
    environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    assert any(e.startswith(b"SSDSGD_SECRET_FILE=") for e in environ), environ
    return pid, environ


def job_keys(job, node="server 0"):
    """A running job's keys of ``node``, from its environment (as only their owner can;
    each process has its own)."""
    _, environ = job_pid(job, node)
    path = next(e for e in environ if e.startswith(b"SSDSGD_SECRET_FILE="))
    return load_keys(path.split(b"=", 1)[1].decode())


def undisturbed_weights(tmp_path_factory, steps, env, n=2):
    """Worker 0's final weights of the same job (``n`` workers) with nobody disturbing
    it (one run per test session and settings)."""
    tag = "-".join([str(steps), str(n)] + [f"{k}={v}" for k, v in sorted(env.items())])
    out = tmp_path_factory.getbasetemp() / f"undisturbed-{abs(hash(tag))}"
    if not (out / "final-rank0.npz").exists():
        job = LiveJob(out, n=n, steps=steps, env=env)
        assert job.wait() == 0, job.text[-3000:]
    return load_npz(out / "final-rank0.npz")


def assert_undisturbed(out, undisturbed):
    """Worker 0's final weights in ``out`` equal the undisturbed job's, bit for bit."""
    final = load_npz(out / "final-rank0.npz")
    for k in undisturbed:
        np.testing.assert_array_equal(final[k], undisturbed[k])
