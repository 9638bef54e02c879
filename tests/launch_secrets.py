"""Where a running job's secrets can be read (issue 28, item 1): every process's environment
and command line on this machine, against the secret material of the job's key files. The
multi-host launchers' tests call it while a job runs (as root, which reads every
/proc/PID/environ; the emulated hosts are network namespaces, so their processes are here
too)."""
import glob
import json
import os
from pathlib import Path

SECRET_VAR = b"SSDSGD_SECRET_FILE="


def _read(pid, what):
    try:
        return Path(f"/proc/{pid}/{what}").read_bytes()
    except OSError:          # gone, or a kernel thread
        return b""


def processes():
    """{pid: (environ, cmdline)} of every process readable now."""
    return {int(p): (_read(p, "environ"), _read(p, "cmdline"))
            for p in os.listdir("/proc") if p.isdigit()}


def key_paths(procs):
    """The key files the processes were given (their SSDSGD_SECRET_FILE)."""
    out = {}
    for pid, (environ, _) in procs.items():
        for item in environ.split(b"\0"):
            if item.startswith(SECRET_VAR):
                out[pid] = item[len(SECRET_VAR):].decode()
    return out


def secret_material(path):
    """The secret strings of a key file: a process's own secret (PLAIN secret or CURVE
    secret key), or the job's one secret and CURVE secret keys."""
    data = json.loads(Path(path).read_text())
    own = data.get("own") or {}
    found = [own.get("secret"), own.get("token"), data.get("secret")]
    found += [v for k, v in (data.get("curve") or {}).items() if k.endswith("secret")]
    return [s for s in found if s]


def job_secrets(run_dir, procs):
    """{secret: the file it is from} of every key file of the job: those in the run
    directory's key directory and every file a process was given."""
    paths = set(glob.glob(os.path.join(str(run_dir), ".ssdsgd-keys-*", "keys-*.json")))
    paths |= set(key_paths(procs).values())
    out = {}
    for path in paths:
        try:
            for secret in secret_material(path):
                out[secret] = path
        except (OSError, ValueError):
            continue
    return out


def leaks(secrets, procs):
    """One line per (process, secret) where a secret is in an environment or a command
    line."""
    found = []
    for pid, (environ, cmdline) in procs.items():
        for secret, path in secrets.items():
            for where, data in (("environ", environ), ("cmdline", cmdline)):
                if secret.encode() in data:
                    name = cmdline[:100].replace(b"\0", b" ").decode(errors="replace")
                    found.append(f"pid {pid} ({name}): the secret of "
                                 f"{os.path.basename(path)} in its {where}")
    return found


def check_running_job(run_dir, count):
    """What a test of a running mpi or slurm job asserts: no secret of the job in any
    process's environment or command line (the group command's, its daemons', the
    ranks'); the job's ``count`` key files in one 0700 directory of the run directory,
    0600 each, and each process given one of them. Returns the key directory."""
    procs = processes()
    mark = str(run_dir).encode()
    ours = {pid: p for pid, p in procs.items() if mark in p[0] or mark in p[1]}
    secrets = job_secrets(run_dir, ours)
    found = leaks(secrets, procs)
    assert found == [], "\n".join(found[:8])
    assert any(b"SSDSGD_LAUNCH_SPEC=" in env for env, _ in ours.values()), \
        "no process of the group command was seen"
    dirs = glob.glob(os.path.join(str(run_dir), ".ssdsgd-keys-*"))
    assert len(dirs) == 1, dirs
    files = sorted(glob.glob(os.path.join(dirs[0], "keys-*.json")))
    assert len(files) == count and len(secrets) == count, (files, secrets.values())
    assert os.stat(dirs[0]).st_mode & 0o777 == 0o700, dirs
    assert all(os.stat(f).st_mode & 0o777 == 0o600 for f in files), files
    given = set(key_paths(ours).values())
    assert given == set(files), (given, files)
    return Path(dirs[0])
