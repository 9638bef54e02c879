"""``python launch/dist.py``: start a whole ssdsgd job on this machine or several.

Two forms:

    python launch/dist.py CONFIG.yaml [--set sync.delay_steps=10 ...] [--resume RUN_DIR]
    python launch/dist.py -n 4 -s 1 [--launcher local] [--env K=V ...] -- python train.py ...

The first runs ssdsgd's training program (``python -m ssdsgd.train``) on every worker with
the cluster and synchronization taken from the config; the second is MXNet's
``tools/launch.py`` form for your own script, which then uses ``kvstore='ssd_sync'``.
"""
import argparse
import os
import re
import sys
import time

from ..settings import BY_NAME, SettingError, check_launch_env, to_env
from . import discovery
from .job import check_port, run_job
from .launchers import make_launcher
from .remote import LaunchError, add_arguments, options_from


# cluster.on_worker_failure: restart with cluster.max_restarts 0 restarts this many times
DEFAULT_RESTARTS = 3

# what --help shows first: both forms, as plain text (the module docstring is reST)
USAGE_TEXT = """Start an ssdsgd job: scheduler, servers and workers, here or on several hosts.

  python launch/dist.py CONFIG.yaml [--set KEY=VALUE ...] [--resume RUN_DIR] [options]
      runs ssdsgd's training program (python -m ssdsgd.train) on every worker, with the
      cluster and the synchronization taken from the config (see configs/)

  python launch/dist.py -n N [-s S] [--env KEY=VALUE ...] [options] -- COMMAND ...
      MXNet's tools/launch.py form: starts COMMAND (your script, which imports ssdsgd and
      uses kvstore='ssd_sync') as each of the N workers, with S servers (default 1);
      a bare 'python' or 'python3' in COMMAND is this launcher's own interpreter

The options below apply to both forms; -n/-s/--env belong to the second."""

# a bare interpreter name in the command: the launcher's own interpreter (its venv)
BARE_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")


def resolve_python(cmd):
    """``-- python script.py`` runs this launcher's interpreter, not the first ``python``
    on PATH (which may lack MXNet); a path (``/usr/bin/python3``, ``./python``) is kept."""
    if cmd and BARE_PYTHON.fullmatch(cmd[0]):
        return [sys.executable] + list(cmd[1:])
    return list(cmd)


def _command_form(argv):
    if "--" not in argv:
        raise SystemExit("launch/dist.py: give a CONFIG.yaml, or -n N -s S -- COMMAND ...")
    i = argv.index("--")
    opts, cmd = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="launch/dist.py", description=USAGE_TEXT,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--num-workers", type=int, required=True)
    p.add_argument("-s", "--num-servers", type=int, default=1)
    p.add_argument("--port", type=int, default=0, help="scheduler port (default: a free one)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for every process, e.g. SSDSGD_ALGORITHM=ssgd")
    _restarts_argument(p, "0; the command restarts as it is, it resumes by itself")
    p.add_argument("--run-dir", metavar="DIR", help="with SSDSGD_MAX_WORKERS above -n: "
                   "where join.json goes, for launch/dist.py --join DIR "
                   "(docs/spec/membership.md)")
    add_arguments(p)
    args = p.parse_args(opts)
    if not cmd:
        p.error("no command after --")
    if args.num_workers < 1 or args.num_servers < 1:
        p.error("-n and -s must be >= 1")
    if args.max_restarts is not None and args.max_restarts < 0:
        p.error("--max-restarts must be >= 0")
    extra = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"--env {item!r}: expected KEY=VALUE")
        extra[key] = value
    cmd = resolve_python(cmd)
    try:
        most = _watch_settings(extra)["max_workers"]
    except SettingError as e:
        p.error(str(e))
    if most and most > args.num_workers and not args.run_dir:
        p.error("SSDSGD_MAX_WORKERS above -n takes joiners: give --run-dir DIR, where "
                "launch/dist.py --join DIR finds the job")
    try:    # before anything starts: no --env for what the launcher sets, no bad values
        check_launch_env(extra, to_env(num_workers=args.num_workers, scheduler_port=args.port
                                       or None, num_servers=args.num_servers), os.environ)
        opts = options_from(args, extra)
        discovery.check(opts, args.num_workers, most)
        runner = make_launcher(opts, args.num_workers, args.num_servers)
        check_port(args.port, runner)
    except (SettingError, LaunchError) as e:
        print(f"launch/dist.py: error: {e}", file=sys.stderr)
        return 2
    restarts, code = args.max_restarts or 0, 1
    for attempt in range(restarts + 1):
        failures = []
        code = run_job(args.num_workers, args.num_servers, cmd, extra, port=args.port or None,
                       launcher=runner, failures=failures, run_dir=args.run_dir,
                       **_watch_settings(extra))
        if code != 1 or attempt == restarts:
            break
        print(f"[launcher] {_restart_line(attempt + 1, restarts, failures, 'the command again')}",
              file=sys.stderr, flush=True)
    return _gave_up(code, restarts)


