"""Run one job: scheduler, servers, workers; prefix their output; stop them all at the end.

The job succeeds when every worker exits 0 (the scheduler and servers then shut down on
their own). Any process that fails, or Ctrl-C, stops every process the launcher started,
with a message naming the process that failed: no orphans, no hang.
"""
import os
import signal
import socket
import sys
import threading
import time

from ..kvstore.security import ENV_VAR as SECRET_ENV, KeyFile
from .local import LAUNCHERS

GRACE_SECONDS = 5.0


def free_port(host="127.0.0.1"):
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


def base_env(num_workers, num_servers, port, extra=None, scheduler_host="127.0.0.1"):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DMLC_")}
    env.update({"SSDSGD_SCHEDULER_HOST": scheduler_host, "SSDSGD_SCHEDULER_PORT": str(port),
                "SSDSGD_NUM_WORKERS": str(num_workers), "SSDSGD_NUM_SERVERS": str(num_servers),
                "PYTHONUNBUFFERED": "1"})
    env.update(extra or {})
    return env


def run_job(num_workers, num_servers, worker_cmd, extra_env=None, port=None, launcher="local",
            progress=None, log=None, stdout=None, stderr=None, secure=False):
    """Start the job and wait for it; returns the exit code for the launcher's process."""
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    log = log or (lambda text: print(f"[launcher] {text}", file=stderr, flush=True))
    if isinstance(launcher, str):
        if launcher not in LAUNCHERS:
            log(f"unknown launcher {launcher!r}; available: {', '.join(LAUNCHERS)}")
            return 2
        runner = LAUNCHERS[launcher]()
    else:
        runner = launcher          # an instance with the LocalLauncher interface
    port = port or free_port()
    env = base_env(num_workers, num_servers, port, extra_env, runner.scheduler_host)
    keys = KeyFile(secure)    # only this job's processes may join it (kvstore/security.py)
    if SECRET_ENV not in (extra_env or {}):
        env.update(keys.env)
    py = sys.executable
    plan = [("scheduler", 0, [py, "-m", "ssdsgd.node"])]
    plan += [("server", r, [py, "-m", "ssdsgd.node"]) for r in range(num_servers)]
    plan += [("worker", r, list(worker_cmd)) for r in range(num_workers)]
    procs, pumps, lock = [], [], threading.Lock()
    interrupted = []

    def on_signal(signum, _frame):
        interrupted.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        for role, rank, cmd in plan:
            penv = dict(env, SSDSGD_ROLE=role, SSDSGD_RANK=str(rank), **runner.node_env(role, rank))
            try:
                proc = runner.start(role, rank, cmd, penv)
            except OSError as e:
                log(f"cannot start {role} {rank} ({' '.join(cmd)}): {e}")
                code = 2
                return code
            procs.append(proc)
            for stream, sink in ((proc.popen.stdout, stdout), (proc.popen.stderr, stderr)):
                t = threading.Thread(target=_pump, args=(stream, f"[{proc.name}] ", sink, lock),
                                     daemon=True)
                t.start()
                pumps.append(t)
        workers = [p for p in procs if p.role == "worker"]
        others = [p for p in procs if p.role != "worker"]
        done_at = None
        while True:
            if interrupted:
                log(f"{signal.Signals(interrupted[0]).name}: stopping every process")
                code = 130 if interrupted[0] == signal.SIGINT else 143
                return code
            failed = [p for p in procs if p.poll() not in (None, 0)]
            if failed:
                failed.sort(key=lambda p: p.role != "worker")   # usually the root cause
                log(", ".join(f"{p.name} (pid {p.pid}) {_describe_exit(p.poll())}"
                              for p in failed) + "; stopping the job")
                code = 1
                return code
            if all(p.poll() == 0 for p in workers):
                if done_at is None:
                    done_at = time.monotonic()
                if all(p.poll() is not None for p in others):
                    return 0
                if time.monotonic() - done_at > GRACE_SECONDS + 10:
                    late = [p.name for p in others if p.poll() is None]
                    log(f"workers finished but {', '.join(late)} did not exit; stopping them")
                    return 0
            if progress is not None:
                progress.poll()
            time.sleep(0.1)
    finally:
        _stop_all(runner, procs)
        keys.remove()
        for t in pumps:
            t.join(timeout=2)
        if progress is not None:
            progress.close()
        for s, h in old.items():
            signal.signal(s, h)


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
