"""ssdsgd.checkpoint: the checkpoint record, where a run stands, and --resume of a run
that has nothing left to train (issue 12, defect 7: it exited 0 and overwrote the run's
summary.json with a null accuracy)."""
import json
from pathlib import Path

import pytest

from conftest import DIGITS_EPOCHS, DIGITS_STEPS
from ssdsgd import checkpoint as C
from ssdsgd import train as T
from ssdsgd.data import DataError
from test_e2e_configs import dist
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
    again = dist(["--resume", run, "--set", "train.log_interval=5"], timeout=150)
    assert again.returncode == 2
    assert again.stdout == ""                        # no process was started
    assert again.stderr.strip().splitlines() == [
        f"launch/dist.py: error: {run}: the run is finished ({steps} of {steps} steps done); "
        "nothing to resume (--set train.epochs=N with a larger N continues it)"]
    assert snapshot(run) == before


def _write_checkpoint(ck: Path, stem: str, workers=2):
    for name in [f"{stem}.params", f"{stem}.states"] + [
            f"{stem}.worker-{r}.npz" for r in range(workers)]:
        (ck / name).write_bytes(b"x" * 10)


def _stems(ck: Path) -> set:
    return {p.name.split(".")[0] for p in ck.iterdir()
            if p.name.startswith(("epoch-", "step-"))}


def test_keep_checkpoints_keeps_the_last_n_and_the_best(tmp_path):
    ck = tmp_path / "checkpoints"
    ck.mkdir()
    accuracies = {"epoch-0000": 0.5, "epoch-0001": 0.9, "step-00000250": None,
                  "epoch-0002": 0.6, "epoch-0003": 0.7, "epoch-0004": 0.8}
    for step, (stem, acc) in enumerate(accuracies.items()):
        _write_checkpoint(ck, stem)
        C.record_checkpoint(tmp_path, {"params": f"{stem}.params", "step": 100 * step},
                            keep=2, accuracy=acc)
    assert _stems(ck) == {"epoch-0001", "epoch-0003", "epoch-0004"}   # best + last 2
    assert [e["stem"] for e in json.loads((ck / "index.json").read_text())] == \
        ["epoch-0001", "epoch-0003", "epoch-0004"]
    assert json.loads((ck / "latest.json").read_text())["params"] == "epoch-0004.params"
    assert C.checkpoint_bytes(tmp_path) == sum(p.stat().st_size for p in ck.iterdir())


def test_keep_zero_keeps_every_checkpoint_and_a_resume_drops_the_abandoned_future(tmp_path):
    ck = tmp_path / "checkpoints"
    ck.mkdir()
    for step, stem in enumerate(["epoch-0000", "epoch-0001", "epoch-0002"]):
        _write_checkpoint(ck, stem)
        C.record_checkpoint(tmp_path, {"params": f"{stem}.params", "step": 100 * step})
    assert _stems(ck) == {"epoch-0000", "epoch-0001", "epoch-0002"}
    # resumed from epoch-0000 (step 0): the next checkpoint, at step 50, is the newest;
    # what the killed run wrote after step 0 is never used again
    _write_checkpoint(ck, "step-00000050")
    C.record_checkpoint(tmp_path, {"params": "step-00000050.params", "step": 50})
    assert _stems(ck) == {"epoch-0000", "step-00000050"}
