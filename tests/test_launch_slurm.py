"""``launch/dist.py --launcher slurm`` under a real single-machine Slurm (slurmctld and
slurmd started here): the README's demo job submitted with ``sbatch``; inside the
allocation the launcher starts scheduler, server and workers with one ``srun``, each task
taking its role from SLURM_PROCID, and the job ends like a local one."""
import contextlib
import json
import os
import re
import sys
import time

import pytest

import jobs
import launch_secrets
from emulated_hosts import copy_repo
from slurm_cluster import SlurmCluster, unavailable
from ssdsgd.testing import clean_env
from test_e2e_configs import ROOT, run_dir_of

pytestmark = [pytest.mark.system, pytest.mark.xdist_group("slurm")]   # one test Slurm at a time
REASON = unavailable()
if REASON:
    pytest.skip(f"test Slurm unavailable: {REASON}", allow_module_level=True)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield c
    finally:
        c.close()


def readme_slurm_block():
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Several machines\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```\n(.*?)^```$", section, re.S | re.M)[2]


def test_readme_sbatch_command_as_written(slurm, tmp_path):
    """The README's Slurm commands pasted into a shell (in a copy of the repository): the
    demo job runs as one batch job, its processes started by srun inside it."""
    repo = copy_repo(tmp_path / "repo")
    env = {k: v for k, v in clean_env().items() if k != "PYTHONPATH"}
    env["PATH"] = f"{os.path.dirname(sys.executable)}:{env.get('PATH', '/usr/bin:/bin')}"
    # the batch job's processes get the submitter's environment, and so the job's tag
    with jobs.start(["bash", "-e", "-c", readme_slurm_block()], cwd=repo, merge=True,
                    environ=dict(env, SLURM_CONF=str(slurm.conf)),
                    grace=jobs.LAUNCHER_GRACE_S) as r:
        r.wait(timeout=400)
    out = r.stdout
    assert r.returncode == 0, f"{out[-4000:]}\n{slurm.logs()}"
    assert "Traceback" not in out
    node = slurm.node
    assert f"[launcher]   {node}: scheduler, server 0, worker 0, worker 1" in out
    assert "SLURM_PROCID 0: the scheduler" in out
    for prefix in (f"[scheduler on {node}] ", f"[worker 0 on {node}] ",
                   f"[worker 1 on {node}] "):
        assert any(line.startswith(prefix) for line in out.splitlines()), prefix
    run = run_dir_of(repo / "runs")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["workers_reporting"] == 2 and summary["final_accuracy"] > 0.9
    assert re.search(r"^\[launcher\] test accuracy \d\.\d{4} \(20 epochs, 440 steps", out,
                     re.M)
    assert slurm.run(["squeue", "-h"]).stdout.strip() == ""


def test_outside_an_allocation_it_says_how_to_get_one(slurm, tmp_path):
    env = {k: v for k, v in clean_env().items() if not k.startswith("SLURM_")}
    r = jobs.run(["-n", "2", "-s", "1", "--launcher", "slurm", "--", sys.executable, "-c",
                  "pass"], environ=dict(env, PYTHONPATH=str(ROOT), SLURM_CONF=str(slurm.conf)),
                 timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "launch/dist.py: error: --launcher slurm runs inside an allocation: e.g. sbatch -N 3 "
        "job.sh or salloc -N 3, then launch/dist.py ... --launcher slurm")


def _wait(done, timeout, what):
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.25)


