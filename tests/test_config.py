"""ssdsgd.config: loading, validation (one-line errors naming the key), overrides, env."""
from pathlib import Path

import pytest
import yaml

from ssdsgd.config import (Config, ConfigError, cluster_env, load_config, new_run_dir,
                           parse_config, resolve_warmup_steps, save_config, sync_env)

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
MINIMAL = {"model": {"name": "digits_mlp"}, "data": {"dataset": "digits"}}


def write(tmp_path, data, name="job.yaml"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def merged(**sections):
    raw = {k: dict(v) for k, v in MINIMAL.items()}
    for key, value in sections.items():
        if isinstance(value, dict):
            raw.setdefault(key, {}).update(value)
        else:
            raw[key] = value
    return raw


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg, f"error is not one line: {msg!r}"
    return msg


def test_shipped_configs_exist():
    names = {p.name for p in CONFIGS}
    expected = {"digits.yaml"} | {f"cifar10_resnet{d}_{a}.yaml" for d in (20, 56)
                                  for a in ("ssgd", "asgd", "ssd")} | {
        f"imagenet_resnet50_{a}.yaml" for a in ("ssgd", "asgd", "ssd")}
    assert expected <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load_and_round_trip(path, tmp_path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert cfg.name == path.stem
    out = tmp_path / "saved.yaml"
    save_config(cfg, out)
    assert load_config(out) == cfg


def test_paper_settings_in_reproduction_configs():
    c = load_config(ROOT / "configs" / "cifar10_resnet20_ssd.yaml")
    assert (c.cluster.workers, c.cluster.servers, c.data.batch_size) == (4, 1, 128)
    assert (c.train.epochs, c.optimizer.lr, c.optimizer.momentum, c.optimizer.wd) == \
        (160, 0.4, 0.9, 1e-4)
    assert c.optimizer.lr_schedule.type == "step"
    assert c.optimizer.lr_schedule.step_epochs == [80, 120]
    assert c.optimizer.lr_schedule.factor == 0.1
    assert (c.sync.warmup_steps, c.sync.delay_steps) == ("500", "5")   # pinned: the paper's
    i = load_config(ROOT / "configs" / "imagenet_resnet50_asgd.yaml")
    assert (i.cluster.workers, i.cluster.servers, i.data.batch_size, i.train.epochs) == \
        (3, 3, 128, 90)
    assert i.optimizer.lr_schedule.warmup_epochs == 5
    assert i.sync.algorithm == "asgd"
    for alg in ("ssgd", "asgd", "ssd"):
        assert load_config(ROOT / f"configs/cifar10_resnet56_{alg}.yaml").sync.algorithm == alg


def test_defaults_and_overrides(tmp_path):
    path = write(tmp_path, MINIMAL)
    cfg = load_config(path, ["sync.delay_steps=10", "optimizer.lr_schedule.type=cosine",
                             "train.gpus=[0, 1]", "sync.lr_local=0.01", "optimizer.wd=1e-4"])
    assert cfg.sync.delay_steps == "10"
    assert cfg.optimizer.lr_schedule.type == "cosine"
    assert cfg.train.gpus == [0, 1]
    assert cfg.sync.lr_local == 0.01
    assert cfg.optimizer.wd == 1e-4          # '1e-4' is a string to PyYAML: accepted
    assert cfg.sync.algorithm == "ssd" and cfg.sync.warmup_steps == "auto"
    assert cfg.sync.local_rule == "glu" and cfg.sync.glu_state == "exact"
    assert cfg.cluster.heartbeat_timeout == 30.0
    assert cfg.to_dict()["sync"]["delay_steps"] == "10"
    assert load_config(path).sync.delay_steps == "auto"  # the file itself is unchanged


def test_a_bare_off_in_a_config_file_is_the_choice_off(tmp_path):
    """PyYAML reads `pull_relay: off` as false; a user who wrote off means the choice off
    (before: "expected one of auto, off, chain, got false"). A word that is no choice of
    the setting is still refused."""
    path = write(tmp_path, "model: {name: digits_mlp}\ndata: {dataset: digits}\n"
                           "sync: {pull_relay: off}\n")
    assert load_config(path).sync.pull_relay == "off"
    assert load_config(path, ["sync.pull_relay=off"]).sync.pull_relay == "off"
    bad = write(tmp_path, "model: {name: digits_mlp}\ndata: {dataset: digits}\n"
                          "sync: {compression: off}\n", "bad.yaml")
    with pytest.raises(ConfigError, match="sync.compression: expected"):
        load_config(bad)


BAD = [
    # (sections merged into a minimal valid config, overrides, substrings of the error)
    (dict(sync={"delay": 3}), [], ["sync.delay: unknown key", "delay_steps"]),
    (dict(trainer={"epochs": 3}), [], ["trainer: unknown key"]),
    (dict(cluster={"workers": "two"}), [], ["cluster.workers: expected an integer", "'two'"]),
    (dict(cluster={"workers": -1}), [], ["cluster.workers: expected an integer >= 1", "-1"]),
    (dict(cluster={"workers": 2.5}), [], ["cluster.workers: expected an integer"]),
    (dict(train={"epochs": True}), [], ["train.epochs: expected an integer"]),
    (dict(sync={"delay_steps": 0}), [], ["sync.delay_steps: expected auto or an integer >= 1", "0"]),
    (dict(sync={"algorithm": "fast"}), [], ["sync.algorithm: expected one of ssd, ssgd, asgd"]),
    (dict(sync={"local_rule": "glue"}), [], ["sync.local_rule: expected one of glu, sgd, none"]),
    (dict(model={"name": "resnet18"}), [], ["model.name: expected one of"]),
    (dict(model={"hybridize": "yes"}), [], ["model.hybridize: expected true or false"]),
    (dict(data={"dataset": "cifar10"}, model={"name": "cifar_resnet20_v1"}), [],
     ["data.path: required for dataset 'cifar10'"]),
    (dict(data={"dataset": "imagenet"}, model={"name": "resnet50_v1"}), [],
     ["data.path: required for dataset 'imagenet'"]),
    (dict(model={"name": "resnet50_v1"}), [], ["model.name", "does not fit dataset"]),
    # a path the digits dataset would ignore: the user meant other data (before: digits
    # trained silently)
    (dict(data={"path": "/data/cifar-10-batches-bin"}), [],
     ["data.path: dataset 'digits' reads no files", "/data/cifar-10-batches-bin",
      "data.dataset"]),
    (dict(data={"batch_size": 0}), [], ["data.batch_size: expected an integer >= 1"]),
    (dict(optimizer={"lr": 0}), [], ["optimizer.lr: expected a number > 0.0"]),
    (dict(optimizer={"lr": "fast"}), [], ["optimizer.lr: expected a number"]),
    (dict(optimizer={"name": "rmsprop2"}), [], ["optimizer.name: expected a registered"]),
    (dict(optimizer={"name": "adam"}, sync={"glu_state": "estimate"}), [],
     ["sync.glu_state", "use 'exact'"]),
    (dict(optimizer={"name": "adam"}, sync={"glu_state": "corrected"}), [],
     ["sync.glu_state: 'corrected' needs optimizer sgd or nag", "use 'exact'"]),
    (dict(sync={"glu_state": "corrected"}, optimizer={"momentum": 0}), [],
     ["sync.glu_state: 'corrected' needs optimizer sgd or nag with momentum > 0"]),
    (dict(optimizer={"lr_schedule": {"type": "step"}}), [],
     ["optimizer.lr_schedule.step_epochs: expected a non-empty list"]),
    (dict(optimizer={"lr_schedule": {"type": "step", "step_epochs": [5, 3]}}), [],
     ["optimizer.lr_schedule.step_epochs: expected strictly increasing"]),
    (dict(optimizer={"lr_schedule": {"factor": 1.5}}), [],
     ["optimizer.lr_schedule.factor: expected a number > 0.0 and <= 1.0"]),
    (dict(optimizer={"lr_schedule": "step"}), [], ["optimizer.lr_schedule: expected a mapping"]),
    (dict(train={"gpus": [0, "x"]}), [], ["train.gpus[1]: expected an integer"]),
    (dict(train={"gpus": "0"}), [], ["train.gpus: expected a list of integers"]),
    (dict(train={"gpus": [0, 0]}), [], ["train.gpus: expected distinct"]),
    (dict(cluster={"heartbeat_timeout": 0}), [], ["cluster.heartbeat_timeout: expected a number >= 0.1"]),
    (dict(cluster={"launcher": "yarn"}), [],
     ["cluster.launcher: expected one of local, ssh, mpi, slurm"]),
    (dict(sync={"lr_local": -1}), [], ["sync.lr_local: expected a number > 0.0"]),
    (dict(data={"augmentation": 1}), [], ["data.augmentation: expected true or false"]),
    (dict(sync=[1, 2]), [], ["sync: expected a mapping"]),
    ({}, ["sync.delay_steps"], ["--set 'sync.delay_steps': expected KEY=VALUE"]),
    ({}, ["=5"], ["--set '=5'", "dotted key"]),
    ({}, ["sync..delay_steps=5"], ["dotted key"]),
    ({}, ["sync.delay_steps=[1"], ["--set 'sync.delay_steps=[1'", "not a YAML"]),
    ({}, ["sync.delay_steps=0"], ["sync.delay_steps: expected auto or an integer >= 1, got 0"]),
    ({}, ["sync.nope=1"], ["sync.nope: unknown key"]),
    ({}, ["model.name.x=1"], ["model.name is not a section"]),
]


@pytest.mark.parametrize("sections, overrides, expected", BAD,
                         ids=[f"{i}-{' '.join(e[2])[:30]}" for i, e in enumerate(BAD)])
def test_bad_config_gives_one_line_error_naming_the_key(tmp_path, sections, overrides,
                                                        expected):
    path = write(tmp_path, merged(**sections))
    msg = error_of(load_config, path, overrides)
    for part in expected:
        assert part in msg, f"{part!r} not in {msg!r}"


def test_missing_required_sections(tmp_path):
    msg = error_of(load_config, write(tmp_path, {"data": {"dataset": "digits"}}))
    assert msg.startswith("model: required key is missing")
    msg = error_of(load_config, write(tmp_path, {"model": {"name": "digits_mlp"}}))
    assert msg.startswith("data: required key is missing")


def test_error_names_the_file(tmp_path):
    path = write(tmp_path, merged(sync={"delay_steps": 0}), "myjob.yaml")
    assert "myjob.yaml" in error_of(load_config, path)


def test_unreadable_and_invalid_files(tmp_path):
    msg = error_of(load_config, tmp_path / "absent.yaml")
    assert "absent.yaml: cannot read config file" in msg
    msg = error_of(load_config, write(tmp_path, "model: {name: digits_mlp\ndata: [\n"))
    assert "not valid YAML at line" in msg
    msg = error_of(load_config, write(tmp_path, "- 1\n- 2\n"))
    assert "the top level: expected a mapping" in msg


def test_sync_env_matches_design_doc_names(tmp_path):
    cfg = parse_config(merged(sync={"algorithm": "ssgd", "warmup_steps": 7,
                                    "delay_steps": 3, "local_rule": "sgd",
                                    "glu_state": "exact", "lr_local": 0.5}))
    assert sync_env(cfg) == {"SSDSGD_ALGORITHM": "ssgd", "SSDSGD_GROUP_SIZE": "2",
                             "SSDSGD_SYNC_PERIOD": "4", "SSDSGD_OUTER_LR": "0.7",
                             "SSDSGD_OUTER_MOMENTUM": "0.9", "SSDSGD_WARMUP_STEPS": "7",
                             "SSDSGD_DELAY_STEPS": "3", "SSDSGD_LOCAL_RULE": "sgd",
                             "SSDSGD_GLU_STATE": "exact", "SSDSGD_LR_LOCAL": "0.5",
                             "SSDSGD_PULL_SCHEDULE": "aligned", "SSDSGD_PULL_RELAY": "auto"}
    assert "SSDSGD_LR_LOCAL" not in sync_env(parse_config(MINIMAL))
    cfg = parse_config(merged(cluster={"workers": 3, "servers": 2, "heartbeat_timeout": 5}))
    assert cluster_env(cfg) == {"SSDSGD_NUM_WORKERS": "3", "SSDSGD_NUM_SERVERS": "2",
                                "SSDSGD_HEARTBEAT_INTERVAL": "1.0",
                                "SSDSGD_HEARTBEAT_TIMEOUT": "5.0",
                                "SSDSGD_STALL_TIMEOUT": "300.0",
                                "SSDSGD_ON_WORKER_FAILURE": "abort",
                                "SSDSGD_SCHEDULER_RESTARTS": "0",
                                "SSDSGD_SERVER_REPLICAS": "0"}


def test_warmup_epochs_converted_with_steps_per_epoch():
    # digits: 1437 training images; 2 workers x 32 -> 22 steps per epoch
    cfg = parse_config(merged(cluster={"workers": 2}, sync={"warmup_epochs": 2.5},
                              data={"batch_size": 32}))
    assert resolve_warmup_steps(cfg) == 55
    assert sync_env(cfg)["SSDSGD_WARMUP_STEPS"] == "55"
    assert resolve_warmup_steps(cfg, steps_per_epoch=10) == 25
    assert resolve_warmup_steps(parse_config(merged(sync={"warmup_steps": 9}))) == 9


def test_new_run_dir_is_unique(tmp_path):
    cfg = parse_config(merged(output={"dir": str(tmp_path / "runs")}), name="job")
    a, b = new_run_dir(cfg), new_run_dir(cfg)
    assert a != b and a.is_dir() and b.is_dir()
    assert a.parent == tmp_path / "runs" and a.name.startswith("job-")


# ---- the launcher's checks without MXNet -------------------------------------------------
PREPARE_ONLY = """
import sys
from ssdsgd.launch import cli
args = cli._config_parser().parse_args(sys.argv[1:])
config, run_dir, length, env, runner = cli._prepare(args)
assert length.total_steps == 440 and config.optimizer.name == "sgd", (length, config.optimizer.name)
print("mxnet loaded" if "mxnet" in sys.modules else "mxnet not loaded")
"""


@pytest.mark.system
def test_the_launchers_checks_do_not_load_mxnet(tmp_path):
    """Every check the launcher makes before a process starts (config, data, the run
    directory) runs without MXNet, as ssdsgd/__init__.py says: loading it took 1-3 s of
    CPU before every job (most of a short test job's launcher time)."""
    import subprocess
    import sys
    from ssdsgd.testing import clean_env
    r = subprocess.run([sys.executable, "-c", PREPARE_ONLY, str(ROOT / "configs" / "digits.yaml"),
                        "--set", f"output.dir={tmp_path}"], capture_output=True, text=True,
                       cwd=ROOT, env=dict(clean_env(), PYTHONPATH=str(ROOT)), timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "mxnet not loaded"


def test_the_launchers_optimizer_names_are_mxnets_registry():
    """The names the config accepts without MXNet are exactly those MXNet itself registers
    (classes another module registered in this test process left out)."""
    import mxnet as mx
    from ssdsgd.config import MXNET_OPTIMIZERS
    registry = mx.optimizer.Optimizer.opt_registry
    assert MXNET_OPTIMIZERS == {name for name, cls in registry.items()
                                if cls.__module__.startswith("mxnet.")}
