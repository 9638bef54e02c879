"""cluster.max_workers and ``launch/dist.py --join`` short of a running job: the settings'
one-line refusals, the keys of the spare ranks, RUN_DIR/join.json and the claims of
spare ranks (docs/spec/membership.md). In process, no MXNet, no job."""
import dataclasses
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ssdsgd import settings as S
from ssdsgd.config import ConfigError, cluster_env, parse_config
from ssdsgd.kvstore.security import KeyFile, identity, load_keys
from ssdsgd.kvstore.env import NodeEnv
from ssdsgd.launch import joining
from ssdsgd.sync.auto import relay_listens

ROOT = Path(__file__).resolve().parents[1]


def _config(cluster=None, sync=None):
    raw = {"model": {"name": "digits_mlp"}, "data": {"dataset": "digits"},
           "cluster": dict({"workers": 2, "max_workers": 3}, **(cluster or {})),
           "sync": dict({"algorithm": "ssgd", "pull_relay": "off"}, **(sync or {}))}
    return parse_config(raw)


def _error(**sections):
    with pytest.raises(ConfigError) as e:
        _config(**sections)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_max_workers_unset_is_the_workers_and_writes_no_variable():
    cfg = parse_config({"model": {"name": "digits_mlp"}, "data": {"dataset": "digits"},
                        "cluster": {"workers": 2}})
    assert cfg.cluster.max_workers is None
    assert "SSDSGD_MAX_WORKERS" not in cluster_env(cfg)
    assert cluster_env(_config())["SSDSGD_MAX_WORKERS"] == "3"


@pytest.mark.parametrize("sections, words", [
    ({"sync": {"algorithm": "asgd"}}, ["sync.algorithm: ssd or ssgd only", "'asgd'"]),
    ({"sync": {"algorithm": "localsgd"}}, ["sync.algorithm", "'localsgd'"]),
    ({"sync": {"quorum": "1"}}, ["sync.quorum"]),
    ({"cluster": {"max_workers": 1}}, ["at least cluster.workers (2)"]),
])
def test_a_job_that_cannot_take_joiners_is_refused_in_one_line(sections, words):
    msg = _error(**sections)
    assert msg.startswith("cluster.max_workers:"), msg
    for word in words:
        assert word in msg, msg


def test_ssd_with_its_defaults_or_a_fixed_k_and_ssgd_take_joiners():
    """sync.delay_steps and sync.pull_relay at auto (the defaults) take joiners: k is
    agreed where the scheduler keeps it, and the first workers may relay (a relayed reply
    carries the join's decision); a joiner never opens a relay (no chain knows it)."""
    defaults = parse_config({"model": {"name": "digits_mlp"}, "data": {"dataset": "digits"},
                             "cluster": {"workers": 3, "max_workers": 4}})
    assert defaults.sync.algorithm == "ssd" and defaults.sync.delay_steps == "auto"
    assert defaults.sync.pull_relay == "auto"
    env = NodeEnv.from_environ(cluster_env(defaults) | {"SSDSGD_SCHEDULER_PORT": "9000",
                                                         "SSDSGD_ROLE": "worker"})
    assert relay_listens(env) and relay_listens(dataclasses.replace(env, max_workers=None))
    assert not relay_listens(dataclasses.replace(env, joining=True))
    assert not relay_listens(dataclasses.replace(env, joining=True, pull_relay="chain"))
    assert _config(sync={"algorithm": "ssd", "pull_relay": "chain"}).cluster.max_workers == 3
    assert _config(sync={"algorithm": "ssd", "delay_steps": 3, "pull_schedule": "staggered"}
                   ).cluster.max_workers == 3
    assert _config(sync={"algorithm": "ssd", "delay_steps": 3}).cluster.max_workers == 3
    # a dead worker's data leaves at a boundary (docs/spec/membership.md rule 10)
    assert _config(cluster={"on_worker_failure": "continue"}).cluster.max_workers == 3
    assert _config(cluster={"servers": 2, "server_replicas": 1}).cluster.max_workers == 3
    assert _config(cluster={"max_restarts": 2}).cluster.max_workers == 3
    assert _config(cluster={"scheduler_restarts": 1}).cluster.max_workers == 3
    assert _config().sync.algorithm == "ssgd"
    env = {"SSDSGD_SCHEDULER_PORT": "9000", "SSDSGD_NUM_WORKERS": "2",
           "SSDSGD_MAX_WORKERS": "3", "SSDSGD_ALGORITHM": "asgd"}
    with pytest.raises(S.SettingError, match="SSDSGD_MAX_WORKERS: 3 .*SSDSGD_ALGORITHM"):
        S.read_env(env)


def _job(tmp_path, num_workers=2, max_workers=4):
    ids = ([identity("scheduler", 0), identity("server", 0)]
           + [identity("worker", r) for r in range(max_workers)])
    keys = KeyFile(False, ids, str(tmp_path))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {"SSDSGD_NUM_WORKERS": str(num_workers), "SSDSGD_ROLE": "worker",
           "SSDSGD_RANK": "0", "HOME": "/nowhere", "SSDSGD_MAX_WORKERS": str(max_workers)}
    joining.write(str(run_dir), keys.dir, keys.files, num_workers, max_workers,
                  ["python", "-m", "ssdsgd.train"], env)
    return keys, run_dir


