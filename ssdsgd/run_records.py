"""What a training run writes and logs besides its checkpoints: the ``start`` record,
the ``train`` record and Speedometer line of every log interval (with the stage and lr
they report), and rank 0's ``summary.json`` (the record formats: ``ssdsgd/metrics.py``).

Apart from the training loop (``ssdsgd/train.py``), which calls them with its ``Run``
(``run`` below; not imported, so the imports go one way), so that the loop reads as
set-up, epochs and finish, and what a run reports can be read in one place.
"""
from __future__ import annotations

import logging
import time

import numpy as np

from ssdsgd.checkpoint import checkpoint_bytes
from ssdsgd.metrics import (Speedometer, kv_metrics, net_figures, summarize,
                            throughput_by_membership)
from ssdsgd.settings import count_or_auto
from ssdsgd.sync.auto import K_UNTIMED
from ssdsgd.sync.stage import Stage, plan, syncs_periodically

log = logging.getLogger("ssdsgd.train")


def write_start(run) -> None:
    """The ``start`` record (the progress monitor reads the run's length from it)."""
    c, n = run.config, run.length
    run.writer.write("start", rank=run.rank, num_workers=run.num_workers,
                     steps_per_epoch=n.steps_per_epoch, total_steps=n.total_steps,
                     epochs=c.train.epochs, batch_size=c.data.batch_size,
                     warmup_steps=run.warmup, algorithm=c.sync.algorithm,
                     delay_steps=c.sync.delay_steps, model=c.model.name,
                     dataset=c.data.dataset, kvstore=run.kv is not None,
                     start_epoch=run.start_epoch, start_batch=run.start_batch,
                     start_step=run.step, slowdown=c.debug.slowdown)
    if c.debug.slowdown != "none":
        log.warning("debug.slowdown=%s: straggler injection is on, ranks %s are slowed on "
                    "purpose", c.debug.slowdown,
                    "drawn at random each step" if run.slowdown.kind == "random"
                    else run.slowdown.slow_ranks(0))
    # a joiner's rank is past the job's first N (docs/spec/membership.md rule 1)
    who = (f"rank {run.rank}/{run.num_workers}" if run.rank < run.num_workers else
           f"rank {run.rank} (joining a job of {run.num_workers} workers)")
    log.info("%s: %s on %s, %d samples, %d steps/epoch x %d epochs (%d steps), "
             "batch %d, warm-up %d steps, %s", who, c.model.name,
             c.data.dataset, run.dataset.n_train, n.steps_per_epoch, c.train.epochs,
             n.total_steps, c.data.batch_size, run.warmup,
             "kvstore ssd_sync" if run.kv is not None else "single process (no kvstore)")


def log_interval(run, epoch: int, batch: int) -> None:
    """The ``train`` record and the Speedometer line for the steps since the last one."""
    stats = run.speed.stats()
    m = kv_metrics(run.kv)
    run.writer.write("train", step=run.step, epoch=epoch, batch=batch, **stats,
                     stage=stage_of(run, m), lr=lr_at(run, global_batches(run)),
                     **global_step(run),
                     **net_figures(run.kv, m), elapsed=time.time() - run.t_train)
    if not np.isfinite(stats["loss"]):
        raise FloatingPointError(f"loss is {stats['loss']} at step {run.step} "
                                 "(diverged; lower optimizer.lr?)")
    log.info(Speedometer.line(epoch, batch, stats))
    run.speed.reset()


def stage_of(run, m: dict | None = None):
    """The stage of this worker's last step: the kvstore's own (``m``, its metrics),
    else the schedule's plan for that step; "local" only without a kvstore."""
    if run.kv is None:
        return "local"
    m = kv_metrics(run.kv) if m is None else m
    if "stage" in m:
        return Stage(m["stage"])
    s = run.config.sync          # not the stage machine: ssgd/asgd/preduce, or k pinned
    period = s.sync_period if syncs_periodically(s.algorithm) else \
        count_or_auto(s.delay_steps) or K_UNTIMED      # localsgd, diloco: H in k's place
    return plan(max(run.step - 1, 0), s.algorithm, run.warmup, period).stage


def global_batches(run) -> float:
    """Where the job is in the lr schedule: this worker's steps, or with dynamic data the
    chunks handed out by the last one it took over N (the global batches the servers'
    schedule counts, ssdsgd/mxglue/batch_schedule.py)."""
    feed = getattr(run, "feed", None)
    return run.step if feed is None else feed.position / run.num_workers


