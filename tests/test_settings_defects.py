"""Issue 12, defect 8: settings that passed one check and failed another.

Each test reproduces what the probe found (it failed before the settings table):
- ``cluster.heartbeat_timeout: 0.05`` passed config validation, then every process died
  on SSDSGD_HEARTBEAT_TIMEOUT (exit 1, a run directory left behind);
- a heartbeat interval >= the timeout aborted the job with "lost the scheduler";
- ``SSDSGD_LR_LOCAL=1e30`` was accepted (the job exited 0 with garbage weights);
- ``--env SSDSGD_NUM_WORKERS=3`` with ``-n 2`` made the scheduler wait for a third worker.
Now each is refused before anything starts: exit code 2 and one line naming the cause.
In process; nothing is started when the checks work.
"""
import os
import sys
from pathlib import Path

import pytest

from ssdsgd.config import ConfigError, parse_config
from ssdsgd.kvstore.env import EnvError, NodeEnv

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
MINIMAL = {"model": {"name": "digits_mlp"}, "data": {"dataset": "digits"}}


@pytest.fixture
def launcher(monkeypatch, capsys):
    """Run launch/dist.py's main in process from the repository root with no SSDSGD_*
    variables inherited; returns (exit code, stderr lines)."""
    from ssdsgd.launch.cli import main
    monkeypatch.chdir(ROOT)
    for key in [k for k in os.environ if k.startswith(("SSDSGD_", "DMLC_"))]:
        monkeypatch.delenv(key)

    def run(args):
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return code, out, err.strip().splitlines()
    return run


def with_cluster(**cluster):
    return dict(MINIMAL, cluster=cluster)


def node_env(**variables):
    return dict({"SSDSGD_SCHEDULER_PORT": "9000"}, **{k: str(v) for k, v in variables.items()})


def one_line_error(code, out, lines, *parts):
    assert code == 2, (code, lines[-5:])
    assert out == "" and len(lines) == 1, lines
    assert lines[0].startswith("launch/dist.py: error: "), lines
    for part in parts:
        assert part in lines[0], (part, lines[0])


# ------------------------------------------------------------ heartbeat_timeout: 0.05

def test_config_refuses_a_heartbeat_timeout_the_processes_refuse():
    with pytest.raises(ConfigError, match=r"^cluster\.heartbeat_timeout: expected a number "
                                          r">= 0\.1 .*got 0\.05"):
        parse_config(with_cluster(heartbeat_timeout=0.05))
    with pytest.raises(EnvError, match=r"^SSDSGD_HEARTBEAT_TIMEOUT='0.05': expected a number "
                                       r">= 0\.1"):
        NodeEnv.from_environ(node_env(SSDSGD_HEARTBEAT_TIMEOUT=0.05))


def test_launcher_refuses_heartbeat_timeout_before_starting(launcher, tmp_path):
    runs = tmp_path / "runs"
    one_line_error(*launcher(["configs/digits.yaml", "--set", "cluster.heartbeat_timeout=0.05",
                              "--set", f"output.dir={runs}"]),
                   "cluster.heartbeat_timeout: expected a number >= 0.1", "got 0.05")
    assert not runs.exists() or not any(runs.iterdir()), "a run directory was left behind"


# ------------------------------------------------------------ interval >= timeout

def test_config_refuses_heartbeat_interval_not_well_below_timeout():
    for interval, timeout in ((5, 3), (3, 3), (2, 3)):
        with pytest.raises(ConfigError, match=r"^cluster\.heartbeat_timeout: expected at least "
                                              r"twice cluster\.heartbeat_interval"):
            parse_config(with_cluster(heartbeat_interval=interval, heartbeat_timeout=timeout))
    cfg = parse_config(with_cluster(heartbeat_interval=1.5, heartbeat_timeout=3))
    assert (cfg.cluster.heartbeat_interval, cfg.cluster.heartbeat_timeout) == (1.5, 3.0)


def test_env_reader_refuses_heartbeat_interval_not_well_below_timeout():
    with pytest.raises(EnvError, match=r"^SSDSGD_HEARTBEAT_TIMEOUT: expected at least twice "
                                       r"SSDSGD_HEARTBEAT_INTERVAL \(5 s\), got 3"):
        NodeEnv.from_environ(node_env(SSDSGD_HEARTBEAT_INTERVAL=5, SSDSGD_HEARTBEAT_TIMEOUT=3))
    env = NodeEnv.from_environ(node_env(SSDSGD_HEARTBEAT_INTERVAL=1.5,
                                        SSDSGD_HEARTBEAT_TIMEOUT=3))
    assert (env.heartbeat_interval, env.heartbeat_timeout) == (1.5, 3.0)


def test_launcher_refuses_heartbeat_interval_before_starting(launcher):
    one_line_error(*launcher(["-n", 1, "-s", 1, "--env", "SSDSGD_HEARTBEAT_INTERVAL=5",
                              "--env", "SSDSGD_HEARTBEAT_TIMEOUT=3", "--", PY, "-c", "pass"]),
                   "SSDSGD_HEARTBEAT_TIMEOUT", "twice SSDSGD_HEARTBEAT_INTERVAL")


# ------------------------------------------------------------ SSDSGD_LR_LOCAL=1e30

