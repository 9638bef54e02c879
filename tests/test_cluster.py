"""ssd_sync end to end: launch/dist.py starts a real scheduler, servers and workers
(separate processes on real ZeroMQ sockets) running the stock gluon.Trainer."""
import os
import signal
import socket
import subprocess
import time

import numpy as np
import pytest

import tiny
import jobs
from conftest import PY, SCRIPTS, load_npz
from jobs import launch

pytestmark = pytest.mark.system


def _initial():
    return {f"p{i}": p.data().asnumpy() for i, p in enumerate(tiny.params(tiny.make_net()))}


def _check_ok(res):
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def test_stock_trainer_with_kvstore_string_really_uses_ssd_sync(tmp_path):
    res = launch(2, 1, ["--out", tmp_path, "--steps", 8], env={"SSDSGD_ALGORITHM": "ssgd"})
    _check_ok(res)
    init = _initial()
    finals = [load_npz(tmp_path / f"final-rank{r}.npz") for r in range(2)]
    for r in range(2):
        info = __import__("json").loads((tmp_path / f"info-rank{r}.json").read_text())
        assert info["kvstore_type"] == "SSD_Sync" and info["update_on_kvstore"] is True
        assert info["metrics"]["pushes"] == 8 and info["metrics"]["ssgd"] == 8
        assert info["metrics"]["bytes_sent"] > 0
    for k in init:
        np.testing.assert_array_equal(finals[0][k], finals[1][k])
        assert not np.allclose(finals[0][k], init[k])
    # every line of output carries its role and rank
    assert "[worker 0] rank 0 done" in res.stdout and "[worker 1] rank 1 done" in res.stdout


def test_kvstore_instance_ssd_two_servers_ends_on_identical_global_weights(tmp_path):
    res = launch(2, 2, ["--out", tmp_path, "--steps", 12, "--kv-instance"],
                 env={"SSDSGD_WARMUP_STEPS": 3, "SSDSGD_DELAY_STEPS": 2,
                      "SSDSGD_BIGARRAY_BOUND": 50})   # the 16x12 weight is split over both
    _check_ok(res)
    local = [load_npz(tmp_path / f"local-rank{r}.npz") for r in range(2)]
    final = [load_npz(tmp_path / f"final-rank{r}.npz") for r in range(2)]
    assert any(not np.array_equal(local[0][k], local[1][k]) for k in local[0]), \
        "in the steps-delay stage workers train on their own local weights"
    for k in final[0]:
        np.testing.assert_array_equal(final[0][k], final[1][k])
    info = __import__("json").loads((tmp_path / "info-rank0.json").read_text())
    assert info["metrics"]["warmup"] == 3 and info["metrics"]["steps_delay"] == 9


def test_batchnorm_trains_and_trainer_states_round_trip(tmp_path):
    env = {"SSDSGD_ALGORITHM": "ssgd"}
    _check_ok(launch(2, 2, ["--out", tmp_path / "a", "--net", "bn", "--steps", 10,
                            "--save-at", 4], env=env))
    _check_ok(launch(2, 2, ["--out", tmp_path / "b", "--net", "bn", "--steps", 5,
                            "--start-step", 5, "--load", tmp_path / "a"], env=env))
    a = load_npz(tmp_path / "a" / "final-rank0.npz")
    b = load_npz(tmp_path / "b" / "final-rank0.npz")
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-6, atol=1e-7)
    losses = __import__("json").loads((tmp_path / "a" / "info-rank0.json").read_text())["losses"]
    assert np.mean(losses[-3:]) < np.mean(losses[:3])


def test_asgd_mode_trains(tmp_path):
    res = launch(2, 1, ["--out", tmp_path, "--steps", 10], env={"SSDSGD_ALGORITHM": "asgd"})
    _check_ok(res)
    info = __import__("json").loads((tmp_path / "info-rank1.json").read_text())
    assert info["metrics"]["asgd"] == 10


def _wait_for(path, timeout=60):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)
    time.sleep(0.2)
    return int(path.read_text())


def _start_long_job(tmp_path, extra_env=(), script_args=(), n=2):
    args = ["-n", n, "-s", "1"]
    for kv in extra_env:
        args += ["--env", kv]
    return jobs.dist([*args, "--", PY, SCRIPTS / "ssd_worker.py", "--out", tmp_path,
                      "--steps", "1000000", *script_args])


def _finish(job, timeout):
    try:
        out, err = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        job.close(grace=0)
        pytest.fail(f"the job did not end within {timeout} s")
    return out, err


def _no_leftovers(tmp_path, n=2):
    for r in range(n):
        pid = int((tmp_path / f"pid-rank{r}").read_text())
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{pid}") or \
            open(f"/proc/{pid}/stat").read().split()[2] == "Z", f"worker pid {pid} left running"


def test_killed_worker_ends_the_job_with_a_message_naming_it(tmp_path):
    job = _start_long_job(tmp_path)
    _wait_for(tmp_path / "pid-rank0")
    pid = _wait_for(tmp_path / "pid-rank1")
    time.sleep(1.0)
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    out, err = _finish(job, 30)
    assert job.returncode != 0
    assert "worker 1" in err and "SIGKILL" in err and "stopping the job" in err
    assert time.monotonic() - started < 30
    _no_leftovers(tmp_path)


