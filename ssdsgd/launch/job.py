"""Run one job: scheduler, servers, workers; prefix their output; stop them all at the end.

The job succeeds when every worker exits 0 (the scheduler and servers then shut down on
their own). Any process that fails, or Ctrl-C, stops every process the launcher started,
with a message naming the process that failed: no orphans, no hang.
"""
import contextlib
import os
import signal
import socket
import sys
import threading
import time

from ..kvstore import job_status
from ..kvstore.security import KeyFile, identity
from ..settings import to_env
from . import joining
from .janitor import Janitor
from .hosts import role_label
from .local import LAUNCHERS
from .remote import LaunchError
from .scheduler_restarts import SchedulerRestarts

GRACE_SECONDS = 5.0
SETTLE_SECONDS = 3.0   # after a failure, for the others to report it and exit
# a worker exited 0 while the scheduler has not started the job: this long for the
# scheduler's record to catch up before the worker counts as one that never joined
JOIN_CONFIRM_SECONDS = 2.0
NEVER_JOINED = ("exited 0 without joining the job (it never registered with the "
                "scheduler, so it trained alone, if at all): the script must `import ssdsgd` "
                "and create its store with kvstore='ssd_sync' (MXNet's own local store, "
                "which a missing import gives, trains each worker alone)")


def free_port(host="127.0.0.1"):
    """A TCP port free on ``host`` now (the OS's pick). The one copy: the launcher, the
    tests and bench import it from here."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _pump(stream, prefix, sink, lock):
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        with lock:
            print(f"{prefix}{line}", file=sink, flush=True)
    stream.close()


def _describe_exit(code):
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def check_port(port, runner):
    """A scheduler port given by the user, checked before anything starts: in use, it
    would be found only once the scheduler fails to bind, after every process started.
    A port on another host (a remote scheduler) is left to the scheduler."""
    if not port:
        return
    if getattr(runner, "site", None) is not None and not runner.site.local:
        return
    host = runner.scheduler_host
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)    # as ZeroMQ binds
        try:
            s.bind((host, port))
        except OSError as e:
            raise LaunchError(f"--port {port}: the scheduler's port is in use on {host} "
                              f"({e.strerror}); pick another or leave --port out for a free "
                              "one") from None


def base_env(num_workers, num_servers, port, extra=None, scheduler_host="127.0.0.1"):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMLC_")}
    env.update(to_env(scheduler_host=scheduler_host, scheduler_port=port,
                      num_workers=num_workers, num_servers=num_servers), PYTHONUNBUFFERED="1")
    env.update(extra or {})
    return env


def run_job(num_workers, num_servers, worker_cmd, extra_env=None, port=None, launcher="local",
            progress=None, log=None, stdout=None, stderr=None, failures=None,
            continue_without_workers=False, run_dir=None, server_replicas=0,
            max_workers=None):
    """Start the job and wait for it; returns the exit code for the launcher's process.

    ``launcher``: a name in LAUNCHERS or an instance with the LocalLauncher interface.
    Whatever ends the job, every process it started is stopped before this returns.
    ``failures``, a list, receives one line per failed process, the likely root cause
    (a process killed by a signal) first. ``continue_without_workers``
    (cluster.on_worker_failure: continue): a worker that dies is left behind (the
    scheduler removes it, or aborts the job saying why it cannot go on) and the job goes
    on. ``run_dir``: the run's
    directory, where a launcher whose processes read their keys from a shared
    filesystem (mpi, slurm: ``keys_parent``) makes the job's key directory.
    ``server_replicas`` (cluster.server_replicas: 1): the first server that dies is left
    behind (its backup takes its keys) and the job goes on. ``max_workers``
    (cluster.max_workers) above ``num_workers``: keys for the spare ranks too, and
    ``run_dir``/join.json for ``launch/dist.py --join`` (launch/joining.py)."""
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    log = log or (lambda text: print(f"[launcher] {text}", file=stderr, flush=True))
    runner = _runner(launcher, log)
    if runner is None:
        return 2
    env = base_env(num_workers, num_servers, port or free_port(), extra_env,
                   runner.scheduler_host)
    # Only this job's processes may join it, each as itself: fresh keys (CURVE with
    # ``runner.secure``), a 0600 file per process with its own secret, its path in that
    # process's SSDSGD_SECRET_FILE (kvstore/security.py); in a 0700 directory of the
    # system's temporary one, or of the shared filesystem when the launcher asks.
    plan = job_plan(num_workers, num_servers, worker_cmd)
    parent = getattr(runner, "keys_parent", lambda _run_dir: None)(run_dir)
    spare = range(num_workers, max_workers or num_workers)
    keys = KeyFile(getattr(runner, "secure", False),
                   [identity(role, rank) for role, rank, _ in plan]
                   + [identity("worker", r) for r in spare], parent,
                   cipher=getattr(runner, "cipher", "curve"))
    janitor = Janitor(keys.dir)       # gone with the launcher, even after a SIGKILL
    # the scheduler's record for this loop (kvstore/job_status.py), beside the keys
    status = JobStatus(os.path.join(keys.dir, "status.json"))
    env.update(to_env(status_file=status.path))
    if spare and run_dir:
        joining.write(run_dir, keys.dir, keys.files, num_workers, max_workers, worker_cmd,
                      env, getattr(runner, "join_spec", lambda: None)())
    procs, pumps = [], []
    start = _Starter(runner, env, keys, pumps, (stdout, stderr), log)
    hosts, code = None, None
    with _signals_recorded() as interrupted:
        try:
            restarts = _scheduler_restarts(runner, env, plan, start, status, log)
            if restarts is None or not _start_plan(start, plan, procs):
                return 2
            # --host-discovery-script (ssh): joiners on the hosts that appear
            hosts = getattr(runner, "watch_hosts", lambda *a: None)(
                run_dir, len(spare), log, (stdout, stderr), start.lock,
                [p for p in procs if p.role == "server"], server_replicas)
            code = _watch(procs, interrupted, progress, log, failures,
                          continue_without_workers, status, server_replicas,
                          restarts)
            return code
        finally:
            _stop_all(runner, procs)
            if hosts is not None:      # joiners end with the job's end; else stopped now
                hosts.stop(ended=code == 0)
            keys.remove()
            janitor.close()
            for t in pumps:
                t.join(timeout=2)
            if progress is not None:
                progress.close()


def _runner(launcher, log):
    if not isinstance(launcher, str):
        return launcher
    if launcher not in LAUNCHERS:
        log(f"unknown launcher {launcher!r}; available: {', '.join(LAUNCHERS)}")
        return None
    return LAUNCHERS[launcher]()


def job_plan(num_workers, num_servers, worker_cmd):
    """(role, rank, command) of every process, in start order: the scheduler, the
    servers, the workers."""
    node = [sys.executable, "-m", "ssdsgd.node"]
    return ([("scheduler", 0, node)] + [("server", r, node) for r in range(num_servers)]
            + [("worker", r, list(worker_cmd)) for r in range(num_workers)])


@contextlib.contextmanager
def _signals_recorded():
    """SIGINT/SIGTERM are recorded (for _watch to stop the job) instead of raising in
    the middle of a start or a stop; the previous handlers are restored at the end."""
    received = []
    old = {s: signal.signal(s, lambda signum, _frame: received.append(signum))
           for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class _Starter:
    """Starts one process of the job: its environment and own key file, and a thread per
    output stream that prefixes its lines. Returns it, or None if it cannot start."""

    def __init__(self, runner, env, keys, pumps, sinks, log):
        self.runner, self.env, self.keys, self.pumps, self.sinks, self.log = (
            runner, env, keys, pumps, sinks, log)
        self.lock = threading.Lock()

    def __call__(self, role, rank, cmd, extra=None):
        penv = dict(self.env, **to_env(role=role, rank=rank),
                    **self.runner.node_env(role, rank), **self.keys.env_for(role, rank),
                    **(extra or {}))
        try:
            proc = self.runner.start(role, rank, cmd, penv)
        except OSError as e:
            self.log(f"cannot start {role} {rank} ({' '.join(cmd)}): {e}")
            return None
        for stream, sink in zip((proc.popen.stdout, proc.popen.stderr), self.sinks):
            t = threading.Thread(target=_pump, args=(stream, f"[{proc.name}] ", sink,
                                                     self.lock), daemon=True)
            t.start()
            self.pumps.append(t)
        return proc


def _start_plan(start, plan, procs):
    """Start every process of ``plan`` (appended to ``procs`` as it starts); False if
    one cannot be started."""
    for role, rank, cmd in plan:
        proc = start(role, rank, cmd)
        if proc is None:
            return False
        procs.append(proc)
    return True


def _scheduler_restarts(runner, env, plan, start, status, log):
    """cluster.scheduler_restarts (launch/scheduler_restarts.py); None: the launcher
    cannot restart one process of the job (its line said why)."""
    budget = int(env.get("SSDSGD_SCHEDULER_RESTARTS") or 0)
    if budget and getattr(runner, "restarts_one", None):
        log(f"cluster.scheduler_restarts={budget}: {runner.restarts_one}")
        return None
    cmd = plan[0][2]

    def again(n, servers_lost=()):
        proc = start("scheduler", 0, cmd, to_env(
            scheduler_restart=n, servers_lost=",".join(map(str, servers_lost)) or None))
        if proc is None:
            raise LaunchError("the scheduler could not be started again")
        return proc
    where = f"{runner.scheduler_host}:{env['SSDSGD_SCHEDULER_PORT']}"
    return SchedulerRestarts(budget, again, status, where, log)


def _left_behind(failed, left, log):
    """cluster.on_worker_failure: continue: failed workers join ``left`` (the scheduler
    removes them, or ends the job saying why it cannot go on without one); True if every
    failure was a worker's."""
    if not all(p.role == "worker" for p in failed):
        return False
    for p in failed:
        log(f"{p.name} (pid {p.pid}) {_describe_exit(p.poll())}; the job continues without "
            "it (cluster.on_worker_failure: continue)")
        left.append(p)
    return True


