"""``launch/dist.py --launcher slurm`` under a real single-machine Slurm (slurmctld and
slurmd started here): the digits job submitted with ``sbatch``; inside the allocation the
launcher starts scheduler, server and workers with one ``srun``, each task taking its role
from SLURM_PROCID, and the job ends like a local one (same weights for ssgd)."""
import json
import re
import sys

import numpy as np
import pytest

from slurm_cluster import SlurmCluster, unavailable
from test_e2e_configs import ROOT, clean_env, dist, run_dir_of, sets
from test_resume import params

pytestmark = pytest.mark.system
REASON = unavailable()
if REASON:
    pytest.skip(f"test Slurm unavailable: {REASON}", allow_module_level=True)

JOB = dict(sync__algorithm="ssgd", train__epochs=2, train__checkpoint_every=1)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield c
    finally:
        c.close()


def test_digits_job_through_sbatch_and_srun(slurm, tmp_path):
    args = " ".join(["configs/digits.yaml", *sets(**JOB, output__dir=tmp_path / "runs"),
                     "--launcher", "slurm"])
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\ncd {ROOT}\nexec {sys.executable} launch/dist.py {args}\n")
    out_file = tmp_path / "slurm.out"
    env = dict(clean_env(), PYTHONPATH=str(ROOT), SLURM_CONF=str(slurm.conf))
    r = slurm.run(["sbatch", "--wait", "--nodes", "1", "--ntasks", "4", "--overcommit",
                   "--output", str(out_file), str(script)], env=env, timeout=300)
    out = out_file.read_text() if out_file.exists() else ""
    assert r.returncode == 0, f"{r.stdout} {r.stderr}\n{out[-4000:]}\n{slurm.logs()}"
    assert "Traceback" not in out
    node = slurm.node
    assert f"[launcher]   {node}: scheduler, server 0, worker 0, worker 1" in out
    assert "SLURM_PROCID 0: the scheduler" in out
    for prefix in (f"[scheduler on {node}] ", f"[worker 0 on {node}] ",
                   f"[worker 1 on {node}] "):
        assert any(line.startswith(prefix) for line in out.splitlines()), prefix
    run = run_dir_of(tmp_path / "runs")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["workers_reporting"] == 2 and summary["final_accuracy"] > 0.85
    assert re.search(r"^\[launcher\] test accuracy \d\.\d{4} \(2 epochs, 44 steps", out, re.M)
    # the same weights as the job run by the local launcher
    local = dist(["configs/digits.yaml", *sets(**JOB, output__dir=tmp_path / "local")])
    assert local.returncode == 0, local.stderr[-3000:]
    pa = params(run_dir_of(tmp_path / "local") / "checkpoints" / "epoch-0001.params")
    pb = params(run / "checkpoints" / "epoch-0001.params")
    assert pa.keys() == pb.keys()
    for key in pa:
        np.testing.assert_allclose(pb[key], pa[key], rtol=0, atol=1e-6, err_msg=key)
    assert slurm.run(["squeue", "-h"]).stdout.strip() == ""


def test_outside_an_allocation_it_says_how_to_get_one(slurm, tmp_path):
    env = {k: v for k, v in clean_env().items() if not k.startswith("SLURM_")}
    r = slurm.run([sys.executable, "launch/dist.py", "-n", "2", "-s", "1", "--launcher",
                   "slurm", "--", sys.executable, "-c", "pass"], cwd=ROOT,
                  env=dict(env, PYTHONPATH=str(ROOT)))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "launch/dist.py: error: --launcher slurm runs inside an allocation: e.g. sbatch -N 3 "
        "job.sh or salloc -N 3, then launch/dist.py ... --launcher slurm")
