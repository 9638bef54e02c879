"""Where an ssd step blocks, by its place in the pull period, for runs of two commits
(docs/benchmarks/push_path.md: the push taken off the training thread, issue 25).

A matrix run of ``bench.cluster`` keeps every timed step's blocked seconds (averaged over
the workers) in its raw ``results.json``. In the steps-delay stage with aligned pulls,
timed step i (step T_w + i, the harness's warm-up being T_w) is one of three kinds, which
block for different things:

    pulls    i mod k = k - 1: its push asks for w_G (sent before the step returns)
    resets   i mod k = 0, i > 0: waits for the pull asked one step before, then resets
    plain    the others: nobody waits for its push in this step

Only ``plain`` steps can stop waiting for their push altogether, so they show the change.
Two commits cannot run in one invocation, so run the same command on each, back to back
(and once more, the machine being shared), then compare:

    sudo nice -n 5 .venv/bin/python -m bench.cluster --only matrix \\
        --workloads emulated:resnet50@1gbit --systems ssd-k5,ssd-k5-2bit --steps 20 \\
        --no-write --raw /tmp/RUN                       # once per commit and repeat
    .venv/bin/python -m bench.push_path before-1=/tmp/RUN1 after-1=/tmp/RUN2 \\
        before-2=/tmp/RUN3 after-2=/tmp/RUN4 [--plot docs/benchmarks/push_path.png]
"""
import argparse
import json
import statistics
from pathlib import Path

KINDS = ("plain", "pulls", "resets")


def kind(i, k):
    """The kind of timed step ``i`` with pull period ``k`` (aligned pulls)."""
    if i % k == k - 1:
        return "pulls"
    return "resets" if i % k == 0 and i > 0 else "plain"


def rows(raw):
    """The ssd rows of a run's matrix (aligned pulls only: staggered ones have a phase per
    worker, and the averaged steps would mix the kinds)."""
    results = json.loads((Path(raw) / "results.json").read_text())
    for group in results.get("matrix", []):
        for row in group["rows"]:
            if row.get("k") and row.get("pull_schedule") == "aligned" \
                    and row.get("blocked_steps_s"):
                yield row


def by_kind(row):
    """Median blocked seconds of each kind of step in one row."""
    out = {}
    for name in KINDS:
        steps = [b for i, b in enumerate(row["blocked_steps_s"]) if kind(i, row["k"]) == name]
        out[name] = statistics.median(steps) if steps else None
    return out


def table(runs):
    """runs: [(label, raw dir)] -> one line per (run, row)."""
    lines = ["| run | system | plain steps: blocked s | pulling steps | resetting steps | "
             "samples/s | s/step |", "|---|---|---|---|---|---|---|"]
    for label, raw in runs:
        for row in rows(raw):
            b = by_kind(row)
            cells = [f"{b[n]:.3f}" if b[n] is not None else "-" for n in KINDS]
            lines.append(f"| {label} | {row['label']} | " + " | ".join(cells)
                         + f" | {row['samples_per_s']:.1f} | {row['step_s']:.3f} |")
    return "\n".join(lines)


def plot(runs, path):
    """Per system: the median blocked seconds of plain steps (top) and samples/s (bottom)
    of each pair of runs, labelled SERIES-PAIR (before-1, after-1, ...)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    points = {}     # system -> series -> [(pair, plain, samples/s)]
    pairs = []
    for label, raw in runs:
        series, _, pair = label.partition("-")
        pairs += [pair] if pair not in pairs else []
        for row in rows(raw):
            points.setdefault(row["label"], {}).setdefault(series, []).append(
                (pairs.index(pair), by_kind(row)["plain"], row["samples_per_s"]))
    fig, axes = plt.subplots(2, len(points), figsize=(5.5 * len(points), 6), squeeze=False,
                             sharex=True)
    for col, (system, by_series) in enumerate(sorted(points.items())):
        for series, pts in by_series.items():
            x = [p[0] for p in pts]
            axes[0][col].plot(x, [p[1] for p in pts], "o-", label=series)
            axes[1][col].plot(x, [p[2] for p in pts], "o-", label=series)
        axes[0][col].set_title(system)
        axes[0][col].set_ylabel("plain step: blocked s (median)")
        axes[1][col].set_ylabel("samples/s")
        axes[1][col].set_xticks(range(len(pairs)), pairs)
        axes[1][col].set_xlabel("pair of runs (one invocation each, back to back)")
        for ax in axes[:, col]:
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.push_path",
                                description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", metavar="LABEL=RAW",
                   help="a label (SERIES-PAIR for --plot: before-1, after-1, ...) and a "
                   "bench.cluster --raw directory")
    p.add_argument("--plot", help="write the per-step figure here (PNG)")
    args = p.parse_args(argv)
    runs = [tuple(r.split("=", 1)) for r in args.runs]
    print(table(runs))
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
