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
import numpy as np

from .batch_schedule import GlobalBatchSchedule

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
    """The hyper-parameters of ``cls``'s constructors, along its MRO: {name: default}, the
    nearest class's default where several declare one."""
    params = {}
    for klass in cls.__mro__:
        if klass is object:
            break
        try:
            sig = inspect.signature(klass.__init__)
        except (TypeError, ValueError):
            continue
        for p in sig.parameters.values():
            if p.name not in _SKIP and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                params.setdefault(p.name, p.default)
    return params


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
    if isinstance(sched, GlobalBatchSchedule):   # a quorum server's: keep its clock too
        return {**describe_scheduler(sched.inner), "pushes": int(sched.pushes),
                "num_workers": int(sched.num_workers)}
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


def _multipliers(opt):
    """lr and wd multipliers by key number, resolved as ``Optimizer._get_lr`` does: the
    Parameter's (``param_dict``), then a number's, then its name's (``idx2name``: Module
    keys them by name, and gives biases wd_mult 0). A name no number maps to reaches no
    key, on the servers as in MXNet."""
    lr_mult, wd_mult = {}, {}
    for index, param in (opt.param_dict or {}).items():
        lr_mult[str(index)] = float(param.lr_mult)
        wd_mult[str(index)] = float(param.wd_mult)
    for mine, theirs in ((lr_mult, opt.lr_mult), (wd_mult, opt.wd_mult)):
        for index, value in theirs.items():
            if isinstance(index, int):
                mine.setdefault(str(index), float(value))
        for index, name in (opt.idx2name or {}).items():
            if name in theirs:
                mine.setdefault(str(index), float(theirs[name]))
    return lr_mult, wd_mult


def describe(opt):
    """The declarative description of an ``mx.optimizer.Optimizer`` instance."""
    name = _registered_name(opt)
    params = {}
    for p in _init_params(type(opt)):
        attr = {"learning_rate": "lr"}.get(p, p)
        if hasattr(opt, attr):
            params[p] = _scalar(getattr(opt, attr), f"{type(opt).__name__}.{p}")
    lr_mult, wd_mult = _multipliers(opt)
    return {"name": name, "params": params, "lr_scheduler": describe_scheduler(opt.lr_scheduler),
            "lr_mult": lr_mult, "wd_mult": wd_mult,
            "num_update": int(opt.num_update),
            "index_update_count": {str(k): int(v) for k, v in opt._index_update_count.items()}}


SCHEDULERS = ("FactorScheduler", "MultiFactorScheduler", "PolyScheduler", "CosineScheduler")
_SPEC_FIELDS = {"name", "params", "lr_scheduler", "lr_mult", "wd_mult", "num_update",
                "index_update_count"}


def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_NO_DEFAULT = inspect.Parameter.empty


def _fits(value, default):
    """(does ``value`` have the type the constructor's default says, what that type is);
    no default: a number or a list of numbers (schedulers' ``step``, ``max_update``)."""
    if isinstance(default, bool):
        return isinstance(value, bool), "true or false"
    if isinstance(default, (int, float)):
        return _number(value), "a finite number"
    if isinstance(default, str):
        return isinstance(value, str) and len(value) <= 64, "a short string"
    if default is None:
        return value is None or _number(value), "a finite number or null"
    return (_number(value) or (isinstance(value, list) and 0 < len(value) <= 1024
                               and all(_number(x) for x in value)),
            "a finite number or a list of them")


def _check_params(cls, params, where):
    if not isinstance(params, dict):
        raise OptimizerSpecError(f"{where}: params must be an object, got {params!r:.60}")
    defaults = _init_params(cls)
    for name, value in params.items():
        if name not in defaults:
            raise OptimizerSpecError(f"{where} has no parameter {name!r:.60} (it takes "
                                     f"{', '.join(sorted(defaults))})")
        ok, want = _fits(value, defaults[name])
        if not ok:
            raise OptimizerSpecError(f"{where}: {name} = {value!r:.60} is not {want}")


