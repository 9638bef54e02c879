"""The worker-side training program.

    python -m ssdsgd.train CONFIG [--set KEY=VALUE ...] [--run-dir DIR] [--resume RUN_DIR]

By hand (no ``SSDSGD_ROLE`` in the environment) it trains in one process without a
kvstore. Started by the launcher (``SSDSGD_ROLE=worker``) it creates the registered
kvstore ``ssd_sync`` and takes its rank and the number of workers from it; the stock
``gluon.Trainer`` then pushes gradients and pulls weights through it.

Each worker trains on its own disjoint shard of every epoch (ssdsgd.data.shard_indices),
and all workers run the same number of steps per epoch. Rank 0 validates after every
epoch on the whole validation set (top-1; top-5 for ImageNet) with its current weights
(in the steps-delay stage: its local weights, at most k steps from the last global
pull), writes checkpoints, and at the end ``RUN_DIR/summary.json``.
"""
from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

from ssdsgd.config import (Config, ConfigError, check_worker_env, load_config, new_run_dir,
                           resolve_warmup_steps, save_config)
from ssdsgd.data import DataError, Loader, count_train, open_dataset, steps_per_epoch
from ssdsgd.kvstore.compression import parse_setting as parse_compression
from ssdsgd.metrics import MetricsWriter, Speedometer, net_figures, kv_metrics, summarize

log = logging.getLogger("ssdsgd.train")


# ----------------------------------------------------------------------------- pieces

def build_lr_scheduler(config: Config, spe: int):
    """MXNet's own lr scheduler for optimizer.lr_schedule, in steps (= Trainer.step
    calls = server updates); None for a constant lr without warm-up."""
    import mxnet as mx
    s = config.optimizer.lr_schedule
    lr = config.optimizer.lr
    warm = int(round(s.warmup_epochs * spe))
    total = config.train.epochs * spe
    common = dict(base_lr=lr, warmup_steps=warm, warmup_begin_lr=s.warmup_begin_lr)
    if s.type == "none":
        if warm == 0:
            return None
        return mx.lr_scheduler.FactorScheduler(step=total + 1, factor=1.0, **common)
    if s.type == "step":
        steps = []
        for e in s.step_epochs:
            st = max(1, int(round(e * spe)))
            if not steps or st > steps[-1]:
                steps.append(st)
        return mx.lr_scheduler.MultiFactorScheduler(step=steps, factor=s.factor, **common)
    if s.type == "cosine":
        return mx.lr_scheduler.CosineScheduler(max_update=max(total, warm + 1),
                                               final_lr=s.final_lr, **common)
    if s.type == "poly":
        return mx.lr_scheduler.PolyScheduler(max_update=max(total, warm + 1), pwr=s.power,
                                             final_lr=s.final_lr, **common)
    raise ConfigError(f"optimizer.lr_schedule.type: unknown {s.type!r}")


def optimizer_params(config: Config, lr_scheduler) -> dict:
    """Keyword arguments for the optimizer; momentum only where the optimizer takes it."""
    import mxnet as mx
    o = config.optimizer
    params = {"learning_rate": o.lr, "wd": o.wd}
    if lr_scheduler is not None:
        params["lr_scheduler"] = lr_scheduler
    cls = mx.optimizer.Optimizer.opt_registry[o.name]
    if "momentum" in inspect.signature(cls.__init__).parameters:
        params["momentum"] = o.momentum
    elif o.momentum:
        log.info("optimizer %s takes no momentum; optimizer.momentum ignored", o.name)
    return params


def gradient_batch(config: Config, kv, num_workers: int) -> int:
    """What Trainer.step is told the batch size is (it sets rescale_grad = 1 / that).

    As MXNet's Module does for dist_sync: with a synchronous algorithm (ssd, ssgd) the
    servers sum the N workers' gradients, so each is divided by the global batch
    N * batch_size and optimizer.lr is the lr of the mean gradient over the global batch,
    whatever N (the paper's convention: lr 0.4 for 4 x 128 on CIFAR-10). With asgd every
    push is its own update (dist_async): divided by the worker's batch."""
    if kv is None or config.sync.algorithm == "asgd":
        return config.data.batch_size
    return config.data.batch_size * num_workers


