"""Launchers that start every process of the job with one command (``mpirun``, ``srun``).

run_job asks for the processes one by one (scheduler, servers, workers); this launcher
answers each with a :class:`GroupProcess` and, once it has them all, runs the one command
that starts ``rank_entry.py --rank-from VAR`` on every slot: index 0 is the scheduler, then
the servers, then the workers (the spec in SSDSGD_LAUNCH_SPEC has the table). The ranks'
tagged output lines are split back into each process's own stdout/stderr pipe and exit code,
so the prefixes, the failure message naming the process and its host, and the stop are the
same as with the other launchers.

Every rank also holds a TCP "lifeline" to the launcher: when the launcher dies, even by
SIGKILL, the kernel closes it and each rank ends its process, whatever mpirun or srun do.

No secret travels through mpirun's or srun's channels (their daemons, Slurm's job
records): the job's key directory is made on the shared filesystem these launchers need
anyway (``keys_parent``: the run directory, else the working directory), and the spec
carries only each process's key file path, which rank_entry.py checks before use.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading

from . import hosts as H
from .addresses import is_local
from .local import die_with_parent
from .rank_entry import TAG
from .remote import SchedulerSite, forwarded, replace_python, secret_paths


ABORT_WAIT = 5.0     # seconds the group command gets to end the job after a rank failed


class _Pipes:
    """A stand-in for Popen where run_job looks: .stdout/.stderr, .wait()."""

    def __init__(self, group):
        self.group = group
        r_out, self.w_out = os.pipe()
        r_err, self.w_err = os.pipe()
        self.stdout, self.stderr = os.fdopen(r_out, "rb"), os.fdopen(r_err, "rb")
        self.pid = None

    def wait(self, timeout=None):
        return self.group.wait(timeout)

    def close_writers(self):
        for fd in (self.w_out, self.w_err):
            try:
                os.close(fd)
            except OSError:
                pass


class GroupProcess:
    """One process of the job inside the group command."""

    def __init__(self, launcher, index, slot):
        self.launcher, self.index = launcher, index
        self.role, self.rank, self.host = slot.role, slot.rank, slot.host
        if slot.host == "localhost":
            self.host = launcher.scheduler_host
        self.popen = _Pipes(launcher)
        self.code = None          # from the rank's exit line

    @property
    def name(self):
        return f"{H.role_label(self.role, self.rank)} on {self.host}"

    @property
    def pid(self):
        return self.launcher.popen.pid if self.launcher.popen else None

    def poll(self):
        if self.code is not None:
            return self.code
        group = self.launcher.popen.poll() if self.launcher.popen else None
        if group is None or not self.launcher.drained.is_set():
            return None
        return group if group != 0 else 1    # ended without saying how: not a success

    def signal(self, sig):
        self.launcher.send_signal(sig)


class GroupLauncher:
    """Subclasses give ``name``, ``rank_var``, ``hosts_of()`` and ``command(K)``."""
    rank_var = None
    secure_default = True       # see launchers.make_launcher (SECURE-BY-DEFAULT)
    # cluster.scheduler_restarts: why this launcher cannot start one process again
    restarts_one = ("mpirun and srun start every rank with one command and end them all "
                    "when one dies, so a scheduler cannot be restarted alone; use "
                    "--launcher local or ssh")

    def __init__(self, hosts, num_workers, num_servers, opts):
        self.hosts = hosts
        sched = opts.scheduler_host or self.scheduler_slot_host()
        if not is_local(sched):          # e.g. srun from outside the allocation
            opts = dataclasses.replace(opts, scheduler_host=sched)
        self.opts = opts
        self.site = SchedulerSite(hosts, opts)
        self.scheduler_host = self.site.address
        self.slots = H.place(hosts, num_workers, num_servers, sched)
        self.total = len(self.slots)
        self.workdir = opts.workdir or os.getcwd()
        self.python = opts.python or sys.executable
        self.procs, self.table, self.env, self.files = [], [], None, []
        self.popen = None
        self.drained = threading.Event()
        self.sent = set()
        self._lifeline()

    def scheduler_slot_host(self):
        """The name the group command knows the launcher's host by."""
        for h in self.hosts:
            if is_local(h.name):
                return h.name
        return "localhost"

    def _lifeline(self):
        self.listener = socket.create_server((self.site.launcher_address, 0), backlog=128)
        self.lifelines = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.lifelines.append(conn)      # held open until the launcher's process ends

    def prepare(self, log):
        log(f"scheduler at {self.scheduler_host}; placement ({self.rank_var} 0: the "
            "scheduler on the launcher's host, then servers and workers round-robin over the "
            "hosts' slots):")
        for line in H.describe(self.slots, self.scheduler_host):
            log(f"  {line}")

    def node_env(self, role, rank):
        return {"SSDSGD_INTERFACE": self.opts.interface} if self.opts.interface else {}

    def keys_parent(self, run_dir):
        """Where the job's key directory is made: on a filesystem every host sees."""
        return os.path.abspath(run_dir or self.workdir)

    def start(self, role, rank, cmd, env):
        index = len(self.procs)
        slot = self.slots[index]
        assert (slot.role, slot.rank) == (role, rank), "run_job's order changed"
        proc = GroupProcess(self, index, slot)
        self.procs.append(proc)
        self.table.append([role, rank, replace_python(cmd, self.opts.python), slot.host])
        own, paths = secret_paths(
            {k: v for k, v in forwarded(env, self.opts.env_keys).items()
             if k not in ("SSDSGD_ROLE", "SSDSGD_RANK")})
        if self.env is None:
            self.env = own
        self.files.append(paths)      # the path of each process's own key file
        if index + 1 == self.total:
            self._launch()
        return proc

    def _launch(self):
        spec = {"procs": self.table, "env": self.env, "rank_keys": self.files, "tag": True,
                "cwd": self.workdir,
                "connect_timeout": self.opts.start_timeout,
                "lifeline": list(self.listener.getsockname()[:2])}
        cmd = self.command(self.total) + [self.python, self.entry(), "--rank-from",
                                          self.rank_var]
        env = dict(os.environ, SSDSGD_LAUNCH_SPEC=json.dumps(spec), **self.extra_env())
        self.popen = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      start_new_session=True, preexec_fn=die_with_parent())
        for p in self.procs:
            p.popen.pid = self.popen.pid
        threading.Thread(target=self._split, daemon=True).start()
        threading.Thread(target=self._own_lines, args=(self.popen.stderr,), daemon=True).start()

    def extra_env(self):
        return {}

    def entry(self):
        from .remote import entry_path
        return entry_path(False)

    def _split(self):
        """The ranks' tagged lines to their processes' pipes; others are the group
        command's own (printed with its name)."""
        try:
            for raw in iter(self.popen.stdout.readline, b""):
                self._route(raw)
        finally:
            self.popen.wait()
            self.drained.set()
            for p in self.procs:
                p.popen.close_writers()

    def _route(self, raw):
        tag = TAG.encode() + b" "
        if not raw.startswith(tag):
            return self._own(raw)
        parts = raw[len(tag):].split(b" ", 2)
        try:
            proc = self.procs[int(parts[0])]
        except (ValueError, IndexError):
            return self._own(raw)
        kind, rest = parts[1], (parts[2] if len(parts) > 2 else b"\n")
        if kind == b"x":
            proc.code = _exit_code(rest)
            return
        fd = proc.popen.w_out if kind == b"o" else proc.popen.w_err
        try:
            os.write(fd, rest if rest.endswith(b"\n") else rest + b"\n")
        except OSError:
            pass

    def _own(self, raw):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        if line.strip():
            print(f"[{os.path.basename(self.tool)}] {line}", file=sys.stderr, flush=True)

    def _own_lines(self, stream):
        for raw in iter(stream.readline, b""):
            self._own(raw)

    hostfile = None     # a temporary hostfile the group command reads (mpi, slurm)

    def wait(self, timeout=None):
        """The group command's exit code (None while it runs); once it has ended, the
        temporary hostfile it read is removed."""
        code = self.popen.wait(timeout) if self.popen else None
        if code is not None and self.hostfile:
            try:
                os.unlink(self.hostfile)
            except OSError:
                pass
            self.hostfile = None
        return code

    def send_signal(self, sig):
        """Once per signal: the group command forwards it to every rank; SIGKILL ends the
        command itself (each rank's lifeline and its daemons end the rest)."""
        if self.popen is None or self.popen.poll() is not None or sig in self.sent:
            return
        self.sent.add(sig)
        if sig != signal.SIGKILL and any(p.code not in (None, 0) for p in self.procs):
            try:     # a rank failed: mpirun/srun end the job themselves (OpenMPI 4.1's
                self.popen.wait(timeout=ABORT_WAIT)   # mpirun crashes on a signal then)
                return
            except subprocess.TimeoutExpired:
                pass
        try:
            if sig == signal.SIGKILL:
                os.killpg(self.popen.pid, signal.SIGKILL)
            else:
                self.popen.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, proc, sig=signal.SIGTERM):
        proc.signal(sig)


def _exit_code(rest):
    try:
        code = int(rest.split()[0])
    except (ValueError, IndexError):
        return 1
    return -(code - 128) if 128 < code < 160 else code