def _watch_settings(extra):
    """What the launcher's watch of the command form follows from ``--env`` (checked by
    check_launch_env), as the config form's from its config: who may join, whether a dead
    worker is left behind (cluster.on_worker_failure: continue), whether a dead server's
    backup takes over (cluster.server_replicas)."""
    def value(name):
        raw = extra.get(BY_NAME[name].env)
        return BY_NAME[name].parse(raw) if raw else None
    return {"max_workers": value("max_workers"),
            "continue_without_workers": value("on_worker_failure") == "continue",
            "server_replicas": value("server_replicas") or 0}


def _gave_up(code, restarts):
    if code == 1 and restarts:
        print(f"[launcher] the job failed after {restarts} restart(s); giving up",
              file=sys.stderr, flush=True)
    return code


def _config_parser():
    p = argparse.ArgumentParser(prog="launch/dist.py", description=USAGE_TEXT,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="the job's YAML file (see configs/); omitted "
                   "with --resume (RUN_DIR/config.yaml is used)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set sync.delay_steps=10")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last "
                   "checkpoint (--set overrides are written to RUN_DIR/config.yaml)")
    p.add_argument("--port", type=int, default=0, help="scheduler port (default: a free one)")
    _restarts_argument(p, "cluster.max_restarts")
    add_arguments(p, default_launcher=None)
    return p


def _restarts_argument(p, default):
    p.add_argument("--max-restarts", type=int, default=None, metavar="N", help="when a "
                   "process dies, stop the job and restart it (from the last checkpoint) "
                   f"up to N times, like torchrun (default: {default})")


def _restart_line(i, n, failures, whence):
    """The one line printed per restart."""
    cause = failures[0] if failures else "a process failed"
    return f"restart {i} of {n}: {cause}; {whence}"


def _check_restarts(config, max_restarts):
    """``--max-restarts N`` is a restart the config's own check did not see: the registry
    of algorithms decides whether this one takes it (SettingError if not)."""
    from ..sync.registry import refusal
    if not max_restarts:
        return
    refused = refusal({"algorithm": config.sync.algorithm, "max_restarts": max_restarts,
                       "num_workers": config.cluster.workers},
                      lambda name: "--max-restarts" if name == "max_restarts"
                      else BY_NAME[name].path)
    if refused:
        raise SettingError(refused)


