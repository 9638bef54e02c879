"""What the multi-host launchers (ssh, mpi, slurm) share: options, the environment that
travels, the scheduler's host and address, the process objects run_job watches.

A remote launcher has the local launcher's interface (``scheduler_host``,
``node_env(role, rank)``, ``start(role, rank, cmd, env)``, ``stop(proc, sig)``) plus
``prepare(log)``, called once before anything starts: it checks the hosts, prints the
placement and raises :class:`LaunchError` (one line, exit code 2) when the job cannot start.
"""
from __future__ import annotations

import dataclasses
import os
import shlex
import sys

from . import addresses, hosts as H

FORWARD_PREFIXES = ("SSDSGD_", "MXNET_", "OMP_", "KMP_", "PYTHON")
FORWARD_NAMES = ("LD_LIBRARY_PATH",)
DEFAULT_START_TIMEOUT = 30.0
SECRET_FILE_VARS = ("SSDSGD_SECRET_FILE",)   # the job's keys (0600 file; kvstore/security)


class LaunchError(RuntimeError):
    """The job cannot start as asked; the message is one line naming the cause."""


@dataclasses.dataclass
class Options:
    """The command line's launcher options (see add_arguments)."""
    launcher: str = "local"
    hostfile: str | None = None
    hosts: str | None = None
    sync_dir: str | None = None
    workdir: str | None = None
    interface: str | None = None
    scheduler_host: str | None = None
    python: str | None = None
    ssh_command: str | None = None
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    start_timeout: float = DEFAULT_START_TIMEOUT
    mpi_args: str = ""
    srun_args: str = ""
    secure: bool = False          # --secure: encrypted (kvstore/security.py)
    insecure: bool = False        # --insecure: not encrypted where that is the default
    cipher: str = "aesgcm"        # --cipher: aesgcm (sealing.py) or curve (ZeroMQ's)
    env_keys: tuple = ()          # the --env names: they travel to every host
    host_discovery_script: str | None = None     # ssh: hosts that join (discovery.py)


def add_arguments(p, launchers=("local", "ssh", "mpi", "slurm"), default_launcher="local"):
    """The launcher options of launch/dist.py (both forms), named as in MXNet's
    tools/launch.py (dmlc-tracker) and horovodrun."""
    g = p.add_argument_group("several machines (docs/launch.md)")
    g.add_argument("--launcher", choices=launchers, default=default_launcher,
                   help="how the processes are started (default: cluster.launcher of the "
                   "config, else local)")
    g.add_argument("-H", "--hostfile", metavar="FILE", help="hosts, one a line: dmlc's "
                   "host[:ssh_port] or Horovod's 'host slots=N'")
    g.add_argument("--hosts", metavar="H1:SLOTS,H2:SLOTS", help="hosts as a list, e.g. "
                   "node1:2,node2:2 (instead of a hostfile; or cluster.hosts)")
    g.add_argument("--sync-dir", "--sync-dst-dir", dest="sync_dir", metavar="DIR",
                   help="ssh: rsync this directory to DIR on every host first, run there")
    g.add_argument("--workdir", metavar="DIR", help="working directory on the hosts "
                   "(default: this one, or --sync-dir)")
    g.add_argument("--interface", metavar="NAME", help="advertise this network interface's "
                   "address (like DMLC_INTERFACE); default: the route to the scheduler")
    g.add_argument("--scheduler-host", metavar="HOST", help="run the scheduler there "
                   "(default: this host, the launcher's)")
    g.add_argument("--python", metavar="PATH", help="interpreter on the hosts (default: "
                   "this one, %s)" % sys.executable)
    g.add_argument("--ssh-command", metavar="CMD", help="ssh program and options "
                   "(default: $SSDSGD_SSH_COMMAND or ssh), e.g. 'ssh -F cluster.conf'")
    g.add_argument("-p", "--ssh-port", type=int, metavar="PORT", help="ssh port of all hosts")
    g.add_argument("-i", "--ssh-identity-file", metavar="FILE", help="ssh private key")
    g.add_argument("--start-timeout", type=float, default=DEFAULT_START_TIMEOUT,
                   metavar="S", help="seconds to reach a host or the scheduler before the "
                   "job fails naming it (default: %(default)g)")
    g.add_argument("--host-discovery-script", metavar="FILE", help="ssh: run FILE every "
                   "2 s while the job runs; each host it prints (host[:slots] a line) that "
                   "is not one of the job's gets a joining worker per slot, up to "
                   "cluster.max_workers (as horovodrun's option; docs/launch.md)")
    g.add_argument("--mpi-args", default="", metavar="ARGS", help="extra mpirun arguments")
    g.add_argument("--srun-args", default="", metavar="ARGS", help="extra srun arguments")
    security = g.add_mutually_exclusive_group()
    security.add_argument("--secure", action="store_true", help="encrypt and authenticate "
                          "every connection (the default of ssh, mpi and slurm; "
                          "docs/reliability.md); --cipher says how")
    g.add_argument("--cipher", choices=("aesgcm", "curve"), default="aesgcm",
                   help="how a secure job encrypts: aesgcm (the default: plain mode's "
                   "handshake, then AES-256-GCM on every frame, on the sending thread) or "
                   "curve (ZeroMQ CURVE, in libzmq's I/O thread; docs/reliability.md)")
    security.add_argument("--insecure", action="store_true", help="no encryption with ssh, "
                          "mpi or slurm (connections are still authenticated by the job's "
                          "key file)")
    return g


