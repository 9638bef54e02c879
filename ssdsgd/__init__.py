"""ssdsgd: SSD-SGD (Several Steps Delay SGD) for Apache MXNet.

``import ssdsgd`` registers the KVStore ``ssd_sync`` with MXNet and installs the changes
listed in ``ssdsgd/integration.py``, so that ``gluon.Trainer(..., kvstore='ssd_sync')``
and ``mx.kv.create('ssd_sync')`` work in a process started by ``launch/dist.py``.

It does so as soon as MXNet is imported: at once when it already is, else right after
the process imports it (a post-import hook). The launcher and the scheduler, which need
no MXNet, so start without loading it (1-2 s of CPU each, every job). The same hook
hands MXNet's operator-generating modules a cache of their compiled code
(``mxglue/op_code_cache.py``) and leaves out of MXNet's import what training never uses
(``mxglue/import_trim.py``), so a process that imports ssdsgd first imports MXNet in
0.95 s of CPU instead of 1.8.
"""
import importlib.abc
import importlib.util
import sys

from .mxglue import import_trim, op_code_cache

__version__ = "0.1.0"


def _install():
    from . import integration
    from .store import SSD_Sync      # registers 'ssd_sync'
    integration.install()
    globals()["SSD_Sync"] = SSD_Sync


class _AfterMXNet(importlib.abc.MetaPathFinder):
    """Runs ``_install`` once ``mxnet`` has executed -- but never in the middle of one of
    ssdsgd's own modules: one that imports MXNet itself (``import ssdsgd.glu.rules`` as
    a script's first import) would be half made when the install imports it. So the
    finder also wraps the execution of ssdsgd's submodules, and the install runs when
    MXNet is ready and none of them is executing."""

    def __init__(self):
        self.mxnet_ready, self.depth = False, 0

    def find_spec(self, name, path=None, target=None):
        generates = name in op_code_cache.MODULES
        if name != "mxnet" and not generates and not name.startswith(__name__ + "."):
            return None
        spec = None
        for finder in sys.meta_path:           # the real finders, in their order
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        if generates:
            def exec_module(module):
                op_code_cache.prepare(module)
                execute(module)
            spec.loader.exec_module = exec_module
            return spec

        def exec_module(module):
            self.depth += name != "mxnet"
            try:
                if name == "mxnet":
                    with import_trim.trimmed():
                        execute(module)
                else:
                    execute(module)
            finally:
                self.depth -= name != "mxnet"
            if name == "mxnet":
                op_code_cache.finish()
            self.mxnet_ready |= name == "mxnet"
            if self.mxnet_ready and self.depth == 0 and self in sys.meta_path:
                sys.meta_path.remove(self)     # once
                _install()
        spec.loader.exec_module = exec_module
        return spec


def __getattr__(name):
    if name == "SSD_Sync":                   # ssdsgd.SSD_Sync before MXNet was imported
        import mxnet  # noqa: F401  (the hook installs, and sets SSD_Sync)
        return globals()["SSD_Sync"]
    raise AttributeError(f"module 'ssdsgd' has no attribute {name!r}")


if "mxnet" in sys.modules:
    _install()
elif not any(isinstance(f, _AfterMXNet) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterMXNet())
