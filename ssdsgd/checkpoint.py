"""Checkpoints of a run: where it stands, saving, loading, and the global pull before a save.

``RUN_DIR/checkpoints/`` holds, per checkpoint (``epoch-NNNN`` at an epoch's end,
``step-NNNNNNNN`` mid-epoch, train.checkpoint_every_s), ``STEM.params``
(``net.save_parameters``' format), ``STEM.states`` (the optimizer's state: through the
kvstore, the servers' when they update; arrays + JSON, mxglue/state_file.py, no pickle), ``STEM.worker-R.npz`` (each
worker's own state, ``kv.save_worker_state``) and ``latest.json``, the record of the
newest one: epoch, next_epoch and next_batch (the data position), step, seed, params,
states, state_keys (whose state each key of the states file is, ``state_keys``), workers
(how many worker states; 0: none). Rank 0 writes all but the worker
states, and latest.json last, after every worker has saved its own; every worker of a
resumed run loads them. Only the newest mid-epoch checkpoint is kept.

The launcher imports this module (``run_length``, ``checkpoint_info``) without the training
program; MXNet is imported only by the functions that save or load arrays.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

from ssdsgd.data import DataError, steps_per_epoch

log = logging.getLogger("ssdsgd.train")


@dataclasses.dataclass(frozen=True)
class RunLength:
    """How long a run is: every worker runs ``total_steps`` steps, ``steps_per_epoch`` of
    them per epoch (train.epochs x steps per epoch, capped by train.max_steps)."""
    steps_per_epoch: int
    total_steps: int

    @property
    def last_epoch(self) -> int:
        """The epoch in which training ends."""
        return (self.total_steps - 1) // self.steps_per_epoch


def run_length(config, num_workers: int | None = None,
               n_train: int | None = None) -> RunLength:
    """The run's length for ``num_workers`` (default cluster.workers) and ``n_train``
    training samples (default: counted from the data files)."""
    from ssdsgd.config import total_steps
    n = config.cluster.workers if num_workers is None else num_workers
    spe = steps_per_epoch(config, n, n_train)
    return RunLength(spe, total_steps(config, spe))


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
    keys = info.get("state_keys")
    if keys is not None and (not isinstance(keys, list)
                             or not all(isinstance(k, str) for k in keys)):
        raise DataError(f"{path}: state_keys must be a list of parameter names")
    for key in ("params", "states"):
        if info.get(key) and not (ck / info[key]).is_file():
            raise DataError(f"{ck / info[key]}: missing checkpoint file named by {path}")
    if not all(isinstance(info.get(k, 0), int) and info.get(k, 0) >= 0
               for k in ("next_batch", "workers", "chunks")):
        raise DataError(f"{path}: next_batch, workers and chunks (dynamic data's cursor) "
                        "must be integers >= 0")
    members = info.get("members")
    if members is not None and not (isinstance(members, list) and all(
            isinstance(r, int) and r >= 0 for r in members) and "chunks" in info):
        raise DataError(f"{path}: members (a job that takes joiners) must be a list of "
                        "ranks, beside chunks")
    for rank in range(info.get("workers", 0)):
        name = worker_state_name(info, rank, info["workers"])
        if not (ck / name).is_file():
            raise DataError(f"{ck / name}: missing worker state named by {path}")
    return info


def worker_state_name(info: dict, rank: int, num_workers: int) -> str | None:
    """The file of worker ``rank``'s own state in checkpoint ``info``; None if the
    checkpoint has none for a job of ``num_workers`` (a final checkpoint, or another
    number of workers: the job then resumes from the global model alone)."""
    if info.get("workers", 0) != num_workers or not num_workers:
        return None
    return f"{Path(info['params']).stem}.worker-{rank}.npz"


def check_unfinished(run_dir, info: dict, length: RunLength) -> None:
    """Refuse (DataError) to resume a run whose checkpoint ``info`` has no step left of
    ``length``: it would train nothing and overwrite the run's summary.json with an
    empty result. A larger train.epochs or max_steps makes it a run with steps left."""
    if info["step"] >= length.total_steps or info["next_epoch"] > length.last_epoch:
        raise DataError(f"{run_dir}: the run is finished ({info['step']} of "
                        f"{length.total_steps} steps done); nothing to resume (--set "
                        "train.epochs=N with a larger N continues it)")


# ----------------------------------------------------------------------------- saving

def save_states(run_dir: Path, net, trainer, stem: str) -> dict:
    """Rank 0: the trainer's optimizer states (through the kvstore when it updates on the
    servers) to RUN_DIR/checkpoints/STEM.states, arrays + JSON, never a pickle
    (mxglue/state_file.py). Returns the record's fields for them: ``states``, the file's
    name (None if it cannot be written), and ``state_keys``, whose state each key is."""
    ck = run_dir / "checkpoints"
    ck.mkdir(parents=True, exist_ok=True)
    states = ck / f"{stem}.states"
    try:
        if _on_ssd_sync(trainer):
            trainer.save_states(str(states))
        else:      # by hand: MXNet's own save_states would write a pickle
            from ssdsgd.mxglue import state_file
            from ssdsgd.mxglue.optimizer_spec import describe, state_arrays
            updater = _updaters(trainer)[0]
            state_file.save(str(states), describe(updater.optimizer),
                            state_arrays(updater.states))
    except Exception as exc:  # noqa: BLE001 - a kvstore may not support it
        log.warning("checkpoint: optimizer states not saved (%s)", _last_line(exc))
        return {"states": None}
    return {"states": states.name, "state_keys": state_keys(net, trainer)}


def _on_ssd_sync(trainer) -> bool:
    """Whether the Trainer's states live in ssd_sync (whose save/load take no pickle)."""
    if not trainer._kv_initialized:  # noqa: SLF001 - the Trainer has no public accessor
        trainer._init_kvstore()  # noqa: SLF001
    from ssdsgd.integration import is_ssdsgd_store    # MXNet: not at the launcher's import
    return is_ssdsgd_store(trainer._kvstore)  # noqa: SLF001