def options_from(args, env_keys=()):
    names = [f.name for f in dataclasses.fields(Options) if f.name != "env_keys"]
    return Options(**{n: getattr(args, n) for n in names if hasattr(args, n)},
                   env_keys=tuple(env_keys))


def host_list(opts, config_hosts=()):
    """The hosts from --hostfile, --hosts or cluster.hosts (HostError when malformed)."""
    if opts.hostfile and opts.hosts:
        raise LaunchError("give either -H/--hostfile or --hosts, not both")
    if opts.hostfile:
        return H.read_hostfile(opts.hostfile)
    if opts.hosts:
        return H.parse_hosts(opts.hosts)
    if config_hosts:
        return H.parse_hosts(config_hosts, "cluster.hosts")
    return None


def forwarded(env, extra_keys=()):
    """The part of a process's environment that travels to another host: the job's
    SSDSGD_* and every --env variable, MXNET_*, OMP_*, KMP_*, PYTHON*, LD_LIBRARY_PATH,
    and whatever the launcher set that differs from its own environment."""
    out = {}
    for k, v in env.items():
        if (k.startswith(FORWARD_PREFIXES) or k in FORWARD_NAMES or k in extra_keys
                or os.environ.get(k) != v):
            out[k] = v
    return out


def secret_paths(env):
    """(env without SECRET_FILE_VARS, {variable: path}): mpi and slurm pass a key file's
    path only (the file is on the shared filesystem; rank_entry.py checks it), never its
    text, which the group command would carry in its own channels."""
    env = dict(env)
    return env, {var: env.pop(var) for var in SECRET_FILE_VARS if env.get(var)}


def split_secrets(env):
    """(env without SECRET_FILE_VARS, {variable: the file's text}): ssh carries a secret
    file of the launcher's host inside the job's spec on the remote process's stdin (never
    a command line), and rank_entry.py writes it again there, mode 0600."""
    env, paths = secret_paths(env)
    files = {}
    for var, path in paths.items():
        if path:
            try:
                with open(path) as f:
                    files[var] = f.read()
            except OSError as e:
                raise LaunchError(f"{var}={path}: cannot read it ({e.strerror})") from None
    return env, files


def replace_python(cmd, python):
    """Run the hosts' interpreter where the command names this one."""
    if not python:
        return list(cmd)
    return [python if c == sys.executable else c for c in cmd]


class SchedulerSite:
    """Where the scheduler runs and the address everybody dials."""

    def __init__(self, hosts, opts):
        remote = [h.name for h in hosts if not addresses.is_local(h.name)]
        if opts.scheduler_host and not addresses.is_local(opts.scheduler_host):
            self.host = opts.scheduler_host              # started remotely, dialled there
            self.local = False
            try:
                self.address = addresses.resolve(opts.scheduler_host)
                self.launcher_address = addresses.route_source(self.address)
            except addresses.AddressError as e:
                raise LaunchError(f"--scheduler-host: {e}") from None
            return
        self.local = True
        self.host = H.LAUNCHER_HOST
        try:
            if opts.scheduler_host:
                self.address = addresses.resolve(opts.scheduler_host)
            elif opts.interface:
                self.address = addresses.interface_address(opts.interface)
            elif remote:
                self.address = addresses.route_source(remote[0])
            else:
                self.address = "127.0.0.1"
        except addresses.AddressError as e:
            raise LaunchError(f"the scheduler's address on this host: {e}") from None
        self.launcher_address = self.address
        if self.address.startswith("127.") and remote:
            raise LaunchError(f"the scheduler's address {self.address} is this host's loopback"
                              f"{f' (--interface {opts.interface})' if opts.interface else ''}"
                              f", which {', '.join(remote[:3])}{' ...' if len(remote) > 3 else ''}"
                              " cannot reach; choose --interface or --scheduler-host")


    def slot_name(self, hosts):
        """The scheduler's host in the placement: a listed host when it is this one."""
        if not self.local:
            return self.host
        return next((h.name for h in hosts if addresses.is_local(h.name)), H.LAUNCHER_HOST)


def entry_path(relative):
    """Where the hosts find rank_entry.py: relative to the working directory when the
    code is copied there (--sync-dir), else this file's absolute path (shared or
    installed at the same place on every host)."""
    from .rank_entry import ENTRY_FILE
    cwd = os.getcwd().rstrip("/") + "/"
    if relative and ENTRY_FILE.startswith(cwd):
        return ENTRY_FILE[len(cwd):]
    return ENTRY_FILE


def quote(cmd):
    return " ".join(shlex.quote(str(c)) for c in cmd)
