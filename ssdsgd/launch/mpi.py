"""``--launcher mpi``: one ``mpirun`` (OpenMPI) starts every process of the job, as
dmlc-tracker's and horovodrun's MPI modes do; each rank finds its role from
OMPI_COMM_WORLD_RANK (0: the scheduler, then the servers, then the workers).

The placement is ours, not mpirun's: a sequential-mapper hostfile (``--mca rmaps seq``)
lists one host per rank, so the scheduler runs on the launcher's host and servers and
workers take the slots round-robin, as with ``--launcher ssh``. mpirun reaches the other
hosts with ssh (its rsh agent is the launcher's ssh command, so the same keys and options
apply); the processes never call MPI_Init, so no MPI library is needed in them.
"""
from __future__ import annotations

import os
import shlex
import shutil
import socket
import tempfile

from .addresses import is_local
from .group import GroupLauncher
from .remote import LaunchError
from .ssh import SSH_OPTIONS


class MPILauncher(GroupLauncher):
    name = "mpi"
    rank_var = "OMPI_COMM_WORLD_RANK"

    def __init__(self, hosts, num_workers, num_servers, opts):
        if not hosts:
            raise LaunchError("--launcher mpi needs hosts: -H/--hostfile FILE, --hosts "
                              "h1:2,h2:2 or cluster.hosts")
        self.mpirun = self.tool = shutil.which("mpirun")
        if not self.mpirun:
            raise LaunchError("--launcher mpi: mpirun is not installed here (Debian: "
                              "apt-get install openmpi-bin)")
        super().__init__(hosts, num_workers, num_servers, opts)

    def _seq_hostfile(self):
        """One line per rank; this host by its hostname, the one name mpirun knows it by
        (an address of it, or localhost, would be "not in your allocation")."""
        local = {h.name for h in self.hosts if is_local(h.name)} | {"localhost"}
        me = socket.gethostname()
        fd, path = tempfile.mkstemp(prefix="ssdsgd-mpi-hosts-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write("".join(f"{me if s.host in local else s.host}\n" for s in self.slots))
        return path

    def rsh(self):
        """mpirun's rsh agent and its arguments: the launcher's ssh command."""
        ssh = shlex.split(self.opts.ssh_command or os.environ.get("SSDSGD_SSH_COMMAND")
                          or "ssh")
        args = ssh[1:] + [a for a in SSH_OPTIONS if a != "-T"] + [
            "-o", f"ConnectTimeout={max(1, int(self.opts.start_timeout))}"]
        if self.opts.ssh_port:
            args += ["-p", str(self.opts.ssh_port)]
        if self.opts.ssh_identity_file:
            args += ["-i", self.opts.ssh_identity_file]
        return ssh[0], " ".join(shlex.quote(a) for a in args)

    def command(self, total):
        self.hostfile = self._seq_hostfile()
        agent, args = self.rsh()
        cmd = [self.mpirun, "-np", str(total), "--hostfile", self.hostfile,
               "--mca", "rmaps", "seq", "--mca", "plm_rsh_agent", agent,
               "--mca", "plm_rsh_args", args, "--mca", "plm_rsh_no_tree_spawn", "1",
               "--bind-to", "none", "--oversubscribe", "-wdir", self.workdir,
               "-x", "SSDSGD_LAUNCH_SPEC"]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        return cmd + shlex.split(self.opts.mpi_args or "")