def _prepare(args):
    """Check everything that can be checked before a process starts: the config, the
    data, with --resume a checkpoint with steps left to run, and the launcher's hosts.
    Returns (config, run_dir, length, environment for every process, launcher); raises
    ConfigError, DataError, SettingError or LaunchError."""
    from ..checkpoint import check_unfinished, checkpoint_info, run_length
    from ..config import job_env, load_config, new_run_dir, save_config
    from ..data import validate_data
    info = None
    if args.resume:
        run_dir = args.resume
        config = load_config(os.path.join(run_dir, "config.yaml"), args.overrides)
        info = checkpoint_info(run_dir)
    else:
        config = load_config(args.config, args.overrides)
    validate_data(config)       # bad data fails here, before any process starts
    length = run_length(config)
    if info:
        check_unfinished(run_dir, info, length)   # a finished run keeps its result
    # the stage machine of a resumed run continues the warm-up / steps-delay schedule
    env = job_env(config, start_step=info["step"] if info else 0)
    check_launch_env({}, env, os.environ)
    _check_restarts(config, args.max_restarts)
    args.launcher = args.launcher or config.cluster.launcher
    opts = options_from(args)
    discovery.check(opts, config.cluster.workers, config.cluster.max_workers)
    runner = make_launcher(opts, config.cluster.workers, config.cluster.servers,
                           config.cluster.hosts)
    check_port(args.port, runner)       # before the run directory exists
    _warn_whole_warmup(config, length)
    _warn_async_lr(config)
    try:
        if not args.resume:
            run_dir = str(new_run_dir(config))
        if args.launcher != "local":        # the same path on every host
            run_dir = os.path.abspath(run_dir)
        if not args.resume or args.overrides:   # the workers read the run's config file
            save_config(config, os.path.join(run_dir, "config.yaml"))
    except OSError as e:      # a full or read-only output.dir: one line, exit 2
        raise LaunchError(f"cannot write the run directory under output.dir="
                          f"{config.output.dir}: {e.strerror or e} "
                          f"({e.filename or config.output.dir})") from None
    return config, run_dir, length, env, runner


def _warn_async_lr(config):
    """asgd's lr convention is dist_async's (docs/training.md): each push is an update of
    its own at optimizer.lr, so N workers move the weights about N times as far a round
    as ssgd's one step; a config written for ssgd collapses silently (the demo's lr 0.1
    with 2 workers ended at 0.10-0.20 accuracy)."""
    n, lr = config.cluster.workers, config.optimizer.lr
    if config.sync.algorithm == "asgd" and n > 1:
        print(f"[launcher] warning: sync.algorithm asgd applies each of the {n} workers' "
              f"pushes as its own update at optimizer.lr {lr:g} (as dist_async): a round "
              f"moves the weights about {n} times as far as an ssgd step; for the step of "
              f"ssgd at this lr set optimizer.lr to about {lr / n:g} (docs/training.md)",
              file=sys.stderr, flush=True)


def _warn_whole_warmup(config, length):
    """SSD-SGD (localsgd, diloco) whose synchronous warm-up is as long as the run never
    delays a pull (never takes a local step)."""
    from ..config import resolve_warmup_steps
    from ..sync.stage import delays_pulls, syncs_periodically
    warmup = resolve_warmup_steps(config, length.steps_per_epoch)
    algorithm = config.sync.algorithm
    if (delays_pulls(algorithm) or syncs_periodically(algorithm)) and \
            warmup >= length.total_steps:
        after = ("the steps-delay stage never starts" if delays_pulls(algorithm) else
                 "no local step is ever taken")
        print(f"[launcher] warning: the warm-up ({warmup} steps, sync.warmup_steps or "
              f"sync.warmup_epochs) covers the whole run ({length.total_steps} steps): every "
              f"step is synchronous SGD and {after}", file=sys.stderr,
              flush=True)


def _report(run_dir, seconds, plots, timeline=False):
    """With ``train.timeline`` the merged timeline (ssdsgd.timeline_merge: the slowest
    rank, also into summary.json); then, last, the finished job's accuracy line and,
    with ``output.plots``, its plots (ssdsgd.report.finished_run)."""
    from ..report import ReportError, finished_run
    first = []
    if timeline:
        from ..timeline_merge import lines as timeline_lines, merge
        try:
            first = timeline_lines(merge(run_dir, draw=plots))
        except (ImportError, OSError, ValueError) as e:
            first = [f"no timeline to merge ({e})"]
    try:
        lines = finished_run(run_dir, plots=plots)
    except (ReportError, ImportError, OSError, ValueError) as e:
        lines = [f"no result to report ({e})"]
    lines[0] += f"; job {seconds:.1f} s"
    lines = first + lines
    for line in lines:
        print(f"[launcher] {line}", flush=True)


