"""ssdsgd.settings is the single source of every setting: the config validator, the
environment reader (NodeEnv), the launcher, the local rules and the docs all follow it.

For every setting, each probe value (just inside and just outside each bound, each choice,
a wrong choice, the default) is accepted or refused alike by the config and by the
environment reader, with the same value, and a config's values reach every process
unchanged through the variables the launcher writes. In process.
"""
import ast
import dataclasses
import math
from pathlib import Path

import pytest

from ssdsgd import settings as S
from ssdsgd.config import (ClusterConfig, ConfigError, SyncConfig, check_worker_env, job_env,
                           parse_config)
from ssdsgd.kvstore.env import EnvError, NodeEnv
from ssdsgd.sync.registry import algorithm

ROOT = Path(__file__).resolve().parents[1]
MINIMAL = {"model": {"name": "digits_mlp"}, "data": {"dataset": "digits"}}
PORT = {"SSDSGD_SCHEDULER_PORT": "9000"}
# Settings tied by a rule of S.CROSS_CHECKS: while one is probed, the other is set where it
# allows the most, so that the probe meets the setting's own bounds.
PARTNERS = {"heartbeat_timeout": {"heartbeat_interval": 0.01},
            "heartbeat_interval": {"heartbeat_timeout": 86400.0},
            # preduce's default group of 2 needs 2 workers
            "algorithm": {"num_workers": 4},
            # dynamic data needs a quorum below N (or preduce)
            "assignment": {"num_workers": 4, "quorum": "majority"},
            # a backup lives on another server
            "server_replicas": {"num_servers": 2},
            # joiners need an algorithm that takes them (ssgd: with the default relay)
            "max_workers": {"algorithm": "ssgd"}}


def probes(s):
    """Values on both sides of every bound, each choice and wrong ones, the default."""
    if s.choices:
        return list(s.choices) + ["bogus", s.choices[0].upper(), 1, True]
    if s.type is str:
        return ["somewhere.example", 7]
    values = [] if s.default in (None, S.REQUIRED) else [s.default]
    if s.type is int:
        for bound in (s.min, s.max):
            if bound is not None:
                values += [bound - 1, bound, bound + 1]
        return values + [7, 2.5, True]
    for bound in (s.min, s.max, s.above):
        if bound is not None:
            values += [math.nextafter(bound, -math.inf), bound, math.nextafter(bound, math.inf)]
    return values + [0.5, 1e30, -1e30, math.inf, math.nan, "1e-4", "fast", True]


def env_text(value):
    return repr(float(value)) if isinstance(value, float) else str(value)


def by_config(s, value):
    """(accepted, value) of sync/cluster key ``s.path: value`` in a minimal config."""
    raw = {k: dict(v) for k, v in MINIMAL.items()}
    for name, partner in dict(PARTNERS.get(s.name, {}), **{s.name: value}).items():
        p = S.BY_NAME[name]
        raw.setdefault(p.section, {})[p.key] = partner
    try:
        cfg = parse_config(raw)
    except ConfigError as e:
        assert "\n" not in str(e) and str(e).startswith(s.path), str(e)
        return False, None
    return True, getattr(getattr(cfg, s.section), s.key)


def by_env(s, value):
    """(accepted, value) of ``s.env=value`` for the environment reader."""
    env = dict(PORT, **S.to_env(**PARTNERS.get(s.name, {})))
    env[s.env] = env_text(value)
    try:
        got = NodeEnv.from_environ(env)
    except EnvError as e:
        assert "\n" not in str(e) and str(e).startswith(s.env), str(e)
        return False, None
    return True, getattr(got, s.name)


def by_table(s, value):
    try:
        return True, s.check(value)
    except S.SettingError:
        return False, None


def same(a, b):
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


@pytest.mark.parametrize("s", S.SETTINGS, ids=lambda s: s.name)
def test_config_and_environment_accept_the_same_values(s):
    results = []
    for value in probes(s):
        table = by_table(s, value)
        readers = {}
        if s.path:
            readers["config"] = by_config(s, value)
        if s.env:
            readers["environment"] = by_env(s, value)
            if s.type is str and not isinstance(value, str):
                # a variable holds text: the text of 7 is a fine host name
                table = by_table(s, env_text(value))
        for who, (ok, got) in readers.items():
            assert ok == table[0] and same(got, table[1]), (s.name, value, who, readers, table)
        results.append(table[0])
    if s.choices or s.type is not str:     # any text is a host name
        assert True in results and False in results, (s.name, "probes miss a side")


@pytest.mark.parametrize("s", [s for s in S.SETTINGS if s.path and s.env],
                         ids=lambda s: s.name)
