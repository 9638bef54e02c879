"""mxglue/state_file.py in process: optimizer states round-trip as arrays + JSON, and a
pickle, or a damaged file, is refused in one line without being loaded."""
import os
import pickle
import zipfile

import numpy as np
import pytest

from ssdsgd.mxglue import state_file


class _Runs:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_states_round_trip(tmp_path):
    path = str(tmp_path / "s.states")
    spec = {"name": "sgd", "params": {"momentum": 0.9}}
    states = {0: [np.arange(6, dtype=np.float32).reshape(2, 3)], 3: [],
              7: [np.ones(2, np.float16), np.zeros(2, np.float32)]}
    state_file.save(path, spec, states)
    got_spec, got = state_file.load(path)
    assert got_spec == spec and got.keys() == states.keys()
    for key in states:
        assert len(got[key]) == len(states[key])
        for a, b in zip(got[key], states[key]):
            assert a.dtype == b.dtype and (a == b).all()


def test_a_pickle_is_refused_and_not_loaded(tmp_path):
    path = tmp_path / "s.states"
    marker = tmp_path / "ran"
    path.write_bytes(pickle.dumps(_Runs(str(marker))))
    with pytest.raises(state_file.StateFileError, match="a pickle"):
        state_file.load(str(path))
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["garbage", "no_meta", "missing_array"])
def test_a_damaged_file_is_one_line(tmp_path, damage):
    path = tmp_path / "s.states"
    state_file.save(str(path), {"name": "sgd"}, {1: [np.ones(3)]})
    if damage == "garbage":
        path.write_bytes(b"hello world")
    else:
        drop = "__meta__.npy" if damage == "no_meta" else "k1.0.npy"
        with zipfile.ZipFile(path) as z:
            entries = {n: z.read(n) for n in z.namelist() if n != drop}
        with zipfile.ZipFile(path, "w") as z:
            for name, data in entries.items():
                z.writestr(name, data)
    with pytest.raises(state_file.StateFileError) as e:
        state_file.load(str(path))
    assert "\n" not in str(e.value)
