"""``--launcher ssh``: every process of the job started over ssh, like dmlc-tracker's ssh
launcher and horovodrun.

Before anything starts, every host must answer ``ssh HOST true`` without a prompt
(BatchMode: keys and known_hosts set up, as for horovodrun), else the job fails naming the
host. ``--sync-dir`` then copies this directory there with rsync. Each process is
``ssh HOST 'cd WORKDIR && exec PYTHON -m ssdsgd.launch.rank_entry --stdin'``: the job's
environment travels in the first line of its stdin (never on a command line), and the
launcher keeps that stdin open: when the launcher dies, ssh closes it and the remote side
ends its process. The scheduler runs on the launcher's host as a local child unless
``--scheduler-host`` names another host.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading

from . import hosts as H
from .local import LocalProcess, die_with_parent, start_child
from .remote import (LaunchError, Options, SchedulerSite, entry_path, forwarded, quote,
                     replace_python, split_secrets)

SSH_OPTIONS = ["-T", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR",
               "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3"]
RSYNC_EXCLUDES = [".git", ".venv", "__pycache__", "runs", "*.pyc"]


class RemoteProcess(LocalProcess):
    """A process on another host, seen through its ssh client."""

    def poll(self):
        code = self.popen.poll()
        if code is not None and 128 < code < 160:   # rank_entry: killed by signal N
            return -(code - 128)
        return code

    def signal(self, sig):
        """Ask the remote side (a line on stdin); SIGKILL also ends the ssh client, so
        the remote side sees stdin close and kills its process group."""
        try:
            self.popen.stdin.write(f"{int(sig)}\n".encode())
            self.popen.stdin.flush()
        except (OSError, ValueError):
            pass
        if sig == signal.SIGKILL:
            try:
                self.popen.stdin.close()
            except (OSError, ValueError):
                pass
            super().signal(signal.SIGKILL)


class SSHCommand:
    """How one process is started on a host over ssh: the ssh client and its options,
    the hosts' directory and interpreter. The launcher starts every remote process of
    the job with it; ``launch/dist.py --join RUN_DIR --host HOST`` a joiner, from what
    ``join_spec`` wrote into join.json."""

    #: the Options fields a joiner needs (join.json's ``ssh``) and their types
    JOIN_FIELDS = {"ssh_command": str, "ssh_port": (int, type(None)),
                   "ssh_identity_file": (str, type(None)), "sync_dir": (str, type(None)),
                   "workdir": (str, type(None)), "python": (str, type(None)),
                   "interface": (str, type(None)), "start_timeout": (int, float),
                   "env_keys": list}

    def __init__(self, opts):
        self.opts = opts
        self.workdir = opts.sync_dir or opts.workdir or os.getcwd()
        self.python = opts.python or sys.executable
        self.ssh = shlex.split(opts.ssh_command or os.environ.get("SSDSGD_SSH_COMMAND")
                               or "ssh")

    def join_spec(self):
        """join.json's ``ssh``: this launcher's way to a host, for a joiner."""
        spec = {k: getattr(self.opts, k) for k in self.JOIN_FIELDS}
        spec.update(ssh_command=quote(self.ssh), workdir=self.workdir,
                    env_keys=list(self.opts.env_keys))
        return spec

    @classmethod
    def from_join_spec(cls, spec):
        return cls(Options(**dict(spec, env_keys=tuple(spec["env_keys"]))))

    def ssh_args(self, host, port=None):
        args = list(self.ssh) + SSH_OPTIONS + [
            "-o", f"ConnectTimeout={max(1, int(self.opts.start_timeout))}"]
        port = port or self.opts.ssh_port
        if port:
            args += ["-p", str(port)]
        if self.opts.ssh_identity_file:
            args += ["-i", self.opts.ssh_identity_file]
        return args + [host]

    def _check_host(self, host, port, failures):
        check = "true" if self.opts.sync_dir else (
            f"cd {shlex.quote(self.workdir)} || exit 3; "
            f"command -v {shlex.quote(self.python)} >/dev/null || exit 4")
        try:
            r = subprocess.run(self.ssh_args(host, port) + [check], capture_output=True,
                               text=True, stdin=subprocess.DEVNULL,
                               timeout=self.opts.start_timeout + 10)
        except subprocess.TimeoutExpired:
            failures.append(f"host {host}: ssh did not answer within "
                            f"{self.opts.start_timeout + 10:g} s")
            return
        last = (r.stderr.strip().splitlines() or [""])[-1]
        if r.returncode == 3:
            failures.append(f"host {host} has no directory {self.workdir} (use --sync-dir "
                            "DIR, or --workdir with a path every host has)")
        elif r.returncode == 4:
            failures.append(f"host {host} has no interpreter {self.python} (use --python)")
        elif r.returncode != 0:
            failures.append(f"cannot reach host {host} over ssh ({last or f'exit {r.returncode}'}); "
                            "check that it is up and that 'ssh HOST true' works without a "
                            "prompt (keys, known_hosts), or remove it from the hosts")

    def _rsync(self, host, port, failures):
        rsh = quote(self.ssh_args(host, port)[:-1])
        src = os.getcwd().rstrip("/") + "/"
        cmd = ["rsync", "-az", "--rsh", rsh, *sum((["--exclude", e] for e in RSYNC_EXCLUDES),
               []), src, f"{host}:{self.workdir.rstrip('/')}/"]
        r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or [""])[-1]
            failures.append(f"rsync to {host}:{self.workdir} failed ({last})")

    def _check_host_after_sync(self, host, port, failures):
        sync, self.opts.sync_dir = self.opts.sync_dir, None
        try:
            self._check_host(host, port, failures)
        finally:
            self.opts.sync_dir = sync

    def prepare_host(self, host, port=None):
        """Check one host (and copy the code there with --sync-dir): its failures, one
        line each (none: ready)."""
        failures = []
        self._check_host(host, port, failures)
        if self.opts.sync_dir and not failures:
            self._rsync(host, port, failures)
            if not failures:
                self._check_host_after_sync(host, port, failures)
        return failures

    def start_remote(self, role, rank, cmd, env, host, port=None):
        """One process on ``host``: its environment and its key files' text in the first
        line of ssh's stdin (never a command line), which stays open as its lifeline."""
        env, files = split_secrets(forwarded(env, self.opts.env_keys))
        spec = {"procs": [[role, rank, replace_python(cmd, self.opts.python), host]],
                "index": 0, "env": env, "files": files,
                "connect_timeout": self.opts.start_timeout}
        popen = subprocess.Popen(self.ssh_args(host, port) + [self.remote_command()],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, start_new_session=True,
                                 preexec_fn=die_with_parent())
        popen.stdin.write((json.dumps(spec) + "\n").encode())
        popen.stdin.flush()
        return RemoteProcess(role, rank, popen, host)

    def remote_command(self):
        wd, py = shlex.quote(self.workdir), shlex.quote(self.python)
        entry = shlex.quote(entry_path(bool(self.opts.sync_dir)))
        return (f"cd {wd} 2>/dev/null || {{ echo \"ssdsgd: host $(hostname) has no "
                f"directory {wd}\" >&2; exit 2; }}; exec {py} {entry} --stdin")

    def node_env(self, role, rank):
        return {"SSDSGD_INTERFACE": self.opts.interface} if self.opts.interface else {}

    def stop(self, proc, sig=signal.SIGTERM):
        proc.signal(sig)


