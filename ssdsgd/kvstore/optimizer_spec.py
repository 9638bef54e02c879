"""Optimizers cross the network as a description (class name + hyper-parameters), never
as a pickled object, and are rebuilt on the server with MXNet's own classes.

MXNet's ``dist_sync`` pickles the optimizer to the servers; ssdsgd refuses to unpickle
anything from the network, so it sends what an MXNet user could have typed:
``{"name": "sgd", "params": {...}, "lr_scheduler": {...}, "lr_mult": {...}, "wd_mult": {...}}``.
An optimizer or scheduler class that is not one of MXNet's registered ones cannot be
described and gets an error naming it.
"""
import inspect
import math

import mxnet as mx

# Constructor arguments that are not hyper-parameters, or that are sent separately.
_SKIP = {"self", "param_idx2name", "sym", "param_dict", "lr_scheduler", "kwargs", "args"}
# Scheduler attributes that MXNet renames or mutates while running.
_SCHED_ALIASES = {"pwr": ("power",), "base_lr": ("base_lr_orig", "warmup_final_lr", "base_lr")}


class OptimizerSpecError(ValueError):
    """An optimizer that cannot be sent to the servers."""


def _scalar(value, where):
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value) if isinstance(value, float) and not math.isfinite(value) else value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value):
        return list(value)
    if hasattr(value, "item") and getattr(value, "size", 2) == 1:
        return value.item()
    raise OptimizerSpecError(f"{where} = {value!r} is not a plain number, string or list "
                             "and cannot be sent to the servers")


def _init_params(cls):
    names = []
    for klass in cls.__mro__:
        if klass is object:
            break
        try:
            sig = inspect.signature(klass.__init__)
        except (TypeError, ValueError):
            continue
        names += [p for p in sig.parameters if p not in _SKIP and p not in names]
    return names


def _registered_name(opt):
    cls = type(opt)
    for name, klass in mx.optimizer.Optimizer.opt_registry.items():
        if klass is cls and cls.__module__.startswith("mxnet."):
            return name
    raise OptimizerSpecError(
        f"optimizer class {cls.__module__}.{cls.__qualname__} cannot be described for the "
        "servers: ssdsgd sends optimizers by name and hyper-parameters, never pickled; use "
        "one of MXNet's registered optimizers (" +
        ", ".join(sorted(mx.optimizer.Optimizer.opt_registry)) + ")")


def describe_scheduler(sched):
    if sched is None:
        return None
    cls = type(sched)
    if not (cls.__module__.startswith("mxnet.") and hasattr(mx.lr_scheduler, cls.__name__)):
        raise OptimizerSpecError(
            f"lr scheduler class {cls.__module__}.{cls.__qualname__} cannot be described for "
            "the servers; use one of mx.lr_scheduler's classes (FactorScheduler, "
            "MultiFactorScheduler, PolyScheduler, CosineScheduler)")
    params = {}
    for p in inspect.signature(cls.__init__).parameters:
        if p == "self":
            continue
        for attr in _SCHED_ALIASES.get(p, (p,)):
            if hasattr(sched, attr):
                params[p] = _scalar(getattr(sched, attr), f"{cls.__name__}.{p}")
                break
    return {"class": cls.__name__, "params": params}


def describe(opt):
    """The declarative description of an ``mx.optimizer.Optimizer`` instance."""
    name = _registered_name(opt)
    params = {}
    for p in _init_params(type(opt)):
        attr = {"learning_rate": "lr"}.get(p, p)
        if hasattr(opt, attr):
            params[p] = _scalar(getattr(opt, attr), f"{type(opt).__name__}.{p}")
    lr_mult, wd_mult = {}, {}
    for index, param in (opt.param_dict or {}).items():
        lr_mult[str(index)] = float(param.lr_mult)
        wd_mult[str(index)] = float(param.wd_mult)
    for index, value in opt.lr_mult.items():
        lr_mult.setdefault(str(index), float(value))
    for index, value in opt.wd_mult.items():
        wd_mult.setdefault(str(index), float(value))
    return {"name": name, "params": params, "lr_scheduler": describe_scheduler(opt.lr_scheduler),
            "lr_mult": lr_mult, "wd_mult": wd_mult,
            "num_update": int(opt.num_update),
            "index_update_count": {str(k): int(v) for k, v in opt._index_update_count.items()}}


def build(spec):
    """Rebuild an optimizer from ``describe``'s output with MXNet's own classes."""
    try:
        params = dict(spec["params"])
        sched = spec.get("lr_scheduler")
        if sched:
            cls = getattr(mx.lr_scheduler, sched["class"])
            params["lr_scheduler"] = cls(**sched["params"])
        opt = mx.optimizer.create(spec["name"], **params)
        opt.lr_mult = {int(k): float(v) for k, v in spec.get("lr_mult", {}).items()}
        opt.wd_mult = {int(k): float(v) for k, v in spec.get("wd_mult", {}).items()}
        opt._index_update_count.update({int(k): int(v) for k, v in
                                        spec.get("index_update_count", {}).items()})
        opt.num_update = int(spec.get("num_update", opt.num_update))
    except (KeyError, TypeError, ValueError, AttributeError, AssertionError) as e:
        raise OptimizerSpecError(f"cannot build optimizer from {spec!r}: {e}") from None
    return opt


def flatten_state(state):
    """MXNet keeps a key's optimizer state as None, an NDArray or a (nested) tuple."""
    if state is None:
        return []
    if isinstance(state, (tuple, list)):
        return [a for s in state for a in flatten_state(s)]
    return [state]


def unflatten_state(template, arrays):
    """Put ``arrays`` back into the structure of ``template`` (a freshly created state)."""
    it = iter(arrays)

    def fill(t):
        if t is None:
            return None
        if isinstance(t, (tuple, list)):
            return type(t)(fill(s) for s in t)
        return next(it)
    out = fill(template)
    if next(it, None) is not None:
        raise ValueError("more state arrays than the optimizer's state has")
    return out
