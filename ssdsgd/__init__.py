"""ssdsgd: SSD-SGD (Several Steps Delay SGD) for Apache MXNet.

``import ssdsgd`` registers the KVStore ``ssd_sync`` with MXNet and installs the changes
listed in ``ssdsgd/integration.py``, so that ``gluon.Trainer(..., kvstore='ssd_sync')``
and ``mx.kv.create('ssd_sync')`` work in a process started by ``launch/dist.py``.

It does so as soon as MXNet is imported: at once when it already is, else right after
the process imports it (a post-import hook). The launcher and the scheduler, which need
no MXNet, so start without loading it (1-2 s of CPU each, every job).
"""
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"


def _install():
    from . import integration
    from .store import SSD_Sync      # registers 'ssd_sync'
    integration.install()
    globals()["SSD_Sync"] = SSD_Sync


class _AfterMXNet(importlib.abc.MetaPathFinder):
    """Finds ``mxnet`` as usual, and runs ``_install`` once its module has executed."""

    def find_spec(self, name, path=None, target=None):
        if name != "mxnet":
            return None
        sys.meta_path.remove(self)           # once; and the real finder is asked below
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
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
