#!/usr/bin/env python3
"""A worker that joins late: does the job end as well as one that had it from the start?

    .venv/bin/python bench/join_accuracy.py [--seeds 0-4] [--join-at 0.3] [--k K]
                                            [--step-delay 0.03] [--json FILE] [--out DIR]

Issue 29 asks for it: "a 3-worker ssd job whose third worker joins late ends within 1
point of the uninterrupted 3-worker job's accuracy; its throughput after the join is
printed". Rows, each a whole job of ``launch/dist.py configs/digits.yaml`` (the
demo: digits MLP, SSD-SGD, glu exact, sgd lr 0.1 momentum 0.9, cosine over 20 epochs)
run once per seed:

  3 workers      ``cluster.workers: 3`` from the start
  2 + 1 joining  ``cluster.workers: 2, cluster.max_workers: 3``; once rank 0 has done
                 ``--join-at`` of the 2-worker job's steps, ``launch/dist.py --join RUN``
                 starts the third (it joins at the next pull boundary the servers agree on)

A third row, ``defaults``, is the demo with 3 workers exactly as a user starts it (k,
warm-up and relay at auto, no pacing), beside the two. The other two rows keep the
demo's settings too (k and the relay at auto: the auto relay needs a chain of 3
workers, which a 2-worker start has not; ``--k`` pins k in both), and every worker sleeps ``--step-delay`` s a step
(``debug.slowdown``, both rows alike; it changes no arithmetic) so that the 2-worker job
lasts long enough for a joiner's start-up (MXNet's import, about 2-3 s here) to land
inside it.

Reported per row, MLPerf's aggregate over the seeds (drop the highest and the lowest,
mean of the rest) with the spread: the final test accuracy of the global model, and
the job's throughput by the wall clock (samples the servers applied per second); for
the joining row also the step it joined at and its throughput before and after the
join (the job's own ``throughput_by_membership``, summary.json), and the difference of
its final accuracy to the 3-worker job's in points (mean over seeds, each seed against
the same seed's 3-worker job).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.cluster.seeds import olympic, parse_seeds  # noqa: E402
from bench.common import machine_info  # noqa: E402
from ssdsgd.metrics import read_records  # noqa: E402
from ssdsgd.testing.procs import clean_env, stop_groups  # noqa: E402

LAUNCH = ROOT / "launch" / "dist.py"
CONFIG = ROOT / "configs" / "digits.yaml"
JOB_TIMEOUT_S = 300      # one job, start to exit
STEPS_2W = 20 * 22       # the demo's 2-worker job: 20 epochs of 22 steps
SYSTEMS = {"defaults": "3 workers, the defaults (unpaced)",
           "three": "3 workers from the start", "join": "2 + 1 joining"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=parse_seeds, default=parse_seeds("0-4"))
    p.add_argument("--join-at", type=float, default=0.3,
                   help="start the joiner once rank 0 has done this share of its steps")
    p.add_argument("--k", type=int, default=None,
                   help="pin sync.delay_steps in the paced rows (default: auto, as the demo)")
    p.add_argument("--step-delay", type=float, default=0.03,
                   help="seconds every worker sleeps a step, both rows")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--out", help="runs and logs here (default: a new temporary directory)")
    return p.parse_args(argv)


def job_args(args, seed, out, workers, max_workers=None, defaults=False):
    """``defaults``: the demo as a user starts it with 3 workers (k, warm-up and relay at
    auto, no pacing); else the paced rows (``--k`` pins k in them)."""
    sets = {"cluster.workers": workers, "train.seed": seed, "output.dir": out,
            "output.plots": "false"}
    if not defaults:
        delays = ",".join(f"{r}={args.step_delay}" for r in range(3))
        sets["debug.slowdown"] = f"delay:{delays}"
        if args.k is not None:
            sets["sync.delay_steps"] = args.k
    if max_workers:
        sets["cluster.max_workers"] = max_workers
    out_args = [sys.executable, str(LAUNCH), str(CONFIG)]
    for key, value in sets.items():
        out_args += ["--set", f"{key}={value}"]
    return out_args


def wait(proc, what, deadline):
    try:
        return proc.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        stop_groups([proc], grace=15)
        raise SystemExit(f"{what} did not end within {JOB_TIMEOUT_S} s; stopped")


def rank0_step(run):
    recs = read_records(run / "metrics" / "worker-0.jsonl")
    return max((r.get("step", 0) for r in recs if r.get("event") == "train"), default=0)


def run_dir_in(out):
    dirs = [d for d in Path(out).iterdir() if d.is_dir()]
    return dirs[0] if len(dirs) == 1 else None


def run_row(args, seed, base, system):
    joining = system == "join"
    out = base / f"{system}-seed{seed}"
    out.mkdir(parents=True)
    log = open(base / f"{out.name}.log", "w")
    env = clean_env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = job_args(args, seed, out, 2 if joining else 3, 3 if joining else None,
                   defaults=system == "defaults")
    deadline = time.monotonic() + JOB_TIMEOUT_S
    t0 = time.monotonic()
    job = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                           stdin=subprocess.DEVNULL, start_new_session=True)
    joiner_rc = None
    if joining:
        run = None
        while job.poll() is None and time.monotonic() < deadline:
            run = run or run_dir_in(out)
            if run and rank0_step(run) >= args.join_at * STEPS_2W:
                break
            time.sleep(0.05)
        if job.poll() is None and run is not None:
            joiner = subprocess.Popen([sys.executable, str(LAUNCH), "--join", str(run)],
                                      cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
            joiner_rc = wait(joiner, f"the joiner of seed {seed}", deadline)
            stop_groups([joiner], grace=0)
    rc = wait(job, f"the job of seed {seed}", deadline)
    stop_groups([job], grace=0)          # anything the launcher left in its group
    wall = time.monotonic() - t0
    run = run_dir_in(out)
    summary = json.loads((run / "summary.json").read_text()) if run and (
        run / "summary.json").exists() else {}
    row = {"system": system, "seed": seed, "rc": rc,
           "joiner_rc": joiner_rc, "job_s": wall,
           "final_accuracy": summary.get("final_accuracy"),
           "samples_per_s": summary.get("samples_per_sec"),
           "k": summary.get("delay_steps"),
           "relay": (summary.get("choices") or {}).get("pull_relay", {}).get("value"),
           "status": "ok" if rc == 0 and joiner_rc in (None, 0) and summary else "failed"}
    if joining:
        joined = summary.get("workers_joined") or [{}]
        spans = summary.get("throughput_by_membership") or []
        row["joined_at_step"] = joined[0].get("from_step")
        row["before_join_samples_per_s"] = spans[0]["samples_per_sec"] if spans else None
        row["after_join_samples_per_s"] = spans[-1]["samples_per_sec"] if len(spans) > 1 \
            else None
        if row["status"] == "ok" and len(spans) < 2:
            row["status"] = "no join"       # the joiner came after the job's last step
    return row


def fmt(agg, key, digits=4):
    a = agg.get(key)
    if a is None or a["mean"] is None:
        return "-"
    return f"{a['mean']:.{digits}f} [{a['min']:.{digits}f}-{a['max']:.{digits}f}]"


def main(argv=None):
    args = parse_args(argv)
    base = Path(args.out or tempfile.mkdtemp(prefix="ssdsgd-join-accuracy-"))
    rows = []
    for seed in args.seeds:
        for system in SYSTEMS:
            row = run_row(args, seed, base, system)
            rows.append(row)
            print(json.dumps(row), flush=True)
    agg = {}
    for system in SYSTEMS:
        ok = [r for r in rows if r["system"] == system and r["status"] == "ok"]
        agg[system] = {"runs": len(ok), **{key: olympic(
            [r[key] for r in ok if r.get(key) is not None]) for key in (
            "final_accuracy", "samples_per_s", "joined_at_step",
            "before_join_samples_per_s", "after_join_samples_per_s")}}
    three = {r["seed"]: r for r in rows if r["system"] == "three" and r["status"] == "ok"}
    diffs = [100 * (r["final_accuracy"] - three[r["seed"]]["final_accuracy"])
             for r in rows if r["system"] == "join" and r["status"] == "ok"
             and r["seed"] in three]
    print(f"\nseeds {args.seeds}; k = {args.k or 'auto'}, {args.step_delay} s a step; "
          f"joiner started at {args.join_at:.0%} of the 2-worker job's steps; runs in {base}")
    print("| row | runs | final accuracy | samples/s (job) | joined at step | "
          "samples/s before join | samples/s after join |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for system, label in SYSTEMS.items():
        a = agg[system]
        print(f"| {label} | {a['runs']} | {fmt(a, 'final_accuracy')} | "
              f"{fmt(a, 'samples_per_s', 1)} | {fmt(a, 'joined_at_step', 0)} | "
              f"{fmt(a, 'before_join_samples_per_s', 1)} | "
              f"{fmt(a, 'after_join_samples_per_s', 1)} |")
    if diffs:
        print(f"\njoining - 3 workers, final accuracy, same seed: mean "
              f"{sum(diffs) / len(diffs):+.2f} points, per seed "
              f"{', '.join(f'{d:+.2f}' for d in diffs)}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"args": {k: v for k, v in vars(args).items()}, "machine": machine_info(),
             "rows": rows, "aggregate": agg, "diff_points": diffs}, indent=2) + "\n")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
