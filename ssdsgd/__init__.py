"""ssdsgd: SSD-SGD (Several Steps Delay SGD) for Apache MXNet.

``import ssdsgd`` registers the KVStore ``ssd_sync`` with MXNet and installs the changes
listed in ``ssdsgd/integration.py``, so that ``gluon.Trainer(..., kvstore='ssd_sync')``
and ``mx.kv.create('ssd_sync')`` work in a process started by ``launch/dist.py``.
"""
from . import integration
from .store import SSD_Sync  # noqa: F401  (registers 'ssd_sync')

__version__ = "0.1.0"

integration.install()