class SSHLauncher(SSHCommand):
    name = "ssh"
    secure_default = True       # see launchers.make_launcher (SECURE-BY-DEFAULT)

    def __init__(self, hosts, num_workers, num_servers, opts):
        if not hosts:
            raise LaunchError("--launcher ssh needs hosts: -H/--hostfile FILE, --hosts "
                              "h1:2,h2:2 or cluster.hosts")
        super().__init__(opts)
        self.hosts = hosts
        self.site = SchedulerSite(hosts, opts)
        self.plan = {(s.role, s.rank): s for s in
                     H.place(hosts, num_workers, num_servers, self.site.slot_name(hosts))}
        self.scheduler_host = self.site.address
        self.lock = threading.Lock()

    # ---- before the job -----------------------------------------------------------
    def _remote_hosts(self):
        seen = {}
        for s in self.plan.values():
            if not self._here(s):
                seen[(s.host, s.port)] = s
        return list(seen)

    def _parallel(self, fn, items):
        failures = []
        threads = [threading.Thread(target=fn, args=(*item, failures)) for item in items]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failures:
            raise LaunchError("; ".join(sorted(failures)))

    def prepare(self, log):
        """Check every host, copy the code when asked, print the placement."""
        remote = self._remote_hosts()
        self._parallel(self._check_host, remote)
        if self.opts.sync_dir:
            log(f"copying {os.getcwd()} to {self.opts.sync_dir} on {len(remote)} hosts")
            self._parallel(self._rsync, remote)
            self._parallel(self._check_host_after_sync, remote)
        log(f"scheduler at {self.scheduler_host}; placement (the scheduler on the launcher's "
            "host, servers then workers round-robin over the hosts' slots):")
        for line in H.describe(self.plan.values(), self.scheduler_host):
            log(f"  {line}")

    # ---- the launcher interface ---------------------------------------------------
    def start(self, role, rank, cmd, env):
        slot = self.plan[(role, rank)]
        if self._here(slot):                    # the scheduler, a child of the launcher
            env = dict(env, SSDSGD_NODE_HOST=self.scheduler_host)
            return LocalProcess(role, rank, start_child(cmd, env), self.scheduler_host)
        return self.start_remote(role, rank, cmd, env, slot.host, slot.port)

    def watch_hosts(self, run_dir, spare, log, sinks, lock, servers=(), replicas=0):
        """``--host-discovery-script``: the loop that starts joiners on new hosts and
        takes the job off hosts that go (discovery.py), started; None without the option.
        ``servers``: the job's server processes; ``replicas``: cluster.server_replicas."""
        if not self.opts.host_discovery_script:
            return None
        from .discovery import HostDiscovery
        workers = {}          # the job's own hosts -> the first workers placed there
        for (role, rank), slot in self.plan.items():
            if role == "worker":
                workers.setdefault(slot.host, []).append(rank)
        return HostDiscovery(self.opts.host_discovery_script, run_dir,
                             {h.name for h in self.hosts}, spare, log, sinks, lock,
                             workers, servers, replicas).start()

    def _here(self, slot):
        return slot.role == "scheduler" and self.site.local