def test_config_values_reach_every_process_unchanged(s):
    """A config's value, written by the launcher (job_env), is what NodeEnv reads and what
    a worker's own check (check_worker_env) accepts."""
    for value in probes(s):
        ok, want = by_config(s, value)
        if not ok:
            continue
        raw = {k: dict(v) for k, v in MINIMAL.items()}
        for name, v in dict(PARTNERS.get(s.name, {}), **{s.name: value}).items():
            raw.setdefault(S.BY_NAME[name].section, {})[S.BY_NAME[name].key] = v
        cfg = parse_config(raw)
        # a resumed job's step, except for an algorithm that is never resumed (refused:
        # tests/test_combinations.py)
        start = 0 if "resume" in algorithm(cfg.sync.algorithm).refused else 3
        env = dict(PORT, **job_env(cfg, steps_per_epoch=10, start_step=start))
        node = NodeEnv.from_environ(env)
        assert same(getattr(node, s.name), want) and node.start_step == start, (s.name, value)
        check_worker_env(cfg, dict(env), 10, start)


def test_defaults_agree():
    cfg = parse_config(MINIMAL)
    node = NodeEnv.from_environ(PORT)
    for s in S.SETTINGS:
        if s.path:
            assert getattr(getattr(cfg, s.section), s.key) == s.default, s.name
        if s.env and s.default is not S.REQUIRED:
            assert getattr(node, s.name) == s.default, s.name
            assert s.check(s.default) == s.default, s.name
    with pytest.raises(EnvError, match="^SSDSGD_SCHEDULER_PORT is not set; it is required"):
        NodeEnv.from_environ({})


def test_every_reader_has_exactly_the_table_rows():
    assert [f.name for f in dataclasses.fields(NodeEnv)] == [s.name for s in S.BY_ENV.values()]
    for cls, section in ((ClusterConfig, "cluster"), (SyncConfig, "sync")):
        assert [f.name for f in dataclasses.fields(cls)] == \
            [s.key for s in S.SETTINGS if s.section == section]
    from ssdsgd.glu import rules
    from ssdsgd.launch.launchers import NAMES as LAUNCHERS   # local, ssh, mpi, slurm
    assert rules.RULES == S.BY_NAME["local_rule"].choices
    assert rules.GLU_STATES == S.BY_NAME["glu_state"].choices
    assert tuple(sorted(LAUNCHERS)) == tuple(sorted(S.BY_NAME["launcher"].choices))
    assert len(S.BY_NAME) == len(S.SETTINGS) and all(s.env.startswith(S.PREFIX)
                                                     for s in S.BY_ENV.values())


def test_local_rules_apply_the_lr_local_bounds():
    import mxnet as mx
    from ssdsgd.glu import make_local_rule
    make_sgd = lambda: mx.optimizer.SGD(learning_rate=0.1, momentum=0.9)  # noqa: E731
    for bad in (0.0, 1e30, -1.0):
        with pytest.raises(ValueError, match=r"^lr_local: expected a number > 0\.0 and <= 10"):
            make_local_rule("glu", make_sgd, 2, "estimate", lr_local=bad)
    assert make_local_rule("sgd", make_sgd, 2, lr_local=10.0).lr_local == 10.0


def test_heartbeat_rule_is_the_same_in_config_and_environment():
    for interval in (0.01, 0.5, 1.0, 2.0):
        for timeout in (0.1, 1.0, 1.99, 2.0, 4.0):
            raw = dict(MINIMAL, cluster={"heartbeat_interval": interval,
                                         "heartbeat_timeout": timeout})
            try:
                parse_config(raw)
                cfg = True
            except ConfigError as e:
                cfg = False
                assert "cluster.heartbeat_timeout: expected at least twice" in str(e)
            env = dict(PORT, SSDSGD_HEARTBEAT_INTERVAL=str(interval),
                       SSDSGD_HEARTBEAT_TIMEOUT=str(timeout))
            try:
                NodeEnv.from_environ(env)
                node = True
            except EnvError:
                node = False
            assert cfg == node == (timeout >= 2 * interval), (interval, timeout)


def test_environment_text_forms():
    """Variables hold text: integers may be written as integral numbers (500.0), empty
    means unset, booleans (for settings to come) as 1/0, true/false, yes/no."""
    env = NodeEnv.from_environ(dict(PORT, SSDSGD_WARMUP_STEPS="500.0", SSDSGD_DELAY_STEPS=" 7",
                                    SSDSGD_LR_LOCAL="", SSDSGD_ALGORITHM=""))
    assert (env.warmup_steps, env.delay_steps, env.lr_local, env.algorithm) == ("500", "7",
                                                                                None, "ssd")
    with pytest.raises(EnvError, match=r"^SSDSGD_DELAY_STEPS='2.5': expected auto or an "
                                       r"integer >= 1$"):
        NodeEnv.from_environ(dict(PORT, SSDSGD_DELAY_STEPS="2.5"))
    flag = S.Setting("flag", bool, False, "a switch", env="SSDSGD_FLAG")
    assert [flag.parse(t) for t in ("1", "true", "Yes", "0", "false", "no")] == [True] * 3 + \
        [False] * 3
    assert flag.parse(flag.format(True)) is True and flag.format(False) == "0"
    with pytest.raises(S.SettingError, match="expected true or false"):
        flag.parse("maybe")
    for s in S.BY_ENV.values():
        for value in probes(s):
            ok, got = by_table(s, value)
            if ok and got is not None:
                assert same(s.parse(s.format(got)), got), (s.name, value)


