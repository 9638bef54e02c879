"""Choose and prepare the launcher of a job: ``local``, ``ssh``, ``mpi`` or ``slurm``."""
from __future__ import annotations

import sys

from . import hosts as H
from .local import LocalLauncher
from .remote import LaunchError, host_list

NAMES = ("local", "ssh", "mpi", "slurm")


def _log(text):
    print(f"[launcher] {text}", file=sys.stderr, flush=True)


def make_launcher(opts, num_workers, num_servers, config_hosts=(), log=_log):
    """A prepared launcher instance for run_job; LaunchError (one line) when the job
    cannot start as asked (bad host list, unreachable host, no allocation, ...)."""
    name = opts.launcher
    try:
        hosts = host_list(opts, config_hosts)
    except H.HostError as e:
        raise LaunchError(str(e)) from None
    if name == "local":
        if hosts:
            given = "-H/--hostfile, --hosts" if opts.hostfile or opts.hosts else "cluster.hosts"
            raise LaunchError(f"{given}: hosts need --launcher ssh or mpi")
        runner = LocalLauncher()
        runner.secure, runner.cipher = opts.secure, opts.cipher
        return runner
    if name == "ssh":
        from .ssh import SSHLauncher
        runner = SSHLauncher(hosts, num_workers, num_servers, opts)
    elif name == "mpi":
        from .mpi import MPILauncher
        runner = MPILauncher(hosts, num_workers, num_servers, opts)
    elif name == "slurm":
        from .slurm import SlurmLauncher
        runner = SlurmLauncher(hosts, num_workers, num_servers, opts)
    else:
        raise LaunchError(f"unknown launcher {name!r}; available: {', '.join(NAMES)}")
    runner.prepare(log)
    # SECURE-BY-DEFAULT (issue 9): a job whose runner has ``secure_default`` (ssh, mpi,
    # slurm) runs with CURVE unless --insecure: run_job makes the job's keys
    # (kvstore/security.py, a 0600 file per process) and puts each file's path in its
    # process's SSDSGD_SECRET_FILE; ssh carries a file's text to its process's host on
    # stdin and writes it there 0600 (remote.split_secrets, rank_entry.write_secrets);
    # mpi and slurm make the files on the shared filesystem and pass only their paths
    # (group.GroupLauncher.keys_parent, rank_entry.shared_key_files); never on a command
    # line, never through mpirun's or srun's channels.
    runner.secure = opts.secure or (getattr(runner, "secure_default", False)
                                    and not opts.insecure)
    runner.cipher = opts.cipher
    if not runner.secure:
        log("--insecure: connections are authenticated by the job's key file but not "
            "encrypted; anyone on the network between the hosts can read them")
    return runner
