"""Emulated hosts for the launcher tests: bench/cluster's network namespaces (unshaped), one
per host at 198.18.0.10, .11, ..., each running a real OpenSSH server that accepts a key
made here, for root, on port 22 of its own address.

The ssh client is configured by one file (``ssh -F``; the launcher reads it from
``SSDSGD_SSH_COMMAND``, mpirun from its rsh agent) that names the key and a known_hosts
file holding exactly these hosts' key: no prompt, and nothing else trusted.
``close()`` stops every sshd and removes the namespaces (processes still inside are
killed first).
"""
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.cluster import netns  # noqa: E402

SSHD = "/usr/sbin/sshd"


def unavailable():
    """Why the emulated hosts cannot be made here (None: they can)."""
    try:
        netns.check_available()
    except netns.NetnsUnavailable as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - any failure means: cannot test here
        return f"network namespaces unusable: {e}"
    for tool in (SSHD, "ssh", "ssh-keygen"):
        if not shutil.which(tool):
            return f"{tool} is not installed (Debian: openssh-server, openssh-client)"
    return None


def _sshd_config(d, address, i):
    return "\n".join([
        f"ListenAddress {address}", "Port 22", f"HostKey {d / 'host_key'}",
        f"AuthorizedKeysFile {d / 'authorized_keys'}", "PermitRootLogin prohibit-password",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no",
        "StrictModes no", f"PidFile {d / f'sshd-{i}.pid'}", "PrintMotd no",
        "PrintLastLog no", "MaxStartups 100:30:200", "MaxSessions 100", "LogLevel ERROR",
        "UseDNS no", ""])


class EmulatedHosts:
    def __init__(self, n, workdir, hide=None):
        """``hide``: {host index: [directory, ...]}: on that host each directory is covered
        by an empty tmpfs (a path that exists everywhere else is missing there)."""
        self.hide = hide or {}
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.sshd = []
        self.cluster = netns.Cluster(n)
        try:
            self._keys()
            self._start_sshd()
        except BaseException:
            self.close()
            raise

    @property
    def addresses(self):
        return self.cluster.addresses

    @property
    def names(self):
        return self.cluster.names

    def _keys(self):
        d = self.dir
        for name in ("id", "host_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"ssdsgd-{name}",
                            "-f", str(d / name)], check=True)
        shutil.copy(d / "id.pub", d / "authorized_keys")
        host_pub = (d / "host_key.pub").read_text().split()[:2]
        (d / "known_hosts").write_text("".join(f"{a} {' '.join(host_pub)}\n"
                                               for a in self.addresses))
        (d / "ssh_config").write_text("\n".join([
            "Host *", "  User root", f"  IdentityFile {d / 'id'}", "  IdentitiesOnly yes",
            f"  UserKnownHostsFile {d / 'known_hosts'}", "  GlobalKnownHostsFile /dev/null",
            "  StrictHostKeyChecking yes", "  BatchMode yes", "  ConnectTimeout 10", ""]))
        for p in (d / "id", d / "host_key"):
            os.chmod(p, 0o600)

    @property
    def ssh_command(self):
        return f"ssh -F {self.dir / 'ssh_config'}"

    def _start_sshd(self):
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)   # sshd's privilege separation
        for i, address in enumerate(self.addresses):
            cfg = self.dir / f"sshd-{i}.conf"
            cfg.write_text(_sshd_config(self.dir, address, i))
            cmd = [SSHD, "-D", "-e", "-f", str(cfg)]
            if self.hide.get(i):     # `ip netns exec` gave sshd a mount namespace of its own
                mounts = " && ".join(f"mount -t tmpfs ssdsgd-hidden {shlex.quote(str(d))}"
                                     for d in self.hide[i])
                cmd = ["sh", "-c", f"{mounts} && exec {shlex.join(cmd)}"]
            self.sshd.append(self.cluster.popen(i, cmd,
                                                stderr=open(self.dir / f"sshd-{i}.log", "w")))
        deadline = time.monotonic() + 20
        for i, address in enumerate(self.addresses):
            while True:
                r = self.run(0, self.ssh_command.split() + [address, "true"], timeout=15)
                if r.returncode == 0:
                    break
                if time.monotonic() > deadline or self.sshd[i].poll() is not None:
                    raise RuntimeError(f"sshd on {address} does not answer: {r.stderr.strip()} "
                                       f"{(self.dir / f'sshd-{i}.log').read_text()}")
                time.sleep(0.2)

    def prefix(self, i):
        return self.cluster.prefix(i)

    def run(self, i, cmd, **kw):
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.prefix(i) + list(cmd), **kw)

    def popen(self, i, cmd, **kw):
        return self.cluster.popen(i, cmd, **kw)

    def hostfile(self, lines, name="hosts.txt"):
        path = self.dir / name
        path.write_text("".join(f"{line}\n" for line in lines))
        return path

    def job_pids(self):
        """Every process inside the hosts' namespaces except the sshd listeners."""
        keep = {p.pid for p in self.sshd}
        out = {}
        for ns in self.names:
            pids = [p for p in netns.namespace_pids(ns) if p not in keep]
            if pids:
                out[ns] = pids
        return out

    def wait_no_job(self, timeout):
        """Wait until no job process is left in any namespace; returns what is left."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.job_pids()
            if not left or time.monotonic() > deadline:
                return {ns: [_cmdline(p) for p in pids] for ns, pids in left.items()}
            time.sleep(0.25)

    def close(self):
        for p in self.sshd:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.cluster.close()


def copy_repo(dest):
    """A copy of this repository's files (not .git, runs, caches) at ``dest``."""
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
        ".git", ".venv", "runs", "__pycache__", "*.pyc", ".pytest_cache", "*.egg-info"))
    return Path(dest)


def _cmdline(pid):
    try:
        return f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ") \
            .decode(errors="replace")[:150]
    except OSError:
        return f"{pid}: (gone)"
