#!/usr/bin/env python3
"""SSD-SGD on real data through the real system: digits, 4 workers, every local rule and k.

    .venv/bin/python bench/ssd_digits.py                       # the full experiment
    .venv/bin/python bench/ssd_digits.py --quick               # smoke run (2 ks, 6 epochs)
    .venv/bin/python bench/ssd_digits.py --rows ssgd --lrs 0.1,0.4,0.8   # an lr scan
    .venv/bin/python bench/ssd_digits.py --load results.json   # reprint saved tables

Every configuration is one whole job started with ``launch/dist.py configs/digits.yaml
--set ...`` (scheduler, server and worker processes talking over ZeroMQ); nothing is
simulated. For each learning rate it runs the rows

    ssgd, asgd                                   (no k)
    ssd/glu-estimate, ssd/glu-exact, ssd/sgd, ssd/none   at every k

and prints (1) the final test accuracy (global model, 360 test images) per row and k,
with the difference to ssgd in points, and (2) per run: bytes sent / received per worker
and step, the received bytes per step of the steps-delay stage relative to ssgd's, the
mean time a worker was blocked on the network, the training wall time and the job's
whole time. A run whose loss became NaN/inf stops (ssdsgd.train raises) and is shown as
``div``.

Runs go to ``--out DIR`` (default: a new temporary directory, kept): ``runs/`` holds
the run directories, ``logs/`` each job's output. ``--json FILE`` keeps everything.
Every job gets OMP_NUM_THREADS=1 (the launcher passes the environment through) unless
the variable is already set.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import machine_info  # noqa: E402
from ssdsgd.launch.local import kill_group  # noqa: E402
from ssdsgd.metrics import metrics_path, read_records  # noqa: E402
from ssdsgd.report import text_table, validation_curve  # noqa: E402

CONFIG = ROOT / "configs" / "digits.yaml"
LAUNCH = ROOT / "launch" / "dist.py"

ROWS = {  # row name -> (algorithm, local_rule, glu_state); None: the config's default
    "ssgd": ("ssgd", None, None),
    "asgd": ("asgd", None, None),
    "glu-estimate": ("ssd", "glu", "estimate"),
    "glu-exact": ("ssd", "glu", "exact"),
    "sgd": ("ssd", "sgd", None),
    "none": ("ssd", "none", None),
}
ROW_LABEL = {"ssgd": "ssgd", "asgd": "asgd", "glu-estimate": "ssd/glu-estimate",
             "glu-exact": "ssd/glu-exact", "sgd": "ssd/sgd", "none": "ssd/none"}

DEFAULTS = dict(lrs=[0.05, 0.2], ks=[2, 5, 10, 20, 50], epochs=30, warmup=50)
QUICK = dict(ks=[2, 10], epochs=6)


# ----------------------------------------------------------------------------- running

def overrides(args, row: str, lr: float, k: int | None, out: Path, name: str) -> list[str]:
    algorithm, rule, state = ROWS[row]
    sets = {
        "cluster.workers": args.workers,
        "cluster.servers": 1,
        "sync.algorithm": algorithm,
        "sync.warmup_steps": args.warmup,
        "data.batch_size": args.batch,
        "optimizer.lr": lr,
        "optimizer.lr_schedule.type": args.lr_schedule,
        "train.epochs": args.epochs,
        "train.seed": args.seed,
        "output.dir": str(out / "runs"),
        "output.name": name,
    }
    if k is not None:
        sets["sync.delay_steps"] = k
    if rule is not None:
        sets["sync.local_rule"] = rule
    if state is not None:
        sets["sync.glu_state"] = state
    return [f"{key}={value}" for key, value in sets.items()]


def delay_stage_bytes(records: list[dict], warmup: int) -> dict | None:
    """Bytes per step of one worker between its first ``train`` record at or after the
    warm-up and its last one (the figures are cumulative)."""
    train = [r for r in records if r.get("event") == "train"
             and r.get("bytes_received") is not None]
    after = [r for r in train if r["step"] >= warmup]
    if len(after) < 2 or after[-1]["step"] == after[0]["step"]:
        return None
    a, b = after[0], after[-1]
    steps = b["step"] - a["step"]
    return {"from_step": a["step"], "to_step": b["step"],
            "sent_per_step": (b["bytes_sent"] - a["bytes_sent"]) / steps,
            "recv_per_step": (b["bytes_received"] - a["bytes_received"]) / steps}


def collect(run_dir: Path, warmup: int, num_workers: int) -> dict:
    """What one finished (or failed) run left in its directory."""
    res: dict = {"run_dir": str(run_dir)}
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    workers = {}
    for rank in range(num_workers):
        recs = read_records(metrics_path(run_dir, rank))
        workers[rank] = worker_figures(recs, warmup)
        if rank == 0:
            res["val_curve"] = [(r.get("epoch"), r.get("step"), r.get("accuracy"))
                                for r in validation_curve(recs)]
    res["workers"] = workers
    res["summary"] = summary
    return res


def worker_figures(recs: list[dict], warmup: int) -> dict:
    """One worker's totals from its metrics records (its ``end`` record, else its last
    ``train`` record), the steps-delay stage's bytes per step, the first non-finite loss."""
    end = next((r for r in reversed(recs) if r.get("event") == "end"), None)
    train = [r for r in recs if r.get("event") == "train"]
    last = end or (train[-1] if train else {})
    kv = (end or {}).get("kv") or {}
    return {
        "steps": last.get("steps", last.get("step")),
        "bytes_sent": last.get("bytes_sent"), "bytes_received": last.get("bytes_received"),
        "time_blocked": last.get("time_blocked"),
        "wall_time": last.get("wall_time", last.get("elapsed")),
        "pushes": kv.get("pushes"), "pulls": kv.get("pulls"),
        "delay_stage": delay_stage_bytes(recs, warmup),
        "nonfinite_loss_at": next((r["step"] for r in train
                                   if r.get("loss") is None
                                   or not math.isfinite(r["loss"])), None),
    }


