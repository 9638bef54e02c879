"""Every algorithm x feature (ssdsgd/sync/registry.py) is either refused by the config
check, in one line naming both, or taken and run by a named test that exists; likewise the
pairs of features the registry names. In process, no job is started."""
import ast
import functools
from pathlib import Path

import pytest

from ssdsgd import settings as S
from ssdsgd.config import ConfigError, parse_config
from ssdsgd.sync import stage
from ssdsgd.sync.registry import (ALGORITHMS, CONFLICTS, FEATURES, TESTED_PAIRS,
                                  features_on, refusal)

ROOT = Path(__file__).resolve().parents[1]

# Each feature on, as config sections (resume: the environment only, SSDSGD_START_STEP).
ON = {"compression": {"sync": {"compression": "2bit"}},
      "relay": {"sync": {"pull_relay": "chain"}},
      "quorum": {"cluster": {"workers": 4}, "sync": {"quorum": "majority"}},
      "staggered": {"sync": {"pull_schedule": "staggered"}},
      "restart": {"cluster": {"on_worker_failure": "restart"}},
      "continue": {"cluster": {"on_worker_failure": "continue"}},
      "scheduler_restart": {"cluster": {"scheduler_restarts": 1}},
      "resume": {},
      "checkpoint": {"train": {"checkpoint_every": 1}},
      "replicas": {"cluster": {"servers": 2, "server_replicas": 1}}}
# ... and as variables (compression and checkpoints have none)
ON_ENV = {"relay": {"SSDSGD_PULL_RELAY": "chain"},
          "quorum": {"SSDSGD_QUORUM": "majority"},
          "staggered": {"SSDSGD_PULL_SCHEDULE": "staggered"},
          "restart": {"SSDSGD_ON_WORKER_FAILURE": "restart"},
          "continue": {"SSDSGD_ON_WORKER_FAILURE": "continue"},
          "scheduler_restart": {"SSDSGD_SCHEDULER_RESTARTS": "1"},
          "resume": {S.BY_NAME["start_step"].env: "7"},
          "replicas": {"SSDSGD_SERVER_REPLICAS": "1", "SSDSGD_NUM_SERVERS": "2"}}
VARIABLE = {"relay": "SSDSGD_PULL_RELAY", "quorum": "SSDSGD_QUORUM",
            "staggered": "SSDSGD_PULL_SCHEDULE", "restart": "SSDSGD_ON_WORKER_FAILURE",
            "continue": "SSDSGD_ON_WORKER_FAILURE", "resume": S.BY_NAME["start_step"].env,
            "replicas": "SSDSGD_SERVER_REPLICAS",
            "scheduler_restart": "SSDSGD_SCHEDULER_RESTARTS"}
KEY = {"compression": "sync.compression", "relay": "sync.pull_relay",
       "quorum": "sync.quorum", "staggered": "sync.pull_schedule",
       "restart": "cluster.on_worker_failure", "continue": "cluster.on_worker_failure",
       "replicas": "cluster.server_replicas",
       "scheduler_restart": "cluster.scheduler_restarts"}


def _config(algorithm, *features):
    """A digits job of ``algorithm`` (4 workers, group size 2) with only ``features`` on."""
    raw = {"model": {"name": "digits_mlp"}, "data": {"dataset": "digits"},
           "cluster": {"workers": 4}, "train": {"checkpoint_every": 0},
           "sync": {"algorithm": algorithm}}
    for feature in features:
        for section, keys in ON[feature].items():
            raw.setdefault(section, {}).update(keys)
    return raw


def _env(algorithm, *features):
    env = {"SSDSGD_SCHEDULER_PORT": "9000", S.BY_NAME["num_workers"].env: "4",
           "SSDSGD_ALGORITHM": algorithm}
    for feature in features:
        env.update(ON_ENV.get(feature, {}))
    return env


def _config_error(raw):
    with pytest.raises(ConfigError) as e:
        parse_config(raw)
    return str(e.value)


