"""The worker-side training program.

    python -m ssdsgd.train CONFIG [--set KEY=VALUE ...] [--run-dir DIR] [--resume RUN_DIR]

By hand (no ``SSDSGD_ROLE`` in the environment) it trains in one process without a
kvstore. Started by the launcher (``SSDSGD_ROLE=worker``) it creates the registered
kvstore ``ssd_sync`` and takes its rank and the number of workers from it; the stock
``gluon.Trainer`` then pushes gradients and pulls weights through it.

Each worker trains on its own disjoint shard of every epoch (ssdsgd.data.shard_indices),
and all workers run the same number of steps per epoch; with dynamic data
(``data.assignment``, docs/spec/dynamic_data.md) the scheduler hands each epoch's batches
to whichever worker asks next (ssdsgd.data.dynamic), until the job's budget of batches
is spent, so a fast worker trains more of them. Rank 0 (the chief: after worker 0
left the job or was removed, the lowest rank still in it, ``is_chief``) validates
after every epoch on the whole validation set (top-1; top-5 for ImageNet) with its current weights
(in the steps-delay stage: its local weights, at most k steps from the last global
pull), writes checkpoints (ssdsgd.checkpoint), and at the end ``RUN_DIR/summary.json``.

The program in three parts over one :class:`Run`: ``set_up`` (join the job, data, model,
Trainer, resume), ``run_epoch`` (one epoch, then validation and a due checkpoint) and
``finish`` (the global model, last validation and checkpoint, the summary). The records
and log lines a run writes besides checkpoints are ``ssdsgd/run_records.py``'s.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import time
from pathlib import Path

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

from ssdsgd.checkpoint import (RunLength, check_unfinished, checkpoint_info, load_checkpoint,
                               load_local_params, pull_global, record_checkpoint, run_length,
                               save_local_params, save_params, save_states, worker_state_name)
from ssdsgd.config import (Config, ConfigError, load_config, new_run_dir,
                           resolve_warmup_steps, save_config)
from ssdsgd.data import DataError, Loader, count_train, open_dataset, steps_per_epoch
from ssdsgd.data.dynamic import ChunkFeed, chunk_plan
from ssdsgd.data.membership_feed import MembershipFeed
from ssdsgd.kvstore.compression import parse_setting as parse_compression
from ssdsgd.metrics import MetricsWriter, Speedometer, kv_metrics, net_figures
from ssdsgd.models import build_model, initializer
from ssdsgd.recipe import (build_lr_scheduler, contexts, create_kvstore, evaluate,
                           gradient_batch, optimizer_params, seed_everything)
from ssdsgd.run_records import global_step, log_interval, stage_of, write_start, write_summary
from ssdsgd.settings import dynamic_data
from ssdsgd.slowdown import Slowdown
from ssdsgd.sync.stage import Stage

log = logging.getLogger("ssdsgd.train")


# ----------------------------------------------------------------------------- training

@dataclasses.dataclass
class Run:
    """One worker's training run: what set_up builds, and the position run_epoch
    advances (``step`` = steps done, counted from the start of the job)."""
    config: Config
    run_dir: Path
    kv: object                # the 'ssd_sync' kvstore; None by hand
    rank: int
    num_workers: int
    dataset: object
    length: RunLength
    warmup: int               # T_w, in steps
    ctx: list
    net: object
    trainer: object
    grad_batch: int
    lr_view: object           # a copy of the lr scheduler, only to report the lr
    t_start: float            # when train() was called
    writer: MetricsWriter | None = None
    loader: Loader | None = None
    feed: ChunkFeed | None = None      # dynamic data: the scheduler's chunks (else None)
    start_epoch: int = 0
    start_batch: int = 0      # the data position in start_epoch (a mid-epoch checkpoint)
    step: int = 0
    samples: int = 0
    vals: list = dataclasses.field(default_factory=list)
    speed: Speedometer = dataclasses.field(default_factory=Speedometer)
    loss_fn: object = dataclasses.field(default_factory=gluon.loss.SoftmaxCrossEntropyLoss)
    t_train: float = 0.0      # when the first epoch started
    t_checkpoint: float = 0.0  # when the last checkpoint was taken (checkpoint_every_s)
    slowdown: Slowdown | None = None   # debug.slowdown: straggler injection, off by default


def train(config: Config, run_dir, resume: bool = False) -> dict:
    """Train as configured; return the chief's summary (other ranks: their end record;
    the chief is rank 0 unless it left or was removed: ``is_chief``).

    The loader, the metrics file and the kvstore are closed once, in that order, also on
    an error: closing the kvstore leaves the job, so rank 0 does it after its summary."""
    with contextlib.ExitStack() as closing:
        run = set_up(config, Path(run_dir), resume, closing)
        for epoch in range(run.start_epoch, run.length.last_epoch + 1):
            run_epoch(run, epoch)
            if run.feed is not None and run.feed.over:
                break           # the job's budget is spent (docs/spec/dynamic_data.md)
        if run.feed is not None and run.feed.over == "left":   # docs/spec/membership.md
            log.info("rank %d left the job at step %d (the others go on)", run.rank,
                     run.feed.left_at())
        return finish(run)


def set_up(config: Config, run_dir: Path, resume: bool, closing) -> Run:
    """Join the job (worker mode), open the data, build the model and the Trainer,
    load the checkpoint when resuming, open the metrics file and the loader; each thing
    that must be closed is handed to ``closing``."""
    t_start = time.time()
    seed_everything(config.train.seed)
    info = checkpoint_info(run_dir) if resume else None
    spe_cluster = steps_per_epoch(config, config.cluster.workers, count_train(config))
    dataset = open_dataset(config)
    kv, rank, num_workers = create_kvstore(config, spe_cluster, info["step"] if info else 0,
                                           dataset)
    if kv is not None:
        closing.callback(kv.close)
        if num_workers != config.cluster.workers:
            log.warning("kvstore reports %d workers, config cluster.workers is %d",
                        num_workers, config.cluster.workers)
    length = run_length(config, num_workers, dataset.n_train)
    if info:
        check_unfinished(run_dir, info, length)
    ctx = contexts(config)
    net, trainer = build_trainer(config, kv, dataset, length, ctx)
    run = Run(config, run_dir, kv, rank, num_workers, dataset, length,
              resolve_warmup_steps(config, length.steps_per_epoch), ctx, net, trainer,
              gradient_batch(config, kv, num_workers),
              build_lr_scheduler(config, length.steps_per_epoch), t_start=t_start)
    run.slowdown = Slowdown(config.debug.slowdown, rank, num_workers)
    if info:
        resume_from(run, info)
    joined = getattr(kv, "joined_from", None)
    if joined is not None:      # launch/dist.py --join: from step s, at w_G(s - 1)
        run.step = joined
    run.writer = MetricsWriter(run_dir, rank)
    closing.callback(run.writer.close)
    write_start(run)
    run.loader = Loader(dataset, config.train.seed, config.data.loader_threads)
    closing.callback(run.loader.close)
    run.feed = open_feed(run, info)
    if joined is not None:
        start_joiner(run, joined)
    run.t_train = run.t_checkpoint = time.time()
    return run


def start_joiner(run: Run, joined: int) -> None:
    """A joiner's first step s (docs/spec/membership.md rule 5): the servers' weights as of
    s - 1 before its first gradient; none if the budget is spent before s (a join
    decided at a pull boundary after the job's last step): it trains nothing and says so."""
    run.start_epoch = run.feed.first_epoch()
    if run.feed.where(joined) is None:
        log.info("rank %d joined at step %d, after the job's last step (%d): nothing to "
                 "train", run.rank, joined, run.feed.members.end() - 1)
        return
    # the shapes (one forward pass), then the servers' weights before the first
    # gradient, which the Trainer would otherwise fetch only at its first step
    x0, _ = run.dataset.train_batch(np.arange(1), np.random.default_rng(0))
    run.net(mx.nd.array(x0, ctx=run.ctx[0]))
    # the optimizer the servers have, rescaled as Trainer.step would (it refuses a change)
    trainer = run.trainer
    trainer._optimizer.rescale_grad = trainer._scale / run.grad_batch  # noqa: SLF001
    trainer._init_kvstore()   # noqa: SLF001
    trainer._init_params()    # noqa: SLF001


def takes_joiners(config: Config) -> bool:
    """cluster.max_workers above the workers (docs/spec/membership.md): the batches
    follow the membership, and checkpoints are taken at steps every member computes
    alike (a join moves the workers' epoch ends apart: ``membership_checkpoint_due``)."""
    return (config.cluster.max_workers or 0) > config.cluster.workers


def open_feed(run: Run, info: dict | None) -> ChunkFeed | None:
    """Dynamic data's feed if ``data.assignment`` chooses it (by hand, with no kvstore,
    the one process's static shard is the whole epoch), starting at the checkpoint's
    cursor when resuming (an epoch end: dynamic data checkpoints nowhere else)."""
    c = run.config
    per_epoch = run.length.steps_per_epoch * run.num_workers
    if run.kv is not None and takes_joiners(c):
        step, start = 0, 0
        if info is not None:       # docs/spec/membership.md rule 11
            if "members" not in info:
                raise DataError(f"{run.run_dir}: its checkpoint is of a job that took no "
                                "joiners (its data followed other shards); resume it without "
                                "cluster.max_workers")
            step, start = info["step"], info["chunks"]
        return MembershipFeed(run.kv, run.dataset, c.train.seed, c.data.batch_size,
                              chunk_plan(per_epoch, run.length.total_steps, run.num_workers,
                                         start), run.rank, run.num_workers, lambda: run.step,
                              start_step=step)
    if info is not None and "members" in info:
        raise DataError(f"{run.run_dir}: its checkpoint is of a job that took joiners (its "
                        "data followed the membership); resume it with the same "
                        "cluster.max_workers")
    if run.kv is None or not dynamic_data(c.data.assignment, c.sync.algorithm,
                                          c.sync.quorum, run.num_workers):
        return None
    start = run.start_epoch * per_epoch
    if info is not None and info.get("chunks") is not None:
        start = info["chunks"]          # checked by checkpoint_info
    elif run.start_batch:
        raise DataError(f"{run.run_dir}: a mid-epoch checkpoint of static data cannot be "
                        "resumed with dynamic data (data.assignment: static resumes it)")
    return ChunkFeed(run.kv, run.dataset, c.train.seed, c.data.batch_size,
                     chunk_plan(per_epoch, run.length.total_steps, run.num_workers, start),
                     pause_due=lambda: pause_due(run),
                     on_pause=lambda at: checkpoint_chunks(run, at=at))


def build_trainer(config: Config, kv, dataset, length: RunLength, ctx):
    """(net, gluon.Trainer): the initialized model and a stock Trainer over ``kv`` (by
    hand: 'device' on several devices, else none)."""
    net = build_model(config.model.name, dataset.num_classes)
    net.initialize(initializer(config.model.name), ctx=ctx)
    if config.model.hybridize:
        net.hybridize(static_alloc=True, static_shape=True)
    store = kv if kv is not None else ("device" if len(ctx) > 1 else None)
    sched = build_lr_scheduler(config, length.steps_per_epoch)
    # pushes are compressed on ssd_sync only (one process alone has nothing to push)
    compression = parse_compression(config.sync.compression) if kv is not None else None
    trainer = gluon.Trainer(net.collect_params(), config.optimizer.name,
                            optimizer_params(config, sched), kvstore=store,
                            compression_params=compression)
    return net, trainer


def resume_from(run: Run, info: dict) -> None:
    """Load the checkpoint ``info`` and continue at its data position and step."""
    # one forward pass materializes deferred shapes before the parameters are loaded
    x0, _ = run.dataset.train_batch(
        np.arange(min(run.config.data.batch_size, run.dataset.n_train)),
        np.random.default_rng(0))
    run.net(mx.nd.array(x0[:1], ctx=run.ctx[0]))
    load_checkpoint(run.run_dir, info, run.net, run.trainer, run.ctx, run.grad_batch)
    run.start_epoch, run.step = int(info["next_epoch"]), int(info["step"])
    run.start_batch = int(info.get("next_batch", 0))
    name = worker_state_name(info, run.rank, run.num_workers)
    if run.kv is not None and name:
        if not run.trainer._kv_initialized:  # noqa: SLF001 - no states file: not yet
            run.trainer._init_kvstore()      # noqa: SLF001
        try:
            run.kv.load_worker_state(str(run.run_dir / "checkpoints" / name))
            load_local_params(run.net, run.run_dir / "checkpoints" / name.replace(
                ".npz", ".local.params"), run.ctx)
        except (OSError, ValueError, KeyError) as exc:
            raise DataError(f"{run.run_dir / 'checkpoints' / name}: cannot restore this "
                            f"worker's state ({exc})") from None
    log.info("resumed from %s at epoch %d, batch %d, step %d%s", run.run_dir / "checkpoints",
             run.start_epoch, run.start_batch, run.step,
             " with this worker's own state" if name else "")


def run_epoch(run: Run, epoch: int) -> None:
    """This worker's shard of one epoch; then, on rank 0, validation and a due
    checkpoint (but for the last epoch: finish() does those on the global model)."""
    run.speed.reset()
    whole = Speedometer()
    c = run.config
    first = run.start_batch if epoch == run.start_epoch else 0
    batches = (run.feed.epoch(epoch) if run.feed is not None else run.loader.epoch(
        epoch, run.rank, run.num_workers, c.data.batch_size, start_step=first))
    for batch, (x, y) in batches:
        figures = train_step(run, x, y)
        run.speed.update(*figures)
        whole.update(*figures)
        if ((batch + 1) % c.train.log_interval == 0 or run.step == run.length.total_steps
                or batch + 1 == run.length.steps_per_epoch < c.train.log_interval):
            log_interval(run, epoch, batch + 1)   # an epoch shorter than log_interval: once
        if run.feed is None and run.step >= run.length.total_steps:
            break               # dynamic data: the scheduler says when the budget is spent
        if isinstance(run.feed, MembershipFeed):
            if membership_checkpoint_due(run):
                checkpoint_membership(run)
        elif (run.feed is None and batch + 1 < run.length.steps_per_epoch
              and (batch + 1) % c.train.log_interval == 0 and time_for_checkpoint(run)):
            checkpoint(run, epoch, batch + 1)     # dynamic data's: at the dealer's pause
    ep = whole.stats()
    log.info("Epoch[%d] Train-accuracy=%.6f loss=%.4f Speed: %.1f samples/sec", epoch,
             ep["accuracy"], ep["loss"], ep["samples_per_sec"])
    if epoch < run.length.last_epoch and not (run.feed is not None and run.feed.over):
        if is_chief(run):
            validate(run, epoch)
        if wants_checkpoint(run, epoch):
            checkpoint(run, epoch + 1, 0)


def is_chief(run: Run) -> bool:
    """Does this worker do the chief's part now (validation, the checkpoint's global
    model and record, the checkpoint clock, the summary)? The lowest rank in the job not
    removed as far as this worker has heard (cluster.on_worker_failure: continue: a dead
    worker 0 is removed like any rank, and every worker hears of it): worker 0 until then.
    In a job that takes joiners (docs/spec/membership.md rule 8) the lowest such rank in
    the job at its next step, which every worker computes alike from the membership:
    worker 0 until it leaves, then the next. A worker that left is nobody's chief."""
    removed = {w["rank"] for w in kv_metrics(run.kv).get("left", ())}
    if isinstance(run.feed, MembershipFeed):
        if run.feed.over == "left":
            return False
        run.feed.where(run.step)          # the changes heard of until that step
        return run.feed.members.chief(run.step, removed) == run.rank
    return run.rank == min(set(range(run.num_workers)) - removed, default=None)


def train_step(run: Run, x, y) -> tuple[int, float, int]:
    """One step: forward, backward, Trainer.step; (samples, loss sum, correct)."""
    t0 = time.perf_counter()
    xs = gluon.utils.split_and_load(mx.nd.array(x), run.ctx, even_split=False)
    ys = gluon.utils.split_and_load(mx.nd.array(y), run.ctx, even_split=False)
    with autograd.record():
        outs = [run.net(xi) for xi in xs]
        losses = [run.loss_fn(o, yi) for o, yi in zip(outs, ys)]
    autograd.backward(losses)
    if run.slowdown is not None and run.slowdown.kind != "none":
        if run.slowdown.measures_compute:
            mx.nd.waitall()
        run.slowdown.after_compute(run.step, time.perf_counter() - t0)
    run.trainer.step(run.grad_batch)
    run.step += 1
    run.samples += len(y)
    loss_sum = sum(float(l.sum().asscalar()) for l in losses)
    correct = sum(int((o.argmax(axis=1) == yi.astype(o.dtype)).sum().asscalar())
                  for o, yi in zip(outs, ys))
    return len(y), loss_sum, correct


def validate(run: Run, epoch: int) -> None:
    """The chief (rank 0, ``is_chief``): the validation figures after ``epoch``, recorded and logged (the others
    may wait for it: the stall watch does not count it, kvstore/liveness.py)."""
    with run.kv.busy() if run.kv is not None else contextlib.nullcontext():
        res = evaluate(run.net, run.dataset, run.ctx, run.config.data.batch_size)
    run.vals.append(res)
    elapsed = time.time() - run.t_train
    run.writer.write("val", epoch=epoch + 1, step=run.step, **res, elapsed=elapsed)
    log.info("Epoch[%d] Validation %s time=%.1fs", epoch,
             " ".join(f"{k}={v:.6f}" for k, v in res.items()), elapsed)


def wants_checkpoint(run: Run, epoch: int) -> bool:
    """Every train.checkpoint_every epochs and after the last one; never when it is 0;
    in a job that takes joiners after the last one only here (its others are where the
    chunks pass an epoch end: ``membership_checkpoint_due``)."""
    every = run.config.train.checkpoint_every
    if takes_joiners(run.config) and epoch != run.length.last_epoch:
        return False
    return bool(every) and ((epoch + 1) % every == 0 or epoch == run.length.last_epoch)


def time_for_checkpoint(run: Run, step: int | None = None) -> bool:
    """Every train.log_interval steps with train.checkpoint_every_s set: has rank 0's
    clock passed it since the last checkpoint? Rank 0 decides and every worker hears
    the decision at a barrier (kv.barrier(value)), so all checkpoint at the same step
    (with ``step``: the barrier of the workers in the job at that step)."""
    every = run.config.train.checkpoint_every_s
    if not every:
        return False
    due = int(is_chief(run) and time.time() - run.t_checkpoint >= every)
    if run.kv is not None:
        due = run.kv.barrier(due) if step is None else run.kv.barrier(due, step=step)
    return bool(due)


def pause_due(run: Run) -> bool:
    """Dynamic data, worker 0: does its clock ask for a mid-epoch checkpoint (the
    dealer's pause, docs/spec/dynamic_data.md rule 7)? Only past the warm-up: in ssd
    with k auto every worker agrees at its last warm-up step (a barrier), and worker 0
    past it means every worker is."""
    every = run.config.train.checkpoint_every_s
    return bool(run.rank == 0 and every and run.step > run.warmup
                and time.time() - run.t_checkpoint >= every)


def membership_checkpoint_due(run: Run) -> bool:
    """A job that takes joiners (docs/spec/membership.md rule 11), once step t - 1 is
    done: a checkpoint is due where the chunks before t pass the end of every
    train.checkpoint_every-th epoch, which every worker in the job at t - 1 computes
    alike from the membership; or, every train.log_interval steps, by rank 0's clock
    (train.checkpoint_every_s) at a barrier of the workers in the job at t - 1."""
    t, c = run.step, run.config.train
    if run.feed.over or run.feed.where(t) is None:
        return False          # this worker's last step (it leaves, or the budget is spent)
    if run.feed.members.checkpoint_due(t, c.checkpoint_every):
        return True
    return t % c.log_interval == 0 and time_for_checkpoint(run, step=t - 1)


def checkpoint_membership(run: Run) -> None:
    """A job that takes joiners, at step t (every worker in the job at t - 1 is here):
    the data position is the chunks before t, G(t). Worker states are kept when the
    members at t are the job's first workers (a resumed job starts with those and is
    exact then); otherwise a resume starts every worker from the global model."""
    members = run.feed.members
    chunks = members.first_chunk(run.step)
    per_epoch = run.feed.plan["per_epoch"]
    now = members.members(run.step)
    checkpoint(run, chunks // per_epoch, chunks % per_epoch, cursor={"chunks": chunks,
                                                                      "members": now},
               barrier_step=run.step - 1, keep_states=now == members.first)


