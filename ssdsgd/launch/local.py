"""The local launcher: every role is a child process of the launcher on this machine."""
import os
import signal
import subprocess


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
    if popen.returncode is not None and _exists(popen.pid):
        return
    kill_group(popen.pid, sig)


def _exists(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LocalProcess:
    def __init__(self, role, rank, popen):
        self.role, self.rank, self.popen = role, rank, popen

    @property
    def name(self):
        return self.role if self.role == "scheduler" else f"{self.role} {self.rank}"

    @property
    def pid(self):
        return self.popen.pid

    def poll(self):
        return self.popen.poll()

    def signal(self, sig):
        """Signal the child's whole process group (it runs in a session of its own), so
        nothing it started survives it."""
        signal_group(self.popen, sig)


class LocalLauncher:
    """Every launcher offers: ``scheduler_host`` (the address workers and servers dial),
    ``node_env(role, rank)`` (extra variables for one process, e.g. SSDSGD_NODE_HOST, the
    address a server binds), ``start(role, rank, cmd, env)`` and ``stop(proc, sig)``."""
    name = "local"
    scheduler_host = "127.0.0.1"

    def node_env(self, role, rank):
        return {}

    def start(self, role, rank, cmd, env):
        popen = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        return LocalProcess(role, rank, popen)

    def stop(self, proc, sig=signal.SIGTERM):
        proc.signal(sig)


LAUNCHERS = {"local": LocalLauncher}
