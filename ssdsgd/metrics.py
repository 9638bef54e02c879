"""Per-worker metrics: JSON lines, Speedometer-style log lines, the run summary.

Every worker appends to ``RUN_DIR/metrics/worker-{rank}.jsonl`` one JSON object per line,
each with an ``event``:

- ``start``: rank, num_workers, steps_per_epoch, total_steps, batch_size, warmup_steps,
  algorithm, time (unix seconds);
- ``train`` (every ``train.log_interval`` steps): step (global steps done), epoch, loss
  and accuracy (means over the interval), samples_per_sec (this worker's), stage,
  bytes_sent, bytes_received, time_blocked (cumulative, from ``kv.metrics()`` when the
  kvstore has that method; 0 without a kvstore, null if it does not report them),
  elapsed (seconds since training started), time;
- ``val`` (after every epoch, on the validating worker): epoch (1-based count of epochs
  done), step, accuracy (top-1), top5 (ImageNet), elapsed, time;
- ``checkpoint``: epoch, step, path;
- ``end``: steps, samples, wall_time, samples_per_sec and the network figures, plus the
  kvstore's full metrics dict under ``kv``.

Rank 0 writes ``RUN_DIR/summary.json`` at the end (see :func:`summarize`).
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

log = logging.getLogger("ssdsgd.train")

NET_KEYS = ("bytes_sent", "bytes_received", "time_blocked")


def metrics_path(run_dir, rank: int) -> Path:
    return Path(run_dir) / "metrics" / f"worker-{rank}.jsonl"


def _clean(value):
    """JSON-safe: numpy scalars to Python, NaN/inf to None."""
    if hasattr(value, "item") and not isinstance(value, (list, dict, str)):
        try:
            value = value.item()
        except (ValueError, AttributeError):
            pass
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def kv_metrics(kv) -> dict:
    """The kvstore's own figures (``kv.metrics()``), or {} when it has none."""
    fn = getattr(kv, "metrics", None) if kv is not None else None
    if not callable(fn):
        return {}
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - metrics must never stop training
        log.warning("kv.metrics() failed: %s", exc)
        return {}
    return dict(out) if isinstance(out, dict) else {}


def net_figures(kv, m: dict | None = None) -> dict:
    """bytes_sent, bytes_received, time_blocked: 0 without a kvstore, None when the
    kvstore does not report them. ``m``: the kvstore's metrics if already read."""
    if kv is None:
        return {k: 0 for k in NET_KEYS}
    m = kv_metrics(kv) if m is None else m
    aliases = {"bytes_received": ("bytes_received", "bytes_recv"),
               "bytes_sent": ("bytes_sent",), "time_blocked": ("time_blocked",)}
    return {k: next((m[a] for a in aliases[k] if a in m), None) for k in NET_KEYS}


class MetricsWriter:
    """Appends this worker's records to RUN_DIR/metrics/worker-{rank}.jsonl."""

    def __init__(self, run_dir, rank: int):
        self.path = metrics_path(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)

    def write(self, event: str, **fields) -> dict:
        rec = {"event": event, **{k: _clean(v) for k, v in fields.items()},
               "time": time.time()}
        self._f.write(json.dumps(rec) + "\n")
        return rec

    def close(self):
        if not self._f.closed:
            self._f.close()


class Speedometer:
    """Interval statistics and the classic MXNet log line:
    ``Epoch[0] Batch[20] Speed: 1234.5 samples/sec accuracy=0.910000 loss=0.3012``."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.tic = time.perf_counter()
        self.samples = 0
        self.loss_sum = 0.0
        self.correct = 0
        self.count = 0

    def update(self, samples: int, loss_sum: float, correct: int):
        self.samples += samples
        self.loss_sum += loss_sum
        self.correct += correct
        self.count += samples

    def stats(self) -> dict:
        dt = max(time.perf_counter() - self.tic, 1e-9)
        return {"loss": self.loss_sum / max(self.count, 1),
                "accuracy": self.correct / max(self.count, 1),
                "samples_per_sec": self.samples / dt}

    @staticmethod
    def line(epoch: int, batch: int, stats: dict) -> str:
        return (f"Epoch[{epoch}] Batch[{batch}] Speed: {stats['samples_per_sec']:.1f} "
                f"samples/sec accuracy={stats['accuracy']:.6f} loss={stats['loss']:.4f}")


def read_records(path) -> list[dict]:
    """All complete JSON records of a metrics file (a torn last line is skipped)."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                if not line.endswith("\n"):
                    break
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        pass
    return out