def _updaters(trainer) -> list:
    """The Updaters that hold a by-hand Trainer's states: MXNet's kvstore's when it
    updates there, else the Trainer's own (one per device)."""
    if trainer._params_to_init:  # noqa: SLF001
        trainer._init_params()  # noqa: SLF001
    kv = trainer._kvstore  # noqa: SLF001
    if kv is not None and trainer._update_on_kvstore:  # noqa: SLF001
        return [kv._updater]  # noqa: SLF001
    return trainer._updaters  # noqa: SLF001


def _load_local_states(trainer, path: Path) -> None:
    """A by-hand Trainer's states from a state_file, into its Updaters in place."""
    from ssdsgd.mxglue import state_file
    from ssdsgd.mxglue.optimizer_spec import build, states_from_arrays
    spec, arrays = state_file.load(str(path))
    optimizer = build(spec)
    for updater in _updaters(trainer):
        updater.optimizer = optimizer
        updater.states = states_from_arrays(optimizer, arrays, {
            key: p.shape for key, p in enumerate(trainer._params)})  # noqa: SLF001
        updater.states_synced = {key: False for key in updater.states}   # to the device
    trainer._optimizer = optimizer  # noqa: SLF001
    optimizer.param_dict = dict(enumerate(trainer._params))  # noqa: SLF001


def state_keys(net, trainer) -> list[str]:
    """Whose optimizer state each of the Trainer's keys is, in key order: the parameter's
    name in ``net.save_parameters``' file (its place in the model, '0.weight'). A states
    file stores the states by key, that is by the Trainer's order of the parameters (by
    their names, which follow the model's code), so the checkpoint's record keeps this
    list and a resume whose model orders its parameters otherwise is refused
    (``load_checkpoint``): two parameters of the same shape would otherwise take each
    other's state and pass every shape check."""
    places = {id(p): name for name, p in net._collect_params_with_prefix().items()}  # noqa: SLF001
    return [places.get(id(p), p.name) for p in trainer._params]  # noqa: SLF001


def _check_state_keys(path: Path, saved, now: list[str]) -> None:
    """The record's ``state_keys`` (None: a record written before it existed) against
    this model's."""
    if saved is None or saved == now:
        return
    i = next((i for i, (a, b) in enumerate(zip(saved, now)) if a != b),
             min(len(saved), len(now)))
    theirs = f"parameter {saved[i]!r}" if i < len(saved) else "no parameter"
    ours = repr(now[i]) if i < len(now) else "absent"
    raise DataError(f"{path}: its optimizer state of key {i} belongs to {theirs}, but "
                    f"this model's key {i} is {ours} (the model orders its parameters "
                    "otherwise than when the checkpoint was saved)")


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
    if getattr(kv, "algorithm", None) == "preduce":
        # docs/spec/preduce.md: no server holds a model; mid-run a checkpoint is rank 0's
        # own model, the end of the run the average of all (kv.close()).
        return {p.name: p.data() for _, p in pairs}
    if into_params:
        outs = [p.list_data() for _, p in pairs]
    else:
        outs = [[mx.nd.zeros(p.shape, dtype=p.dtype)] for _, p in pairs]
    if pairs:
        kv.pull([i for i, _ in pairs], out=outs)
    return {p.name: o[0] for (_, p), o in zip(pairs, outs)}


