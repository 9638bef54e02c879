"""Optimizer state files without pickle: what ``Trainer.save_states`` writes on ssd_sync.

MXNet's own format (``Updater.get_states``) is a pickle of the states and the optimizer,
and loading one runs whatever code it names: a checkpoint replaced by a pickle of
``os.system`` ran its command on every worker at ``--resume`` (issue 30, item 1). This
file is an ``.npz`` (loaded with ``allow_pickle=False``) holding each key's state arrays
and a JSON meta entry with the optimizer's description (``optimizer_spec.describe``:
rebuilt with MXNet's own classes and checked). A pickle is refused in one line.

    save(path, spec, {key: [array, ...]})
    spec, states = load(path)          # StateFileError, one line, if it is not this format
"""
import json
import os
import re
import zipfile

import numpy as np

FORMAT = "ssdsgd-optimizer-states-1"
META = "__meta__"
_ENTRY = re.compile(r"k(\d+)\.(\d+)")


class StateFileError(ValueError):
    """A state file that is not this format (a pickle, a damaged file). One line."""


def save(path, spec, states):
    """``states``: key (int) -> that key's state arrays in ``flatten_state`` order."""
    arrays = {f"k{key}.{j}": np.ascontiguousarray(a)
              for key, parts in states.items() for j, a in enumerate(parts)}
    meta = {"format": FORMAT, "optimizer": spec,
            "keys": {str(key): len(parts) for key, parts in states.items()}}
    arrays[META] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)


def _refuse_other_formats(path):
    with open(path, "rb") as f:
        head = f.read(4)
    if head[:1] == b"\x80" or head[:1] in (b"(", b"]", b"}", b"c"):
        raise StateFileError(f"{path}: a pickle (MXNet's own optimizer-state format, or "
                             "something posing as one); ssdsgd never unpickles a file, so "
                             "it cannot be loaded (save the states again with ssd_sync)")
    if head != b"PK\x03\x04":
        raise StateFileError(f"{path}: not an ssdsgd optimizer-state file")


def load(path):
    """(optimizer description, {key: [state arrays]}) of a file ``save`` wrote."""
    _refuse_other_formats(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise StateFileError(f"{path}: not a readable optimizer-state file ({e})") from None
    try:
        meta = json.loads(arrays.pop(META).tobytes().decode())
    except (KeyError, ValueError, UnicodeDecodeError):
        raise StateFileError(f"{path}: no readable {META} entry") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or \
            not isinstance(meta.get("keys"), dict) or not isinstance(meta.get("optimizer"), dict):
        raise StateFileError(f"{path}: not format {FORMAT}")
    states = {}
    for key, count in meta["keys"].items():
        if not (key.isdigit() and isinstance(count, int) and 0 <= count <= 16):
            raise StateFileError(f"{path}: bad key entry {key!r}: {count!r}")
        try:
            states[int(key)] = [arrays.pop(f"k{key}.{j}") for j in range(count)]
        except KeyError:
            raise StateFileError(f"{path}: key {key} lacks a state array") from None
    if arrays:
        raise StateFileError(f"{path}: unexpected entries {sorted(arrays)[:3]}")
    return meta["optimizer"], states