def _check_spec(spec):
    """The description's structure and every hyper-parameter's type, against the
    constructor of the optimizer (and scheduler) it names."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise OptimizerSpecError(f"an optimizer description is an object with a name, got "
                                 f"{spec!r:.60}")
    unknown = set(spec) - _SPEC_FIELDS
    if unknown:
        raise OptimizerSpecError(f"unknown field {sorted(unknown)[0]!r:.60} in the optimizer "
                                 f"description")
    cls = mx.optimizer.Optimizer.opt_registry.get(spec["name"].lower())
    if cls is None or not cls.__module__.startswith("mxnet."):
        raise OptimizerSpecError(f"{spec['name']!r:.60} is not one of MXNet's optimizers")
    _check_params(cls, spec.get("params", {}), spec["name"])
    sched = spec.get("lr_scheduler")
    if sched is not None:
        if not isinstance(sched, dict) or sched.get("class") not in SCHEDULERS:
            raise OptimizerSpecError(f"lr_scheduler must name one of {', '.join(SCHEDULERS)}, "
                                     f"got {sched!r:.60}")
        _check_params(getattr(mx.lr_scheduler, sched["class"]), sched.get("params", {}),
                      sched["class"])
        clock = {f: sched[f] for f in ("pushes", "num_workers") if f in sched}
        if clock and not (len(clock) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) for v in clock.values())
                and clock["pushes"] >= 0 and 1 <= clock["num_workers"] <= 1 << 20):
            raise OptimizerSpecError(f"lr_scheduler's pushes and num_workers must be counts "
                                     f"(num_workers >= 1), got {clock!r:.60}")
    for field in ("lr_mult", "wd_mult", "index_update_count"):
        table = spec.get(field, {})
        if not isinstance(table, dict) or not all(
                k.isdigit() and len(k) < 10 and _number(v) for k, v in table.items()):
            raise OptimizerSpecError(f"{field} must map key numbers to numbers, got "
                                     f"{table!r:.60}")
    if not (_number(spec.get("num_update", 0)) and spec.get("num_update", 0) >= 0):
        raise OptimizerSpecError(f"num_update must be a count, got {spec['num_update']!r:.60}")


def _dry_run(opt):
    """One update of a small array: what MXNet checks only when it first updates a key
    (a server must refuse a description before acknowledging it, not at the next step)."""
    weight, grad = mx.nd.ones((2, 2)), mx.nd.array([[0.5, -0.5], [1.0, -1.0]])
    updater = mx.optimizer.get_updater(opt)
    updater(0, grad, weight)
    if not np.isfinite(weight.asnumpy()).all():
        raise ValueError("one update of a unit array gives non-finite weights")


def build(spec, check=True):
    """Rebuild an optimizer from ``describe``'s output with MXNet's own classes; a
    description from the network is checked first (types, then one trial update)."""
    if check:
        _check_spec(spec)
        try:
            _dry_run(_create(spec))
        except OptimizerSpecError:
            raise
        except Exception as e:     # noqa: BLE001 - MXNet raises anything for a bad value
            lines = str(e).strip().splitlines() or [type(e).__name__]
            raise OptimizerSpecError(f"optimizer {spec['name']!r:.40} fails a trial update: "
                                     f"{lines[-1][:200]}") from None
    return _create(spec)


def _create(spec):
    try:
        params = dict(spec.get("params", {}))
        sched = spec.get("lr_scheduler")
        if sched:
            cls = getattr(mx.lr_scheduler, sched["class"])
            params["lr_scheduler"] = cls(**sched["params"])
        if sched and "pushes" in sched:
            inner = params["lr_scheduler"]
        opt = mx.optimizer.create(spec["name"], **params)
        if sched and "pushes" in sched:      # after create: it sets base_lr on the inner one
            opt.lr_scheduler = GlobalBatchSchedule(inner, sched["num_workers"], sched["pushes"])
        opt.lr_mult = {int(k): float(v) for k, v in spec.get("lr_mult", {}).items()}
        opt.wd_mult = {int(k): float(v) for k, v in spec.get("wd_mult", {}).items()}
        opt._index_update_count.update({int(k): int(v) for k, v in
                                        spec.get("index_update_count", {}).items()})
        opt.num_update = int(spec.get("num_update", opt.num_update))
    except (KeyError, TypeError, ValueError, AttributeError, AssertionError) as e:
        raise OptimizerSpecError(f"cannot build optimizer from {spec!r:.200}: {e}") from None
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


def state_arrays(states):
    """An Updater's ``states`` (key -> MXNet state) as numpy arrays per key, in
    ``flatten_state`` order: what an optimizer-state file holds."""
    return {key: [a.asnumpy() for a in flatten_state(state)] for key, state in states.items()}


def states_from_arrays(optimizer, arrays, shapes):
    """The inverse of ``state_arrays`` for ``optimizer``: each key's state rebuilt in the
    structure the optimizer creates for a weight of that shape. ``shapes`` (key -> its
    weight's shape): every MXNet optimizer keeps states of its weight's shape, so a file of
    another model, or of another order of parameters, is refused here by key (ValueError,
    one line), not by the first update's shape check."""
    states = {}
    for key, parts in arrays.items():
        if key not in shapes:
            raise ValueError(f"key {key}: no such parameter in this model")
        shape = tuple(shapes[key])
        wrong = [tuple(a.shape) for a in parts if tuple(a.shape) != shape]
        if wrong:
            raise ValueError(f"key {key}: a state of shape {wrong[0]} for a weight of shape "
                             f"{shape} (a file of another model or parameter order)")
        template = optimizer.create_state_multi_precision(
            key, mx.nd.zeros(shape, dtype=parts[0].dtype if parts else "float32"))
        states[key] = unflatten_state(template, [mx.nd.array(a, dtype=a.dtype)
                                                 for a in parts])
    return states