class JobStatus:
    """What the scheduler recorded (kvstore/job_status.py), read by the watch loop: an
    empty record where there is none (a scheduler on another host, or none yet)."""

    def __init__(self, path):
        self.path = path

    def read(self):
        if not self.path:
            return {}
        try:
            return job_status.read(self.path) or {}
        except job_status.StatusError:
            return {}

    def finished(self, proc):
        """A worker killed by a signal after the scheduler received its FINISH: its part
        of the job was done. (A non-zero exit code is the worker's own word that it
        failed, FINISH or not.)"""
        return (proc.role == "worker" and (proc.poll() or 0) < 0
                and proc.rank in self.read().get("finished", ()))

    def never_joined(self, workers):
        """The workers that exited 0 and never registered, once the record says the job
        did not start; [] while it may still start or when there is no record. The file
        is read only once a worker has exited 0 (not on every poll of a running job)."""
        exited = [p for p in workers if p.poll() == 0]
        record = self.read() if exited else {}
        if not record or record["started"]:
            return []
        return [p for p in exited if p.rank not in record["workers"]]

    def abort_reason(self):
        return self.read().get("abort")


def _server_left_behind(failed, left, log):
    """cluster.server_replicas: 1: the first server to die is left behind (its backup
    owns its keys); True if that was the only failure."""
    if any(p.role == "server" for p in left) or [p.role for p in failed] != ["server"]:
        return False
    p, = failed
    log(f"{p.name} (pid {p.pid}) {_describe_exit(p.poll())}; its backup takes its keys and "
        "the job continues (cluster.server_replicas: 1)")
    left.append(p)
    return True


