"""The servers' snapshots of the global model (ssdsgd/kvstore/snapshots.py): what the
benchmark tests off the workers' path. A real job's snapshots, joined over its servers,
hold every update count asked for, time-stamped in order, and end with the weights every
worker ends with and the pushes the servers applied."""
import numpy as np
import pytest

from jobs import launch
from conftest import load_npz
from ssdsgd.kvstore.snapshots import read_model
from test_quorum import _trainer_keys
import tiny

STEPS, EVERY = 6, 2


@pytest.mark.system
def test_a_jobs_snapshots_hold_the_global_model_and_the_pushes_applied(tmp_path):
    n, s, quorum = 3, 2, "majority"     # rounds of 2 close without the slow worker
    res = launch(n, s, ["--out", tmp_path, "--steps", STEPS],
                 env={"SSDSGD_ALGORITHM": "ssgd", "SSDSGD_QUORUM": quorum,
                      "SSDSGD_SLOWDOWN": "delay:2=0.3",
                      "SSDSGD_SNAPSHOT_EVERY": EVERY,
                      "SSDSGD_SNAPSHOT_DIR": tmp_path / "snapshots",
                      "SSDSGD_BIGARRAY_BOUND": 100},    # the 16x12 weight spans both servers
                 script="quorum_worker.py", timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    models = read_model(tmp_path / "snapshots", s)
    metas = [m for m, _ in models]
    numbered = [m["updates"] for m in metas if m["tag"] != "final"]
    assert numbered and all(u % EVERY == 0 for u in numbered), metas
    assert numbered == sorted(set(numbered))
    assert [m["time"] for m in metas] == sorted(m["time"] for m in metas)
    final_meta, final = models[-1]
    assert final_meta["tag"] == "final" and final_meta["pushes"] == n * STEPS
    assert final_meta["dropped"] == 0
    assert final_meta["updates"] >= STEPS and numbered[0] == EVERY
    keys = _trainer_keys(tiny.make_net())
    for r in range(n):
        weights = load_npz(tmp_path / f"final-rank{r}.npz")
        for i, j in keys.items():
            np.testing.assert_array_equal(final[i], weights[f"p{j}"].ravel(),
                                          err_msg=f"worker {r}, key {i}")
