"""Whole-job progress from the workers' metrics files, for the launcher.

    mon = ProgressMonitor(run_dir, total_steps=None, tty=sys.stderr.isatty())
    while job_running:
        mon.poll(); time.sleep(1)
    mon.close()

``poll()`` reads only what the workers appended to ``RUN_DIR/metrics/worker-*.jsonl``
since the last call. On a tty it drives one tqdm bar for the job (steps of the slowest
worker, or with dynamic data the job's global batches, with epoch, job samples/s and the
latest accuracy); otherwise it prints a plain line at most every ``interval`` seconds
(10 by default). ``total_steps`` may be None: it is then taken from the workers' ``start``
records. The samples/s shown is the job's throughput by the wall clock: the samples the
workers have trained over the longest time any of them has trained (at the end, their
``end`` records': the summary's figure).

Other output must not be written through the monitor's line: ``mon.sink(stream)`` is a
file-like object for the launcher's output prefixer that writes whole lines, one at a time
with the monitor's own (on a tty above the bar: clear, write, redraw). Without it, a
worker's line could land between a progress line and its newline.

A resumed run (``start_step``: the checkpoint's step) appends to the same files: what they
hold already is the interrupted run's, which may have gone past the checkpoint, so the
monitor starts after it, at ``start_step``.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from ssdsgd.metrics import job_throughput, worker_files


def rate_text(rate: float) -> str:
    """A rate as shown: whole numbers from 100 on, else three significant digits, so a
    slow job (big images, under 1 sample a second) does not read as 0."""
    return f"{rate:.0f}" if rate >= 100 or rate == 0 else f"{rate:.3g}"


class ProgressMonitor:
    def __init__(self, run_dir, total_steps: int | None = None, tty: bool = False,
                 interval: float = 10.0, stream=None, start_step: int | None = None):
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.tty = tty
        self.interval = interval
        self.stream = stream if stream is not None else sys.stderr
        self._offsets: dict[Path, int] = {}
        self.workers: dict[int, dict] = {}   # rank -> latest train record
        self.val: dict | None = None          # latest validation record
        self.num_workers: int | None = None
        self._bar = None
        self._last_print = float("-inf")
        self._t0 = time.monotonic()
        self._closed = False
        self._lock = threading.RLock()   # the bar vs lines written by other threads
        self._last_line = None
        if start_step is not None:
            self._skip_to(start_step)

    def _skip_to(self, start_step: int) -> None:
        """Ignore what the files hold now (an earlier run's records); every worker that
        wrote one starts at ``start_step``."""
        for rank, path in worker_files(self.run_dir).items():
            try:
                self._offsets[path] = path.stat().st_size
            except FileNotFoundError:
                continue
            self.workers[rank] = {"step": start_step}

    # -- reading
    def _read_new(self, path: Path) -> list[dict]:
        offset = self._offsets.get(path, 0)
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n")
        if end < 0:
            return []
        self._offsets[path] = offset + end + 1
        out = []
        for line in chunk[:end].splitlines():
            try:
                out.append(json.loads(line))
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
        return out

    def _ingest(self, rank: int, rec: dict) -> None:
        event = rec.get("event")
        if event == "start":
            if self.total_steps is None and rec.get("total_steps"):
                self.total_steps = int(rec["total_steps"])
            if rec.get("num_workers"):
                self.num_workers = int(rec["num_workers"])
            # a resumed run appends to the file: its start record begins afresh
            start = int(rec.get("start_step") or 0)
            self.workers[rank] = {"step": start, "from_step": start,
                                  "batch_size": rec.get("batch_size")}
        elif event in ("train", "end"):
            state = self.workers.setdefault(rank, {})
            if event == "end":
                state["step"] = rec.get("global_step", rec.get("steps", state.get("step", 0)))
                state["done"] = True
                # what the job's throughput is made of (metrics.job_throughput)
                state["samples_per_sec"] = rec.get("samples_per_sec")
                state["end"] = {k: rec.get(k) for k in ("samples", "wall_time")}
            else:
                state.update({k: rec.get(k) for k in ("step", "epoch", "accuracy", "loss",
                                                      "samples_per_sec", "stage", "elapsed")})
                state["own_step"] = rec.get("step")
                if "global_step" in rec:     # dynamic data: the job's global batches
                    state["step"] = rec["global_step"]
        elif event == "val":
            self.val = rec

    # -- figures
    @property
    def step(self) -> int:
        steps = [w.get("step") or 0 for w in self.workers.values()]
        if not steps:
            return 0
        if self.num_workers and len(steps) < self.num_workers:
            return 0
        return min(steps)

    def status(self) -> dict:
        live = [w for w in self.workers.values() if not w.get("done")]
        epochs = [w.get("epoch") for w in self.workers.values() if w.get("epoch") is not None]
        # the job's throughput by its wall clock, the summary's (metrics.job_throughput)
        # once every worker has ended, and the same figure so far while they run
        speed = (self._speed_so_far() if live else job_throughput(
            w.get("end", {}) for w in self.workers.values())) or 0.0
        accs = [w.get("accuracy") for w in self.workers.values()
                if w.get("accuracy") is not None]
        return {"step": self.step, "total_steps": self.total_steps,
                "epoch": min(epochs) if epochs else None,
                "samples_per_sec": speed,
                "train_accuracy": sum(accs) / len(accs) if accs else None,
                "val_accuracy": self.val.get("accuracy") if self.val else None,
                "stage": next((w.get("stage") for w in live if w.get("stage")), None),
                "workers": len(self.workers)}

    def _speed_so_far(self):
        """The samples the workers have trained over the longest time any has trained
        (each record's ``elapsed``), as the summary counts them at the end: never a sum
        of the workers' interval rates, which overstates a job whose workers differ in
        speed. None until it is known (a worker without its batch size or time)."""
        samples, longest = 0, 0.0
        for w in self.workers.values():
            if w.get("done"):
                end = w.get("end", {})
                if end.get("samples") is None or not end.get("wall_time"):
                    return None
                samples, longest = samples + end["samples"], max(longest, end["wall_time"])
            elif w.get("elapsed") is not None:
                if w.get("batch_size") is None or w.get("own_step") is None:
                    return None
                samples += (w["own_step"] - w.get("from_step", 0)) * w["batch_size"]
                longest = max(longest, w["elapsed"])
        return samples / longest if longest > 0 else None

    def _text(self, s: dict) -> str:
        parts = [f"epoch {s['epoch']}" if s["epoch"] is not None else "epoch -",
                 f"{rate_text(s['samples_per_sec'])} samples/s"]
        if s["val_accuracy"] is not None:
            parts.append(f"val acc {s['val_accuracy']:.4f}")
        elif s["train_accuracy"] is not None:
            parts.append(f"train acc {s['train_accuracy']:.4f}")
        if s["stage"]:
            parts.append(s["stage"])
        return " | ".join(parts)

    # -- public
    def poll(self, display: bool = True) -> dict:
        """Read new records and refresh the display; returns the current status."""
        for rank, path in worker_files(self.run_dir).items():
            for rec in self._read_new(path):
                self._ingest(rank, rec)
        s = self.status()
        if self._closed or not display:
            return s
        if self.tty:
            with self._lock:
                if self._bar is None and (self.total_steps or self.workers):
                    from tqdm import tqdm
                    self._bar = tqdm(total=self.total_steps, unit="step", file=self.stream,
                                     dynamic_ncols=True, desc="training",
                                     bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/"
                                                "{total_fmt} [{elapsed}<{remaining}{postfix}]")
                if self._bar is not None:
                    if self.total_steps and self._bar.total != self.total_steps:
                        self._bar.total = self.total_steps
                    self._bar.n = s["step"]
                    self._bar.set_postfix_str(self._text(s), refresh=False)
                    self._bar.refresh()
        elif self.workers:
            now = time.monotonic()
            if now - self._last_print >= self.interval:
                self._last_print = now
                self._print_line(s)
        return s

    def _print_line(self, s: dict, final: bool = False) -> None:
        total = s["total_steps"]
        pct = f" ({100.0 * s['step'] / total:.0f}%)" if total else ""
        line = (f"progress: step {s['step']}/{total if total else '?'}{pct} | "
                f"{self._text(s)}")
        if final and line == self._last_line:
            return          # the last periodic line already said it
        self._last_line = line
        self._write_lines(self.stream, f"{line} | {time.monotonic() - self._t0:.0f}s\n")

    def sink(self, stream):
        """A file-like object that writes whole lines to ``stream``, never inside one of
        the monitor's (above the bar on a tty)."""
        return _LineSink(self, stream)

    def _write_lines(self, stream, text: str) -> None:
        with self._lock:
            bar = self._bar
            if bar is not None:
                bar.clear()
            stream.write(text)
            stream.flush()
            if bar is not None:
                bar.refresh()

    def close(self) -> dict:
        """A last poll, then close the bar (or print the final line)."""
        s = self.poll(display=self.tty)
        with self._lock:
            self._closed = True
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            elif not self.tty:
                self._print_line(s, final=True)
        return s


class _LineSink:
    """Buffers writes until a newline, then hands whole lines to the monitor."""

    def __init__(self, monitor: ProgressMonitor, stream):
        self.monitor, self.stream = monitor, stream
        self._buf = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._buf += text
            cut = self._buf.rfind("\n")
            if cut < 0:
                return len(text)
            lines, self._buf = self._buf[:cut + 1], self._buf[cut + 1:]
        self.monitor._write_lines(self.stream, lines)
        return len(text)

    def flush(self) -> None:
        pass                  # partial lines wait for their newline

    def isatty(self) -> bool:
        return self.monitor.tty