def seed_everything(seed: int) -> None:
    import mxnet as mx
    random.seed(seed)
    np.random.seed(seed)
    mx.random.seed(seed)


def check_environment(config: Config, spe_cluster: int, start_step: int = 0) -> None:
    """In worker mode: the SSDSGD_* sync and cluster variables the launcher set must say
    what the config says, and SSDSGD_START_STEP the step this run starts at (that of the
    checkpoint it resumes from, else 0); missing ones are filled in."""
    check_worker_env(config, os.environ, spe_cluster, start_step)


def create_kvstore(config: Config, spe_cluster: int, start_step: int = 0):
    """(kv, rank, num_workers): the 'ssd_sync' store when SSDSGD_ROLE=worker, else
    (None, 0, 1). ``start_step``: the stage machine's first step (a resumed run
    continues the warm-up / steps-delay schedule)."""
    role = os.environ.get("SSDSGD_ROLE")
    if role is None:
        return None, 0, 1
    if role != "worker":
        raise ConfigError(f"SSDSGD_ROLE={role}: ssdsgd.train runs only as a worker "
                          "(servers and the scheduler are started by the launcher)")
    check_environment(config, spe_cluster, start_step)
    import mxnet as mx
    import ssdsgd  # noqa: F401 - registers the 'ssd_sync' kvstore
    try:
        import ssdsgd.kvstore  # noqa: F401 - in case the package does not import it
    except ImportError:
        pass
    kv = mx.kv.create("ssd_sync")
    return kv, int(kv.rank), int(kv.num_workers)


def contexts(config: Config):
    import mxnet as mx
    return [mx.gpu(i) for i in config.train.gpus] or [mx.cpu()]


def evaluate(net, dataset, ctx, batch_size: int) -> dict:
    """Top-1 (and top-k for k = dataset.top_k > 1) accuracy on the validation set."""
    import mxnet as mx
    from mxnet import gluon
    k = dataset.top_k
    correct1 = correctk = total = 0
    for x, y in dataset.val_batches(batch_size):
        xs = gluon.utils.split_and_load(mx.nd.array(x), ctx, even_split=False)
        out = np.concatenate([net(xi).asnumpy() for xi in xs])
        pred = np.argsort(-out, axis=1)
        correct1 += int((pred[:, 0] == y).sum())
        if k > 1:
            correctk += int((pred[:, :k] == y[:, None]).any(axis=1).sum())
        total += len(y)
    res = {"accuracy": correct1 / max(total, 1)}
    if k > 1:
        res[f"top{k}"] = correctk / max(total, 1)
    return res


def stage_of(config: Config, kv, step: int, warmup: int, m: dict) -> str:
    if "stage" in m:
        return str(m["stage"])
    if kv is None:
        return "local"
    alg = config.sync.algorithm
    if alg == "ssd":
        return "warmup" if step < warmup else "delay"
    return {"ssgd": "sync", "asgd": "async"}[alg]


def save_states(run_dir: Path, trainer, epoch: int) -> str | None:
    """Rank 0: the trainer's optimizer states (through the kvstore when it updates on the
    servers) to RUN_DIR/checkpoints/epoch-NNNN.states; None if it cannot."""
    ck = run_dir / "checkpoints"
    ck.mkdir(parents=True, exist_ok=True)
    states = ck / f"epoch-{epoch:04d}.states"
    try:
        trainer.save_states(str(states))
    except Exception as exc:  # noqa: BLE001 - a kvstore may not support it
        text = str(exc).strip()
        log.warning("checkpoint: optimizer states not saved (%s)",
                    text.splitlines()[-1] if text else type(exc).__name__)
        return None
    return states.name


def trainable(trainer) -> list:
    """(kvstore key, Parameter) of the parameters the kvstore updates (the Trainer's
    keys are the parameters' indices; grad_req 'null' ones, such as BatchNorm's running
    statistics, stay with each worker)."""
    return [(i, p) for i, p in enumerate(trainer._params)  # noqa: SLF001
            if p.grad_req != "null"]