def checkpoint(run: Run, next_epoch: int, next_batch: int, cursor: dict | None = None, *,
               barrier_step: int | None = None, keep_states: bool = True) -> None:
    """Every worker, between two steps (the same step on all): a checkpoint whose data
    position is (next_epoch, next_batch). Each worker saves its own state; rank 0 the
    global model (in the steps-delay stage and in localsgd's and diloco's local steps its
    own weights are local ones: it pulls the servers'), the servers' optimizer states, and,
    once every worker has saved (a barrier), latest.json, which names them all. Dynamic
    data: checkpoint_chunks; a job that takes joiners: ``cursor``, the record's data
    position, its barrier that of ``barrier_step``, worker states only if ``keep_states``
    (checkpoint_membership)."""
    cursor = cursor or {}
    if run.feed is not None and not cursor:
        return checkpoint_chunks(run, next_epoch)
    chief = is_chief(run)
    stem = (f"epoch-{next_epoch - 1:04d}" if next_batch == 0 and not cursor
            else f"step-{run.step:08d}")
    ck = run.run_dir / "checkpoints"
    ck.mkdir(parents=True, exist_ok=True)
    if run.kv is not None and keep_states:
        run.kv.save_worker_state(str(ck / f"{stem}.worker-{run.rank}.npz"))
        save_local_params(run.net, ck / f"{stem}.worker-{run.rank}.local.params")
    if chief:
        weights = (pull_global(run.kv, run.trainer, into_params=False)
                   if run.kv is not None and stage_of(run) in (Stage.STEPS_DELAY,
                                                               Stage.LOCAL_STEPS) else None)
        states = save_states(run.run_dir, run.net, run.trainer, stem)
        params = save_params(run.run_dir, run.net, stem, weights)
    if run.kv is not None:
        run.kv.barrier() if barrier_step is None else run.kv.barrier(step=barrier_step)
    if chief:
        record_checkpoint(run.run_dir, dict(
            epoch=next_epoch - 1 if next_batch == 0 else next_epoch, next_epoch=next_epoch,
            next_batch=next_batch, step=run.step, seed=run.config.train.seed,
            params=params.name, **states,   # after a worker left: the global model
            workers=run.num_workers if run.kv is not None and keep_states and not kv_metrics(
                run.kv).get("left") else 0, **cursor), keep=run.config.train.keep_checkpoints,
            accuracy=run.vals[-1]["accuracy"] if next_batch == 0 and run.vals else None)
        run.writer.write("checkpoint", epoch=next_epoch, batch=next_batch, step=run.step,
                         path=str(params))
    run.t_checkpoint = time.time()


