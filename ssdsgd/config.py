"""One YAML file per job: typed, validated once at load.

A job is described by one YAML file with the sections ``cluster``, ``sync``, ``model``,
``data``, ``optimizer``, ``train`` and ``output`` (see ``docs/training.md``). Loading it
checks every key: an unknown key, a wrong type or an impossible value raises
:class:`ConfigError` with a one-line message that names the key's dotted path and what
was expected, e.g.::

    sync.delay_steps: expected auto or an integer >= 1, got 0 (configs/digits.yaml)

API used by the launcher::

    cfg = load_config("configs/digits.yaml", ["sync.delay_steps=10"])
    cfg.to_dict(); save_config(cfg, run_dir / "config.yaml")
    env = job_env(cfg, start_step=0)   # every SSDSGD_* variable the config decides
    run_dir = new_run_dir(cfg)         # <output.dir>/<output.name>-<timestamp>

The ``cluster`` and ``sync`` sections are the config keys of ``ssdsgd.settings``' table:
their fields, defaults, bounds and choices come from there, as do the variables that
``sync_env`` / ``cluster_env`` write, so a config the loader accepts is one every process
accepts. How a mapping is read into these dataclasses (types, bounds, unknown keys,
``--set`` overrides) is ``ssdsgd/config_schema.py``.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from . import settings as S
from .sync import auto
from .config_schema import ConfigError, apply_override, build, copy_tree, show
from .config_schema import typed_field as _f

__all__ = [
    "ConfigError", "Config", "ClusterConfig", "SyncConfig", "ModelConfig", "DataConfig",
    "LRScheduleConfig", "OptimizerConfig", "TrainConfig", "OutputConfig",
    "load_config", "parse_config", "save_config", "sync_env", "cluster_env",
    "job_env", "check_worker_env", "resolve_warmup_steps", "new_run_dir", "MODEL_NAMES",
    "DATASETS",
]


MODEL_NAMES = ("cifar_resnet20_v1", "cifar_resnet56_v1", "resnet50_v1", "alexnet", "vgg16",
               "digits_mlp", "digits_cnn")
DATASETS = ("digits", "cifar10", "imagenet")
#: the files data.path must hold, for the datasets that read any
FILES_OF_DATASET = {"cifar10": "CIFAR-10 .bin files",
                    "imagenet": "train.rec/.idx and val.rec/.idx"}


def _section(name: str):
    """The dataclass of config section ``name``: one field per row of the settings table
    whose key is ``name.*``, with its default; the row validates the value."""
    def annotation(s):
        tp = Literal[s.choices] if s.choices else s.type
        return Optional[tp] if s.optional else tp
    rows = [s for s in S.SETTINGS if s.section == name]
    cls = dataclasses.make_dataclass(f"{name.title()}Config", [
        (s.key, annotation(s), field(default=s.default, metadata={"setting": s, "doc": s.doc}))
        for s in rows])
    cls.__module__ = __name__
    return cls


ClusterConfig = _section("cluster")
SyncConfig = _section("sync")
DebugConfig = _section("debug")


@dataclass
class ModelConfig:
    name: Literal[MODEL_NAMES] = _f(required=True)  # type: ignore[valid-type]
    hybridize: bool = _f(True)


@dataclass
class DataConfig:
    dataset: Literal[DATASETS] = _f(required=True)  # type: ignore[valid-type]
    path: Optional[str] = _f(None, doc="directory with the data files (cifar10, imagenet)")
    batch_size: int = _f(32, min=1, doc="per worker")
    augmentation: bool = _f(True)
    loader_threads: int = _f(2, min=0, doc="threads preparing batches (0: in the loop)")
    crop_size: int = _f(224, min=1, doc="imagenet: training/validation crop")
    resize_size: Optional[int] = _f(None, min=1, doc="imagenet: validation resize of the "
                                    "shorter side; default round(crop_size / 0.875)")
    num_classes: Optional[int] = _f(None, min=2, doc="default: the dataset's own")
    assignment: str = field(default=S.BY_NAME["assignment"].default,
                            metadata={"setting": S.BY_NAME["assignment"],
                                      "doc": S.BY_NAME["assignment"].doc})


@dataclass
class LRScheduleConfig:
    type: Literal["none", "step", "cosine", "poly"] = _f("none")
    step_epochs: list[float] = _f(factory=list, doc="step: epochs at which lr *= factor")
    factor: float = _f(0.1, above=0.0, max=1.0)
    power: float = _f(2.0, above=0.0, doc="poly: exponent")
    final_lr: float = _f(0.0, min=0.0, doc="cosine/poly: lr at the end")
    warmup_epochs: float = _f(0.0, min=0.0, doc="linear lr warm-up length")
    warmup_begin_lr: float = _f(0.0, min=0.0)


@dataclass
class OptimizerConfig:
    name: str = _f("sgd", doc="any registered mx.optimizer name")
    lr: float = _f(0.1, above=0.0)
    momentum: float = _f(0.9, min=0.0, max=1.0, doc="ignored by optimizers without momentum")
    wd: float = _f(0.0, min=0.0)
    lr_schedule: LRScheduleConfig = _f(factory=LRScheduleConfig)


@dataclass
class TrainConfig:
    epochs: int = _f(10, min=1)
    max_steps: Optional[int] = _f(None, min=1, doc="stop after this many steps in total")
    seed: int = _f(0, min=0)
    log_interval: int = _f(20, min=1, doc="steps between log lines / metrics records")
    checkpoint_every: int = _f(1, min=0, doc="epochs between checkpoints (0: never)")
    keep_checkpoints: int = _f(3, min=0, doc="checkpoints kept on disk: the last N and the "
                               "best validated (0: every one)")
    checkpoint_every_s: Optional[float] = field(default=S.BY_NAME["checkpoint_every_s"].default,
                                                metadata={"setting": S.BY_NAME["checkpoint_every_s"],
                                                          "doc": S.BY_NAME["checkpoint_every_s"].doc})
    timeline: bool = field(default=S.BY_NAME["timeline"].default,
                           metadata={"setting": S.BY_NAME["timeline"],
                                     "doc": S.BY_NAME["timeline"].doc})
    gpus: list[int] = _f(factory=list, doc="GPU ids; empty: CPU")


@dataclass
class OutputConfig:
    dir: str = _f("runs", doc="runs root; each run gets its own subdirectory")
    name: Optional[str] = _f(None, doc="run name prefix; default: the config file's stem")
    plots: bool = _f(True, doc="the launcher draws RUN_DIR/plots/*.png at the end of the job "
                               "(matplotlib: about 1 s of CPU)")


@dataclass
class Config:
    cluster: ClusterConfig = _f(factory=ClusterConfig)
    sync: SyncConfig = _f(factory=SyncConfig)
    model: ModelConfig = _f(required=True)
    data: DataConfig = _f(required=True)
    optimizer: OptimizerConfig = _f(factory=OptimizerConfig)
    train: TrainConfig = _f(factory=TrainConfig)
    output: OutputConfig = _f(factory=OutputConfig)
    debug: DebugConfig = _f(factory=DebugConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def name(self) -> str:
        return self.output.name or "run"


# The optimizers MXNet 1.9.1 registers itself (mx.optimizer.Optimizer.opt_registry; kept
# equal to it by tests/test_config.py): the launcher checks optimizer.name against them
# without loading MXNet, which cost 1-3 s of CPU before every job.
MXNET_OPTIMIZERS = frozenset({
    "adadelta", "adagrad", "adam", "adamax", "ccsgd", "dcasgd", "ftml", "ftrl",
    "groupadagrad", "lamb", "lars", "lbsgd", "nadam", "nag", "rmsprop", "sgd", "sgld",
    "signum", "test"})


def _optimizer_registry():
    """MXNet's registry where MXNet is loaded already (a worker), else its own names."""
    mx = sys.modules.get("mxnet")
    return mx.optimizer.Optimizer.opt_registry if mx is not None else MXNET_OPTIMIZERS