def pull_global(kv, trainer, into_params: bool = True) -> dict:
    """The servers' (global) weights as of this worker's last step, through the
    kvstore's ``pull`` (one exchange). With ``into_params`` they replace the parameters'
    values on every device, as ``kv.close()`` does at the end of the steps-delay stage;
    otherwise they are returned as {Parameter name: NDArray} and the parameters (in
    ssd's steps-delay stage: this worker's local weights) are left alone."""
    import mxnet as mx
    pairs = trainable(trainer)
    if into_params:
        outs = [p.list_data() for _, p in pairs]
    else:
        outs = [[mx.nd.zeros(p.shape, dtype=p.dtype)] for _, p in pairs]
    if pairs:
        kv.pull([i for i, _ in pairs], out=outs)
    return {p.name: o[0] for (_, p), o in zip(pairs, outs)}


def save_checkpoint(run_dir: Path, net, states_name: str | None, epoch: int, step: int,
                    seed: int, weights: dict | None = None) -> Path:
    """Rank 0: parameters and the data position (the next epoch to run) in
    RUN_DIR/checkpoints/; latest.json points at the newest checkpoint. ``weights``
    ({Parameter name: NDArray}, from pull_global) replace the parameters' own values
    in the file (net.save_parameters' format either way)."""
    import mxnet as mx
    ck = run_dir / "checkpoints"
    ck.mkdir(parents=True, exist_ok=True)
    params = ck / f"epoch-{epoch:04d}.params"
    if weights:
        arrays = {key: weights[p.name] if p.name in weights else p._reduce()  # noqa: SLF001
                  for key, p in net._collect_params_with_prefix().items()}  # noqa: SLF001
        mx.nd.save(str(params), arrays)
    else:
        net.save_parameters(str(params))
    info = {"epoch": epoch, "next_epoch": epoch + 1, "step": step, "seed": seed,
            "params": params.name, "states": states_name}
    tmp = ck / "latest.json.tmp"
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(tmp, ck / "latest.json")
    return params


def checkpoint_info(run_dir) -> dict:
    """RUN_DIR/checkpoints/latest.json, checked (DataError, one line, if unusable)."""
    ck = Path(run_dir) / "checkpoints"
    path = ck / "latest.json"
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{path}: no checkpoint to resume from (train.checkpoint_every "
                        "was 0, or the run stopped before its first checkpoint)") from None
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: unreadable checkpoint record ({exc})") from None
    need = {"next_epoch": int, "step": int, "params": str}
    if not isinstance(info, dict) or any(not isinstance(info.get(k), t)
                                         for k, t in need.items()):
        raise DataError(f"{path}: expected next_epoch, step and params in the checkpoint "
                        "record")
    for key in ("params", "states"):
        if info.get(key) and not (ck / info[key]).is_file():
            raise DataError(f"{ck / info[key]}: missing checkpoint file named by {path}")
    return info


def _last_line(exc) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else type(exc).__name__


def load_checkpoint(run_dir: Path, net, trainer, ctx, grad_batch: int) -> dict:
    """Load the latest checkpoint: parameters, optimizer states (through the kvstore,
    to the servers, when they update) and the optimizer's update count, so that the lr
    schedule continues. Returns latest.json's record."""
    ck = run_dir / "checkpoints"
    info = checkpoint_info(run_dir)
    step = int(info["step"])
    opt = trainer._optimizer  # noqa: SLF001 - the Trainer has no public accessor
    # What the first Trainer.step would have set before the kvstore sends the optimizer
    # to the servers (load_states creates the kvstore): the gradient scale and the
    # update count.
    opt.rescale_grad = trainer._scale / grad_batch  # noqa: SLF001
    opt.begin_num_update = opt.num_update = step
    try:
        net.load_parameters(str(ck / info["params"]), ctx=ctx)
    except Exception as exc:  # noqa: BLE001 - MXNetError carries a C++ traceback
        raise DataError(f"{ck / info['params']}: cannot load parameters "
                        f"({_last_line(exc)})") from None
    if info.get("states"):
        try:
            trainer.load_states(str(ck / info["states"]))
        except Exception as exc:  # noqa: BLE001
            raise DataError(f"{ck / info['states']}: cannot restore optimizer states "
                            f"({_last_line(exc)})") from None
    opt = trainer._optimizer  # noqa: SLF001 - load_states may replace it
    opt.begin_num_update = opt.num_update = step
    return info


