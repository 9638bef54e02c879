"""The one way the tests start a job, and the guarantee that it is gone afterwards.

Entry points (each returns a :class:`Job`):

* :func:`dist` starts ``python launch/dist.py ARGS`` (a config, ``--resume RUN``, or
  ``-n N -s S -- COMMAND``) and returns at once; :func:`run` does the same and waits for
  the end (``timeout`` is required); :func:`launch` runs a script of tests/scripts through
  ``-n N -s S --``. ``hosts=(EmulatedHosts, i)`` starts the launcher on emulated host ``i``
  (tests/emulated_hosts.py); ``tty=COLUMNS`` gives it a pseudo-terminal for stdout and
  stderr, as a user at a terminal has.
* :func:`node` starts one node of a job (``python -m ssdsgd.node``) with a NodeEnv's
  variables, :func:`start` any other command of a job (a worker script started directly).

A Job reads its output while it runs (``lines``, ``text``; ``stdout`` and ``stderr`` apart
unless ``merge``), and every wait has a deadline (:meth:`Job.wait`, :meth:`Job.wait_for`,
:meth:`Job.listening`). Every process of a job carries ``TESTS_JOB_TAG=<its tag>`` in its
environment (the launcher passes its environment on), so :meth:`Job.close` finds them all,
also those in sessions of their own and those a killed launcher left: SIGTERM to the
leader (a launcher then stops its job), then SIGKILL to every process of the job still
there. A job not closed by its test is closed when the test ends, passed or failed
(conftest's autouse fixture calls :func:`close_jobs_started_since`).
"""
from __future__ import annotations

import fcntl
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
import uuid
from pathlib import Path

from ssdsgd.testing import clean_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"
PY = sys.executable
TAG_VAR = "TESTS_JOB_TAG"
#: How long a launcher gets after SIGTERM to stop its processes (it gives them SIGTERM,
#: 5 s, SIGKILL) before everything of the job is SIGKILLed.
LAUNCHER_GRACE_S = 15.0
_POLL_S = 0.05

LISTENING = re.compile(r"\[(scheduler|server \d+|worker \d+)\] .*listening on ([\d.]+):(\d+)")

_open: list["Job"] = []          # started and not closed yet, in start order
_open_lock = threading.Lock()


