"""Compare runs: a table and accuracy plots.

    python -m ssdsgd.report RUN_DIR [RUN_DIR ...] [--out DIR]
    python -m ssdsgd.report RUN_DIR --timeline


Prints one row per run (final and best test accuracy, training wall time, job
throughput, bytes moved by the workers, mean time a worker was blocked on the network)
and writes two PNG plots, test accuracy vs wall-clock time and vs epoch, one line per
run; prints their paths. A run without summary.json (still running, or crashed) is
reported from its metrics files and marked "incomplete". The default output directory
is ``report/`` next to the (first) run directory.

With ``--timeline`` it merges each run's per-process timeline instead (a job run with
``train.timeline``; ``ssdsgd/timeline_merge.py``): RUN_DIR/timeline.json, a Chrome trace,
RUN_DIR/timeline.png, one lane per rank, and the slowest rank with how long the others
waited for it, also added to summary.json.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from ssdsgd.metrics import read_records, worker_files


class ReportError(ValueError):
    pass


def load_run(run_dir) -> dict:
    """Everything the report needs from one run directory."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: not a run directory")
    files = worker_files(run_dir)
    summary_path = run_dir / "summary.json"
    if not files and not summary_path.exists():
        raise ReportError(f"{run_dir}: no metrics/worker-*.jsonl and no summary.json "
                          "(not a run directory?)")
    summary = {}
    if summary_path.exists():
        try:
            summary = json.loads(summary_path.read_text())
        except json.JSONDecodeError as exc:
            raise ReportError(f"{summary_path}: not valid JSON ({exc.msg} at line "
                              f"{exc.lineno})") from None
    records = {rank: read_records(p) for rank, p in files.items()}
    # the chief's validations: worker 0's, and after it left the job the next chief's
    # (docs/spec/membership.md rule 8), each epoch from the lowest rank that has it
    by_epoch = {}
    for rank in sorted(records):
        for v in validation_curve(records[rank]):
            by_epoch.setdefault(v.get("epoch"), v)
    val = [by_epoch[e] for e in sorted(by_epoch, key=lambda e: (e is None, e))]
    starts = [r for recs in records.values() for r in recs if r.get("event") == "start"]
    ends = [r for recs in records.values() for r in recs if r.get("event") == "end"]
    algorithm = summary.get("algorithm") or (
        (starts[0]["algorithm"] if starts[0].get("kvstore") else "local") if starts else None)
    run = {
        "dir": run_dir, "label": run_dir.name, "complete": bool(summary),
        "algorithm": algorithm,
        "num_workers": summary.get("num_workers") or (starts[0].get("num_workers")
                                                      if starts else None),
        "val": val,
        "final_accuracy": summary.get("final_accuracy", val[-1]["accuracy"] if val else None),
        "best_accuracy": summary.get("best_accuracy", max((v["accuracy"] for v in val),
                                                          default=None)),
        "wall_time": summary.get("wall_time", val[-1].get("elapsed") if val else None),
    }

    def total(key):
        vals = [e.get(key) for e in ends]
        return None if not ends or any(v is None for v in vals) else sum(vals)
    run["samples_per_sec"] = summary.get("samples_per_sec", total("samples_per_sec"))
    sent = summary.get("bytes_sent", total("bytes_sent"))
    recv = summary.get("bytes_received", total("bytes_received"))
    run["bytes"] = None if sent is None or recv is None else sent + recv
    blocked = summary.get("time_blocked")
    if blocked is None and ends and all(e.get("time_blocked") is not None for e in ends):
        blocked = sum(e["time_blocked"] for e in ends) / len(ends)
    run["time_blocked"] = blocked
    return run


def validation_curve(records: list[dict]) -> list[dict]:
    """The val records of one worker file, one per epoch (a resumed run repeats epochs:
    the later record wins) with ``elapsed`` continued across resumes."""
    by_epoch: dict = {}
    offset = last_elapsed = 0.0
    for r in records:
        if r.get("event") == "start" and last_elapsed:
            offset, last_elapsed = offset + last_elapsed, 0.0
        elif r.get("event") in ("train", "val") and r.get("elapsed") is not None:
            last_elapsed = r["elapsed"]
            if r["event"] == "val":
                by_epoch[r.get("epoch")] = dict(r, elapsed=offset + r["elapsed"])
    return [by_epoch[e] for e in sorted(by_epoch, key=lambda e: (e is None, e))]