def test_lr_local_has_the_same_sane_bounds_in_config_and_environment():
    for value in ("1e30", "inf", "nan", "0", "-1"):
        with pytest.raises(EnvError, match=f"^SSDSGD_LR_LOCAL='{value}': expected a"):
            NodeEnv.from_environ(node_env(SSDSGD_LR_LOCAL=value))
    for value in (1e30, 0, 0.0, -1):
        with pytest.raises(ConfigError, match=r"^sync\.lr_local: expected a number > 0\.0 and "
                                              r"<= 10\.0"):
            parse_config(dict(MINIMAL, sync={"lr_local": value}))
    assert NodeEnv.from_environ(node_env(SSDSGD_LR_LOCAL="0.05")).lr_local == 0.05
    assert parse_config(dict(MINIMAL, sync={"lr_local": 0.05})).sync.lr_local == 0.05


def test_launcher_refuses_lr_local_before_starting(launcher):
    one_line_error(*launcher(["-n", 1, "-s", 1, "--env", "SSDSGD_LR_LOCAL=1e30", "--",
                              PY, "-c", "pass"]),
                   "SSDSGD_LR_LOCAL='1e30': expected a number > 0.0 and <= 10.0")


def test_launcher_refuses_a_bad_inherited_variable_before_starting(launcher, monkeypatch,
                                                                    tmp_path):
    """What every process would inherit from the launcher's own environment is checked
    too (a config-form job overrides the variables the config decides: see job_env)."""
    monkeypatch.setenv("SSDSGD_LR_LOCAL", "1e30")
    one_line_error(*launcher(["-n", 1, "--", PY, "-c", "pass"]), "SSDSGD_LR_LOCAL='1e30'")
    monkeypatch.setenv("SSDSGD_MAX_MESSAGE_BYTES", "0")
    runs = tmp_path / "runs"
    one_line_error(*launcher(["configs/digits.yaml", "--set", f"output.dir={runs}"]),
                   "SSDSGD_MAX_MESSAGE_BYTES='0': expected an integer >= 1")
    assert not runs.exists() or not any(runs.iterdir()), "a run directory was left behind"


# ------------------------------------------------------------ --env SSDSGD_NUM_WORKERS=3 -n 2

@pytest.mark.parametrize("env, parts", [
    ("SSDSGD_NUM_WORKERS=3", ["--env SSDSGD_NUM_WORKERS=3", "-n 2"]),
    ("SSDSGD_NUM_SERVERS=2", ["--env SSDSGD_NUM_SERVERS=2", "-s 1"]),
    ("SSDSGD_RANK=1", ["--env SSDSGD_RANK=1", "the launcher sets"]),
    ("SSDSGD_ROLE=server", ["--env SSDSGD_ROLE=server", "the launcher sets"]),
    ("SSDSGD_SCHEDULER_PORT=5555", ["--env SSDSGD_SCHEDULER_PORT=5555", "--port"]),
    ("SSDSGD_DELAY_STEP=3", ["--env SSDSGD_DELAY_STEP=3", "unknown", "SSDSGD_DELAY_STEPS"]),
])
def test_launcher_refuses_env_it_owns(launcher, env, parts):
    one_line_error(*launcher(["-n", 2, "-s", 1, "--env", env, "--", PY, "-c", "pass"]),
                   *parts)


def test_continue_without_a_dead_worker_is_refused_with_a_partial_quorum():
    """Quorum rounds do not take a removed worker (their staleness bound would wait for
    it): on_worker_failure: continue needs sync.quorum: all, or a quorum that is all."""
    from ssdsgd.config import ConfigError, parse_config
    raw = {"cluster": {"workers": 4, "on_worker_failure": "continue"},
           "sync": {"quorum": "majority"},
           "model": {"name": "digits_mlp"}, "data": {"dataset": "digits"}}
    with pytest.raises(ConfigError, match=r"cluster.on_worker_failure: continue works with "
                                          r"sync.quorum: all only, got 'majority'"):
        parse_config(raw)
    raw["cluster"]["workers"] = 2           # majority of 2 is all: nothing partial
    assert parse_config(raw).sync.quorum == "majority"


def test_relayed_pulls_are_refused_when_dead_workers_are_left_behind():
    """docs/spec/pull_relay.md: a relayed reply passes through other workers, so a job
    that continues without a dead worker would leave the rest of its chain waiting."""
    raw = {"cluster": {"workers": 4, "on_worker_failure": "continue"},
           "sync": {"pull_relay": "chain"}, **MINIMAL}
    with pytest.raises(ConfigError, match=r"sync.pull_relay: chain works with "
                                          r"cluster.on_worker_failure: abort or restart only"):
        parse_config(raw)
    for failure in ("abort", "restart"):
        raw["cluster"]["on_worker_failure"] = failure
        assert parse_config(raw).sync.pull_relay == "chain"
    raw["sync"]["quorum"] = "majority"
    with pytest.raises(ConfigError, match=r"sync.pull_relay: chain works with sync.quorum: "
                                          r"all only, got 'majority'"):
        parse_config(raw)
    with pytest.raises(EnvError, match="SSDSGD_PULL_RELAY: chain works with "
                                       "SSDSGD_ON_WORKER_FAILURE: abort or restart only"):
        NodeEnv.from_environ({"SSDSGD_PULL_RELAY": "chain", "SSDSGD_ON_WORKER_FAILURE":
                              "continue", "SSDSGD_SCHEDULER_HOST": "127.0.0.1",
                              "SSDSGD_SCHEDULER_PORT": "9000", "SSDSGD_ROLE": "worker",
                              "SSDSGD_NUM_WORKERS": "2", "SSDSGD_NUM_SERVERS": "1"})