@functools.lru_cache(maxsize=None)
def _tests_in(path):
    """The test functions defined in ``path`` (module level or in classes)."""
    tree = ast.parse((ROOT / path).read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
            and n.name.startswith("test_")}


def _assert_test_exists(node_id):
    path, sep, name = node_id.partition("::")
    assert sep and path.startswith("tests/") and (ROOT / path).is_file(), node_id
    assert name in _tests_in(path), f"{node_id}: no such test"


COMBINATIONS = [(a, f) for a in ALGORITHMS for f in FEATURES]


def test_the_registry_names_every_algorithm_and_decides_every_feature():
    assert set(ALGORITHMS) == set(S.BY_NAME["algorithm"].choices)
    assert set(ON) == set(FEATURES)
    for a in ALGORITHMS.values():
        assert a.stage in stage.RULES and a.server in ("sum", "each", "average"), a.name
        assert set(a.tested) | set(a.refused) == set(FEATURES), a.name
        assert not set(a.tested) & set(a.refused), a.name
    for a, b in list(CONFLICTS) + list(TESTED_PAIRS):
        assert a in FEATURES and b in FEATURES and a != b, (a, b)
    assert not set(CONFLICTS) & set(TESTED_PAIRS)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_each_algorithm_alone_is_taken(algorithm):
    assert parse_config(_config(algorithm)).sync.algorithm == algorithm
    assert features_on(S.read_env(_env(algorithm))) == {}


@pytest.mark.parametrize("algorithm,feature", COMBINATIONS,
                         ids=[f"{a}-{f}" for a, f in COMBINATIONS])
def test_each_combination_is_refused_in_one_line_or_run_by_a_named_test(algorithm, feature):
    entry = ALGORITHMS[algorithm]
    if feature in entry.tested:
        _assert_test_exists(entry.tested[feature])
        assert parse_config(_config(algorithm, feature)).sync.algorithm == algorithm
        env = S.read_env(_env(algorithm, feature))
        assert feature not in ON_ENV or feature in features_on(env), feature
        return
    assert feature in entry.refused and (feature in KEY or feature in VARIABLE), \
        "a refusal no check can make"
    reason = entry.refused[feature]
    if feature in KEY:                       # the config check
        text = _config_error(_config(algorithm, feature))
        assert text.startswith(f"sync.algorithm: {algorithm} works with {KEY[feature]}: "), text
        assert reason in text and "\n" not in text, text
    if feature in VARIABLE:                  # every process's check of its variables
        with pytest.raises(S.SettingError) as e:
            S.read_env(_env(algorithm, feature))
        text = str(e.value)
        assert text.startswith(f"SSDSGD_ALGORITHM: {algorithm} works with "
                               f"{VARIABLE[feature]}: "), text
        assert reason in text and "\n" not in text, text


def test_every_pair_of_features_is_refused_or_run_by_a_named_test():
    """No pair of features is left to chance: each of the 45 is in CONFLICTS (refused,
    the test below) or TESTED_PAIRS (run together by a named test), once."""
    named = [frozenset(pair) for pair in list(CONFLICTS) + list(TESTED_PAIRS)]
    assert len(named) == len(set(named)), "a pair named twice"
    every = {frozenset((a, b)) for a in FEATURES for b in FEATURES if a != b}
    assert every - set(named) == set(), sorted(map(sorted, every - set(named)))
    assert len(every) == 45


@pytest.mark.parametrize("pair", CONFLICTS, ids="-".join)
def test_each_conflicting_pair_is_refused_in_one_line_naming_both(pair):
    a, b = pair
    text = _config_error(_config("ssd", a, b))      # ssd takes every feature alone
    assert text.startswith(f"{KEY[a]}: ") and f" works with {KEY[b]}: " in text, text
    assert CONFLICTS[pair] in text and "\n" not in text, text
    for feature in pair:                              # either alone is taken
        parse_config(_config("ssd", feature))


