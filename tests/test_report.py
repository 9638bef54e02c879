"""ssdsgd.report on run directories in the real format (written with ssdsgd.metrics)."""
import json

import pytest

from ssdsgd import report
from ssdsgd.metrics import MetricsWriter, summarize


def fake_run(root, name, algorithm, accs, workers=2, bytes_per_step=1000, complete=True):
    """A run dir as ssdsgd.train leaves it: metrics per worker, summary.json on rank 0."""
    run = root / name
    for rank in range(workers):
        w = MetricsWriter(run, rank)
        w.write("start", rank=rank, num_workers=workers, steps_per_epoch=10,
                total_steps=10 * len(accs), algorithm=algorithm, kvstore=True)
        for e, acc in enumerate(accs):
            step = 10 * (e + 1)
            w.write("train", step=step, epoch=e, loss=1.0 / step, accuracy=acc,
                    samples_per_sec=500.0, stage="steps_delay", bytes_sent=step * bytes_per_step,
                    bytes_received=step * bytes_per_step // 2, time_blocked=0.1 * step,
                    elapsed=2.0 * (e + 1))
            if rank == 0:
                w.write("val", epoch=e + 1, step=step, accuracy=acc, elapsed=2.0 * (e + 1))
        if complete:
            n = 10 * len(accs)
            w.write("end", steps=n, samples=n * 32, wall_time=2.0 * len(accs),
                    samples_per_sec=n * 32 / (2.0 * len(accs)), bytes_sent=n * bytes_per_step,
                    bytes_received=n * bytes_per_step // 2, time_blocked=0.1 * n * (rank + 1))
        w.close()
    if complete:
        summarize(run, {"name": name, "algorithm": algorithm, "num_workers": workers,
                        "final_accuracy": accs[-1], "best_accuracy": max(accs),
                        "wall_time": 2.0 * len(accs)}, wait_for=workers, timeout=1)
    return run


def test_summary_aggregates_the_workers(tmp_path):
    run = fake_run(tmp_path, "a", "ssd", [0.5, 0.8], workers=3)
    s = json.loads((run / "summary.json").read_text())
    assert s["workers_reporting"] == 3
    assert s["samples_per_sec"] == 3 * 160.0     # 3 x 20 steps x 32 samples in 4 s
    assert s["bytes_sent"] == 3 * 20 * 1000 and s["bytes_received"] == 3 * 10 * 1000
    assert s["time_blocked"] == pytest.approx(4.0) and s["time_blocked_max"] == pytest.approx(6.0)


def test_the_summary_states_the_samples_applied_by_the_jobs_clock(tmp_path):
    """Workers of unequal speed (dynamic data): their own rates summed overstate the job;
    the samples applied over the longest worker's time do not."""
    run = tmp_path / "dyn"
    for rank, (steps, wall) in enumerate([(30, 3.0), (30, 3.0), (10, 4.0)]):
        w = MetricsWriter(run, rank)
        w.write("end", steps=steps, samples=steps * 32, wall_time=wall,
                samples_per_sec=steps * 32 / wall)
        w.close()
    s = summarize(run, {"name": "dyn"}, wait_for=3, timeout=1)
    assert s["samples"] == 70 * 32
    # not the workers' rates summed (2 x 320 + 80 = 720)
    assert s["samples_per_sec"] == pytest.approx(70 * 32 / 4.0)
    assert {r: w["samples_per_sec"] for r, w in s["workers"].items()} == {
        "0": 320.0, "1": 320.0, "2": 80.0}


def test_report_table_and_plots(tmp_path, capsys):
    a = fake_run(tmp_path, "run-ssd", "ssd", [0.5, 0.8, 0.93])
    b = fake_run(tmp_path, "run-ssgd", "ssgd", [0.4, 0.7, 0.91], bytes_per_step=4000)
    c = fake_run(tmp_path, "run-crashed", "asgd", [0.3], complete=False)
    out = tmp_path / "plots"
    assert report.main([str(a), str(b), str(c), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["run", "algorithm", "N", "final"]
    row_a = next(ln for ln in lines if ln.startswith("run-ssd "))
    row_b = next(ln for ln in lines if ln.startswith("run-ssgd "))
    row_c = next(ln for ln in lines if ln.startswith("run-crashed"))
    assert "0.9300" in row_a and "320.0" in row_a and "87.9 KB" in row_a
    assert "0.9100" in row_b and "351.6 KB" in row_b and "ssgd" in row_b
    assert "(incomplete)" in row_c and "0.3000" in row_c
    for name in ("accuracy_vs_time.png", "accuracy_vs_epoch.png"):
        png = out / name
        assert f"plot: {png}" in text
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_report_default_output_dir(tmp_path, capsys):
    a = fake_run(tmp_path, "x", "ssd", [0.5])
    assert report.main([str(a)]) == 0
    assert (tmp_path / "report" / "accuracy_vs_epoch.png").exists()


def test_finished_run_draws_the_plots_unless_told_not_to(tmp_path):
    """The launcher's end-of-job lines; output.plots false leaves out the plots (and
    matplotlib, about 1 s of CPU per job) but not the accuracy line."""
    run = fake_run(tmp_path, "x", "ssd", [0.5, 0.75])
    without = report.finished_run(run, plots=False)
    assert len(without) == 1 and without[0].startswith("test accuracy 0.7500 (")
    assert not (run / "plots").exists()
    lines = report.finished_run(run)
    assert lines[0] == without[0]
    assert lines[1:] == [f"plot: {run / 'plots' / n}"
                         for n in ("accuracy_vs_time.png", "accuracy_vs_epoch.png")]
    assert all((run / "plots" / n).stat().st_size > 5000
               for n in ("accuracy_vs_time.png", "accuracy_vs_epoch.png"))


def test_resumed_run_continues_the_clock(tmp_path):
    run = tmp_path / "r"
    w = MetricsWriter(run, 0)
    w.write("start", num_workers=1)
    w.write("val", epoch=1, accuracy=0.5, elapsed=10.0)
    w.write("val", epoch=2, accuracy=0.6, elapsed=20.0)
    w.write("start", num_workers=1, start_epoch=1)      # resumed after epoch 1
    w.write("val", epoch=2, accuracy=0.65, elapsed=8.0)
    w.close()
    val = report.load_run(run)["val"]
    assert [(v["epoch"], v["accuracy"], v["elapsed"]) for v in val] == [
        (1, 0.5, 10.0), (2, 0.65, 28.0)]


def test_report_errors(tmp_path, capsys):
    assert report.main([str(tmp_path / "missing")]) == 2
    assert "not a run directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert report.main([str(tmp_path / "empty")]) == 2
    bad = fake_run(tmp_path, "bad", "ssd", [0.5])
    (bad / "summary.json").write_text("{oops")
    assert report.main([str(bad)]) == 2
    assert "summary.json: not valid JSON" in capsys.readouterr().err
