"""The local launcher: every role is a child process of the launcher on this machine.

Every child the launchers start dies with the launcher: ``die_with_parent`` asks the kernel
(``PR_SET_PDEATHSIG``) to SIGKILL it when the launcher's process ends, even by SIGKILL,
so a killed launcher leaves no scheduler, server or worker training on (issue 12, defect 5).
"""
import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1


def _prctl():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):    # not Linux: children are stopped by run_job only
        return None


_PRCTL = _prctl()      # resolved once here: the child after fork only calls it


def die_with_parent(sig=signal.SIGKILL):
    """A ``preexec_fn`` for Popen: the child gets ``sig`` when this process dies.

    Call it in the thread that lives as long as the launcher (the kernel ties the signal
    to the forking thread). Returns None where prctl does not exist."""
    if _PRCTL is None or not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()

    def preexec():
        _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:       # the launcher died before prctl took effect
            os.kill(os.getpid(), sig)
    return preexec


def kill_group(pid, sig):
    """Send ``sig`` to the process group led by ``pid`` (a child started with
    ``start_new_session=True``), so nothing it started survives it; a group that is gone
    already, or not ours, is no error."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def signal_group(popen, sig):
    """kill_group for a child we started, safe after it has been reaped.

    Until the leader is reaped its pid stays reserved. Once reaped (``returncode`` set),
    the kernel may give the pid to a new process, which can lead a session of its own; a
    live process with that pid is therefore a stranger, and its group is left alone. With
    no such process the group, if any, is ours: a pid is not reused while a group of that
    id has members (children the leader left behind)."""
    if popen.returncode is not None and process_exists(popen.pid):
        return
    kill_group(popen.pid, sig)


def process_exists(pid):
    """Whether a process ``pid`` exists (ours or another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LocalProcess:
    def __init__(self, role, rank, popen, host=None):
        self.role, self.rank, self.popen, self.host = role, rank, popen, host

    @property
    def name(self):
        # hosts.role_label's rule, written out: rank_entry.py imports this file on its own
        # (standard library only, no package), so it cannot import hosts
        label = self.role if self.role == "scheduler" else f"{self.role} {self.rank}"
        return f"{label} on {self.host}" if self.host else label

    @property
    def pid(self):
        return self.popen.pid

    def poll(self):
        return self.popen.poll()

    def signal(self, sig):
        """Signal the child's whole process group (it runs in a session of its own), so
        nothing it started survives it."""
        signal_group(self.popen, sig)


def start_child(cmd, env, cwd=None, stdin=subprocess.DEVNULL):
    """A child in a session of its own, with stdout/stderr pipes, that dies with us."""
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=stdin, start_new_session=True,
                            preexec_fn=die_with_parent())


class LocalLauncher:
    """Every launcher offers: ``scheduler_host`` (the address workers and servers dial),
    ``node_env(role, rank)`` (extra variables for one process, e.g. SSDSGD_NODE_HOST, the
    address a server binds), ``start(role, rank, cmd, env)`` and ``stop(proc, sig)``."""
    name = "local"
    scheduler_host = "127.0.0.1"

    def node_env(self, role, rank):
        return {}

    def start(self, role, rank, cmd, env):
        return LocalProcess(role, rank, start_child(cmd, env))

    def stop(self, proc, sig=signal.SIGTERM):
        proc.signal(sig)


LAUNCHERS = {"local": LocalLauncher}
