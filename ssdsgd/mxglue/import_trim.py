"""MXNet's import without the packages it loads for APIs a training process never uses.

``import mxnet`` 1.9.1 also loads, at import time:
- scikit-learn's base (``mxnet/model.py``: the deprecated ``FeedForward`` derives from
  ``BaseEstimator`` when scikit-learn is installed), and with it scipy.stats;
- scipy.stats (``mxnet/test_utils.py``, for MXNet's own tests of its random numbers) and
  scipy.sparse (``mxnet/ndarray/sparse.py``, for ``asscipy`` and ``array`` of scipy
  matrices);
- OpenCV (``mxnet/image``, ``mxnet/recordio.py``: images decoded and encoded in Python;
  MXNet's own image iterators decode in C++) and requests (``gluon.utils.download``);
- ``distutils.version`` (numpy version checks in ``numpy_dispatch_protocol.py`` and
  ``numpy_op_fallback.py``), which setuptools' ``distutils`` shim serves by importing
  all of setuptools and pkg_resources.
Measured here, ``import ssdsgd, mxnet`` takes 1.8 CPU seconds with them and 0.95
without, in every process of a job: on the emulated cluster (five MXNet processes on two
cores) more than a second of every job's start-up (docs/design.md, "Start-up").

So while ``mxnet`` executes, and only for what is not imported yet:
- ``sklearn`` is not found, and MXNet takes its own fallback for that case
  (``FeedForward`` derives from ``object``; MXNet sets ``SKLEARN_INSTALLED = False``);
- ``scipy.stats``, ``scipy.sparse``, ``cv2`` and ``requests`` load lazily
  (``importlib.util.LazyLoader``, with Python 3.12's lock: threads that race to the
  first use all get it loaded): each executes at its first use, so what changes is
  when, not what (``cv2`` is one that would refuse it if it put another module in its
  place as it loads; the pinned 4.10 does not, and the tests use it);
- ``distutils`` is the standard library's (Python 3.11 still has it; without it nothing
  changes), not setuptools' copy, and it leaves ``sys.modules`` again once MXNet is
  imported: MXNet keeps the two version classes it took, and a later ``import
  distutils`` gets what it would have got.
``SSDSGD_MXNET_IMPORT=full`` (a row of ssdsgd/settings.py) is MXNet's own import.
"""
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
import threading
import types
import warnings

#: Packages MXNet imports only for its scikit-learn estimator, never used in training.
ABSENT = ("sklearn",)
#: Packages MXNet imports for calls a training step does not make: loaded at first use.
LAZY = ("scipy.stats", "scipy.sparse", "cv2", "requests")


def wanted():
    """Whether this process trims MXNet's import (``SSDSGD_MXNET_IMPORT``, its row of
    ssdsgd/settings.py; an invalid value is an error naming the variable)."""
    from ..settings import BY_ENV, env_value
    return env_value(BY_ENV["SSDSGD_MXNET_IMPORT"], os.environ) == "trimmed"


class _LazyModule(types.ModuleType):
    """A module that executes at its first use, safely when threads race to that use.

    Python 3.11's ``importlib.util._LazyModule`` makes itself a plain module before it
    executes, so a second thread arriving meanwhile reads a half-made module (8 threads at
    once on scipy.stats: 7 AttributeErrors; a DataLoader's threads decoding with cv2 on
    their first batch). This is Python 3.12's own fix (CPython gh-114763, in
    ``importlib/util.py``), as it stands there: a lock per module, taken by the first use;
    the others wait for it and the loading thread's own re-entries pass. And one change
    of ours: ``__spec__`` is read without loading, because Python 3.11's import statement
    reads it from a module already in ``sys.modules`` (to see whether it is still being
    initialised), so a second ``import scipy.sparse`` would load it."""

    def __getattribute__(self, attr):
        spec = object.__getattribute__(self, "__dict__")["__spec__"]
        if attr == "__spec__":
            return spec
        state = spec.loader_state
        with state["lock"]:
            if object.__getattribute__(self, "__class__") is _LazyModule:
                plain = state["__class__"]
                if state["is_loading"]:       # the module's own execution, on this thread
                    return plain.__getattribute__(self, attr)
                state["is_loading"] = True
                now = plain.__getattribute__(self, "__dict__")
                then = state["__dict__"]
                updated = {k: v for k, v in now.items() if k not in then or then[k] is not v}
                spec.loader.exec_module(self)
                if spec.name in sys.modules and sys.modules[spec.name] is not self:
                    raise ValueError(f"module object for {spec.name!r} substituted in "
                                     "sys.modules during a lazy load")
                now.update(updated)
                if isinstance(self, _LazyModule):
                    object.__setattr__(self, "__class__", plain)
        return getattr(self, attr)

    def __delattr__(self, attr):
        self.__getattribute__(attr)
        delattr(self, attr)


class _LazyLoader(importlib.util.LazyLoader):
    """The standard library's lazy loader with Python 3.12's state: a lock per module."""

    def exec_module(self, module):
        module.__spec__.loader = self.loader
        module.__loader__ = self.loader
        module.__spec__.loader_state = {"__dict__": module.__dict__.copy(),
                                        "__class__": module.__class__,
                                        "lock": threading.RLock(), "is_loading": False}
        module.__class__ = _LazyModule


class _Trim(importlib.abc.MetaPathFinder):
    """The finder in front of the others while ``mxnet`` executes."""

    def __init__(self):
        self.stdlib_distutils = False

    def find_spec(self, name, path=None, target=None):
        if name in ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r} (left out of MXNet's "
                                      "import: SSDSGD_MXNET_IMPORT)", name=name)
        if name in LAZY:
            spec = importlib.machinery.PathFinder.find_spec(name, path, target)
            if spec is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _LazyLoader(spec.loader)
            return spec
        if name == "distutils":
            return self._stdlib_distutils()
        return None

    def _stdlib_distutils(self):
        spec = importlib.machinery.PathFinder.find_spec(
            "distutils", [sysconfig.get_paths()["stdlib"]])
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return None
        execute = spec.loader.exec_module

        def exec_module(module):
            with warnings.catch_warnings():    # its own "deprecated" notice, meant for users
                warnings.simplefilter("ignore", DeprecationWarning)
                execute(module)
        spec.loader.exec_module = exec_module
        self.stdlib_distutils = True
        return spec


@contextlib.contextmanager
def trimmed():
    """Around the execution of ``mxnet``: its import, trimmed (unless set to full)."""
    if not wanted():
        yield
        return
    trim = _Trim()
    sys.meta_path.insert(0, trim)
    try:
        yield
    finally:
        sys.meta_path.remove(trim)
        if trim.stdlib_distutils:
            for name in [m for m in sys.modules if m == "distutils" or
                         m.startswith("distutils.")]:
                del sys.modules[name]