def checkpoint_chunks(run: Run, next_epoch: int | None = None, at: int | None = None) -> None:
    """Dynamic data's checkpoint, at the end of epoch ``next_epoch - 1`` on every worker,
    or mid-epoch at the dealer's pause with the cursor ``at`` (docs/spec/dynamic_data.md
    rule 7: no chunk is handed out past it until the barrier). Once all are there (a
    barrier: every chunk handed out is trained and its push applied; a quorum's rounds
    are closed, quorum.md rule 5), every worker takes the servers' model into its
    parameters (but in ssd's steps-delay stage, whose local weights are its own) and
    rank 0 saves it, the servers' optimizer states and the cursor (the chunks handed
    out): what a job resumed from it starts from. No worker states: the workers' step
    counts differ, so the record's step is the global batches done (chunks / N), the
    count the servers' lr schedule resumes at."""
    plan = run.feed.plan
    if at is None:
        stem, chunks = f"epoch-{next_epoch - 1:04d}", min(next_epoch * plan["per_epoch"],
                                                           plan["budget"])
        epoch, next_batch = next_epoch - 1, 0
    else:
        stem, chunks = f"chunk-{at:08d}", at
        epoch, next_batch = divmod(at, plan["per_epoch"])
        next_epoch = epoch
    run.kv.barrier()
    synchronous = stage_of(run) != Stage.STEPS_DELAY
    if synchronous or run.rank == 0:
        weights = pull_global(run.kv, run.trainer, into_params=synchronous)
    if run.rank == 0:
        states = save_states(run.run_dir, run.net, run.trainer, stem)
        params = save_params(run.run_dir, run.net, stem, None if synchronous else weights)
    run.kv.barrier()        # nobody pushes again before every worker has the model
    if run.rank == 0:
        record_checkpoint(run.run_dir, dict(
            epoch=epoch, next_epoch=next_epoch, next_batch=next_batch,
            step=chunks // run.num_workers, chunks=chunks, seed=run.config.train.seed,
            params=params.name, **states, workers=0),
            keep=run.config.train.keep_checkpoints,
            accuracy=run.vals[-1]["accuracy"] if run.vals and not next_batch else None)
        run.writer.write("checkpoint", epoch=next_epoch, batch=next_batch, step=run.step,
                         path=str(params))
    run.t_checkpoint = time.time()