def launch_cmd(args, row: str, lr: float, k: int | None, out: Path, name: str) -> list[str]:
    cmd = [sys.executable, str(LAUNCH), str(args.config)]
    for s in overrides(args, row, lr, k, out, name):
        cmd += ["--set", s]
    return cmd


def run_one(args, row: str, lr: float, k: int | None, out: Path) -> dict:
    """One configuration as one job; a job that failed (no summary, no divergence) is
    run again up to ``args.retries`` times."""
    name = f"{row}_lr{lr:g}" + (f"_k{k}" if k is not None else "")
    log_path = out / "logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = launch_cmd(args, row, lr, k, out, name)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    attempts = []
    for attempt in range(1 + args.retries):
        t0 = time.time()
        returncode, run_dir, timed_out = run_job(cmd, env, log_path, attempt > 0,
                                                 t0 + args.timeout)
        job_time = time.time() - t0
        res = collect(run_dir, args.warmup, args.workers) if run_dir else {"workers": {},
                                                                          "summary": None}
        res.update(row=row, lr=lr, k=k, name=name, cmd=cmd, log=str(log_path),
                   returncode=returncode, job_time=job_time, timed_out=timed_out)
        res["status"] = job_status(res, log_path.read_text(errors="replace"))
        attempts.append({"returncode": returncode, "status": res["status"],
                         "run_dir": res.get("run_dir"), "job_time": job_time})
        if res["status"] != "failed":
            break
    res["attempts"] = attempts
    return res


