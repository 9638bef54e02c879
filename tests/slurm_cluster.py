"""A real single-machine Slurm for the launcher tests: slurmctld and slurmd (Debian's
slurm-wlm) started here with a generated slurm.conf on free ports, state and logs in a
temporary directory, and no authentication daemon (``auth/none``, ``cred/none``: this
Slurm still has them; only this machine's root talks to it). The client commands find it
through ``SLURM_CONF``. ``close()`` cancels what is left and stops both daemons.
"""
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue")
PLUGINS = Path("/usr/lib/x86_64-linux-gnu/slurm-wlm")


def unavailable():
    if os.geteuid() != 0:
        return "a test Slurm runs its daemons as root"
    for tool in DAEMONS:
        if not shutil.which(tool):
            return f"{tool} is not installed (Debian: slurm-wlm)"
    if PLUGINS.is_dir() and not (PLUGINS / "auth_none.so").exists():
        return "this Slurm has no auth/none plugin"
    return None


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    def __init__(self, workdir, cpus=8):
        self.dir = Path(workdir)
        for sub in ("state", "spool"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.node = socket.gethostname()
        self.conf = self.dir / "slurm.conf"
        self.conf.write_text(self._config(cpus))
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.procs = []
        try:
            for daemon in (["slurmctld", "-D", "-i"], ["slurmd", "-D", "-N", self.node]):
                log = open(self.dir / f"{daemon[0]}.out", "w")
                self.procs.append(subprocess.Popen(
                    [shutil.which(daemon[0]), *daemon[1:], "-f", str(self.conf)],
                    env=self.env, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True))
            self._wait_idle()
        except BaseException:
            self.close()
            raise

    def _config(self, cpus):
        d = self.dir
        return "\n".join([
            "ClusterName=ssdsgdtest", f"SlurmctldHost={self.node}(127.0.0.1)",
            "SlurmUser=root", "SlurmdUser=root",
            f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
            "AuthType=auth/none", "CredType=cred/none", "MpiDefault=none",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin", "ReturnToService=2",
            "SlurmdParameters=config_overrides", "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none", "SwitchType=switch/none",
            f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'slurmctld.log'}", f"SlurmdLogFile={d / 'slurmd.log'}",
            "SlurmctldDebug=info", "SlurmdDebug=info", "InactiveLimit=0", "KillWait=5",
            "MinJobAge=5", "SlurmctldTimeout=30", "SlurmdTimeout=30",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
            f"PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP "
            "OverSubscribe=YES", ""])

    def run(self, cmd, **kw):
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("timeout", 60)
        kw["env"] = dict(kw.get("env") or self.env, SLURM_CONF=str(self.conf))
        return subprocess.run(cmd, **kw)

    def _wait_idle(self, timeout=60):
        deadline = time.monotonic() + timeout
        while True:
            r = self.run(["sinfo", "-h", "-N", "-o", "%T"], timeout=20)
            if r.returncode == 0 and r.stdout.strip().rstrip("*") in ("idle", "mixed"):
                return
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited: " + self.logs())
            if time.monotonic() > deadline:
                raise RuntimeError(f"the test Slurm is not up (sinfo: {r.stdout.strip()} "
                                   f"{r.stderr.strip()}): " + self.logs())
            time.sleep(0.3)

    def logs(self):
        out = []
        for name in ("slurmctld.out", "slurmd.out", "slurmctld.log", "slurmd.log"):
            p = self.dir / name
            if p.exists():
                out.append(f"--- {name}\n" + p.read_text()[-2000:])
        return "\n".join(out)

    def close(self):
        if any(p.poll() is None for p in self.procs):
            self.run(["scancel", "--full", "-u", "root"], timeout=20)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, 9)
                    p.wait()
