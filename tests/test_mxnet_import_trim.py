"""mxglue/import_trim.py in real processes: ``import ssdsgd`` before ``import mxnet``
leaves out of MXNet's import what training never uses (scikit-learn; scipy.stats,
scipy.sparse, OpenCV and requests run only at their first use; setuptools' distutils),
changes nothing a program sees afterwards, and ``SSDSGD_MXNET_IMPORT=full`` is MXNet's
own import."""
import json
import subprocess
import sys

import pytest

from ssdsgd.testing import clean_env

PROBE = r"""
import json, sys
import ssdsgd, mxnet as mx
imported = {m: m in sys.modules for m in
            ("sklearn", "setuptools", "pkg_resources", "distutils", "distutils.version",
             "scipy.stats._continuous_distns", "scipy.sparse._csr", "urllib3")}
lazy = {m: type(sys.modules[m]).__name__ for m in ("scipy.stats", "scipy.sparse", "cv2",
                                                   "requests")}
estimator = [c.__module__ + "." + c.__name__ for c in mx.model.FeedForward.__mro__]
# what the program sees after the import: every package there, and working
norm = mx.test_utils.ss.norm.cdf(0.0)          # the lazy scipy.stats runs here
sparse = mx.nd.sparse.csr_matrix(([1.0, 2.0], [0, 2], [0, 1, 2]), shape=(2, 3))
as_scipy = sparse.asscipy().toarray().tolist()
from distutils.version import LooseVersion
packed = mx.recordio.pack_img(mx.recordio.IRHeader(0, 1.0, 7, 0),
                              __import__("numpy").zeros((4, 4, 3), "uint8"), img_fmt=".png")
_, image = mx.recordio.unpack_img(packed)      # cv2's encoder and decoder
import sklearn.base
after = {"norm": norm, "as_scipy": as_scipy, "loose": LooseVersion("1.23") > LooseVersion("1.9"),
         "sklearn_base": sklearn.base.BaseEstimator.__name__,
         "stats_loaded": "scipy.stats._continuous_distns" in sys.modules,
         "image": list(image.shape), "download": callable(mx.gluon.utils.requests.get),
         "types": sorted({type(sys.modules[m]).__name__ for m in lazy})}
print(json.dumps({"imported": imported, "lazy": lazy, "estimator": estimator,
                  "after": after}))
"""


def run_script(script, *args, env=None):
    """``python -c script args`` in a fresh process: (its last line as JSON, stderr)."""
    done = subprocess.run([sys.executable, "-W", "default::DeprecationWarning", "-c", script,
                           *args], env=env or clean_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def probe(mode):
    return run_script(PROBE, env=clean_env(**({} if mode is None else
                                             {"SSDSGD_MXNET_IMPORT": mode})))


def test_the_trimmed_import_leaves_out_what_training_does_not_use():
    seen, stderr = probe(None)
    assert not any(seen["imported"].values()), seen["imported"]
    assert set(seen["lazy"].values()) == {"_LazyModule"}, seen["lazy"]
    # MXNet's own fallback without scikit-learn: FeedForward derives from object
    assert seen["estimator"][-1] == "builtins.object"
    assert not any(c.startswith("sklearn.") for c in seen["estimator"]), seen["estimator"]
    # and afterwards everything is there, and works: nothing but the time of loading moved
    assert seen["after"] == {"norm": 0.5, "as_scipy": [[1.0, 0.0, 0.0], [0.0, 0.0, 2.0]],
                             "loose": True, "sklearn_base": "BaseEstimator",
                             "stats_loaded": True, "image": [4, 4, 3], "download": True,
                             "types": ["module"]}
    # the standard library's distutils says it is deprecated when imported: not to users
    assert "distutils package is deprecated" not in stderr, stderr[-2000:]


def test_full_is_mxnets_own_import():
    seen, _ = probe("full")
    assert seen["imported"]["sklearn"] and seen["imported"]["scipy.stats._continuous_distns"]
    assert "sklearn.base.BaseEstimator" in seen["estimator"]
    assert seen["after"]["norm"] == 0.5


def test_a_wrong_value_names_the_setting():
    done = subprocess.run([sys.executable, "-c", "import ssdsgd, mxnet"],
                          env=clean_env(SSDSGD_MXNET_IMPORT="slim"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "SSDSGD_MXNET_IMPORT" in last and "slim" in last, done.stderr[-2000:]


@pytest.mark.parametrize("first", ["sklearn", "scipy.stats"])
def test_a_package_imported_before_mxnet_is_left_as_it_is(first):
    code = (f"import sys, {first}, ssdsgd, mxnet as mx\n"
            "print([c.__module__ for c in mx.model.FeedForward.__mro__][1], "
            "type(sys.modules['scipy.stats']).__name__)")
    done = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    base, stats_type = done.stdout.split()
    assert stats_type == "module"             # already there: never made lazy
    if first == "sklearn":
        assert base == "sklearn.base"


THREADS = r"""
import json, sys, threading
import ssdsgd, mxnet as mx
name, attr = sys.argv[1], sys.argv[2]
module = sys.modules[name]
assert type(module).__name__ == "_LazyModule", type(module)
gate, seen = threading.Barrier(8), []

def first_use():
    gate.wait()
    try:
        seen.append(getattr(module, attr) is not None)
    except Exception as e:           # what a thread saw of a module another one loads
        seen.append(f"{type(e).__name__}: {e}")

threads = [threading.Thread(target=first_use) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join(60)
print(json.dumps({"seen": seen, "alive": sum(t.is_alive() for t in threads),
                  "type": type(module).__name__}))
"""


@pytest.mark.parametrize("name,attr", [("scipy.stats", "norm"), ("scipy.sparse", "csr_matrix"),
                                       ("cv2", "imdecode")])
def test_threads_that_use_a_lazy_package_first_at_once_all_get_it_loaded(name, attr):
    """Python 3.11's LazyLoader makes the module a plain one before it executes it, so a
    second thread in that window read a half-made module (AttributeError: 8 threads at
    once on scipy.stats failed 7 of 8). A DataLoader's threads decoding with cv2 do just
    that on their first batch."""
    out, _ = run_script(THREADS, name, attr)
    assert out == {"seen": [True] * 8, "alive": 0, "type": "module"}, out
