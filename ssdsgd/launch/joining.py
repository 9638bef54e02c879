"""Workers that join a running job (docs/spec/membership.md): the launcher's half
(``leaving.py`` is the half that lets one go).

A job with ``cluster.max_workers`` above its workers has keys for its spare ranks
N..max_workers-1, made with the others' (every process's key file then verifies them),
and ``RUN_DIR/join.json`` (0600): where the key directory is, the spare ranks, the
worker's command and environment. ``launch/dist.py --join RUN_DIR`` reads it, claims a
spare rank by creating ``claimed-worker-R`` with O_EXCL in the key directory (two
joiners never take one rank) and starts one worker on this host. A job that ended has
removed its key directory: the join then fails in one line naming RUN_DIR.
"""
import json
import os
import stat

from ..kvstore.security import ENV_VAR
from ..settings import BY_ENV, to_env

FILE = "join.json"
VERSION = 2        # 2: ``workers``, every worker rank's key file (--leave)


class JoinRefused(RuntimeError):
    """A join this job cannot take (one line, naming RUN_DIR)."""


def write(run_dir, key_dir, key_files, num_workers, max_workers, cmd, env, ssh=None):
    """RUN_DIR/join.json (0600, replaced if a restart wrote one): what ``--join`` needs.
    ``key_files``: identity -> path of its key file; ``env``: the job's environment
    (its SSDSGD_* variables are kept, a joiner's own rank and key are set by --join);
    ``ssh``: how the ssh launcher reaches a host (``SSHCommand.join_spec``), so that
    ``--join RUN_DIR --host HOST`` starts the joiner there as it starts its workers."""
    path = os.path.join(run_dir, FILE)
    spare = {str(r): key_files[f"worker {r}"] for r in range(num_workers, max_workers)}
    workers = {str(r): key_files[f"worker {r}"] for r in range(max_workers)}
    data = {"version": VERSION, "key_dir": key_dir, "spare": spare, "workers": workers,
            "command": list(cmd),
            "env": {k: v for k, v in env.items()
                    if k in BY_ENV and not k.startswith("SSDSGD_ROLE")
                    and k not in ("SSDSGD_RANK", ENV_VAR)}}
    if ssh is not None:
        data["ssh"] = ssh
    tmp = path + ".tmp"
    if os.path.exists(tmp):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
    return path


def read(run_dir):
    """RUN_DIR/join.json, type-checked; JoinRefused in one line if there is none, it is
    not ours to read, or the job it names has ended."""
    path = os.path.join(run_dir, FILE)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise JoinRefused(f"--join {run_dir}: no {FILE} there ({e.strerror}): the job does "
                          "not take joiners (cluster.max_workers) or it is not a run "
                          "directory") from None
    with os.fdopen(fd) as f:
        if stat.S_IMODE(os.fstat(f.fileno()).st_mode) & 0o077:
            raise JoinRefused(f"--join {run_dir}: {FILE} is readable by others; expected "
                              "mode 0600")
        try:
            data = json.load(f)
        except ValueError as e:
            raise JoinRefused(f"--join {run_dir}: {FILE} is not JSON ({e})") from None
    ok = (isinstance(data, dict) and data.get("version") == VERSION
          and isinstance(data.get("key_dir"), str)
          and isinstance(data.get("spare"), dict)
          and all(k.isdigit() and isinstance(v, str) for k, v in data["spare"].items())
          and isinstance(data.get("workers"), dict)
          and all(k.isdigit() and isinstance(v, str) for k, v in data["workers"].items())
          and isinstance(data.get("command"), list) and data["command"]
          and all(isinstance(c, str) for c in data["command"])
          and isinstance(data.get("env"), dict)
          and all(isinstance(k, str) and k in BY_ENV and isinstance(v, str)
                  for k, v in data["env"].items()))
    if ok and "ssh" in data:
        from .ssh import SSHCommand
        fields = SSHCommand.JOIN_FIELDS
        ssh = data["ssh"]
        ok = (isinstance(ssh, dict) and set(ssh) == set(fields)
              and all(isinstance(ssh[k], t) and not isinstance(ssh[k], bool)
                      for k, t in fields.items())
              and all(isinstance(k, str) for k in ssh["env_keys"]))
    if not ok:
        raise JoinRefused(f"--join {run_dir}: {FILE} is not a join file of version {VERSION}")
    if not os.path.isdir(data["key_dir"]):
        raise JoinRefused(f"--join {run_dir}: the job has ended (its key directory "
                          f"{data['key_dir']} is gone); nothing to join")
    return data


def claim(run_dir, data):
    """The first spare rank no other joiner has claimed (``claimed-worker-R`` created with
    O_EXCL in the key directory), with its key file; JoinRefused if none is left."""
    ranks = sorted(int(r) for r in data["spare"])
    for rank in ranks:
        try:
            fd = os.open(os.path.join(data["key_dir"], f"claimed-worker-{rank}"),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        except FileNotFoundError:
            raise JoinRefused(f"--join {run_dir}: the job has ended (its key directory "
                              f"{data['key_dir']} is gone); nothing to join") from None
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return rank, data["spare"][str(rank)]
    most = (max(ranks) + 1) if ranks else "?"
    raise JoinRefused(f"--join {run_dir}: every spare rank is taken: the job is at "
                      f"cluster.max_workers = {most}")


def worker_env(data, rank, key_file):
    """The environment of the joiner: the job's variables, its rank and its own key."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SSDSGD_", "DMLC_"))}
    env.update(data["env"])
    env.update(to_env(role="worker", rank=rank, joining=True), PYTHONUNBUFFERED="1")
    env[ENV_VAR] = key_file
    return env