def test_join_json_is_private_and_two_joiners_never_take_one_rank(tmp_path):
    keys, run_dir = _job(tmp_path)
    path = run_dir / "join.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    data = joining.read(str(run_dir))
    assert sorted(data["spare"]) == ["2", "3"]
    assert data["env"] == {"SSDSGD_NUM_WORKERS": "2", "SSDSGD_MAX_WORKERS": "4"}
    first, second = joining.claim(str(run_dir), data), joining.claim(str(run_dir), data)
    assert [first[0], second[0]] == [2, 3]
    assert load_keys(first[1]).identity == "worker 2"
    # the spare ranks' keys are verified by the others' files
    assert "worker 3" in load_keys(keys.files["server 0"]).peers
    with pytest.raises(joining.JoinRefused, match="cluster.max_workers = 4"):
        joining.claim(str(run_dir), data)
    env = joining.worker_env(data, 2, first[1])
    assert env["SSDSGD_RANK"] == "2" and env["SSDSGD_JOINING"] in ("1", "true")
    assert env["SSDSGD_SECRET_FILE"] == first[1]
    keys.remove()


def _dist(*args):
    return subprocess.run([sys.executable, str(ROOT / "launch" / "dist.py"), *args],
                          capture_output=True, text=True, timeout=60)


def test_joining_a_finished_job_or_no_job_fails_in_one_line(tmp_path):
    keys, run_dir = _job(tmp_path)
    keys.remove()          # the job ended: its launcher removed the key directory
    done = _dist("--join", str(run_dir))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(run_dir) in lines[0] and "ended" in lines[0], done.stderr
    none = _dist("--join", str(tmp_path))
    assert none.returncode == 2 and len(none.stderr.strip().splitlines()) == 1
    assert "no join.json" in none.stderr


def test_a_job_at_max_workers_refuses_a_joiner_in_one_line(tmp_path):
    keys, run_dir = _job(tmp_path, max_workers=3)
    data = joining.read(str(run_dir))
    joining.claim(str(run_dir), data)
    full = _dist("--join", str(run_dir))
    assert full.returncode == 2, full.stderr
    lines = full.stderr.strip().splitlines()
    assert len(lines) == 1 and "cluster.max_workers = 3" in lines[0], full.stderr
    keys.remove()


def test_a_tampered_join_file_is_refused(tmp_path):
    keys, run_dir = _job(tmp_path)
    path = run_dir / "join.json"
    data = json.loads(path.read_text())
    data["env"]["LD_PRELOAD"] = "/tmp/x.so"
    os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    with pytest.raises(joining.JoinRefused, match="not a join file"):
        joining.read(str(run_dir))
    keys.remove()


def test_a_job_whose_algorithm_takes_no_joiner_is_refused_before_it_starts(tmp_path):
    bad = _dist("--run-dir", str(tmp_path), "-n", "2", "--env", "SSDSGD_ALGORITHM=asgd",
                "--env", "SSDSGD_MAX_WORKERS=3", "--", "python", "-c", "pass")
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "SSDSGD_MAX_WORKERS: 3" in lines[0] and "asgd" in lines[0], \
        bad.stderr
    assert not (tmp_path / "join.json").exists()
    nodir = _dist("-n", "2", "--env", "SSDSGD_ALGORITHM=ssgd", "--env", "SSDSGD_MAX_WORKERS=3",
                  "--", "python", "-c", "pass")
    assert nodir.returncode == 2 and "--run-dir" in nodir.stderr.strip().splitlines()[-1]


def _ssh_site(**changes):
    site = {"ssh_command": "ssh", "ssh_port": None, "ssh_identity_file": None,
            "sync_dir": None, "workdir": "/srv/work", "python": None, "interface": None,
            "start_timeout": 10.0, "env_keys": []}
    return dict(site, **changes)


@pytest.mark.parametrize("ssh", [
    "ssh", {"ssh_command": "ssh"}, _ssh_site(ssh_port="22"), _ssh_site(start_timeout=True),
    _ssh_site(env_keys=[1]), dict(_ssh_site(), extra=1)])
def test_a_join_file_whose_ssh_section_is_malformed_is_refused(tmp_path, ssh):
    """join.json's ``ssh`` (how --join --host reaches a host) is type-checked like the
    rest: a missing, extra or mistyped field is refused in one line."""
    keys, run_dir = _job(tmp_path)
    path = run_dir / "join.json"
    data = json.loads(path.read_text())
    data["ssh"] = _ssh_site()
    path.write_text(json.dumps(data))
    assert joining.read(str(run_dir))["ssh"]["workdir"] == "/srv/work"
    data["ssh"] = ssh
    path.write_text(json.dumps(data))
    with pytest.raises(joining.JoinRefused, match="not a join file"):
        joining.read(str(run_dir))
    keys.remove()


@pytest.mark.parametrize("host", ["-oProxyCommand=touch /tmp/x", "a b", ""])
def test_a_join_host_that_is_not_a_host_name_is_refused_before_anything(tmp_path, host):
    """--host goes to ssh as its host argument: one that is not a host name or an IPv4
    address (one that ssh would read as an option) is refused in one line, and no rank
    is claimed."""
    keys, run_dir = _job(tmp_path)
    path = run_dir / "join.json"
    data = json.loads(path.read_text())
    data["ssh"] = _ssh_site()
    path.write_text(json.dumps(data))
    r = _dist("--join", str(run_dir), f"--host={host}")
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "is not a host name" in line, line
    assert not list(Path(keys.dir).glob("claimed-*"))
    keys.remove()