def global_step(run) -> dict:
    """With dynamic data a record's ``global_step``: the job's progress in global batches
    (the progress monitor's, ssdsgd/progress.py), as the workers' own steps differ."""
    return {} if getattr(run, "feed", None) is None else {"global_step": int(global_batches(run))}


def lr_at(run, num_update: int) -> float:
    """The lr of update ``num_update``, from a second, identical scheduler: MXNet's are
    stateful, and with a kvstore the servers, not this process, run the real one."""
    if run.lr_view is None:
        return run.config.optimizer.lr
    return float(run.lr_view(num_update))


def write_summary(run, wall: float) -> dict:
    """Rank 0: RUN_DIR/summary.json from its figures and every worker's end record."""
    c, kv, last = run.config, run.kv, run.vals[-1]      # finish() validated
    m = kv_metrics(kv)
    left = m.get("left", [])                             # cluster.on_worker_failure
    base = {
        "name": c.name, "algorithm": c.sync.algorithm if kv is not None else "local",
        "num_workers": run.num_workers,
        "num_servers": c.cluster.servers if kv is not None else 0,
        "model": c.model.name, "dataset": c.data.dataset,
        "batch_size": c.data.batch_size,
        "epochs": round(global_batches(run) / run.length.steps_per_epoch, 3),
        "steps": run.step,       # rank 0's; with dynamic data the others' differ
        "data_assignment": "dynamic" if getattr(run, "feed", None) else "static",
        "steps_per_epoch": run.length.steps_per_epoch, "warmup_steps": run.warmup,
        "delay_steps": m.get("delay_steps", c.sync.delay_steps),
        # what the job chose for the knobs left at auto, and why (sync/auto.py)
        "choices": m.get("choices", {}),
        "final_accuracy": last.get("accuracy"),
        "best_accuracy": max(v["accuracy"] for v in run.vals),
        **({"final_top5": last["top5"]} if "top5" in last else {}),
        "wall_time": wall, "total_time": time.time() - run.t_start,
        "checkpoint_bytes": checkpoint_bytes(run.run_dir),
        "debug_slowdown": run.slowdown.describe(),
        # sync.quorum: auto: whom server 0 left out of the rounds, and when (its record,
        # on the final reply: sync/quorum_rules.py)
        **({"quorum_auto": m["quorum_auto"]} if "quorum_auto" in m else {}),
    }
    # who left: removed when dead or stuck (cluster.on_worker_failure: continue; it writes
    # no end record), or left at a step every worker heard of (docs/spec/membership.md;
    # it ends its part and writes one). A dead worker of a job that takes joiners does
    # both: the servers drop it from one step, its data leaves at a later one (rule 10)
    leaves = m.get("leaves", [])
    data_left = {w["rank"]: w["from_step"] for w in leaves}
    removed = {w["rank"] for w in left}
    base["workers_left"] = [
        {"rank": w["rank"], "from_step": w["from_step"], "time": w["time"] - run.t_train,
         "how": how, **({"data_from_step": data_left[w["rank"]]}
                        if how == "removed" and w["rank"] in data_left else {})}
        for how, ws in (("removed", left), ("left", leaves)) for w in ws
        if how == "removed" or w["rank"] not in removed]
    joined = m.get("joined", [])                         # docs/spec/membership.md
    base["workers_joined"] = [{"rank": w["rank"], "from_step": w["from_step"],
                               "time": w["time"] - run.t_train} for w in joined]
    members = getattr(getattr(run, "feed", None), "members", None)
    if (joined or leaves) and members is not None:
        edges = sorted((w["from_step"], w["time"] - run.t_train) for w in joined + leaves)
        untrained = [(w["from_step"], data_left[w["rank"]]) for w in left
                     if w["rank"] in data_left]          # rule 10: E..s-1 never trained
        base["throughput_by_membership"] = spans = throughput_by_membership(
            members, edges, wall, c.data.batch_size, untrained)
        log.info("throughput by membership (samples the servers applied per second of "
                 "wall time): %s", "; ".join(
                     f"{s['workers']} workers, steps {s['from_step']}-{s['to_step'] - 1}: "
                     + ("-" if s["samples_per_sec"] is None
                        else f"{s['samples_per_sec']:.1f} samples/s") for s in spans))
    summary = summarize(run.run_dir, base,
                        wait_for=run.num_workers + len(joined) - len(left))
    log.info("done: test accuracy %.4f after %d steps, %.1f s; checkpoints %.1f MB; "
             "summary in %s", last["accuracy"], run.step, wall,
             base["checkpoint_bytes"] / 1e6, run.run_dir / "summary.json")
    return summary