def _environ(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return None


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except OSError:
        return False


class Job:
    """A process tree started by a test (see the module's doc)."""

    def __init__(self, cmd, *, env=None, environ=None, cwd=ROOT, merge=False, tty=None,
                 hosts=None, stdin=subprocess.DEVNULL, grace=LAUNCHER_GRACE_S, log=None):
        """``env``: variables added to :func:`clean_env`; ``environ``: the whole environment
        instead. ``hosts``: (EmulatedHosts, index) to run ``cmd`` on that emulated host.
        ``grace``: the seconds :meth:`close` gives a leader still running after SIGTERM.
        ``log``: a file that gets every line too, as it is read."""
        self.tag, self.grace = uuid.uuid4().hex, grace
        base = dict(environ) if environ is not None else clean_env()
        base.update({k: str(v) for k, v in (env or {}).items()})
        base[TAG_VAR] = self.tag
        self.cmd = [str(c) for c in cmd]
        if hosts is not None:
            h, i = hosts
            self.cmd = h.prefix(i) + self.cmd
        self.merge = merge or tty is not None
        self.out, self.err, self.lines, self.raw = [], [], [], []
        self._lock = threading.Lock()
        self._log = open(log, "w") if log is not None else None
        self._master = None
        if tty is not None:
            master, slave = os.openpty()
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, tty, 0, 0))
            out = err = slave
        else:
            out, err = subprocess.PIPE, (subprocess.STDOUT if self.merge else subprocess.PIPE)
        self.proc = subprocess.Popen(self.cmd, cwd=cwd, env=base, stdin=stdin, stdout=out,
                                     stderr=err, start_new_session=True)
        with _open_lock:
            _open.append(self)
        if tty is not None:
            os.close(slave)
            self._master = master
            self._readers = [threading.Thread(target=self._read_tty, daemon=True)]
        else:
            self._readers = [threading.Thread(target=self._read, args=(self.proc.stdout,
                                                                       self.out), daemon=True)]
            if not self.merge:
                self._readers.append(threading.Thread(target=self._read, args=(
                    self.proc.stderr, self.err), daemon=True))
        for t in self._readers:
            t.start()

    # ---- output ---------------------------------------------------------------------
    def _read(self, pipe, into):
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", "replace")
            with self._lock:
                into.append(line)
                self.lines.append(line.rstrip("\n"))
                if self._log is not None:
                    self._log.write(line)
                    self._log.flush()

    def _read_tty(self):
        while True:
            try:
                data = os.read(self._master, 1 << 16)
            except OSError:            # EIO: every writer has closed the terminal
                return
            if not data:
                return
            self.raw.append(data)

    @property
    def stdout(self):
        """What the job wrote to stdout (everything, with ``merge`` or ``tty``)."""
        if self.raw:
            return b"".join(self.raw).decode("utf-8", "replace")
        with self._lock:
            return "".join(self.out)

    @property
    def stderr(self):
        with self._lock:
            return "".join(self.err)

    @property
    def text(self):
        """Every line so far, stdout and stderr in the order they were read."""
        with self._lock:
            return "\n".join(self.lines)

    def tail(self, n=3000):
        return (self.stdout + self.stderr)[-n:] if not self.merge else self.stdout[-n:]

    # ---- state ----------------------------------------------------------------------
    @property
    def pid(self):
        return self.proc.pid

    @property
    def returncode(self):
        return self.proc.returncode

    def poll(self):
        return self.proc.poll()

    def send_signal(self, sig):
        """Signal the leader alone (a launcher, a node)."""
        self.proc.send_signal(sig)

    def processes(self):
        """The pids of every live process of this job but the leader."""
        mark = f"{TAG_VAR}={self.tag}".encode()
        out = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == self.proc.pid:
                continue
            environ = _environ(entry)
            if environ and mark in environ and _alive(int(entry)):
                out.append(int(entry))
        return out

    def running(self, role, rank=0):
        """The pid of the job's process (``role``, ``rank``) ('scheduler', 'server',
        'worker'), from the SSDSGD_ROLE/SSDSGD_RANK the launcher gave it, or None."""
        want = {f"SSDSGD_ROLE={role}".encode(), f"SSDSGD_RANK={rank}".encode()}
        pids = [p for p in self.processes() if want <= set(_environ(p) or ())]
        return pids[0] if pids else None

    def process(self, role, rank=0, timeout=120):
        """The pid of ``running(role, rank)``; waits until it runs (the launcher starts
        it a moment after itself)."""
        return self.wait_for(lambda: self.running(role, rank), timeout, f"its {role} {rank}")

    # ---- waits, each with a deadline -------------------------------------------------
    def wait(self, timeout):
        """The exit code; after ``timeout`` s the job is stopped and the test fails."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.close()
            raise AssertionError(f"{self.cmd[:6]} did not end within {timeout} s:\n"
                                 f"{self.tail()}") from None
        for t in self._readers:
            t.join(10)
        return code

    def wait_for(self, done, timeout, what=None, running=True):
        """Wait until ``done()`` (or, for a str, until that text is in the output) holds;
        fails after ``timeout`` s, or at once if the job ends first (``running``)."""
        check = (lambda: done in self.text) if isinstance(done, str) else done
        deadline = time.monotonic() + timeout
        while True:
            result = check()
            if result:
                return result
            what_ = what or repr(done)
            assert not running or self.proc.poll() is None, \
                f"the job ended before {what_}:\n{self.tail()}"
            assert time.monotonic() < deadline, f"no {what_} within {timeout} s:\n{self.tail()}"
            time.sleep(_POLL_S)

    def listening(self, node="server 0", timeout=120):
        """tcp://host:port where the launched job's ``node`` ('scheduler', 'server 0',
        'worker 1': its pull relay) listens, once it says so."""
        def found():
            for line in list(self.lines):
                m = LISTENING.search(line)
                if m and m.group(1) == node:
                    return f"tcp://{m.group(2)}:{m.group(3)}"
        return self.wait_for(found, timeout, f"{node} saying where it listens")

    # ---- the end ----------------------------------------------------------------------
    def communicate(self, timeout=60):
        """(stdout, stderr) once the leader has ended, as Popen's (TimeoutExpired after
        ``timeout`` s, the job left running)."""
        self.proc.wait(timeout=timeout)
        for t in self._readers:
            t.join(10)
        return self.stdout, self.stderr

    def kill(self):
        """SIGKILL to the leader's process group."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self, grace=None):
        """Stop everything of the job: SIGTERM to a leader still running (``grace`` s to
        end, default the Job's), then SIGKILL to its group and to every process of the
        job still there."""
        grace = self.grace if grace is None else grace
        if self.proc.poll() is None and grace > 0:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for _ in range(3):               # a process may start another while we look
            left = self.processes()
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(_POLL_S)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for t in self._readers:
            t.join(10)
        if self._master is not None:
            os.close(self._master)
            self._master = None
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        with self._lock:
            if self._log is not None:
                self._log.close()
                self._log = None
        with _open_lock:
            if self in _open:
                _open.remove(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_jobs():
    with _open_lock:
        return list(_open)


def close_jobs_started_since(before):
    """Close every job started since ``before`` (a list from :func:`open_jobs`) that is
    still open; returns how many there were."""
    left = [j for j in open_jobs() if j not in before]
    for j in left:
        j.close()
    return len(left)


# ---- entry points ------------------------------------------------------------------------
def start(cmd, grace=0, **kw):
    """Any command of a job (a worker script started directly); see :class:`Job`. Closed
    with SIGKILL at once unless ``grace``."""
    return Job(cmd, grace=grace, **kw)


def node(role, environ, rank=None, **kw):
    """One node of a job: ``python -m ssdsgd.node`` with ``environ`` (a NodeEnv's
    variables, tests/conftest.py node_env) and SSDSGD_ROLE=``role``."""
    env = {"SSDSGD_ROLE": role, **({"SSDSGD_RANK": rank} if rank is not None else {})}
    kw.setdefault("grace", 0)       # a node left running at the end is SIGKILLed at once
    return Job([PY, "-m", "ssdsgd.node"], environ=environ, env=env, **kw)


def dist(args, **kw):
    """``python launch/dist.py ARGS``, started (see :class:`Job` for ``kw``)."""
    return Job([PY, str(ROOT / "launch" / "dist.py"), *map(str, args)], **kw)


def run(args, *, timeout, **kw):
    """``python launch/dist.py ARGS`` run to its end; fails the test after ``timeout`` s.
    The returned Job has ``returncode``, ``stdout`` and ``stderr``, and nothing left."""
    job = dist(args, **kw)
    try:
        job.wait(timeout)
    finally:
        job.close()
    return job


def launch_args(n, s, script_args, env=None, script="ssd_worker.py", secure=False):
    """``-n N -s S [--secure] [--env K=V ...] -- python tests/scripts/SCRIPT ARGS``."""
    args = ["-n", n, "-s", s] + (["--secure"] if secure else [])
    for k, v in (env or {}).items():
        args += ["--env", f"{k}={v}"]
    return [*args, "--", PY, SCRIPTS / script, *script_args]


def launch(n, s, script_args, env=None, timeout=180, script="ssd_worker.py", **kw):
    """A script of tests/scripts on N workers and S servers, run to its end."""
    return run(launch_args(n, s, script_args, env, script), timeout=timeout, **kw)
