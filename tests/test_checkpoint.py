"""ssdsgd.checkpoint: the checkpoint record and the run's length."""
import json

import pytest

from ssdsgd import checkpoint as C
from ssdsgd.data import DataError
from test_train import cfg_with


def test_run_length():
    cfg = cfg_with(cluster={"workers": 2}, data={"batch_size": 32}, train={"epochs": 20})
    assert C.run_length(cfg) == C.RunLength(steps_per_epoch=22, total_steps=440)
    assert C.run_length(cfg).last_epoch == 19
    assert C.run_length(cfg, num_workers=1, n_train=64) == C.RunLength(2, 40)
    capped = C.run_length(cfg_with(data={"batch_size": 32}, train={"epochs": 20,
                                                                    "max_steps": 100}))
    assert (capped.total_steps, capped.last_epoch) == (100, 2)   # ends in epoch 2 (44/step)


def test_checkpoint_info_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match="latest.json: no checkpoint to resume from"):
        C.checkpoint_info(tmp_path)
    ck = tmp_path / "checkpoints"
    ck.mkdir()
    (ck / "latest.json").write_text("{")
    with pytest.raises(DataError, match="latest.json: unreadable checkpoint record"):
        C.checkpoint_info(tmp_path)
    (ck / "latest.json").write_text(json.dumps({"next_epoch": 1, "step": "44"}))
    with pytest.raises(DataError, match="expected next_epoch, step and params"):
        C.checkpoint_info(tmp_path)
    (ck / "latest.json").write_text(json.dumps({"next_epoch": 1, "step": 44,
                                                "params": "epoch-0000.params"}))
    with pytest.raises(DataError, match="epoch-0000.params: missing checkpoint file"):
        C.checkpoint_info(tmp_path)