def _fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return str(n)


def _fmt(value, spec) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def table(runs: list[dict]) -> str:
    head = ["run", "algorithm", "N", "final acc", "best acc", "time (s)", "samples/s",
            "bytes moved", "blocked (s)"]
    rows = []
    for r in runs:
        rows.append([r["label"] + ("" if r["complete"] else " (incomplete)"),
                     r["algorithm"] or "-", _fmt(r["num_workers"], "d"),
                     _fmt(r["final_accuracy"], ".4f"), _fmt(r["best_accuracy"], ".4f"),
                     _fmt(r["wall_time"], ".1f"), _fmt(r["samples_per_sec"], ".1f"),
                     _fmt_bytes(r["bytes"]), _fmt(r["time_blocked"], ".2f")])
    return text_table(head, rows)


def text_table(head: list[str], rows: list[list]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned, a
    rule of dashes under the header (also used by bench/)."""
    rows = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(head)]

    def line(cells):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def plot(runs: list[dict], out_dir) -> list[Path]:
    """accuracy_vs_time.png and accuracy_vs_epoch.png in ``out_dir``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for xkey, xlabel, name in (("elapsed", "wall-clock time (s)", "accuracy_vs_time.png"),
                               ("epoch", "epoch", "accuracy_vs_epoch.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
        for r in runs:
            pts = [(v.get(xkey), v.get("accuracy")) for v in r["val"]
                   if v.get(xkey) is not None and v.get("accuracy") is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, markersize=3,
                        label=f"{r['label']} ({r['algorithm'] or '?'})")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy (top-1)")
        ax.grid(True, alpha=0.3)
        if any(r["val"] for r in runs):
            ax.legend(fontsize=8)
        ax.set_title(f"test accuracy vs {xlabel.split(' (')[0]}")
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def finished_run(run_dir, out_dir=None, plots=True) -> list[str]:
    """For the launcher at the end of a job: write the run's two plots (default
    ``RUN_DIR/plots/``; none without ``plots``, which spares importing matplotlib) and
    return the lines to print: the final test accuracy, then ``plot: PATH`` for each
    plot."""
    run = load_run(run_dir)
    acc = run["final_accuracy"]
    summary_path = Path(run_dir) / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    text = "test accuracy " + (f"{acc:.4f}" if acc is not None else "n/a")
    if summary.get("final_top5") is not None:
        text += f" (top-5 {summary['final_top5']:.4f})"
    facts = []
    if summary.get("epochs") is not None and summary.get("steps") is not None:
        e = summary["epochs"]
        facts.append(f"{e:g} epoch{'' if e == 1 else 's'}, {summary['steps']} steps")
    if run["wall_time"] is not None:
        facts.append(f"training {run['wall_time']:.1f} s")
    if run["samples_per_sec"]:
        facts.append(f"{run['samples_per_sec']:.0f} samples/s")
    if summary.get("debug_slowdown", "off") != "off":
        facts.append(f"debug.slowdown {summary['debug_slowdown']}")
    lines = [text + (f" ({', '.join(facts)})" if facts else "") +
             (f"; summary: {summary_path}" if summary else "")]
    if plots:
        for p in plot([run], Path(out_dir) if out_dir else Path(run_dir) / "plots"):
            lines.append(f"plot: {p}")
    return lines


def timelines(run_dirs) -> int:
    """``--timeline``: merge each run's timeline and print what it found."""
    from ssdsgd.timeline_merge import TimelineError, lines, merge
    for run_dir in run_dirs:
        try:
            out = merge(run_dir)
        except (TimelineError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print("\n".join(lines(out)))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ssdsgd.report",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", metavar="RUN_DIR")
    ap.add_argument("--out", help="where to write the PNG plots (default: report/ next to "
                    "the first run directory)")
    ap.add_argument("--timeline", action="store_true", help="merge each run's timeline "
                    "(train.timeline) into RUN_DIR/timeline.json and timeline.png")
    args = ap.parse_args(argv)
    if args.timeline:
        return timelines(args.runs)
    try:
        runs = [load_run(d) for d in args.runs]
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(runs))
    if args.out:
        out = Path(args.out)
    else:
        parents = {r["dir"].resolve().parent for r in runs}
        out = (Path(os.path.commonpath([str(p) for p in parents])) if len(parents) > 1
               else parents.pop()) / "report"
    for p in plot(runs, out):
        print(f"plot: {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