def _config_form(argv):
    from ..config import ConfigError
    from ..data import DataError
    p = _config_parser()
    args = p.parse_args(argv)
    if not args.config and not args.resume:
        p.error("give a CONFIG.yaml (or --resume RUN_DIR)")
    if args.max_restarts is not None and args.max_restarts < 0:
        p.error("--max-restarts must be >= 0")
    try:
        config, run_dir, length, env, runner = _prepare(args)
    except (ConfigError, DataError, SettingError, LaunchError) as e:
        print(f"launch/dist.py: error: {e}", file=sys.stderr)
        return 2
    restarts = (config.cluster.max_restarts if args.max_restarts is None
                else args.max_restarts)
    if config.cluster.on_worker_failure == "restart" and not restarts:
        restarts = DEFAULT_RESTARTS
    print(f"[launcher] run directory: {run_dir}", flush=True)
    t0, resume, code = time.monotonic(), bool(args.resume), 1
    start = _start_step(env)
    for attempt in range(restarts + 1):
        failures = []
        code = _run_training(config, run_dir, length, env, runner, args.port, resume, failures,
                             start)
        if code in (130, 143):
            _interrupted(run_dir)
            break
        if code != 1 or attempt == restarts:
            break
        try:
            env, whence = _restart_from_checkpoint(config, run_dir, length)
        except (DataError, SettingError) as e:
            print(f"[launcher] cannot restart: {e}", file=sys.stderr, flush=True)
            return 1
        resume = whence is not None
        start = _start_step(env)
        print(f"[launcher] {_restart_line(attempt + 1, restarts, failures, whence or 'from the start (no checkpoint yet)')}",
              file=sys.stderr, flush=True)
    if code == 0:
        _report(run_dir, time.monotonic() - t0, config.output.plots, config.train.timeline)
    return _gave_up(code, restarts)


def _start_step(env):
    """The step a job's environment starts at (a resumed run: its checkpoint's)."""
    return int(env.get(BY_NAME["start_step"].env) or 0)


def _interrupted(run_dir):
    """Ctrl-C or SIGTERM: where the run is and how to continue it."""
    if os.path.exists(os.path.join(run_dir, "checkpoints", "latest.json")):
        how = f"continue it with: python launch/dist.py --resume {run_dir}"
    else:
        how = "it has no checkpoint yet; start it again to run it"
    print(f"[launcher] stopped; the run directory is {run_dir}; {how}", file=sys.stderr,
          flush=True)


def _run_training(config, run_dir, length, env, runner, port, resume, failures, start=0):
    """One run of the training program on every worker (resumed from RUN_DIR's last
    checkpoint, step ``start``, with ``resume``) under a progress bar; its exit code."""
    from ..progress import ProgressMonitor
    cmd = [sys.executable, "-m", "ssdsgd.train", os.path.join(run_dir, "config.yaml"),
           "--run-dir", run_dir]
    if resume:
        cmd += ["--resume", run_dir]
    if config.train.timeline:     # where every process records (ssdsgd/timeline.py)
        env = dict(env, **to_env(timeline_dir=os.path.abspath(os.path.join(run_dir,
                                                                            "timeline"))))
    progress = ProgressMonitor(run_dir, length.total_steps, tty=sys.stderr.isatty(),
                               start_step=start if resume else None)
    return run_job(config.cluster.workers, config.cluster.servers, cmd, env,
                   port=port or None, launcher=runner, progress=progress,
                   stdout=progress.sink(sys.stdout), stderr=progress.sink(sys.stderr),
                   failures=failures, run_dir=run_dir,
                   continue_without_workers=config.cluster.on_worker_failure == "continue",
                   server_replicas=config.cluster.server_replicas,
                   max_workers=config.cluster.max_workers)


def _restart_from_checkpoint(config, run_dir, length):
    """(environment, what the restart continues from) after a failure: RUN_DIR's last
    checkpoint if there is one (its step becomes SSDSGD_START_STEP), else (env, None):
    the run starts again from step 0 (deterministic, so it ends the same)."""
    from ..checkpoint import check_unfinished, checkpoint_info
    from ..config import job_env
    if not os.path.exists(os.path.join(run_dir, "checkpoints", "latest.json")):
        return job_env(config, start_step=0), None
    info = checkpoint_info(run_dir)
    check_unfinished(run_dir, info, length)
    return (job_env(config, start_step=info["step"]),
            f"resuming from the checkpoint at step {info['step']}")


