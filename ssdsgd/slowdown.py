"""Straggler injection (``debug.slowdown``): workers made slow on purpose.

Slow workers are what quorum aggregation and partial reduce are for; tests need arrival
orders they can fix, benchmarks need eager-SGD's injected delays, and users want to see
what one slow machine does to their job. Off by default; when on, the worker warns at
start and the run's summary names it (``debug_slowdown``).

    slow = Slowdown("delay:1=0.2", rank=1, num_workers=4)
    slow.after_compute(step, compute_s)   # sleeps 0.2 s on rank 1, nothing elsewhere

The forms are ``ssdsgd.settings.parse_slowdown``'s: ``factor:R=F`` (rank R's compute
takes F times as long: it sleeps (F - 1) x the compute it measured), ``delay:R=S`` (rank R
sleeps S seconds per step before it pushes) and ``random:D:R[:SEED]`` (eager-SGD, Li et
al. PPoPP'20: each step, R ranks drawn from a generator seeded with (SEED, step) sleep D
seconds, so every worker agrees on who is slow without talking).
"""
from __future__ import annotations

import time

import numpy as np

from ssdsgd.settings import parse_slowdown


class Slowdown:
    """One worker's injected delay per step."""

    def __init__(self, text: str, rank: int, num_workers: int):
        spec = parse_slowdown(text)
        self.text, self.rank, self.num_workers = text, rank, num_workers
        self.kind, self.per_rank = spec["kind"], spec["per_rank"]
        self.delay, self.count, self.seed = spec["delay"], spec["count"], spec["seed"]
        self.count = min(self.count, num_workers)   # by hand, one process: rank 0 only

    @property
    def active(self) -> bool:
        """Whether this worker is ever slowed (a factor of 1 or a delay of 0 is not)."""
        if self.kind == "factor":
            return self.per_rank.get(self.rank, 1.0) > 1.0
        if self.kind == "delay":
            return self.per_rank.get(self.rank, 0.0) > 0.0
        return self.kind == "random" and self.delay > 0

    @property
    def measures_compute(self) -> bool:
        """The caller must wait for its compute to finish and time it (factor only)."""
        return self.kind == "factor" and self.active

    def slow_ranks(self, step: int) -> list[int]:
        """The ranks slowed at ``step`` (global step, from 0)."""
        if self.kind == "random":
            rng = np.random.default_rng([self.seed, step])
            return sorted(int(r) for r in rng.choice(self.num_workers, self.count,
                                                     replace=False))
        return sorted(r for r in self.per_rank
                      if self.per_rank[r] > (1.0 if self.kind == "factor" else 0.0))

    def seconds(self, step: int, compute_s: float = 0.0) -> float:
        """This worker's extra seconds at ``step``."""
        if self.kind == "factor":
            return (self.per_rank.get(self.rank, 1.0) - 1.0) * compute_s
        if self.kind == "delay":
            return self.per_rank.get(self.rank, 0.0)
        if self.kind == "random" and self.rank in self.slow_ranks(step):
            return self.delay
        return 0.0

    def after_compute(self, step: int, compute_s: float = 0.0) -> float:
        """Sleep this worker's extra seconds at ``step``; the seconds slept."""
        extra = self.seconds(step, compute_s)
        if extra > 0:
            time.sleep(extra)
        return extra

    def describe(self) -> str:
        return "off" if self.kind == "none" else f"{self.text} (injected on purpose)"