def test_srun_carries_no_key_through_its_own_channels(slurm, tmp_path):
    """Issue 28, item 1: srun --export hands SSDSGD_LAUNCH_SPEC to Slurm (its controller,
    slurmd, slurmstepd), and the spec carried every process's key file. Now each
    process's file is written, 0600, in a 0700 directory of the run directory and the
    spec carries its path: while the job runs, no secret of any process is in the
    environment or command line of any process here (srun, slurmstepd, rank_entry, the
    job's processes); the directory is gone once the batch job is cancelled."""
    out, runs = tmp_path / "job.out", tmp_path / "runs"
    cmd = (f"{sys.executable} launch/dist.py configs/digits.yaml --launcher slurm "
           f"--set train.epochs=1000 --set output.dir={runs}")
    with _batch_job(slurm, cmd, out, dict(clean_env(), PYTHONPATH=str(ROOT))):
        keydir = launch_secrets.check_running_job(run_dir_of(runs), 4)
    _wait(lambda: not keydir.exists(), 30, f"removal of {keydir}")


@contextlib.contextmanager
def _batch_job(slurm, cmd, out, env):
    """``cmd`` submitted with ``sbatch -n 4`` (its output in ``out``), once it says the
    job started; on the way out it is cancelled (a no-op if it ended by itself) and
    waited for (bounded)."""
    r = slurm.run(["sbatch", "-n", "4", "--parsable", "--chdir", str(ROOT), "--output",
                   str(out), "--wrap", cmd], env=env)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip().split(";")[0]
    try:
        _wait(lambda: out.exists() and "job started" in out.read_text(), 300,
              f"the batch job's start ({slurm.logs()})")
        yield job_id
    finally:
        slurm.run(["scancel", job_id])
        _wait(lambda: slurm.run(["squeue", "-h"]).stdout.strip() == "", 120,
              "the batch job's end")


def test_a_worker_joins_a_slurm_job_from_outside_its_allocation_and_leaves_it(slurm,
                                                                             tmp_path):
    """``launch/dist.py --join RUN_DIR`` for a batch job the slurm launcher started: the
    key directory is in the run directory (the shared filesystem), so the joiner, started
    here outside the allocation, takes a spare rank and its key from there; then
    ``--leave RUN_DIR --rank 2`` lets it go. ssgd digits, 2 workers, cluster.max_workers 3:
    the summary records both, and the batch job ends by itself."""
    from test_join_jobs import each_epoch_once
    from test_dynamic_data import BATCH, N_TRAIN
    from ssdsgd.metrics import read_records
    out, runs = tmp_path / "job.out", tmp_path / "runs"
    sets = {"sync.algorithm": "ssgd", "cluster.max_workers": 3, "data.batch_size": BATCH,
            "train.epochs": 3, "train.log_interval": 4, "output.plots": "false",
            "debug.slowdown": "delay:0=0.1,1=0.1,2=0.1", "output.dir": runs}
    cmd = " ".join([sys.executable, "launch/dist.py", "configs/digits.yaml", "--launcher",
                    "slurm", *(f"--set {k}={v}" for k, v in sets.items())])
    env = dict(clean_env(), PYTHONPATH=str(ROOT))
    with _batch_job(slurm, cmd, out, env):
        run = run_dir_of(runs)
        joiner = jobs.dist(["--join", run], environ=env, merge=True)
        with joiner:
            joiner.wait_for(lambda: any(r["event"] == "train" for r in read_records(
                run / "metrics" / "worker-2.jsonl")), 120, "the joiner's first steps")
            leave = jobs.run(["--leave", run, "--rank", "2"], environ=env, timeout=120)
            assert leave.returncode == 0, leave.stdout + leave.stderr
            assert joiner.wait(timeout=240) == 0, joiner.tail()
        _wait(lambda: slurm.run(["squeue", "-h"]).stdout.strip() == "", 240,
              f"the batch job's end: {out.read_text()[-3000:]}")
    text = out.read_text()
    assert "Traceback" not in text + joiner.stdout, text[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    (join,) = summary["workers_joined"]
    (left,) = summary["workers_left"]
    assert join["rank"] == 2 and left["rank"] == 2 and left["how"] == "left", summary
    ends = [[r for r in read_records(run / "metrics" / f"worker-{w}.jsonl")
             if r["event"] == "end"][-1] for w in range(3)]
    each_epoch_once(ends, N_TRAIN // (2 * BATCH) * 2, BATCH, 3, dropped=2)
