"""ssd_sync as a drop-in for MXNet's distributed stores, through scripts written the way
MXNet's own are (tests/scripts/module_fit.py, tests/scripts/kvstore_api.py):

* Module API: ``mod.fit(..., kvstore='ssd_sync')`` and with a store object end with the
  weights native dist_sync ends with, bit for bit (before integration.py patched
  mxnet/model.py's and module.py's ``_create_kvstore``, the string trained each worker
  alone; with the object, names as lr/wd multiplier keys were refused).
* The KVStore API (string keys, fp16, big arrays, row_sparse, bad keys, the Trainer's
  type checks) gives what dist_sync gives; asgd refuses what dist_async refuses (it
  silently applied each worker's own gradient with update_on_kvstore=False).
"""
import json
import sys

import numpy as np
import pytest

from conftest import ROOT, SCRIPTS
from jobs import launch
from ssdsgd.testing import run_native

pytestmark = pytest.mark.system

JOB_ENV = {"OMP_NUM_THREADS": "1"}


def _check_ok(res):
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def _load(out, rank):
    with np.load(out / f"params-rank{rank}.npz") as z:
        params = {k: z[k] for k in z.files}
    return params, json.loads((out / f"meta-rank{rank}.json").read_text())


@pytest.fixture(scope="module")
def native_module_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("native-module")
    run_native([sys.executable, str(SCRIPTS / "module_fit.py"), "--kvstore", "{mode}",
                "--object", "--out", str(out)], 2, num_servers=1, mode="dist_sync",
               env=JOB_ENV, timeout=240, cwd=ROOT)
    return out


@pytest.mark.parametrize("given", ["string", "object"])
def test_module_fit_on_ssd_sync_ends_bit_identical_to_native_dist_sync(
        native_module_run, tmp_path, given):
    res = launch(2, 1, ["--kvstore", "ssd_sync", "--out", tmp_path]
                 + (["--object"] if given == "object" else []),
                 env={"SSDSGD_ALGORITHM": "ssgd", **JOB_ENV}, script="module_fit.py",
                 timeout=240)
    _check_ok(res)
    for rank in range(2):
        ref, ref_meta = _load(native_module_run, rank)
        got, meta = _load(tmp_path, rank)
        assert meta["type"] == "dist_sync_ssdsgd", "Module must really use the store"
        # Module's rescale_grad covers every worker's batch, as for dist_sync.
        assert meta["rescale_grad"] == ref_meta["rescale_grad"] == 1 / (8 * 2)
        assert sorted(got) == sorted(ref)
        for key in ref:
            np.testing.assert_array_equal(got[key], ref[key], err_msg=f"rank {rank} {key}")


@pytest.mark.parametrize("part", ["keys", "trainer"])
def test_the_kvstore_api_gives_what_dist_sync_gives(part):
    res = launch(2, 2, [part], env={"SSDSGD_ALGORITHM": "ssgd",
                                    "SSDSGD_BIGARRAY_BOUND": 100000},
                 script="kvstore_api.py", timeout=240)
    _check_ok(res)
    checks = {"keys": ["type", "string keys push pull", "init then pull", "row_sparse",
                       "bad keys"],
              "trainer": ["trainer steps", "trainer types", "trainer reset refused"]}[part]
    for rank in range(2):
        for name in checks:
            assert f"rank {rank}: ok {name}\n" in res.stdout, (name, res.stdout[-2000:])


def test_asgd_refuses_what_dist_async_refuses():
    res = launch(2, 1, ["asgd"], env={"SSDSGD_ALGORITHM": "asgd"}, script="kvstore_api.py")
    _check_ok(res)
    for rank in range(2):
        assert f"rank {rank}: ok asgd refusals\n" in res.stdout, res.stdout[-2000:]
