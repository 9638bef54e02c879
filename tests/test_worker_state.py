"""A worker's state file writes each distinct array once (store._one_copy_each): in a
synchronous stage its local weights, last global snapshot and pending reply are equal."""
import numpy as np

from ssdsgd.store import _one_copy_each


def test_equal_arrays_are_written_once_and_differing_ones_each():
    w = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    arrays = {"k0.value": w, "k0.local": w.copy(), "p0.value": w.copy(),
              "k0.prev_value": w + 1, "k0.flat": w.reshape(-1).copy(),   # other shape
              "k0.half": w.astype(np.float16)}                           # other dtype
    kept, same_as = _one_copy_each(arrays)
    assert same_as == {"k0.local": "k0.value", "p0.value": "k0.value"}
    assert sorted(kept) == ["k0.flat", "k0.half", "k0.prev_value", "k0.value"]
    restored = {**kept, **{name: kept[twin] for name, twin in same_as.items()}}
    for name, a in arrays.items():
        assert restored[name].dtype == a.dtype and np.array_equal(restored[name], a)
