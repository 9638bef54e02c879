"""Straggler injection (debug.slowdown): its forms, who is slowed at which step, the
config's checks, and a by-hand run that is really slowed and says so in its summary."""
import json
import sys
import time

import pytest

from ssdsgd.config import ConfigError, parse_config
from ssdsgd.settings import SettingError, parse_slowdown, read_env
from ssdsgd.slowdown import Slowdown

sys.path.insert(0, __import__("os").path.dirname(__file__))
from test_train import digits_job, no_role  # noqa: E402,F401  (fixture)


def test_forms_parse_to_their_parts():
    assert parse_slowdown("none")["kind"] == "none"
    assert parse_slowdown("factor:1=2,3=1.5")["per_rank"] == {1: 2.0, 3: 1.5}
    assert parse_slowdown("delay:0=0.25")["per_rank"] == {0: 0.25}
    spec = parse_slowdown("random:0.5:2:7")
    assert (spec["kind"], spec["delay"], spec["count"], spec["seed"]) == ("random", 0.5, 2, 7)
    assert parse_slowdown("random:0.5:1")["seed"] == 0


@pytest.mark.parametrize("text", ["slow", "none:1", "factor:", "factor:1=0.5", "factor:1",
                                  "delay:-1=1", "delay:1=1,1=2", "delay:a=1", "random:1",
                                  "random:1:0", "random:-1:1", "random:1:1:2:3",
                                  "delay:1=4000"])
def test_malformed_forms_are_refused_with_the_grammar(text):
    with pytest.raises(SettingError, match="expected"):
        parse_slowdown(text)


def test_each_rank_sleeps_only_its_own_share():
    assert Slowdown("delay:1=0.3", 1, 4).seconds(5) == 0.3
    assert Slowdown("delay:1=0.3", 0, 4).seconds(5) == 0.0
    assert Slowdown("factor:2=3", 2, 4).seconds(0, compute_s=0.1) == pytest.approx(0.2)
    assert Slowdown("factor:2=3", 1, 4).seconds(0, compute_s=0.1) == 0.0
    assert not Slowdown("none", 0, 4).active and not Slowdown("delay:1=0.3", 0, 4).active
    assert Slowdown("factor:2=3", 2, 4).measures_compute
    assert not Slowdown("delay:2=3", 2, 4).measures_compute


def test_random_delays_agree_across_workers_and_vary_over_steps():
    workers = [Slowdown("random:0.1:2:3", r, 5) for r in range(5)]
    sets = []
    for step in range(50):
        slowed = [w.rank for w in workers if w.seconds(step) > 0]
        assert slowed == workers[0].slow_ranks(step) and len(slowed) == 2
        sets.append(tuple(slowed))
    assert len(set(sets)) > 3                    # not the same ranks every step
    assert sets == [tuple(Slowdown("random:0.1:2:3", 0, 5).slow_ranks(s)) for s in range(50)]
    assert sets != [tuple(Slowdown("random:0.1:2:4", 0, 5).slow_ranks(s)) for s in range(50)]


def test_after_compute_really_sleeps():
    t = time.perf_counter()
    assert Slowdown("delay:0=0.2", 0, 2).after_compute(0) == 0.2
    assert time.perf_counter() - t >= 0.2


def _raw(slowdown, workers=2):
    return {"cluster": {"workers": workers}, "model": {"name": "digits_mlp"},
            "data": {"dataset": "digits"}, "debug": {"slowdown": slowdown}}


def test_the_config_checks_the_form_and_the_ranks():
    assert parse_config(_raw("delay:1=0.5")).debug.slowdown == "delay:1=0.5"
    assert parse_config({"model": {"name": "digits_mlp"},
                         "data": {"dataset": "digits"}}).debug.slowdown == "none"
    with pytest.raises(ConfigError, match=r"debug.slowdown: .*names ranks beyond the job's 2"):
        parse_config(_raw("delay:2=0.5"))
    with pytest.raises(ConfigError, match=r"debug.slowdown: .*names ranks beyond"):
        parse_config(_raw("random:0.1:3"))
    with pytest.raises(ConfigError, match=r"^debug.slowdown: expected random:DELAY_S"):
        parse_config(_raw("random:x"))


def test_a_job_that_takes_joiners_may_slow_its_spare_ranks():
    """With cluster.max_workers above the workers, ranks up to max_workers - 1 are the
    job's (a joiner takes one): a slowdown may name them, not a rank beyond."""
    raw = _raw("delay:0=0.1,2=0.1")
    raw["cluster"]["max_workers"] = 3
    raw["sync"] = {"algorithm": "ssgd"}
    assert parse_config(raw).debug.slowdown == "delay:0=0.1,2=0.1"
    raw["debug"]["slowdown"] = "delay:3=0.1"
    with pytest.raises(ConfigError, match=r"names ranks beyond the job's 3 workers"):
        parse_config(raw)


def test_the_environment_checks_it_too():
    assert read_env({"SSDSGD_SCHEDULER_PORT": "1", "SSDSGD_SLOWDOWN": "delay:0=1"})[
        "slowdown"] == "delay:0=1"
    with pytest.raises(SettingError, match="SSDSGD_SLOWDOWN.*names ranks beyond"):
        read_env({"SSDSGD_SCHEDULER_PORT": "1", "SSDSGD_SLOWDOWN": "delay:3=1",
                  "SSDSGD_NUM_WORKERS": "2"})


def test_a_slowed_run_takes_longer_and_its_summary_names_it(tmp_path, no_role):
    from ssdsgd import train as T
    slow = digits_job(tmp_path, "slow", train={"max_steps": 8}, debug={"slowdown": "delay:0=0.15"})
    assert T.main([str(slow), "--run-dir", str(tmp_path / "slow")]) == 0
    summary = json.loads((tmp_path / "slow" / "summary.json").read_text())
    assert summary["debug_slowdown"] == "delay:0=0.15 (injected on purpose)"
    assert summary["wall_time"] >= 8 * 0.15
    plain = digits_job(tmp_path, "plain", train={"max_steps": 8})
    assert T.main([str(plain), "--run-dir", str(tmp_path / "plain")]) == 0
    assert json.loads((tmp_path / "plain" / "summary.json").read_text())[
        "debug_slowdown"] == "off"
    from ssdsgd.report import finished_run          # the launcher's final line says so too
    assert "debug.slowdown delay:0=0.15 (injected on purpose)" in finished_run(
        tmp_path / "slow", tmp_path / "plots")[0]
    assert "debug.slowdown" not in finished_run(tmp_path / "plain", tmp_path / "plots")[0]