def finish(run: Run) -> dict:
    """The end of training: rank 0's last validation and checkpoint, every worker's end
    record, rank 0's summary. Rank 0 first replaces its local weights by the final model
    (preduce, a quorum: ``kv.finish()`` on every worker; the steps-delay stage: the
    global weights of the last step, what kv.close() does), so that the last validation
    and checkpoint are of it."""
    last = run.length.last_epoch
    wall = time.time() - run.t_train
    # every worker: preduce's final model is the average of all, a quorum's the one after
    # every worker's last push (and rank 0 must not wait for the others' end records
    # below while a slow one's rounds still count on it)
    ended = run.kv is not None and hasattr(run.kv, "finish") and run.kv.finish()
    chief = is_chief(run)
    if not ended and chief and stage_of(run) == Stage.STEPS_DELAY:
        pull_global(run.kv, run.trainer)
    if chief:
        validate(run, last)
        if wants_checkpoint(run, last):
            # the global model of the last step; no worker states (kv.close() ends the
            # steps-delay stage on the global weights, and a finished run is not resumed)
            stem = f"epoch-{last:04d}"
            states = save_states(run.run_dir, run.net, run.trainer, stem)
            params = save_params(run.run_dir, run.net, stem)
            cursor = {} if run.feed is None else {   # the budget is spent (dynamic data)
                "step": run.length.total_steps, "chunks": run.feed.plan["budget"]}
            record_checkpoint(run.run_dir, dict(dict(
                epoch=last, next_epoch=last + 1, next_batch=0, step=run.step,
                seed=run.config.train.seed, params=params.name, **states, workers=0),
                **cursor),
                keep=run.config.train.keep_checkpoints, accuracy=run.vals[-1]["accuracy"])
            run.writer.write("checkpoint", epoch=last + 1, batch=0, step=run.step,
                             path=str(params))
    end = run.writer.write("end", steps=run.step, **global_step(run), samples=run.samples,
                           wall_time=wall,
                           samples_per_sec=run.samples / max(wall, 1e-9),
                           **net_figures(run.kv), kv=kv_metrics(run.kv),
                           data=run.feed.trained if run.feed is not None else None)
    return write_summary(run, wall) if chief else end


