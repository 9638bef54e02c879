"""mxglue/op_code_cache.py in real processes: ``import ssdsgd`` before ``import mxnet``
compiles MXNet's generated operator functions once per machine, makes exactly the
functions MXNet makes without it, and ignores a cache file it cannot trust."""
import json
import os
import subprocess
import sys

import pytest

from ssdsgd.testing import clean_env

FINGERPRINT = r"""
import json, sys
if sys.argv[1] == "ssdsgd":
    import ssdsgd
import mxnet as mx
import numpy as np

import ctypes
from mxnet.base import _LIB, OpHandle, c_str, check_call, py_str
plist, size = ctypes.POINTER(ctypes.c_char_p)(), ctypes.c_uint()
check_call(_LIB.MXListAllOpNames(ctypes.byref(size), ctypes.byref(plist)))
op_of = {}
for i in range(size.value):
    h = OpHandle()
    check_call(_LIB.NNGetOpHandle(c_str(py_str(plist[i])), ctypes.byref(h)))
    op_of[h.value] = py_str(plist[i])

def shape_of(code):
    # the function's code with its operator handle (an address: another in every process)
    # written as the operator's name
    consts = ["op " + op_of[c] if type(c) is int and c in op_of else
              shape_of(c) if hasattr(c, "co_code") else repr(c) for c in code.co_consts]
    return [code.co_code.hex(), list(code.co_names), list(code.co_varnames), consts]

seen = {}
for mod in (mx.nd, mx.nd._internal, mx.nd.contrib, mx.nd.random, mx.sym, mx.sym._internal,
            mx.sym.contrib, mx.np, mx.npx, mx.nd.numpy._internal, mx.sym.numpy._internal):
    for name in dir(mod):
        f = getattr(mod, name)
        if callable(f) and getattr(f, "__code__", None) is not None and \
                f.__code__.co_filename == "<string>":
            seen[f"{mod.__name__}.{name}"] = [shape_of(f.__code__), f.__doc__, f.__module__,
                                              repr(f.__defaults__)]
x = mx.nd.array(np.arange(12, dtype="float32").reshape(3, 4))
w = mx.nd.array(np.ones((2, 4), dtype="float32"))
out = mx.nd.FullyConnected(x, w, num_hidden=2, no_bias=True).asnumpy().tolist()
sym = mx.sym.FullyConnected(mx.sym.var("x"), num_hidden=2, name="fc").list_arguments()
stats = None
if sys.argv[1] == "ssdsgd":
    from ssdsgd.mxglue import op_code_cache
    c = op_code_cache._cache
    stats = {"loaded": c.loaded, "hits": c.hits}
print(json.dumps({"functions": seen, "out": out, "sym": sym, "stats": stats}))
"""


def fingerprint(mode, cache_dir):
    done = subprocess.run([sys.executable, "-c", FINGERPRINT, mode],
                          env=clean_env(SSDSGD_CACHE_DIR=cache_dir),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def cache_file(cache_dir):
    files = list(cache_dir.glob("mxnet-op-code-*.marshal"))
    assert len(files) == 1, files
    return files[0]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """What MXNet makes on its own."""
    return fingerprint("mxnet", tmp_path_factory.mktemp("unused"))


def test_the_cache_makes_the_functions_mxnet_makes_and_compiles_nothing_again(
        tmp_path, plain):
    first = fingerprint("ssdsgd", tmp_path)           # writes the file
    assert first["stats"]["loaded"] == 0
    second = fingerprint("ssdsgd", tmp_path)          # reads it
    assert second["stats"]["loaded"] > 2000
    # every text was found (identical texts of aliases included); none compiled again
    assert second["stats"]["hits"] >= second["stats"]["loaded"]
    assert len(plain["functions"]) > 2000
    for got in (first, second):
        assert got["functions"] == plain["functions"]
        assert (got["out"], got["sym"]) == (plain["out"], plain["sym"])


@pytest.mark.parametrize("damage", ["writable by others", "garbage", "truncated"])
def test_a_cache_file_that_cannot_be_trusted_is_ignored_and_written_again(
        tmp_path, plain, damage):
    fingerprint("ssdsgd", tmp_path)
    path = cache_file(tmp_path)
    if damage == "writable by others":
        path.chmod(0o666)
    elif damage == "garbage":
        path.write_bytes(b"\x00not marshal" * 10)
    else:
        path.write_bytes(path.read_bytes()[:1000])
    got = fingerprint("ssdsgd", tmp_path)
    assert got["stats"]["loaded"] == 0
    assert got["functions"] == plain["functions"] and got["out"] == plain["out"]
    again = fingerprint("ssdsgd", tmp_path)       # the file was written anew, trusted
    assert again["stats"]["loaded"] > 2000
    assert oct(cache_file(tmp_path).stat().st_mode & 0o777) == oct(0o600)


def test_the_cache_dir_is_read_through_its_settings_row(tmp_path, monkeypatch):
    """SSDSGD_CACHE_DIR is a row of ssdsgd/settings.py: empty is unset (the default under
    XDG_CACHE_HOME), ``off`` keeps no file."""
    from ssdsgd.mxglue import op_code_cache
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for unset in ("", None):
        if unset is None:
            monkeypatch.delenv("SSDSGD_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("SSDSGD_CACHE_DIR", unset)
        assert os.path.dirname(op_code_cache.cache_path()) == str(tmp_path / "xdg/ssdsgd")
    monkeypatch.setenv("SSDSGD_CACHE_DIR", str(tmp_path / "mine"))
    assert os.path.dirname(op_code_cache.cache_path()) == str(tmp_path / "mine")
    monkeypatch.setenv("SSDSGD_CACHE_DIR", "off")
    assert op_code_cache.cache_path() is None
