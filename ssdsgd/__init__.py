"""ssdsgd: SSD-SGD (Several Steps Delay SGD) for Apache MXNet.

``import ssdsgd`` registers the KVStore ``ssd_sync`` with MXNet, so that
``gluon.Trainer(..., kvstore='ssd_sync')`` and ``mx.kv.create('ssd_sync')`` work in a
process started by ``launch/dist.py``.
"""
import sys

from .kvstore.client import ServerError
from .kvstore.env import EnvError
from .kvstore.optimizer_spec import OptimizerSpecError
from .kvstore.scheduler import JobAborted
from .kvstore.store import SSD_Sync  # noqa: F401  (registers 'ssd_sync')

__version__ = "0.1.0"

# ssdsgd's own errors already say what went wrong and which peer or setting caused it:
# print that one line instead of a traceback through the transport.
_ONE_LINE_ERRORS = (JobAborted, ServerError, EnvError, OptimizerSpecError)
_previous_hook = sys.excepthook


def _excepthook(exc_type, exc, tb):
    # The job must learn that this worker failed, not that it finished (see store.close).
    SSD_Sync.uncaught_error = f"{exc_type.__name__}: {exc}"
    if issubclass(exc_type, _ONE_LINE_ERRORS):
        print(f"ssdsgd: {exc_type.__name__}: {exc}", file=sys.stderr)
    else:
        _previous_hook(exc_type, exc, tb)


sys.excepthook = _excepthook