# ----------------------------------------------------------------------------- CLI

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m ssdsgd.train", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="the job's YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="KEY=VALUE", help="override one key, e.g. sync.delay_steps=10")
    p.add_argument("--run-dir", help="this run's directory (default: a new one under "
                   "output.dir); required when started by the launcher")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from "
                   "its latest checkpoint (uses RUN_DIR/config.yaml if CONFIG is omitted)")
    return p.parse_args(argv)


def open_run(args) -> tuple[Config, Path]:
    """The config and the run directory the arguments name: a resumed run's own; by
    hand a new one (or --run-dir) with the config written to it; in worker mode
    --run-dir, whose config.yaml the launcher wrote."""
    if args.resume:
        run_dir = Path(args.resume)
        return load_config(args.config or run_dir / "config.yaml", args.overrides), run_dir
    if args.config is None:
        raise ConfigError("CONFIG: the job's YAML file is required (or --resume RUN_DIR)")
    config = load_config(args.config, args.overrides)
    worker = bool(os.environ.get("SSDSGD_ROLE"))
    if worker and not args.run_dir:
        raise ConfigError("--run-dir: required when started by the launcher "
                          "(all workers must share one run directory)")
    run_dir = Path(args.run_dir) if args.run_dir else new_run_dir(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not worker:
        save_config(config, run_dir / "config.yaml")
    return config, run_dir


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    try:
        config, run_dir = open_run(args)
        log.info("run directory %s", run_dir)
        train(config, run_dir, resume=bool(args.resume))
    except (ConfigError, DataError, FloatingPointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