def save_params(run_dir: Path, net, stem: str, weights: dict | None = None) -> Path:
    """Rank 0: the parameters to RUN_DIR/checkpoints/STEM.params (net.save_parameters'
    format); ``weights`` ({Parameter name: NDArray}, from pull_global) replace the
    parameters' own values."""
    import mxnet as mx
    ck = run_dir / "checkpoints"
    ck.mkdir(parents=True, exist_ok=True)
    params = ck / f"{stem}.params"
    if weights:
        arrays = {key: weights[p.name] if p.name in weights else p._reduce()  # noqa: SLF001
                  for key, p in net._collect_params_with_prefix().items()}  # noqa: SLF001
        mx.nd.save(str(params), arrays)
    else:
        net.save_parameters(str(params))
    return params


def save_local_params(net, path: Path) -> None:
    """This worker's parameters that no kvstore updates (grad_req 'null': BatchNorm's
    running statistics), each worker's own; nothing if the model has none."""
    import mxnet as mx
    local = {key: p._reduce() for key, p in net._collect_params_with_prefix().items()  # noqa: SLF001
             if p.grad_req == "null"}
    if local:
        mx.nd.save(str(path), local)


def load_local_params(net, path: Path, ctx) -> None:
    """Restore save_local_params' file (if there is one) into every device's copy.

    Written in place, not with ``Parameter.set_data``: on a Trainer that updates on the
    kvstore, MXNet's set_data resets the store, and the next step sends a fresh optimizer
    to the servers, dropping the momentum the checkpoint had just restored (a resumed
    ResNet-20 then ended 0.657 against 0.590)."""
    import mxnet as mx
    if not path.is_file():
        return
    params = net._collect_params_with_prefix()  # noqa: SLF001
    for key, value in mx.nd.load(str(path)).items():
        if key not in params:
            raise DataError(f"{path}: parameter {key} is not in this model")
        for copy in params[key].list_data():
            if copy.shape != value.shape:
                raise DataError(f"{path}: parameter {key} has shape {value.shape}, the "
                                f"model's is {copy.shape}")
            copy[:] = value.as_in_context(copy.context)


def record_checkpoint(run_dir: Path, info: dict, keep: int = 0,
                      accuracy: float | None = None) -> None:
    """Rank 0, once every file of the checkpoint is written: latest.json names it
    (atomically); then ``prune`` keeps the last ``keep`` and the best."""
    ck = run_dir / "checkpoints"
    _write_json(ck / "latest.json", info)
    prune(ck, Path(info["params"]).stem, int(info["step"]), keep, accuracy)


def prune(ck: Path, stem: str, step: int, keep: int, accuracy: float | None) -> list[dict]:
    """train.keep_checkpoints: the files of every checkpoint but the last ``keep`` and the
    one of the best validation accuracy (``accuracy``: the checkpoint's, None mid-epoch)
    are removed; 0 keeps all. CHECKPOINTS/index.json lists those that stay, oldest
    first, so a resumed run prunes what the first one wrote."""
    path = ck / "index.json"
    index = json.loads(path.read_text()) if path.is_file() else []
    # a resumed run: what the killed one wrote after the checkpoint it resumed from is
    # never used again
    index = [e for e in index if e["step"] < step] + [
        {"stem": stem, "step": step, "accuracy": accuracy}]
    stay = {e["stem"] for e in index[-keep:]} if keep else {e["stem"] for e in index}
    scored = [e for e in index if e["accuracy"] is not None]
    if scored:
        stay.add(max(scored, key=lambda e: e["accuracy"])["stem"])
    for f in ck.iterdir():
        name = f.name.split(".")[0]
        if name.startswith(("epoch-", "step-")) and name not in stay:
            f.unlink(missing_ok=True)
    index = [e for e in index if e["stem"] in stay]
    _write_json(path, index)
    return index


def checkpoint_bytes(run_dir: Path) -> int:
    """What RUN_DIR/checkpoints holds on disk (the summary reports it)."""
    ck = run_dir / "checkpoints"
    return sum(f.stat().st_size for f in ck.glob("*") if f.is_file()) if ck.is_dir() else 0


def _write_json(path: Path, value) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- loading

def _last_line(exc) -> str:
    """The last non-empty line of an error (MXNetError carries a C++ traceback)."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else type(exc).__name__


def load_checkpoint(run_dir: Path, info: dict, net, trainer, ctx, grad_batch: int) -> None:
    """Load the checkpoint ``info`` (from checkpoint_info): parameters, optimizer states
    (through the kvstore, to the servers, when they update) and the optimizer's update
    count, so that the lr schedule continues."""
    ck = run_dir / "checkpoints"
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
        _check_state_keys(ck / info["states"], info.get("state_keys"),
                          state_keys(net, trainer))
        try:
            if _on_ssd_sync(trainer):
                trainer.load_states(str(ck / info["states"]))
            else:
                _load_local_states(trainer, ck / info["states"])
        except Exception as exc:  # noqa: BLE001
            raise DataError(f"{ck / info['states']}: cannot restore optimizer states "
                            f"({_last_line(exc)})") from None
    opt = trainer._optimizer  # noqa: SLF001 - load_states may replace it
    opt.begin_num_update = opt.num_update = step