def test_to_env_is_checked_and_leaves_unset_out():
    assert S.to_env(num_workers=2, num_servers=1, start_step=40, lr_local=None) == {
        "SSDSGD_NUM_WORKERS": "2", "SSDSGD_NUM_SERVERS": "1", "SSDSGD_START_STEP": "40"}
    with pytest.raises(S.SettingError, match="^SSDSGD_NUM_WORKERS=0: expected an integer >= 1"):
        S.to_env(num_workers=0)
    with pytest.raises(S.SettingError, match="warmup_epochs has no environment variable"):
        S.to_env(warmup_epochs=1.0)


def test_launcher_env_check():
    owned = S.to_env(num_workers=2, num_servers=1)
    S.check_launch_env({"SSDSGD_NUM_WORKERS": "2", "SSDSGD_ALGORITHM": "ssgd", "OMP": "1"},
                       owned, {"SSDSGD_RANK": "not a rank", "SSDSGD_DELAY_STEPS": "3"})
    cases = {
        ("SSDSGD_NUM_WORKERS", "3"): "--env SSDSGD_NUM_WORKERS=3: conflicts with -n 2",
        ("SSDSGD_NUM_WORKERS", "x"): "--env SSDSGD_NUM_WORKERS='x': expected an integer",
        ("SSDSGD_SCHEDULER_HOST", "h"): "the launcher sets SSDSGD_SCHEDULER_HOST",
        ("SSDSGD_ALGORITM", "ssgd"): "unknown setting (did you mean SSDSGD_ALGORITHM?",
        ("SSDSGD_DELAY_STEPS", "0"): "SSDSGD_DELAY_STEPS='0': expected auto or an integer >= 1",
    }
    for (key, value), message in cases.items():
        with pytest.raises(S.SettingError) as info:
            S.check_launch_env({key: value}, owned)
        assert message in str(info.value), (message, str(info.value))
    with pytest.raises(S.SettingError, match="^SSDSGD_CHUNK_BYTES='-1'"):
        S.check_launch_env({}, owned, {"SSDSGD_CHUNK_BYTES": "-1"})


def test_worker_check_follows_the_config():
    cfg = parse_config(dict(MINIMAL, cluster={"workers": 2}, sync={"delay_steps": 7}))
    env = job_env(cfg, 10)
    assert env["SSDSGD_LR_LOCAL"] == "" and env["SSDSGD_START_STEP"] == "0"
    check_worker_env(cfg, dict(env, SSDSGD_DELAY_STEPS="7.0"), 10)
    with pytest.raises(ConfigError, match="^SSDSGD_LR_LOCAL=0.5 in the environment, but the "
                                          "config gives unset"):
        check_worker_env(cfg, dict(env, SSDSGD_LR_LOCAL="0.5"), 10)
    with pytest.raises(ConfigError, match=r"^SSDSGD_DELAY_STEPS='x': expected auto or an "
                                          r"integer"):
        check_worker_env(cfg, dict(env, SSDSGD_DELAY_STEPS="x"), 10)
    filled = {}
    check_worker_env(cfg, filled, 10, start_step=5)
    assert filled == {k: v for k, v in job_env(cfg, 10, 5).items() if v}


def test_launcher_owned_variables_are_written_in_one_place():
    """SSDSGD_NUM_WORKERS, _NUM_SERVERS and _START_STEP appear as a literal (a key to write
    or read) only in ssdsgd/settings.py; everyone else goes through to_env / read_env."""
    names = ("SSDSGD_NUM_WORKERS", "SSDSGD_NUM_SERVERS", "SSDSGD_START_STEP")
    found = []
    for path in sorted((ROOT / "ssdsgd").rglob("*.py")):
        if path.name == "settings.py" and path.parent.name == "ssdsgd":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and any(
                    node.value == n or node.value.startswith(n + "=") for n in names):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
            if isinstance(node, ast.keyword) and node.arg in names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.arg}=")
    assert not found, found


def test_docs_list_every_setting():
    """docs/training.md holds the table as ssdsgd.settings.markdown() writes it."""
    text = (ROOT / "docs" / "training.md").read_text()
    assert S.markdown() in text, "regenerate the table with ssdsgd.settings.markdown()"
    for s in S.SETTINGS:
        assert (s.path or s.env) in text
