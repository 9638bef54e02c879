"""``python launch/dist.py``: start a whole ssdsgd job on this machine.

Two forms:

    python launch/dist.py CONFIG.yaml [--set sync.delay_steps=10 ...] [--resume RUN_DIR]
    python launch/dist.py -n 4 -s 1 [--launcher local] [--env K=V ...] -- python train.py ...

The first runs ssdsgd's training program (``python -m ssdsgd.train``) on every worker with
the cluster and synchronization taken from the config; the second is MXNet's
``tools/launch.py`` form for your own script, which then uses ``kvstore='ssd_sync'``.
"""
import argparse
import os
import sys
import time

from .job import run_job
from .local import LAUNCHERS


def _command_form(argv):
    if "--" not in argv:
        raise SystemExit("launch/dist.py: give a CONFIG.yaml, or -n N -s S -- COMMAND ...")
    i = argv.index("--")
    opts, cmd = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="launch/dist.py", description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--num-workers", type=int, required=True)
    p.add_argument("-s", "--num-servers", type=int, default=1)
    p.add_argument("--launcher", default="local", choices=sorted(LAUNCHERS))
    p.add_argument("--port", type=int, default=0, help="scheduler port (default: a free one)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for every process, e.g. SSDSGD_ALGORITHM=ssgd")
    p.add_argument("--secure", action="store_true", help="encrypt and authenticate every "
                   "connection with ZeroMQ CURVE (docs/reliability.md)")
    args = p.parse_args(opts)
    if not cmd:
        p.error("no command after --")
    if args.num_workers < 1 or args.num_servers < 1:
        p.error("-n and -s must be >= 1")
    extra = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"--env {item!r}: expected KEY=VALUE")
        extra[key] = value
    return run_job(args.num_workers, args.num_servers, cmd, extra, port=args.port or None,
                   launcher=args.launcher, secure=args.secure)


def _config_form(argv):
    from ..config import ConfigError, cluster_env, load_config, new_run_dir, save_config, sync_env
    from ..data import DataError, validate_data
    from ..train import checkpoint_info, total_steps
    p = argparse.ArgumentParser(prog="launch/dist.py", description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", help="the job's YAML file (see configs/); omitted "
                   "with --resume (RUN_DIR/config.yaml is used)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set sync.delay_steps=10")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last "
                   "checkpoint (--set overrides are written to RUN_DIR/config.yaml)")
    p.add_argument("--port", type=int, default=0, help="scheduler port (default: a free one)")
    p.add_argument("--secure", action="store_true", help="encrypt and authenticate every "
                   "connection with ZeroMQ CURVE (docs/reliability.md)")
    args = p.parse_args(argv)
    if not args.config and not args.resume:
        p.error("give a CONFIG.yaml (or --resume RUN_DIR)")
    try:
        if args.resume:
            config = load_config(os.path.join(args.resume, "config.yaml"), args.overrides)
            run_dir = args.resume
            resume_step = checkpoint_info(run_dir)["step"]   # something to resume from
        else:
            config = load_config(args.config, args.overrides)
        validate_data(config)       # bad data fails here, before any process starts
        if not args.resume:
            run_dir = str(new_run_dir(config))
        if not args.resume or args.overrides:   # the workers read the run's config file
            save_config(config, os.path.join(run_dir, "config.yaml"))
        env = dict(cluster_env(config))
        env.update(sync_env(config))
        if args.resume:     # the stage machine continues the warm-up / steps-delay schedule
            env["SSDSGD_START_STEP"] = str(resume_step)
    except (ConfigError, DataError) as e:
        print(f"launch/dist.py: error: {e}", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "ssdsgd.train", os.path.join(run_dir, "config.yaml"),
           "--run-dir", run_dir]
    if args.resume:
        cmd += ["--resume", run_dir]
    from ..progress import ProgressMonitor
    progress = ProgressMonitor(run_dir, total_steps(config), tty=sys.stderr.isatty())
    print(f"[launcher] run directory: {run_dir}", flush=True)
    t0 = time.monotonic()
    code = run_job(config.cluster.workers, config.cluster.servers, cmd, env,
                   port=args.port or None, launcher=config.cluster.launcher, progress=progress,
                   stdout=progress.sink(sys.stdout), stderr=progress.sink(sys.stderr),
                   secure=args.secure)
    if code == 0:
        from ..report import ReportError, finished_run
        try:
            lines = finished_run(run_dir)
        except (ReportError, ImportError, OSError, ValueError) as e:
            lines = [f"no result to report ({e})"]
        lines[0] += f"; job {time.monotonic() - t0:.1f} s"
        for line in lines:
            print(f"[launcher] {line}", flush=True)
    return code


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv or any(a in ("-n", "--num-workers") for a in argv):
        return _command_form(argv)
    return _config_form(argv)
