"""``--launcher slurm``: inside an allocation (``salloc``/``sbatch``), one ``srun`` starts
every process of the job; each task finds its role from SLURM_PROCID (0: the scheduler,
then the servers, then the workers).

The hosts are the allocation's nodes (``scontrol show hostnames $SLURM_JOB_NODELIST``),
their slots its tasks per node (SLURM_TASKS_PER_NODE). The placement is ours: srun's
arbitrary distribution (SLURM_HOSTFILE, one node per task) puts the scheduler on the
launcher's node (the batch script's, or the first node when the launcher runs outside the
allocation) and servers and workers round-robin over the slots, as with the other launchers.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile

from . import addresses
from .group import GroupLauncher
from .hosts import Host
from .remote import LaunchError


def expand_counts(text):
    """SLURM_TASKS_PER_NODE ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    out = []
    for part in filter(None, (text or "").split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise LaunchError(f"SLURM_TASKS_PER_NODE={text!r}: expected e.g. 2(x3),1")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def allocation_hosts(env=None):
    """The allocation's nodes as hosts (slots: tasks per node, at least 1)."""
    env = os.environ if env is None else env
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not env.get("SLURM_JOB_ID") or not nodelist:
        raise LaunchError("--launcher slurm runs inside an allocation: e.g. sbatch -N 3 "
                          "job.sh or salloc -N 3, then launch/dist.py ... --launcher slurm")
    try:
        r = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LaunchError(f"scontrol show hostnames {nodelist}: {e}") from None
    names = r.stdout.split()
    if r.returncode != 0 or not names:
        raise LaunchError(f"scontrol show hostnames {nodelist}: {r.stderr.strip()}")
    counts = expand_counts(env.get("SLURM_TASKS_PER_NODE", ""))
    if len(counts) != len(names):
        counts = [1] * len(names)
    return [Host(n, max(1, c)) for n, c in zip(names, counts)]


class SlurmLauncher(GroupLauncher):
    name = "slurm"
    rank_var = "SLURM_PROCID"

    def __init__(self, hosts, num_workers, num_servers, opts):
        if hosts:
            raise LaunchError("--launcher slurm takes its hosts from the allocation; drop "
                              "-H/--hostfile, --hosts and cluster.hosts")
        if opts.sync_dir:
            raise LaunchError("--sync-dir works with --launcher ssh only (use sbcast or a "
                              "shared filesystem with Slurm)")
        self.srun = self.tool = shutil.which("srun")
        if not self.srun:
            raise LaunchError("--launcher slurm: srun is not installed here (Debian: "
                              "apt-get install slurm-client)")
        super().__init__(allocation_hosts(), num_workers, num_servers, opts)

    def scheduler_slot_host(self):
        me = os.environ.get("SLURMD_NODENAME")
        for h in self.hosts:
            if h.name == me or (me is None and addresses.is_local(h.name)):
                return h.name
        return self.hosts[0].name    # launched from outside the allocation

    def command(self, total):
        fd, self.hostfile = tempfile.mkstemp(prefix="ssdsgd-slurm-hosts-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write("".join(f"{s.host}\n" for s in self.slots))
        return [self.srun, "--ntasks", str(total), "--distribution", "arbitrary",
                "--overcommit", "--cpu-bind", "none", "--quiet", "--kill-on-bad-exit=1",
                "--chdir", self.workdir, "--export", "ALL",
                *shlex.split(self.opts.srun_args or "")]

    def extra_env(self):
        return {"SLURM_HOSTFILE": self.hostfile}
