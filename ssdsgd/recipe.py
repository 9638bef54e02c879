"""What a job's config turns into before training starts: MXNet's lr scheduler and the
optimizer's arguments, the batch size the Trainer divides by, the seeds, the kvstore (and
the launcher's environment checked against the config), the devices; and the validation
pass. Kept apart from the training loop (``ssdsgd/train.py``) so each can be read and
tested alone.
"""
from __future__ import annotations

import inspect
import logging
import os
import random

import mxnet as mx
import numpy as np
from mxnet import gluon

from ssdsgd.config import Config, ConfigError, check_worker_env
from ssdsgd.integration import declare_model
from ssdsgd.models import build_model
from ssdsgd.sync.registry import ALGORITHMS

log = logging.getLogger("ssdsgd.train")


def build_lr_scheduler(config: Config, spe: int):
    """MXNet's own lr scheduler for optimizer.lr_schedule, in steps (= Trainer.step
    calls = server updates); None for a constant lr without warm-up."""
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
    push is its own update (dist_async), with preduce every worker's step is its own
    (docs/spec/preduce.md): divided by the worker's batch."""
    if kv is None or ALGORITHMS[config.sync.algorithm].server != "sum":
        return config.data.batch_size
    return config.data.batch_size * num_workers


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    mx.random.seed(seed)


def check_environment(config: Config, spe_cluster: int, start_step: int = 0) -> None:
    """In worker mode: the SSDSGD_* sync and cluster variables the launcher set must say
    what the config says, and SSDSGD_START_STEP the step this run starts at (that of the
    checkpoint it resumes from, else 0); missing ones are filled in."""
    check_worker_env(config, os.environ, spe_cluster, start_step)


def model_key_bytes(config: Config, dataset) -> list:
    """The bytes of each parameter of the job's model, from its shapes alone: symbolic
    shape inference on one training sample's shape, so nothing is initialized and no
    random number drawn; the probe is named in a scope of its own, so the network built
    later keeps its names. Every model here is float32."""
    x, _ = dataset.train_batch(np.arange(1), np.random.default_rng(0))
    scope = gluon.Block(prefix="ssdsgd_probe_")
    with scope.name_scope():
        probe = build_model(config.model.name, dataset.num_classes)
    out = probe(mx.sym.var("data"))
    args, _, aux = out.infer_shape(data=x.shape)
    shapes = [s for name, s in zip(out.list_arguments(), args) if name != "data"] + aux
    return [4 * int(np.prod(s)) for s in shapes]


def create_kvstore(config: Config, spe_cluster: int, start_step: int = 0, dataset=None):
    """(kv, rank, num_workers): the 'ssd_sync' store when SSDSGD_ROLE=worker, else
    (None, 0, 1). ``start_step``: the stage machine's first step (a resumed run
    continues the warm-up / steps-delay schedule). With ``dataset`` the store is
    declared for the job's model (``model_key_bytes``): the servers' message limit
    follows it (docs/reliability.md)."""
    role = os.environ.get("SSDSGD_ROLE")
    if role is None:
        return None, 0, 1
    if role != "worker":
        raise ConfigError(f"SSDSGD_ROLE={role}: ssdsgd.train runs only as a worker "
                          "(servers and the scheduler are started by the launcher)")
    check_environment(config, spe_cluster, start_step)
    if dataset is not None:
        declare_model(model_key_bytes(config, dataset))
    kv = mx.kv.create("ssd_sync")   # registered by ssdsgd/__init__, imported with this module
    return kv, int(kv.rank), int(kv.num_workers)


def contexts(config: Config):
    return [mx.gpu(i) for i in config.train.gpus] or [mx.cpu()]


def evaluate(net, dataset, ctx, batch_size: int) -> dict:
    """Top-1 (and top-k for k = dataset.top_k > 1) accuracy on the validation set."""
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