# ----------------------------------------------------------------------------- training

def total_steps(config: Config, num_workers: int | None = None) -> int:
    """Steps every worker runs in the whole job: train.epochs x steps per epoch (for
    ``num_workers``, default cluster.workers), capped by train.max_steps."""
    n = config.cluster.workers if num_workers is None else num_workers
    total = config.train.epochs * steps_per_epoch(config, n)
    if config.train.max_steps is not None:
        total = min(total, config.train.max_steps)
    return total


def train(config: Config, run_dir, resume: bool = False) -> dict:
    """Train as configured; return rank 0's summary (other ranks: their end record)."""
    import mxnet as mx
    from mxnet import autograd, gluon
    from ssdsgd.models import build_model, initializer

    t_start = time.time()
    run_dir = Path(run_dir)
    seed = config.train.seed
    seed_everything(seed)

    n_train = count_train(config)
    spe_cluster = steps_per_epoch(config, config.cluster.workers, n_train)
    resume_info = checkpoint_info(run_dir) if resume else None
    kv, rank, num_workers = create_kvstore(
        config, spe_cluster, int(resume_info["step"]) if resume else 0)
    if kv is not None and num_workers != config.cluster.workers:
        log.warning("kvstore reports %d workers, config cluster.workers is %d",
                    num_workers, config.cluster.workers)
    writer = loader = None
    try:
        dataset = open_dataset(config)
        spe = steps_per_epoch(config, num_workers, dataset.n_train)
        warmup = resolve_warmup_steps(config, spe)
        bs = config.data.batch_size
        n_steps = config.train.epochs * spe
        if config.train.max_steps is not None:
            n_steps = min(n_steps, config.train.max_steps)
        last_epoch = (n_steps - 1) // spe  # the epoch in which training ends

        ctx = contexts(config)
        net = build_model(config.model.name, dataset.num_classes)
        net.initialize(initializer(config.model.name), ctx=ctx)
        if config.model.hybridize:
            net.hybridize(static_alloc=True, static_shape=True)
        sched = build_lr_scheduler(config, spe)
        # a second, identical scheduler only to report the lr (MXNet's are stateful, and
        # with a kvstore the servers, not this process, run the real one)
        lr_view = build_lr_scheduler(config, spe)

        def lr_at(num_update):
            return float(lr_view(num_update)) if lr_view is not None else config.optimizer.lr
        store = kv if kv is not None else ("device" if len(ctx) > 1 else None)
        # pushes are compressed on ssd_sync only (one process alone has nothing to push)
        compression = parse_compression(config.sync.compression) if kv is not None else None
        trainer = gluon.Trainer(net.collect_params(), config.optimizer.name,
                                optimizer_params(config, sched), kvstore=store,
                                compression_params=compression)
        loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
        grad_batch = gradient_batch(config, kv, num_workers)

        start_epoch, step = 0, 0
        if resume:
            # materialize deferred shapes before loading
            x0, _ = dataset.train_batch(np.arange(min(bs, dataset.n_train)),
                                        np.random.default_rng(0))
            net(mx.nd.array(x0[:1], ctx=ctx[0]))
            info = load_checkpoint(run_dir, net, trainer, ctx, grad_batch)
            start_epoch, step = int(info["next_epoch"]), int(info["step"])
            log.info("resumed from %s at epoch %d, step %d", run_dir / "checkpoints",
                     start_epoch, step)

        writer = MetricsWriter(run_dir, rank)
        writer.write("start", rank=rank, num_workers=num_workers, steps_per_epoch=spe,
                     total_steps=n_steps, epochs=config.train.epochs, batch_size=bs,
                     warmup_steps=warmup, algorithm=config.sync.algorithm,
                     delay_steps=config.sync.delay_steps, model=config.model.name,
                     dataset=config.data.dataset, kvstore=kv is not None,
                     start_epoch=start_epoch, start_step=step)
        log.info("rank %d/%d: %s on %s, %d samples, %d steps/epoch x %d epochs (%d steps), "
                 "batch %d, warm-up %d steps, %s", rank, num_workers, config.model.name,
                 config.data.dataset, dataset.n_train, spe, config.train.epochs,
                 n_steps, bs, warmup, "kvstore ssd_sync" if kv is not None else
                 "single process (no kvstore)")

        loader = Loader(dataset, seed, config.data.loader_threads)
        speed, epoch_speed = Speedometer(), Speedometer()
        t_train = time.time()
        samples = 0
        vals: list[dict] = []

        def validate(epoch):
            res = evaluate(net, dataset, ctx, bs)
            vals.append(res)
            writer.write("val", epoch=epoch + 1, step=step, **res,
                         elapsed=time.time() - t_train)
            log.info("Epoch[%d] Validation %s time=%.1fs", epoch, " ".join(
                f"{k}={v:.6f}" for k, v in res.items()), time.time() - t_train)

        def checkpoint(epoch, states_name, weights=None):
            path = save_checkpoint(run_dir, net, states_name, epoch, step, seed, weights)
            writer.write("checkpoint", epoch=epoch + 1, step=step, path=str(path))

        def wants_checkpoint(epoch):
            every = config.train.checkpoint_every
            return bool(every) and ((epoch + 1) % every == 0 or epoch == last_epoch)

        for epoch in range(start_epoch, last_epoch + 1):
            speed.reset()
            epoch_speed.reset()
            for batch, (x, y) in loader.epoch(epoch, rank, num_workers, bs):
                xs = gluon.utils.split_and_load(mx.nd.array(x), ctx, even_split=False)
                ys = gluon.utils.split_and_load(mx.nd.array(y), ctx, even_split=False)
                with autograd.record():
                    outs = [net(xi) for xi in xs]
                    losses = [loss_fn(o, yi) for o, yi in zip(outs, ys)]
                autograd.backward(losses)
                trainer.step(grad_batch)
                step += 1
                samples += len(y)
                loss_sum = sum(float(l.sum().asscalar()) for l in losses)
                correct = sum(int((o.argmax(axis=1) == yi.astype(o.dtype)).sum().asscalar())
                              for o, yi in zip(outs, ys))
                speed.update(len(y), loss_sum, correct)
                epoch_speed.update(len(y), loss_sum, correct)
                if (batch + 1) % config.train.log_interval == 0 or step == n_steps:
                    stats = speed.stats()
                    m = kv_metrics(kv)
                    writer.write("train", step=step, epoch=epoch, batch=batch + 1, **stats,
                                 stage=stage_of(config, kv, step - 1, warmup, m),
                                 lr=lr_at(step), **net_figures(kv),
                                 elapsed=time.time() - t_train)
                    if not np.isfinite(stats["loss"]):
                        raise FloatingPointError(f"loss is {stats['loss']} at step {step} "
                                                 "(diverged; lower optimizer.lr?)")
                    log.info(Speedometer.line(epoch, batch + 1, stats))
                    speed.reset()
                if step >= n_steps:
                    break
            ep = epoch_speed.stats()
            log.info("Epoch[%d] Train-accuracy=%.6f loss=%.4f Speed: %.1f samples/sec", epoch,
                     ep["accuracy"], ep["loss"], ep["samples_per_sec"])
            if rank == 0 and epoch < last_epoch:
                validate(epoch)
                if wants_checkpoint(epoch):
                    # in the steps-delay stage rank 0's weights are its local ones: the
                    # checkpoint holds the global model, pulled from the servers
                    checkpoint(epoch, save_states(run_dir, trainer, epoch),
                               pull_global(kv, trainer, into_params=False)
                               if delay_stage(config, kv, step, warmup) else None)
        loader.close()
        # The end of training. In the steps-delay stage rank 0 first replaces its local
        # weights by the global weights of the last step (what kv.close() does), so the
        # last validation and checkpoint are of the global model. Rank 0 does everything
        # (validation, checkpoint, summary) before it leaves the job: the scheduler ends
        # the job when the last worker has closed its kvstore.
        ran = start_epoch <= last_epoch
        if rank == 0 and ran and delay_stage(config, kv, step, warmup):
            pull_global(kv, trainer)
        wall = time.time() - t_train
        if rank == 0 and ran:
            validate(last_epoch)
            if wants_checkpoint(last_epoch):
                checkpoint(last_epoch, save_states(run_dir, trainer, last_epoch))
        end = writer.write("end", steps=step, samples=samples, wall_time=wall,
                           samples_per_sec=samples / max(wall, 1e-9), **net_figures(kv),
                           kv=kv_metrics(kv))
        writer.close()
        summary = end if rank != 0 else _summary(config, run_dir, kv, vals, step, spe,
                                                 warmup, num_workers, wall, t_start)
        if kv is not None and hasattr(kv, "close"):
            kv.close()
    finally:
        if loader is not None:
            loader.close()
        if writer is not None:
            writer.close()
        if kv is not None and hasattr(kv, "close"):
            kv.close()  # idempotent; on an error it still leaves the job

    return summary