def test_hung_worker_is_detected_by_heartbeats_and_named(tmp_path):
    """A worker that stops (SIGSTOP at step 5) is found by the heartbeats and named, by the
    launcher's own line too, not the first process to exit. docs/spec/pull_relay.md: every
    reply to workers 1 and 2 passes through worker 1 (chain 0 -> 1 -> 2); when it stops,
    worker 2 waits for pieces that never come, until the heartbeats name worker 1 and the
    job ends. (One job for both: a plain 2-worker job with a stopped worker, its own test
    before, is the same heartbeat path.)"""
    job = _start_long_job(tmp_path, ["SSDSGD_HEARTBEAT_TIMEOUT=3", "SSDSGD_ALGORITHM=ssgd",
                                     "SSDSGD_PULL_RELAY=chain"], ["--stop-at", "5"], n=3)
    for r in range(3):
        _wait_for(tmp_path / f"pid-rank{r}")
    started = time.monotonic()
    out, err = _finish(job, 40)
    assert job.returncode != 0
    assert "worker 1" in err and "presumed dead" in err, err[-2000:]
    # the launcher's own line names the stopped worker, not the first process to exit
    assert any(ln.startswith("[launcher] the scheduler aborted the job: worker 1 ")
               and "presumed dead" in ln for ln in err.splitlines()), err[-2000:]
    assert "pull relay listening" in err
    assert time.monotonic() - started < 30
    _no_leftovers(tmp_path, 3)


def test_port_in_use_is_a_clear_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = jobs.run(["-n", "1", "-s", "1", "--port", port, "--", PY,
                        SCRIPTS / "ssd_worker.py", "--out", tmp_path], timeout=60)
    assert res.returncode != 0
    assert "port is in use" in res.stderr and str(port) in res.stderr
    assert "Traceback" not in res.stderr


def test_custom_optimizer_class_gets_a_one_line_error_naming_it(tmp_path):
    res = launch(1, 1, ["--out", tmp_path, "--custom-optimizer"], timeout=60)
    assert res.returncode != 0
    assert "HomeMadeSGD" in res.stderr and "cannot be described" in res.stderr
    assert "Traceback" not in res.stderr


def test_ctrl_c_stops_every_process(tmp_path):
    job = _start_long_job(tmp_path)
    _wait_for(tmp_path / "pid-rank1")
    _wait_for(tmp_path / "pid-rank0")
    job.send_signal(signal.SIGINT)
    out, err = _finish(job, 30)
    assert job.returncode == 130
    assert "SIGINT: stopping every process" in err
    _no_leftovers(tmp_path)


def test_push_pull_and_list_pushpull_without_optimizer_keep_the_sum(tmp_path):
    res = launch(2, 2, [], env={"SSDSGD_ALGORITHM": "ssgd"}, script="push_pull.py")
    _check_ok(res)
    for r in range(2):
        assert f"rank {r}: pull [3.0, 3.0, 3.0, 3.0, 3.0, 3.0] pushpull 20.0 3.0" in res.stdout


def test_a_worker_that_raises_ends_the_job_and_every_node_names_it(tmp_path):
    started = time.monotonic()
    res = launch(2, 1, [], env={"SSDSGD_ALGORITHM": "ssgd"}, script="fail_rank1.py", timeout=60)
    assert res.returncode != 0
    assert "worker 1" in res.stderr and "exited with code 1; stopping the job" in res.stderr
    cause = "worker 1 (pid"
    for node in ("[scheduler]", "[server 0]", "[worker 0]"):
        assert any(line.startswith(node) and cause in line and "bad batch shape" in line
                   for line in res.stderr.splitlines()), (node, res.stderr[-2000:])
    assert time.monotonic() - started < 30


def test_the_scheduler_names_the_cause_before_the_launcher_can_read_it(tmp_path):
    """The launcher stops every process once the status file holds an abort reason, so
    the scheduler's own line naming the cause must be out before that file says so (in
    CI, a loaded machine stopped the scheduler between the two, and its line was lost)."""
    from ssdsgd.kvstore import job_status
    from ssdsgd.kvstore.env import NodeEnv
    from ssdsgd.kvstore.scheduler import JobAborted, Scheduler
    from ssdsgd.launch.job import free_port
    from ssdsgd.sync.scheduler_policies import make_scheduler_policy
    status = tmp_path / "status.json"
    seen = []

    def log(text):
        known = job_status.read(status)
        seen.append((text, known and known.get("abort")))
    env = NodeEnv.from_environ({"SSDSGD_SCHEDULER_PORT": str(free_port()),
                                "SSDSGD_NUM_WORKERS": "2", "SSDSGD_ALGORITHM": "ssgd",
                                "SSDSGD_STATUS_FILE": str(status)})
    sched = Scheduler(env, make_scheduler_policy, log=log)
    try:
        with pytest.raises(JobAborted, match="worker 1 failed: ValueError"):
            sched._abort("worker 1 failed: ValueError")
    finally:
        sched.close()
    assert job_status.read(status)["abort"] == "worker 1 failed: ValueError"
    said = [abort for text, abort in seen if "worker 1 failed: ValueError" in text]
    assert said == [None], seen
