"""The scheduler's record of the job for its launcher: who registered, whether the job
started, which workers finished, why it was aborted.

The launcher sees only exit codes. A worker that exits 0 without ever joining the job
(a script without ``import ssdsgd`` trains on MXNet's local store, alone) looks like a
success; one killed after it finished looks like a failure; the first process to exit
after a heartbeat timeout is rarely the one that stopped. The scheduler knows each of
these, so it writes them to a small JSON file (``SSDSGD_STATUS_FILE``, in the launcher's
private key directory) that the launcher reads when it decides the job's exit code.
"""
import json
import os

# what a reader accepts: the file is the scheduler's, but a reader still checks its form
_FIELDS = {"started": bool, "workers": list, "finished": list, "abort": (str, type(None))}
# written by a scheduler that may be restarted (cluster.scheduler_restarts): the workers
# that left the job, a restarted one's rebuild {restart, seconds} once every node is back,
# and in a job that takes joiners what a restarted one needs of them (``membership``)
# and with cluster.server_replicas the servers replaced by their backups ([dead, owner])
_OPTIONAL = {"left": list, "rebuilt": (dict, type(None)), "membership": (dict, type(None)),
             "replaced": list, "pushed": list}
_MEMBERSHIP = {"joined": list, "departed": list, "agreed": dict, "deciding": list,
               "layout": (dict, type(None)), "listen": (dict, type(None))}


class StatusError(ValueError):
    """The status file exists but is not what a scheduler writes."""


def write(path, *, started, workers, finished, abort=None, left=None, rebuilt=None,
          membership=None, replaced=None, pushed=None):
    """Replace ``path`` atomically (a reader never sees half a file). ``workers``: the
    ranks the registered workers asked for (their launcher ranks); ``finished``: those
    whose FINISH arrived; ``left``: those removed (on_worker_failure: continue);
    ``rebuilt``: a restarted scheduler's rebuild, once done; ``membership``: the joins,
    departures and agreements decided, the joins and departures being decided, and what
    a joiner hears (the topology, LISTEN), in a job that takes joiners; ``replaced``:
    {dead server: the backup that owns its keys}, with cluster.server_replicas;
    ``pushed``: the workers a heartbeat counted a push of (removals.py)."""
    if not path:
        return
    data = {"started": bool(started), "workers": sorted(workers),
            "finished": sorted(finished), "abort": abort}
    if left is not None:
        data["left"] = sorted(left)
    if rebuilt is not None:
        data["rebuilt"] = rebuilt
    if membership is not None:
        data["membership"] = membership
    if replaced:
        data["replaced"] = sorted([dead, owner] for dead, owner in replaced.items())
    if pushed:
        data["pushed"] = sorted(pushed)
    _replace(path, data)


def _replace(path, data):
    tmp = f"{path}.tmp"
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        pass    # the launcher then judges by exit codes alone, as before


# The other way, launcher to scheduler: the servers the launcher saw die
# (cluster.server_replicas) and the workers, rank 0 too (cluster.on_worker_failure:
# continue), for the scheduler in force. It acts on them within a turn instead of after
# its heartbeat timeout (30 s by default): a running scheduler hands a dead server's keys
# to its backup, and a restarted one that rebuilds the job does not wait for them until
# the rebuild's deadline (two processes of a lost host exit at different moments, a
# remote host's connection drops later). Servers seen dead before a restart are in
# SSDSGD_SERVERS_LOST too: the file is on the launcher's host, the environment variable
# reaches a scheduler on another.
def lost_path(path):
    return f"{path}.servers-lost"


def write_lost(path, restart, servers, workers=()):
    """The servers and workers seen dead by now, for the scheduler of restart
    ``restart``."""
    if path:
        _replace(lost_path(path), {"restart": int(restart), "lost": sorted(servers),
                                   "workers": sorted(workers)})


def read_lost(path, restart):
    """(server ranks, worker ranks) written for restart ``restart`` (none: no file,
    another restart's, or not the launcher's form)."""
    try:
        with open(lost_path(path)) as f:
            data = json.load(f)
    except (OSError, ValueError, TypeError):
        return [], []
    if not isinstance(data, dict) or data.get("restart") != restart:
        return [], []
    servers, workers = data.get("lost"), data.get("workers", [])
    if not all(isinstance(v, list) and all(_rank(r) for r in v) for v in (servers, workers)):
        return [], []
    return servers, workers


def read(path):
    """The last status written, or None if there is none (no file: a remote scheduler,
    or one that never got so far)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise StatusError(f"{path}: {e}") from None
    if not isinstance(data, dict) or any(
            not isinstance(data.get(k), t) for k, t in _FIELDS.items()):
        raise StatusError(f"{path}: not a scheduler's status")
    if any(k in data and not isinstance(data[k], t) for k, t in _OPTIONAL.items()):
        raise StatusError(f"{path}: not a scheduler's status")
    for k in ("workers", "finished", "left", "pushed"):
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in data.get(k, ())):
            raise StatusError(f"{path}: {k} must be ranks")
    if not all(_pair(c) for c in data.get("replaced", ())):
        raise StatusError(f"{path}: replaced must be [dead server, owner] pairs")
    m = data.get("membership")
    if m is not None and (any(not isinstance(m.get(k), t) for k, t in _MEMBERSHIP.items())
                          or not all(_pair(c) for k in ("joined", "departed") for c in m[k])
                          or not all(_rank(r) for r in m["deciding"])
                          or not all(isinstance(k, str) and _rank(v)
                                     for k, v in m["agreed"].items())):
        raise StatusError(f"{path}: not a scheduler's membership record")
    return data


def _rank(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _pair(c):
    return isinstance(c, list) and len(c) == 2 and all(map(_rank, c))