def _cross_check(cfg: Config) -> None:
    """Checks that involve more than one key."""
    files = FILES_OF_DATASET.get(cfg.data.dataset)
    if files and not cfg.data.path:
        raise ConfigError(f"data.path: required for dataset '{cfg.data.dataset}' (a directory "
                          f"with the {files})")
    if not files and cfg.data.path:
        raise ConfigError(f"data.path: dataset '{cfg.data.dataset}' reads no files "
                          f"(scikit-learn ships it), so {cfg.data.path} would be ignored; for "
                          f"the data there set data.dataset ({', '.join(FILES_OF_DATASET)}) "
                          "and its model, or remove data.path")
    model_data = {"digits_mlp": "digits", "digits_cnn": "digits"}
    if model_data.get(cfg.model.name, cfg.data.dataset) != cfg.data.dataset or (
            cfg.data.dataset == "digits" and cfg.model.name not in model_data):
        raise ConfigError(f"model.name: '{cfg.model.name}' does not fit dataset "
                          f"'{cfg.data.dataset}' (digits needs digits_mlp or digits_cnn; "
                          "the others need cifar10 or imagenet)")
    name = cfg.optimizer.name.lower()
    registry = _optimizer_registry()
    if name not in registry:
        raise ConfigError(f"optimizer.name: expected a registered mx.optimizer name "
                          f"(e.g. sgd, nag, adam), got {cfg.optimizer.name!r}")
    cfg.optimizer.name = name
    sched = cfg.optimizer.lr_schedule
    if sched.type == "step":
        if not sched.step_epochs:
            raise ConfigError("optimizer.lr_schedule.step_epochs: expected a non-empty list "
                              "of epochs for type 'step'")
        if any(e <= 0 for e in sched.step_epochs) or sorted(set(sched.step_epochs)) != \
                list(sched.step_epochs):
            raise ConfigError("optimizer.lr_schedule.step_epochs: expected strictly "
                              f"increasing positive epochs, got {show(sched.step_epochs)}")
    if sched.warmup_epochs > 0 and sched.warmup_begin_lr > cfg.optimizer.lr:
        raise ConfigError("optimizer.lr_schedule.warmup_begin_lr: expected <= optimizer.lr "
                          f"({cfg.optimizer.lr}), got {sched.warmup_begin_lr}")
    if sched.type in ("cosine", "poly") and sched.final_lr >= cfg.optimizer.lr:
        raise ConfigError(f"optimizer.lr_schedule.final_lr: expected < optimizer.lr "
                          f"({cfg.optimizer.lr}), got {sched.final_lr}")
    if sched.warmup_epochs >= cfg.train.epochs and (sched.type in ("cosine", "poly")):
        raise ConfigError(f"optimizer.lr_schedule.warmup_epochs: expected < train.epochs "
                          f"({cfg.train.epochs}), got {sched.warmup_epochs}")
    s = cfg.sync
    if (s.algorithm == "ssd" and s.local_rule == "glu" and s.glu_state in ("estimate", "corrected")
            and (name not in ("sgd", "nag") or cfg.optimizer.momentum <= 0)):
        raise ConfigError(f"sync.glu_state: {s.glu_state!r} needs optimizer sgd or nag with "
                          f"momentum > 0 (got {name}, momentum {cfg.optimizer.momentum}); "
                          "use 'exact'")
    if cfg.train.gpus and len(set(cfg.train.gpus)) != len(cfg.train.gpus):
        raise ConfigError(f"train.gpus: expected distinct GPU ids, got {show(cfg.train.gpus)}")
    if any(g < 0 for g in cfg.train.gpus):
        raise ConfigError(f"train.gpus: expected GPU ids >= 0, got {show(cfg.train.gpus)}")
    # the settings' own rules, and the registry's combinations of algorithm and features
    # (ssdsgd/sync/registry.py), which also read whether the job writes checkpoints
    values = dict(_setting_values(cfg), checkpoint_every=cfg.train.checkpoint_every)
    try:
        S.cross_check(values, lambda name: "train.checkpoint_every"
                      if name == "checkpoint_every" else S.BY_NAME[name].path)
    except S.SettingError as e:
        raise ConfigError(str(e)) from None