def run_job(cmd, env, log_path: Path, append: bool, deadline: float):
    """Run the launcher, copying its output to the log (appended on a retry) and reading
    the run directory from it; stop it at ``deadline`` (SIGTERM, then SIGKILL).
    Returns (exit code, run directory or None, whether it timed out)."""
    with open(log_path, "a" if append else "w") as logf:
        logf.write("$ " + " ".join(cmd) + "\n")
        logf.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        run_dir = None
        timed_out = False
        try:
            for line in proc.stdout:
                logf.write(line)
                if line.startswith("[launcher] run directory: "):
                    run_dir = Path(line.split(": ", 1)[1].strip())
                if time.time() > deadline:
                    timed_out = True
                    break
            if timed_out:
                kill_group(proc.pid, signal.SIGTERM)
            proc.wait(timeout=max(5.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_group(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, run_dir, timed_out


def job_status(res: dict, log_text: str) -> str:
    """ok (summary written), diverged (non-finite loss) or failed."""
    diverged = "FloatingPointError" in log_text or "diverged" in log_text
    if res["summary"] is not None:
        return "ok"
    if diverged or any(w.get("nonfinite_loss_at") for w in res["workers"].values()):
        return "diverged"
    return "failed"


# ----------------------------------------------------------------------------- figures

def accuracy(r: dict):
    s = r.get("summary")
    return None if s is None else s.get("final_accuracy")


def per_worker_step(r: dict, key: str):
    ws = [w for w in r["workers"].values() if w.get(key) is not None and w.get("steps")]
    if not ws:
        return None
    return sum(w[key] / w["steps"] for w in ws) / len(ws)


def delay_recv(r: dict):
    ds = [w["delay_stage"] for w in r["workers"].values() if w.get("delay_stage")]
    return sum(d["recv_per_step"] for d in ds) / len(ds) if ds else None


def blocked(r: dict):
    s = r.get("summary")
    if s is not None and s.get("time_blocked") is not None:
        return s["time_blocked"]
    ws = [w["time_blocked"] for w in r["workers"].values() if w.get("time_blocked") is not None]
    return sum(ws) / len(ws) if ws else None


def wall(r: dict):
    s = r.get("summary")
    if s is not None:
        return s.get("wall_time")
    ws = [w["wall_time"] for w in r["workers"].values() if w.get("wall_time") is not None]
    return max(ws) if ws else None


def diverged_at(r: dict):
    steps = [w["nonfinite_loss_at"] for w in r["workers"].values()
             if w.get("nonfinite_loss_at")]
    return min(steps) if steps and r["status"] == "diverged" else None


def pulls(r: dict):
    ps = [w["pulls"] for w in r["workers"].values() if w.get("pulls") is not None]
    return ps[0] if ps and len(set(ps)) == 1 else (ps or None)


# ----------------------------------------------------------------------------- tables

def _acc_cell(r: dict | None) -> str:
    if r is None:
        return ""
    if r["status"] == "diverged":
        return "div"
    if r["status"] != "ok":
        return "fail"
    a = accuracy(r)
    return "-" if a is None else f"{a:.4f}"


def _kb(x) -> str:
    return "-" if x is None else f"{x / 1000:.1f}"


def accuracy_tables(results: list[dict], lrs, ks, rows) -> str:
    out = []
    by = {(r["row"], r["lr"], r["k"]): r for r in results}
    if not any(ROWS[row][0] == "ssd" for row in rows):   # e.g. an lr scan: one table
        body = [[ROW_LABEL[row], f"{lr:g}", _acc_cell(by.get((row, lr, None)))]
                for row in rows for lr in lrs]
        return ("final test accuracy (global model, 360 test images)\n" +
                text_table(["run", "lr", "accuracy"], body))
    for lr in lrs:
        ssgd = by.get(("ssgd", lr, None))
        base = accuracy(ssgd) if ssgd and ssgd["status"] == "ok" else None
        head = ["lr=%g" % lr, "no k"] + [f"k={k}" for k in ks]
        body = []
        for row in rows:
            if ROWS[row][0] != "ssd":
                body.append([ROW_LABEL[row], _acc_cell(by.get((row, lr, None)))] +
                            [""] * len(ks))
            else:
                body.append([ROW_LABEL[row], ""] + [_acc_cell(by.get((row, lr, k)))
                                                    for k in ks])
        out.append("final test accuracy (global model, 360 test images)\n" +
                   text_table(head, body))
        if base is not None and any(ROWS[row][0] == "ssd" for row in rows):
            out.append(f"difference to ssgd ({base:.4f}), points\n" +
                       text_table(head, difference_rows(by, base, lr, ks, rows)))
    return "\n\n".join(out)


def difference_rows(by: dict, base: float, lr: float, ks, rows) -> list[list[str]]:
    """Per ssd row and k: the accuracy minus ssgd's (``base``), in points."""
    body = []
    for row in rows:
        if ROWS[row][0] != "ssd":
            continue
        cells = []
        for k in ks:
            r = by.get((row, lr, k))
            a = accuracy(r) if r else None
            cells.append("" if r is None else ("div" if r["status"] == "diverged"
                                               else "fail" if a is None
                                               else f"{100 * (a - base):+.1f}"))
        body.append([ROW_LABEL[row], ""] + cells)
    return body


def network_table(results: list[dict]) -> str:
    ref = {r["lr"]: delay_recv(r) for r in results if r["row"] == "ssgd"}
    head = ["run", "lr", "k", "acc", "pulls/wkr", "sent KB/step", "recv KB/step",
            "recv KB/step after warm-up", "ssgd/this", "blocked s", "blocked %", "wall s",
            "job s"]
    body = []
    for r in results:
        d = delay_recv(r)
        base = ref.get(r["lr"])
        p = pulls(r)
        body.append([ROW_LABEL[r["row"]], f"{r['lr']:g}", "-" if r["k"] is None else str(r["k"]),
                     _acc_cell(r) + (f"@{diverged_at(r)}" if diverged_at(r) else ""),
                     "-" if p is None else str(p),
                     _kb(per_worker_step(r, "bytes_sent")),
                     _kb(per_worker_step(r, "bytes_received")), _kb(d),
                     "-" if not d or not base else f"{base / d:.1f}",
                     "-" if blocked(r) is None else f"{blocked(r):.2f}",
                     "-" if not blocked(r) or not wall(r) else f"{100 * blocked(r) / wall(r):.0f}",
                     "-" if wall(r) is None else f"{wall(r):.1f}", f"{r['job_time']:.1f}"])
    return ("per run: KB = 1000 bytes per worker and step; 'after warm-up' counts only the "
            "steps-delay\nstage (from the first metrics record at or after the warm-up to "
            "the last); ssgd/this = ssgd's\nfigure over this one; blocked = mean seconds per "
            "worker waiting on the network (% of\nwall); wall = training loop; job = whole "
            "launcher job, process start-up included\n" + text_table(head, body))


def print_report(data: dict) -> None:
    s = data["settings"]
    print(accuracy_tables(data["results"], s["lrs"], s["ks"], s["rows"]))
    print()
    print(network_table(data["results"]))
    total = sum(r["job_time"] for r in data["results"])
    print(f"\n{len(data['results'])} jobs, {total / 60:.1f} min of job time")
    bad = [r for r in data["results"] if len(r.get("attempts", [])) > 1 or
           r["status"] == "failed"]
    for r in bad:
        print(f"note: {r['name']}: attempts {[(a['status'], a['returncode']) for a in r['attempts']]}")


def plot(data: dict, prefix: str) -> list[str]:
    """PREFIX_lr<lr>.png per learning rate: final accuracy against k, one line per rule."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = data["settings"]
    by = {(r["row"], r["lr"], r["k"]): r for r in data["results"]}
    paths = []
    for lr in s["lrs"]:
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
        for row in s["rows"]:
            plot_row(ax, by, row, lr, s["ks"])
        ax.set_xscale("log")
        ax.set_xticks(s["ks"])
        ax.set_xticklabels([str(k) for k in s["ks"]])
        ax.set_xlabel("k (pull period, steps)")
        ax.set_ylabel("final test accuracy (NaN loss = 0)")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="lower left")
        ax.set_title(f"digits MLP, {s['workers']} workers, lr {lr:g}, "
                     f"{s['epochs']} epochs, warm-up {s['warmup']} steps")
        fig.tight_layout()
        path = f"{prefix}_lr{lr:g}.png"
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_row(ax, by: dict, row: str, lr: float, ks) -> None:
    """A row without k (ssgd, asgd) as a horizontal line, an ssd row as accuracy vs k."""
    if ROWS[row][0] != "ssd":
        r = by.get((row, lr, None))
        a = accuracy(r) if r else None
        if a is not None:
            ax.axhline(a, linestyle="--" if row == "ssgd" else ":",
                       color="k" if row == "ssgd" else "gray",
                       label=f"{row} ({a:.3f})")
        return
    xs, ys = [], []
    for k in ks:
        r = by.get((row, lr, k))
        if r is None:
            continue
        a = accuracy(r)
        xs.append(k)
        ys.append(0.0 if a is None else a)   # NaN loss: plotted at 0
    if xs:
        style = {"glu-estimate": ("o", "-"), "glu-exact": ("s", "-"),
                 "sgd": ("^", "--"), "none": ("v", ":")}[row]
        ax.plot(xs, ys, marker=style[0], linestyle=style[1], label=ROW_LABEL[row])


# ----------------------------------------------------------------------------- main

def parse_list(text: str, kind):
    return [kind(x) for x in text.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: ks {QUICK['ks']}, {QUICK['epochs']} epochs (explicit "
                   "--ks/--epochs win)")
    p.add_argument("--lrs", type=lambda t: parse_list(t, float),
                   help=f"learning rates (default {DEFAULTS['lrs']})")
    p.add_argument("--ks", type=lambda t: parse_list(t, int),
                   help=f"delays k for the ssd rows (default {DEFAULTS['ks']})")
    p.add_argument("--rows", type=lambda t: parse_list(t, str), default=list(ROWS),
                   help=f"which rows, comma-separated (default all: {','.join(ROWS)})")
    p.add_argument("--epochs", type=int, help=f"default {DEFAULTS['epochs']}")
    p.add_argument("--warmup", type=int, default=DEFAULTS["warmup"],
                   help="synchronous warm-up steps T_w (default %(default)s)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch", type=int, default=16, help="per worker (default %(default)s)")
    p.add_argument("--lr-schedule", default="none", choices=["none", "cosine"],
                   help="default %(default)s (constant lr)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--out", type=Path, help="directory for runs/ and logs/ "
                   "(default: a new temporary directory)")
    p.add_argument("--json", type=Path, help="write settings, machine and every run here")
    p.add_argument("--plot", metavar="PREFIX", help="write PREFIX_lr<lr>.png: accuracy vs k")
    p.add_argument("--retries", type=int, default=2,
                   help="re-run a job that ended without summary.json and did not diverge")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    p.add_argument("--load", type=Path, help="print the tables of a --json file; run nothing")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.load:
        show(json.loads(args.load.read_text()), args.plot)
        return 0
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        p.error(f"--rows: unknown {unknown}; choose from {list(ROWS)}")
    args.lrs = args.lrs or DEFAULTS["lrs"]
    args.ks = args.ks or (QUICK["ks"] if args.quick else DEFAULTS["ks"])
    args.epochs = args.epochs or (QUICK["epochs"] if args.quick else DEFAULTS["epochs"])
    out = args.out or Path(tempfile.mkdtemp(prefix="ssd_digits-"))
    out.mkdir(parents=True, exist_ok=True)
    data = {"settings": settings(args, out, argv), "machine": machine_info(), "results": []}
    run_all(args, job_plan(args), out, data)
    show(data, args.plot)
    return 0


def job_plan(args) -> list[tuple]:
    """(row, lr, k) of every job: rows without k once per lr, ssd rows once per k."""
    plan = []
    for lr in args.lrs:
        for row in args.rows:
            if ROWS[row][0] == "ssd":
                plan += [(row, lr, k) for k in args.ks]
            else:
                plan.append((row, lr, None))
    return plan


def settings(args, out: Path, argv) -> dict:
    return {"lrs": args.lrs, "ks": args.ks, "rows": args.rows, "epochs": args.epochs,
            "warmup": args.warmup, "workers": args.workers, "servers": 1,
            "batch": args.batch, "lr_schedule": args.lr_schedule, "seed": args.seed,
            "config": str(args.config), "out": str(out),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "1"),
            "argv": sys.argv[1:] if argv is None else argv}


def run_all(args, plan: list[tuple], out: Path, data: dict) -> None:
    """Run every job in turn, saying how far it got; --json is rewritten after each."""
    print(f"{len(plan)} jobs; runs and logs in {out}", file=sys.stderr, flush=True)
    t0 = time.time()
    for i, (row, lr, k) in enumerate(plan, 1):
        r = run_one(args, row, lr, k, out)
        data["results"].append(r)
        print(f"[{i}/{len(plan)}] lr={lr:g} {ROW_LABEL[row]}" + (f" k={k}" if k else "") +
              f": {_acc_cell(r)} ({r['status']}, job {r['job_time']:.1f} s, "
              f"{(time.time() - t0) / 60:.1f} min so far)", file=sys.stderr, flush=True)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(data, indent=1) + "\n")
    data["total_time"] = time.time() - t0
    if args.json:
        args.json.write_text(json.dumps(data, indent=1) + "\n")


def show(data: dict, plot_prefix: str | None) -> None:
    print_report(data)
    if plot_prefix:
        for path in plot(data, plot_prefix):
            print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
