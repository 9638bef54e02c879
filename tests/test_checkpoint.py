"""ssdsgd.checkpoint: the checkpoint record, where a run stands, and --resume of a run
that has nothing left to train (issue 12, defect 7: it exited 0 and overwrote the run's
summary.json with a null accuracy)."""
import json
import subprocess
from pathlib import Path

import pytest

from conftest import DIGITS_EPOCHS, DIGITS_STEPS
from ssdsgd import checkpoint as C
from ssdsgd import train as T
from ssdsgd.data import DataError
from test_e2e_configs import PY, ROOT, clean_env
from test_train import cfg_with, digits_job, no_role  # noqa: F401 - fixture


def snapshot(run: Path) -> dict:
    """Every file of a run directory and its bytes."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file()}


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


def test_resume_of_a_finished_run_by_hand_is_refused(tmp_path, no_role, capsys):
    cfg = digits_job(tmp_path, train={"epochs": 1, "checkpoint_every": 1})
    run = tmp_path / "run"
    assert T.main([str(cfg), "--run-dir", str(run)]) == 0
    before = snapshot(run)
    assert json.loads(before["summary.json"])["final_accuracy"] > 0.5
    capsys.readouterr()
    assert T.main(["--resume", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {run}: the run is finished (44 of 44 steps done); nothing to "
                   "resume (--set train.epochs=N with a larger N continues it)"]
    assert snapshot(run) == before                  # its result is kept, byte for byte
    # more epochs: a finished run continues where it stopped
    assert T.main(["--resume", str(run), "--set", "train.epochs=2"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 88 and summary["final_accuracy"] > 0.5


@pytest.mark.system
def test_resume_of_a_finished_job_through_the_launcher_is_refused(uninterrupted_digits):
    """``launch/dist.py --resume RUN`` of a job that ran to its end: exit 2, one line
    naming the run, before any process starts; the run directory is left as it was. The
    finished job is the checkpoint tests' digits job (ssd, a checkpoint every epoch), run
    once per session for tests/test_resume.py and tests/test_recovery.py too."""
    run = uninterrupted_digits("ssd")
    before = snapshot(run)
    assert json.loads(before["summary.json"])["final_accuracy"] > 0.5
    steps = DIGITS_EPOCHS * DIGITS_STEPS
    again = subprocess.run([PY, "launch/dist.py", "--resume", str(run), "--set",
                            "train.log_interval=5"], capture_output=True, text=True,
                           cwd=ROOT, env=clean_env(), timeout=150)
    assert again.returncode == 2
    assert again.stdout == ""                        # no process was started
    assert again.stderr.strip().splitlines() == [
        f"launch/dist.py: error: {run}: the run is finished ({steps} of {steps} steps done); "
        "nothing to resume (--set train.epochs=N with a larger N continues it)"]
    assert snapshot(run) == before