@pytest.mark.parametrize("pair", TESTED_PAIRS, ids="-".join)
def test_each_tested_pair_is_taken_and_its_test_exists(pair):
    _assert_test_exists(TESTED_PAIRS[pair])
    if "resume" not in pair:
        parse_config(_config("ssd", *pair))
    assert refusal(S.read_env(_env("ssd", *pair)), lambda name: name) is None


def test_compression_set_by_a_script_is_refused_like_the_config():
    """The Trainer's compression_params reach the kvstore, not the config: the kvstore
    asks the same registry (ssdsgd/store.py), naming its variables."""
    def label(name):
        return "compression_params" if name == "compression" else S.BY_NAME[name].env
    env = S.read_env(_env("preduce"))
    assert refusal({**env, "compression": "2bit"}, label).startswith(
        "SSDSGD_ALGORITHM: preduce works with compression_params: none only, got '2bit'")
    env = S.read_env(_env("ssd", "quorum"))
    assert refusal({**env, "compression": "topk"}, label).startswith(
        "SSDSGD_QUORUM: majority works with compression_params: none only, got 'topk'")
    assert refusal({**S.read_env(_env("ssd")), "compression": "2bit"}, label) is None


def test_a_quorum_that_is_every_worker_is_no_quorum():
    """majority of 2 is 2: no rounds, so nothing a quorum excludes is refused."""
    raw = _config("asgd", "quorum")
    raw["cluster"]["workers"] = 2
    assert parse_config(raw).sync.quorum == "majority"
    raw["cluster"]["workers"] = 3
    assert "sync.quorum: all only, got 'majority'" in _config_error(raw)


def test_the_stage_rule_and_the_steps_ahead_bound_follow_the_registry():
    assert [stage.plan(t, "ssd", 2, 3).stage for t in (0, 1, 2)] == [
        stage.Stage.WARMUP, stage.Stage.WARMUP, stage.Stage.STEPS_DELAY]
    assert [stage.plan(t, "ssd", 2, 3).request_pull for t in range(2, 8)] == [
        False, False, True, False, False, True]
    for algorithm in ("ssgd", "asgd"):
        assert stage.plan(9, algorithm, 2, 3) == stage.StepPlan(stage.Stage(algorithm), True, True)
    assert stage.plan(9, "preduce", 2, 3) == stage.StepPlan(stage.Stage.PREDUCE, False, False)
    assert stage.steps_ahead_bound("ssd", 7) == 9
    assert {stage.steps_ahead_bound(a, 7) for a in ("ssgd", "asgd", "preduce")} == {3}
    for algorithm in ("localsgd", "diloco"):    # T_w = 2, H = 3: a sync every third step
        assert [stage.plan(t, algorithm, 2, 3) for t in range(0, 6)] == [
            stage.StepPlan(stage.Stage.WARMUP, True, True)] * 2 + [
            stage.StepPlan(stage.Stage.LOCAL_STEPS, False, sync) for sync in
            (False, False, True, False)]
        assert stage.steps_ahead_bound(algorithm, 7) == 3


def test_the_table_in_the_training_docs_is_the_registrys():
    from ssdsgd.sync.registry import markdown
    text = (ROOT / "docs" / "training.md").read_text()
    block = text.split("<!-- combinations: generated -->\n", 1)[1].split("<!-- /combinations -->")[0]
    assert block == markdown(), "regenerate it from ssdsgd.sync.registry.markdown()"


def test_restarts_counted_in_the_config_are_a_restart_too():
    raw = _config("asgd")
    raw["cluster"]["max_restarts"] = 2
    text = _config_error(raw)
    assert text.startswith("sync.algorithm: asgd works with cluster.max_restarts: 0 only, "
                           "got 2 ("), text
    raw = _config("ssd")
    raw["cluster"]["max_restarts"] = 2
    assert features_on(dict(parse_config(raw).cluster.__dict__, algorithm="ssd")) == {
        "restart": ("max_restarts", 2, "0")}
