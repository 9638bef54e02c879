"""A launched job the test can watch while it runs (its output read line by line) and
attack: where its scheduler and server listen, and hostile peers to send them messages."""
import os
import re
import signal
import subprocess
import threading
import time

import zmq

from conftest import PY, ROOT, SCRIPTS, load_npz
from ssdsgd.kvstore import protocol as P
from ssdsgd.kvstore.security import load_keys

LISTENING = re.compile(r"\[(scheduler|server \d+|worker \d+)\] .*listening on ([\d.]+):(\d+)")


class LiveJob:
    """``launch/dist.py -n N -s S [--secure] -- python tests/scripts/ssd_worker.py ...``."""

    def __init__(self, out, n=2, s=1, steps=300, env=None, secure=False, script_args=()):
        cmd = [PY, str(ROOT / "launch" / "dist.py"), "-n", str(n), "-s", str(s)]
        if secure:
            cmd.append("--secure")
        for k, v in (env or {}).items():
            cmd += ["--env", f"{k}={v}"]
        cmd += ["--", PY, str(SCRIPTS / "ssd_worker.py"), "--out", str(out), "--steps",
                str(steps)] + [str(a) for a in script_args]
        self.out = out
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def text(self):
        return "\n".join(self.lines)

    def address(self, node="server 0", timeout=120):
        """tcp://host:port where ``node`` ('scheduler', 'server 0', 'worker 1': its pull
        relay) listens."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                m = LISTENING.search(line)
                if m and m.group(1) == node:
                    return f"tcp://{m.group(2)}:{m.group(3)}"
            assert self.proc.poll() is None, f"the job ended early:\n{self.text[-3000:]}"
            time.sleep(0.05)
        raise AssertionError(f"{node} never said where it listens:\n{self.text[-3000:]}")

    def wait(self, timeout=240):
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the job did not end within {timeout} s:\n{self.text[-3000:]}")
        self.reader.join(10)
        return code

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


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
    """Send; the decoded answer, or None if nothing came back within ``timeout``."""
    try:
        sock.send_multipart([bytes(f) for f in frames], flags=zmq.NOBLOCK)
    except zmq.Again:
        return None
    if not sock.poll(int(timeout * 1000)):
        return None
    return P.decode(sock.recv_multipart())


def job_pid(job, node="server 0"):
    """The pid of a running job's ``node`` ('scheduler', 'server 0', 'worker 1')."""
    port = job.address("scheduler").rsplit(":", 1)[1].encode()
    role, _, rank = node.partition(" ")
    for pid in os.listdir("/proc"):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except (OSError, ValueError):
            continue
        if (b"SSDSGD_ROLE=" + role.encode() in environ
                and b"SSDSGD_RANK=" + (rank or "0").encode() in environ
                and b"SSDSGD_SCHEDULER_PORT=" + port in environ
                and any(e.startswith(b"SSDSGD_SECRET_FILE=") for e in environ)):
            return int(pid), environ
    raise AssertionError(f"the job's {node} process was not found")


def job_keys(job, node="server 0"):
    """A running job's keys of ``node``, from its environment (as only their owner can;
    each process has its own)."""
    _, environ = job_pid(job, node)
    path = next(e for e in environ if e.startswith(b"SSDSGD_SECRET_FILE="))
    return load_keys(path.split(b"=", 1)[1].decode())


def undisturbed_weights(tmp_path_factory, steps, env):
    """Worker 0's final weights of the same job with nobody disturbing it (one run per
    test session and settings)."""
    tag = "-".join([str(steps)] + [f"{k}={v}" for k, v in sorted(env.items())])
    out = tmp_path_factory.getbasetemp() / f"undisturbed-{abs(hash(tag))}"
    if not (out / "final-rank0.npz").exists():
        job = LiveJob(out, steps=steps, env=env)
        assert job.wait() == 0, job.text[-3000:]
    return load_npz(out / "final-rank0.npz")