def delay_stage(config: Config, kv, step: int, warmup: int) -> bool:
    """Whether, after ``step`` steps, this worker's weights are its local ones (its last
    step was in ssd's steps-delay stage) rather than the global model."""
    if kv is None or config.sync.algorithm != "ssd":
        return False
    m = kv_metrics(kv)
    if "stage" in m:
        return m["stage"] == "steps_delay"
    return step > warmup


def _summary(config, run_dir, kv, vals, step, spe, warmup, num_workers, wall,
             t_start) -> dict:
    """Rank 0: RUN_DIR/summary.json from its figures and every worker's end record."""
    last = vals[-1] if vals else {}
    base = {
        "name": config.name, "algorithm": config.sync.algorithm if kv is not None else "local",
        "num_workers": num_workers, "num_servers": config.cluster.servers if kv else 0,
        "model": config.model.name, "dataset": config.data.dataset,
        "batch_size": config.data.batch_size, "epochs": round(step / spe, 3),
        "steps": step, "steps_per_epoch": spe, "warmup_steps": warmup,
        "delay_steps": config.sync.delay_steps,
        "final_accuracy": last.get("accuracy"),
        "best_accuracy": max((v["accuracy"] for v in vals), default=None),
        **({"final_top5": last["top5"]} if "top5" in last else {}),
        "wall_time": wall, "total_time": time.time() - t_start,
    }
    summary = summarize(run_dir, base, wait_for=num_workers)
    log.info("done: test accuracy %s after %d steps, %.1f s; summary in %s",
             f"{summary['final_accuracy']:.4f}" if summary["final_accuracy"] is not None
             else "n/a", step, wall, run_dir / "summary.json")
    return summary


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


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    try:
        config_path = args.config
        if args.resume:
            run_dir = Path(args.resume)
            if config_path is None:
                config_path = run_dir / "config.yaml"
        elif config_path is None:
            raise ConfigError("CONFIG: the job's YAML file is required (or --resume RUN_DIR)")
        config = load_config(config_path, args.overrides)
        if not args.resume:
            if args.run_dir:
                run_dir = Path(args.run_dir)
                run_dir.mkdir(parents=True, exist_ok=True)
            elif os.environ.get("SSDSGD_ROLE"):
                raise ConfigError("--run-dir: required when started by the launcher "
                                  "(all workers must share one run directory)")
            else:
                run_dir = new_run_dir(config)
        if not args.resume and not os.environ.get("SSDSGD_ROLE"):
            save_config(config, run_dir / "config.yaml")  # the launcher writes its own
        log.info("run directory %s", run_dir)
        train(config, run_dir, resume=bool(args.resume))
    except (ConfigError, DataError, FloatingPointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
