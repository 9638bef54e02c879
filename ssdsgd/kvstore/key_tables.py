"""The keys a worker initialized: where each is placed, its dtype, and the per-key step
of its next push (the step a server aggregates by). Built once, at ``init``; every
request and every reply reads it."""
import dataclasses

import numpy as np

from .sharding import Placement


@dataclasses.dataclass
class _Key:
    dtype: np.dtype
    pushes: int = 0     # the per-key step of the next push


class KeyTable:
    def __init__(self, num_servers, bigarray_bound):
        self.placement = Placement(num_servers, bigarray_bound)
        self._keys = {}

    def add(self, key, size, dtype):
        """Place ``key`` (in the same order on every worker: it decides the placement)."""
        self.placement.place(key, size, np.dtype(dtype).itemsize)
        self._keys.setdefault(key, _Key(np.dtype(dtype)))

    def __getitem__(self, key):
        k = self._keys.get(key)
        if k is None:
            raise KeyError(f"key {key} was never initialized (call init or broadcast first)")
        return k

    def shapes(self, entries=None):
        """({key: size}, {key: dtype}) of the keys a reply may hold: those of ``entries``
        ((key, step, tensors, dtype)), or, with None, every key this worker placed."""
        if entries is None:
            return ({key: sum(sl.count for sl in slices)
                     for key, slices in self.placement.slices.items()},
                    {key: k.dtype for key, k in self._keys.items()})
        return ({key: sum(sl.count for sl in self.placement[key]) for key, _, _, _ in entries},
                {key: np.dtype(dtype) for key, _, _, dtype in entries})