def _watch(procs, interrupted, progress, log, failures=None, continue_without_workers=False,
           status=None, server_replicas=0, restarts=None):
    """Poll until a signal arrives (130/143), a process fails (1), a worker exits 0
    without having joined (1), or every worker has exited 0 and the scheduler and servers
    have followed (0; if they do not, they are stopped and the job fails: 1)."""
    status = status or JobStatus(None)
    workers = [p for p in procs if p.role == "worker"]
    restarts = restarts or SchedulerRestarts(0, None, status, "", log)
    done_at, left, alone_since, finished_late = None, [], None, set()
    while True:
        if interrupted:
            log(f"{signal.Signals(interrupted[0]).name}: stopping every process")
            return 130 if interrupted[0] == signal.SIGINT else 143
        failed = [p for p in procs if p.poll() not in (None, 0) and p not in left
                  and p not in finished_late and p not in restarts.accepted]
        for p in [p for p in failed if status.finished(p)]:
            log(f"{p.name} (pid {p.pid}) {_describe_exit(p.poll())} after it finished its "
                "part of the job; the job's result is complete")
            finished_late.add(p)
            failed.remove(p)
        if failed and continue_without_workers and _left_behind(failed, left, log):
            failed = []
        elif failed and continue_without_workers and restarts.budget:    # workers and
            behind = [p for p in failed if p.role == "worker"]        # the scheduler
            if behind and _left_behind(behind, left, log):
                failed = [p for p in failed if p not in behind]
        if failed and server_replicas and _server_left_behind(failed, left, log):
            failed = []
        elif failed and server_replicas and restarts.budget:    # a server and the scheduler
            servers = [p for p in failed if p.role == "server"]
            if servers and _server_left_behind(servers, left, log):
                failed = [p for p in failed if p not in servers]
        if failed and restarts.take(failed, procs, _describe_exit):
            failed = []
        restarts.poll(procs)
        if failed:
            return _failed(failed, procs, status, log, failures)
        alone = status.never_joined(workers)
        alone_since = (alone_since or time.monotonic()) if alone else None
        if alone and time.monotonic() - alone_since > JOIN_CONFIRM_SECONDS:
            return _lines_and_failure([f"{p.name} {NEVER_JOINED}" for p in alone], log,
                                      failures)
        if all(p.poll() == 0 or p in finished_late for p in workers if p not in left):
            done_at = done_at or time.monotonic()
            late = [p for p in procs if p.role != "worker" and p.poll() is None]
            if not late:
                return 0
            if time.monotonic() - done_at > GRACE_SECONDS + 10:
                return _lines_and_failure([
                    f"{', '.join(p.name for p in late)} did not exit after every worker "
                    "finished (not a clean end of the job); stopping them"], log, failures)
        if progress is not None:
            progress.poll()
        time.sleep(0.1)