def worker_files(run_dir) -> dict[int, Path]:
    files = {}
    for p in sorted((Path(run_dir) / "metrics").glob("worker-*.jsonl")):
        try:
            files[int(p.stem.split("-", 1)[1])] = p
        except ValueError:
            continue
    return files


def job_throughput(ends):
    """Samples applied per second of the job's wall time, from the workers' ``end``
    records: their samples over the longest wall time (None if one lacks either)."""
    ends = list(ends)
    samples = [e.get("samples") for e in ends]
    walls = [e.get("wall_time") for e in ends]
    if not ends or any(s is None for s in samples) or not all(walls):
        return None
    return sum(samples) / max(walls)


def throughput_by_membership(members, edges, wall: float, batch_size: int, untrained=()):
    """Samples applied per second of wall time in each span of a job whose workers
    joined or left (``members``: its ``sync.membership.Membership``; ``edges``: sorted
    (step of a change, seconds after training started when this worker heard of it),
    the span's edge in time). A span's samples are its steps' chunks (the membership's,
    so they are the samples the servers applied), less one a step of ``untrained``:
    the steps [E, s) of a dead worker whose pushes left at E and its data at s
    (docs/spec/membership.md rule 10). A span with no time of its own has no rate."""
    steps = [0] + [s for s, _ in edges] + [members.end()]
    times = [0.0] + [t for _, t in edges] + [wall]
    spans = []
    for a, b, ta, tb in zip(steps, steps[1:], times, times[1:]):
        lost = sum(max(0, min(b, s) - max(a, e)) for e, s in untrained)
        samples = (members.first_chunk(b) - members.first_chunk(a) - lost) * batch_size
        seconds = max(tb - ta, 0.0)
        spans.append({"workers": len(members.members(a)), "from_step": a, "to_step": b,
                      "seconds": seconds, "samples": samples,
                      "samples_per_sec": samples / seconds if seconds > 0 else None})
    return spans


def summarize(run_dir, base: dict, wait_for: int = 0, timeout: float = 10.0) -> dict:
    """Write RUN_DIR/summary.json from ``base`` (rank 0's figures: final_accuracy,
    wall_time, ...) and the ``end`` records of every worker's metrics file: job
    throughput (the samples every worker trained, which the servers applied once each,
    over the longest worker's wall time: never a sum of the workers' rates, which
    overstates a job whose workers differ in speed or steps), bytes moved (sums), time
    blocked (mean and max over workers). Waits up to ``timeout`` s for ``wait_for`` end records."""
    deadline = time.monotonic() + timeout
    while True:
        ends = {}
        for rank, p in worker_files(run_dir).items():
            recs = [r for r in read_records(p) if r.get("event") == "end"]
            if recs:
                ends[rank] = recs[-1]
        if len(ends) >= wait_for or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    summary = dict(base)
    summary["workers_reporting"] = len(ends)
    if ends:
        def total(key):
            vals = [e.get(key) for e in ends.values()]
            return None if any(v is None for v in vals) else sum(vals)
        # every push is applied once (quorum.md rule 1): the samples the servers applied,
        # over the longest worker's training time (the job's, not a sum of rates)
        summary["samples"] = total("samples")
        summary["samples_per_sec"] = job_throughput(ends.values())
        summary["bytes_sent"] = total("bytes_sent")
        summary["bytes_received"] = total("bytes_received")
        blocked = [e.get("time_blocked") for e in ends.values()]
        if all(b is not None for b in blocked):
            summary["time_blocked"] = sum(blocked) / len(blocked)
            summary["time_blocked_max"] = max(blocked)
        else:
            summary["time_blocked"] = summary["time_blocked_max"] = None
        summary["workers"] = {str(r): {k: e.get(k) for k in (
            "steps", "samples", "wall_time", "samples_per_sec", *NET_KEYS)}
            for r, e in sorted(ends.items())}
    summary = _clean(summary)
    path = Path(run_dir) / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, path)
    return summary