def _setting_values(cfg: Config) -> dict:
    """The config's value of every setting that has a config key, by setting name."""
    return {s.name: getattr(getattr(cfg, s.section), s.key) for s in S.BY_PATH.values()}


# --------------------------------------------------------------------------- public API

def parse_config(raw: Any, overrides: list[str] | tuple[str, ...] = (), *,
                 source: str = "<config>", name: str | None = None) -> Config:
    """Validate an already-parsed mapping (plus overrides) and return a Config."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"the top level: expected a mapping of sections, got {show(raw)} "
                          f"({source})")
    raw = copy_tree(raw)
    for text in overrides or ():
        apply_override(raw, text)
    try:
        cfg = build(Config, raw, "")
        _cross_check(cfg)
    except ConfigError as exc:
        raise ConfigError(f"{exc} ({source})") from None
    if cfg.output.name is None and name:
        cfg.output.name = name
    return cfg


def load_config(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read the YAML job file ``path``, apply ``overrides`` ("sync.delay_steps=10", values
    parsed as YAML) and validate. Raises ConfigError (one line) on any problem."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file ({exc.strerror})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}: not valid YAML{where} ({problem})") from None
    return parse_config(raw, overrides, source=str(path), name=path.stem)


def save_config(config: Config, path: str | os.PathLike) -> None:
    """Write ``config`` as YAML; load_config(path) gives an equal Config back."""
    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))


def resolve_warmup_steps(config: Config, steps_per_epoch: int | None = None) -> int:
    """The warm-up length T_w in steps: sync.warmup_epochs * steps_per_epoch if
    warmup_epochs is set (it overrides warmup_steps), else sync.warmup_steps, whose
    ``auto`` is a share of the run (ssdsgd/sync/auto.py)."""
    if config.sync.warmup_epochs is None and not auto.is_auto(config.sync.warmup_steps):
        return int(config.sync.warmup_steps)
    steps_per_epoch = _steps_per_epoch(config, steps_per_epoch)
    if config.sync.warmup_epochs is None:
        return auto.warmup_steps("auto", total_steps(config, steps_per_epoch))[0]
    return int(round(config.sync.warmup_epochs * steps_per_epoch))


def total_steps(config: Config, steps_per_epoch: int | None = None) -> int:
    """The run's length in steps: train.epochs of ``steps_per_epoch`` (counted for
    cluster.workers if not given), at most train.max_steps (checkpoint.run_length's)."""
    total = config.train.epochs * _steps_per_epoch(config, steps_per_epoch)
    return total if config.train.max_steps is None else min(total, config.train.max_steps)


def _steps_per_epoch(config: Config, steps_per_epoch: int | None) -> int:
    """The given count, else counted from the data (cheap: file sizes, index lengths)."""
    if steps_per_epoch is None:
        from ssdsgd.data import steps_per_epoch as _spe
        steps_per_epoch = _spe(config, config.cluster.workers)
    return steps_per_epoch


def _env_values(config: Config, section: str | None = None,
                steps_per_epoch: int | None = None) -> dict:
    """By setting name, the value of every setting the config decides that has a variable
    (of ``section`` only, if given); warm-up resolved to steps."""
    values = {name: value for name, value in _setting_values(config).items()
              if S.BY_NAME[name].env and section in (None, S.BY_NAME[name].section)}
    if "warmup_steps" in values and config.sync.warmup_epochs is not None:
        values["warmup_steps"] = str(resolve_warmup_steps(config, steps_per_epoch))
    if values.get("quorum") == "all" and values.get("max_staleness") == \
            S.BY_NAME["max_staleness"].default:
        # no quorum: the job's variables stay those of a job before quorums existed
        del values["quorum"], values["max_staleness"]
    return values


def sync_env(config: Config, steps_per_epoch: int | None = None) -> dict[str, str]:
    """The SSDSGD_* variables of the ``sync`` section (unset ones left out).

    If sync.warmup_epochs is set, the steps per epoch are computed from the data
    (cheap: file sizes / index lengths) unless given."""
    return S.to_env(**_env_values(config, "sync", steps_per_epoch))


def cluster_env(config: Config) -> dict[str, str]:
    """The SSDSGD_* variables of the ``cluster`` section."""
    return S.to_env(**_env_values(config, "cluster"))


def _worker_values(config: Config, steps_per_epoch: int | None, start_step: int) -> dict:
    return dict(_env_values(config, None, steps_per_epoch), start_step=start_step,
                total_steps=total_steps(config, steps_per_epoch))


def job_env(config: Config, steps_per_epoch: int | None = None,
            start_step: int = 0) -> dict[str, str]:
    """What a launcher gives every process of the job: the variables of the ``cluster`` and
    ``sync`` sections and SSDSGD_START_STEP (the checkpoint's step when resuming, else 0).
    A setting the config leaves unset is written empty (unset), so that a value inherited
    from the launcher's environment cannot override the config."""
    values = _worker_values(config, steps_per_epoch, start_step)
    env = {S.BY_NAME[name].env: "" for name, value in values.items() if value is None}
    env.update(S.to_env(**values))
    return env


def check_worker_env(config: Config, env: dict, steps_per_epoch: int | None = None,
                     start_step: int = 0) -> None:
    """A worker's check that the variables of ``job_env`` in ``env`` (its os.environ) say
    what its config says; missing ones are filled in, a mismatch is a ConfigError."""
    for name, value in _worker_values(config, steps_per_epoch, start_step).items():
        s = S.BY_NAME[name]
        raw = env.get(s.env)
        if raw is None or raw == "":
            env.update(S.to_env(**{name: value}))
            continue
        try:
            have = s.parse(raw)
        except S.SettingError as e:
            raise ConfigError(f"{s.env}={raw!r}: {e}") from None
        if have != value:
            want = "unset" if value is None else s.format(value)
            raise ConfigError(f"{s.env}={raw} in the environment, but the config gives "
                              f"{want}; start workers with the launcher's job_env(config)")


def new_run_dir(config: Config, now: datetime.datetime | None = None) -> Path:
    """Create and return a fresh ``<output.dir>/<name>-<YYYYmmdd-HHMMSS>`` directory."""
    now = now or datetime.datetime.now()
    root = Path(config.output.dir)
    root.mkdir(parents=True, exist_ok=True)
    base = f"{config.name}-{now:%Y%m%d-%H%M%S}"
    for i in range(1000):
        candidate = root / (base if i == 0 else f"{base}-{i}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise ConfigError(f"output.dir: cannot create a new run directory under {root}")