def _lines_and_failure(lines, log, failures):
    for line in lines:
        log(line)
    if failures is not None:
        failures.extend(lines)
    return 1


def _failed(failed, procs, status, log, failures):
    """A process failed: say which (the scheduler's own reason first: after a heartbeat
    timeout the first process to exit is rarely the one that stopped), give the others
    time to report, and return 1."""
    failed.sort(key=lambda p: p.role != "worker")   # usually the root cause
    log(", ".join(f"{p.name} (pid {p.pid}) {_describe_exit(p.poll())}"
                  for p in failed) + "; stopping the job")
    if all(p.role == "worker" and p.poll() > 0 for p in failed):
        _settle(procs)     # a worker that raised has reported why (not one killed)
    reason = status.abort_reason()
    if reason:
        log(f"the scheduler aborted the job: {reason}")
    if failures is not None:
        failed.sort(key=lambda p: p.poll() > 0)        # killed ones first
        failures.extend(([f"the scheduler aborted the job: {reason}"] if reason else [])
                        + [f"{role_label(p.role, p.rank)} on {p.host or socket.gethostname()} "
                           f"{_describe_exit(p.poll())}" for p in failed])
    return 1


def _settle(procs):
    """A failed worker has usually told the scheduler why; the scheduler then tells every
    node, and each says so and exits. Give them SETTLE_SECONDS to do it before they are
    stopped, or a node killed first never names the cause."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)


def _stop_all(runner, procs):
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        runner.stop(p, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    while time.monotonic() < deadline and any(p.poll() is None for p in alive):
        time.sleep(0.05)
    for p in alive:
        if p.poll() is None:
            runner.stop(p, signal.SIGKILL)
    for p in procs:
        try:
            p.popen.wait(timeout=5)
        except Exception:
            pass
        p.signal(signal.SIGKILL)   # anything left in its process group