def _join_form(argv):
    """``--join RUN_DIR [--host HOST]``: one worker joins the running job of RUN_DIR
    (launch/joining.py), on this host, or with ``--host`` on HOST over ssh as the job's
    ssh launcher starts its workers (run it where that launcher runs: the job's keys are
    there). Its exit code, 2 with one line if the job takes no joiner."""
    from .joining import JoinRefused, claim, read, worker_env
    p = argparse.ArgumentParser(prog="launch/dist.py --join", description="start one worker "
                                "that joins the running job of RUN_DIR (cluster.max_workers)")
    p.add_argument("--join", metavar="RUN_DIR", required=True)
    p.add_argument("--host", help="start it on HOST over ssh (a job of --launcher ssh; "
                   "run this where its launcher runs)")
    args = p.parse_args(argv)
    try:
        data = read(args.join)
        site = _join_site(args, data)
        rank, key_file = claim(args.join, data)
    except JoinRefused as e:
        print(f"launch/dist.py: error: {e}", file=sys.stderr)
        return 2
    where = f" on {args.host}" if args.host is not None else ""
    print(f"[launcher] worker {rank} joins the job of {args.join}{where}", file=sys.stderr,
          flush=True)
    env = worker_env(data, rank, key_file)
    if site is None:
        from .local import LocalProcess, start_child
        proc = LocalProcess("worker", rank, start_child(data["command"], env), "")
    else:
        proc = site.start_remote("worker", rank, data["command"],
                                 dict(env, **site.node_env("worker", rank)), args.host)
    return _follow_joiner(proc, f"[worker {rank}{where}] ")


def _leave_form(argv):
    """``--leave RUN_DIR --rank R``: worker R leaves the running job of RUN_DIR at a step
    every worker hears of in time (launch/leaving.py); the others go on. Exit 0 once the
    job decided the step, 2 with one line if it cannot."""
    from .leaving import leave_form
    p = argparse.ArgumentParser(prog="launch/dist.py --leave", description="worker R "
                                "leaves the running job of RUN_DIR (cluster.max_workers)")
    p.add_argument("--leave", metavar="RUN_DIR", required=True)
    p.add_argument("--rank", type=int, required=True, help="the worker that leaves (not 0)")
    return leave_form(p.parse_args(argv))


def _join_site(args, data):
    """The ssh way to ``--host`` (None: this host), its host checked (and the code
    copied with the job's --sync-dir) before a rank is claimed; JoinRefused if not."""
    from .hosts import HostError, host_name
    from .joining import JoinRefused
    if args.host is None:
        return None
    try:
        host_name(args.host, f"--join {args.join} --host")
    except HostError as e:
        raise JoinRefused(str(e)) from None
    if "ssh" not in data:
        raise JoinRefused(f"--join {args.join} --host {args.host}: the job was not started "
                          "with --launcher ssh; run --join on the host itself")
    from .ssh import SSHCommand
    site = SSHCommand.from_join_spec(data["ssh"])
    failures = site.prepare_host(args.host)
    if failures:
        raise JoinRefused(f"--join {args.join} --host {args.host}: " + "; ".join(failures))
    return site


def _follow_joiner(proc, prefix):
    """The joiner's output, prefixed, until it ends (with the job); Ctrl-C stops it."""
    import signal
    import subprocess
    import threading
    from .job import _pump
    lock = threading.Lock()
    pumps = [threading.Thread(target=_pump, args=(stream, prefix, sink, lock), daemon=True)
             for stream, sink in ((proc.popen.stdout, sys.stdout),
                                  (proc.popen.stderr, sys.stderr))]
    for t in pumps:
        t.start()
    try:
        proc.popen.wait()     # as long as the job runs; it dies with this process
    except KeyboardInterrupt:
        proc.signal(signal.SIGTERM)
        try:
            proc.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.signal(signal.SIGKILL)
            proc.popen.wait(timeout=10)
    for t in pumps:
        t.join(timeout=2)
    return proc.poll()        # a remote one's: -N when its process was killed by signal N


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--join" or a.startswith("--join=") for a in argv):
        return _join_form(argv)
    if any(a == "--leave" or a.startswith("--leave=") for a in argv):
        return _leave_form(argv)
    if "--" in argv or any(a in ("-n", "--num-workers") for a in argv):
        return _command_form(argv)
    return _config_form(argv)
