"""Everything ssdsgd changes outside its own code, and what a process keeps, in one place.

How MXNet 1.9.1 tells a distributed store: by its type string. Module, the Trainer,
``mxnet/model.py`` and scripts in the style of ``example/image-classification/fit.py``
decide with ``'dist' in kv.type`` (distributed: guards, no reset), ``'_sync' in kv.type``
(Module: ``rescale_grad`` over all workers' batch) and ``'async' in kv.type`` (the Trainer
forces ``update_on_kvstore`` and refuses False). So ``kv.type`` is the native type whose
semantics the job's algorithm has (``TYPES``): ssgd and ssd ``dist_sync_ssdsgd``, asgd
``dist_async_ssdsgd``, preduce ``dist_preduce_ssdsgd`` (distributed, neither sync nor
async: every worker applies its own gradient). Those three are also registered names,
for scripts that decide by the name they pass (``fit.py``: ``'dist' in args.kv_store``);
a name whose mode is not the job's algorithm is refused (``store.py``).

``install()`` (called by ``import ssdsgd``, idempotent) makes these changes, each because
of a fact of MXNet 1.9.1 or of the job:

1. ``_create_kvstore`` (``mxnet/model.py``, and its copies imported by name into
   ``gluon/trainer.py`` and ``module/module.py``) creates no store for a name without
   'dist' when a worker has one device, so ``kvstore='ssd_sync'`` would silently train
   each worker alone. The wrapper makes every ssdsgd name create the store.
2. ``_create_sparse_kvstore`` (row_sparse weights) accepts only MXNet's own ``KVStore``
   class; the wrapper accepts ssdsgd's (row_sparse arrays travel dense: docs/training.md).
3. The stock Trainer calls ``pushpull`` once per parameter. ``Trainer._allreduce_grads``
   is wrapped so that the calls of one ``step`` are collected (``store.step_batch``) and
   run as one step of the stage machine: one message per server. An ssgd step (dense,
   no relayed pulls; with or without a quorum) is queued on MXNet's engine as
   ps-lite's pushpull is, so ``step`` returns at once and the weights are pending until
   the reply is written; every other step has the weights in place when it returns.
4. ``sys.excepthook``: a worker that dies of an uncaught exception must tell the job it
   failed, not that it finished (``Node.close`` reads ``PROCESS.uncaught_error``); and
   ssdsgd's own errors, which already name the peer or setting at fault, print one line
   instead of a traceback through the transport.

Not a patch, but a fact the adapter honours: ``Trainer.load_states`` reads
``kvstore._updater.optimizer``, so ``SSD_Sync`` keeps an MXNet updater under that name.

The process state: as with ps-lite, a process is one node of the job. The first
ssdsgd store connects it (``Node``) and every later store shares that connection, so ``mx.kv.create('ssd_sync')`` followed by ``Trainer(kvstore='ssd_sync')`` works.
It is closed once, by ``kv.close()`` or at exit.
"""
import atexit
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import gluon
from mxnet import model as mx_model
from mxnet.kvstore import KVStoreBase
from mxnet.module import module as mx_module

from .kvstore.client import ServerError, WorkerClient
from .kvstore.io_thread import EXIT_AFTER_ABORT
from .kvstore.env import EnvError, NodeEnv
from .mxglue.state_file import StateFileError
from .mxglue.optimizer_spec import OptimizerSpecError
from .kvstore.scheduler import JobAborted
from .sync.auto import relay_listens
from .worker.machine import StageMachine

NAME = "ssd_sync"   # what users pass as kvstore=; MXNet registers SSD_Sync under it
# kv.type by algorithm: the native type whose semantics it has (see above).
TYPES = {"ssgd": "dist_sync_ssdsgd", "ssd": "dist_sync_ssdsgd", "asgd": "dist_async_ssdsgd",
         "preduce": "dist_preduce_ssdsgd", "localsgd": "dist_sync_ssdsgd",
         "diloco": "dist_sync_ssdsgd"}
NAMES = frozenset({NAME, *TYPES.values()})    # every name that creates an ssdsgd store

# ssdsgd's own errors already say what went wrong and which peer or setting caused it.
ONE_LINE_ERRORS = (JobAborted, ServerError, EnvError, OptimizerSpecError, StateFileError)


class Node:
    """This process's part in the job: its environment, connection and stage machine."""

    def __init__(self, model=None):
        if os.environ.get("DMLC_ROLE"):
            raise RuntimeError("DMLC_ROLE is set: this process is configured for MXNet's own "
                               "ps-lite, not ssdsgd; unset it (ssdsgd uses SSDSGD_* variables)")
        try:
            self.env = NodeEnv.from_environ()
        except EnvError as e:
            if os.environ.get("SSDSGD_ROLE"):
                raise
            raise EnvError(f"{e}; this process was not started by ssdsgd's launcher: run "
                           "the script as python launch/dist.py -n N -s S -- python "
                           "SCRIPT ...") from None
        if self.env.role != "worker":
            raise RuntimeError(f"ssd_sync is created by workers; SSDSGD_ROLE is {self.env.role}")
        self.client = WorkerClient(self.env, model, relay=relay_listens(self.env))
        if os.environ.get("SSDSGD_ROLE"):      # started by a launcher, which waits for it
            self.client.io.exit_after_abort = EXIT_AFTER_ABORT
        self.machine = StageMachine(self.client, self.env)
        if self.env.joining:     # launch/dist.py --join: from the step the servers chose
            self.machine.join_at(self.client.await_join())
        self.closed = False

    def close(self):
        """Finish the steps-delay stage on the global weights and leave the job: as a
        failure if an uncaught exception is ending the process."""
        if self.closed:
            return
        self.closed = True
        error = PROCESS.uncaught_error
        try:
            if self.client.failure is None and error is None:
                self.machine.finish()
        finally:
            self.client.close(error)

    def close_at_exit(self):
        try:
            self.close()
        except Exception as e:    # the interpreter is exiting: one line, not a traceback
            print(f"ssdsgd: leaving the job at exit failed: {e}", file=sys.stderr)


class Process:
    """The per-process state: the node (None until the first store), the uncaught error."""

    def __init__(self):
        self.node = None
        self.uncaught_error = None
        self.model = None         # the bytes of each key of the model of the next store

    def connect(self):
        """The process's node, connected on first use (again after a close). With the
        model known (a Trainer or Module creates its store), worker 0 states the largest
        message it will send, which becomes the servers' limit (docs/reliability.md)."""
        if self.node is None or self.node.closed:
            model, self.model = self.model, None
            self.node = Node(model)
            atexit.register(self.node.close_at_exit)
        return self.node


PROCESS = Process()

_stock = {}   # what install() replaced: name -> the original


def is_ssdsgd_store(kv):
    return isinstance(kv, KVStoreBase) and not isinstance(kv, mx.kv.KVStore) \
        and getattr(kv, "type", None) in TYPES.values()


def _is_ssdsgd_name(kvstore):
    return isinstance(kvstore, str) and kvstore.lower() in NAMES


def declare_model(key_bytes):
    """This process's store is for a model whose keys have ``key_bytes`` bytes each.
    Worker 0 states the largest message it will send, which becomes the servers' limit
    (docs/reliability.md): at once if the process has joined the job already (a store
    created before its model, as MXNet's fit.py does), else when its first store joins.
    A model declared after worker 0's first message to a server changes nothing."""
    node = PROCESS.node
    if node is not None and not node.closed:
        node.client.start.declare_model(list(key_bytes))
    else:
        PROCESS.model = list(key_bytes)


def _create_kvstore(kvstore, num_device, arg_params):
    """MXNet's own, after stating the model (Module and the Trainer pass it here, with
    a store's name or with a store created before the model)."""
    if (_is_ssdsgd_name(kvstore) or is_ssdsgd_store(kvstore)) and arg_params:
        declare_model(a.size * np.dtype(a.dtype).itemsize for a in arg_params.values())
    if _is_ssdsgd_name(kvstore):
        try:
            kvstore = mx.kv.create(kvstore)     # then as MXNet does for a store object
        finally:
            PROCESS.model = None
    return _stock["_create_kvstore"](kvstore, num_device, arg_params)


def _create_sparse_kvstore(kvstore):
    if _is_ssdsgd_name(kvstore):
        kvstore = mx.kv.create(kvstore)
    if is_ssdsgd_store(kvstore):
        return kvstore, True                # what MXNet returns for its own KVStore
    return _stock["_create_sparse_kvstore"](kvstore)


def _allreduce_grads(trainer):
    kv = trainer._kvstore
    if is_ssdsgd_store(kv):
        with kv.step_batch():
            _stock["_allreduce_grads"](trainer)
    else:
        _stock["_allreduce_grads"](trainer)


def _excepthook(exc_type, exc, tb):
    PROCESS.uncaught_error = f"{exc_type.__name__}: {exc}"
    if issubclass(exc_type, ONE_LINE_ERRORS):
        print(f"ssdsgd: {exc_type.__name__}: {exc}", file=sys.stderr)
    else:
        _stock["excepthook"](exc_type, exc, tb)


# Where MXNet looks each function up: the module that defines it and those that import
# it by name (patching only the definition would leave their copies stock).
_SITES = {"_create_kvstore": (mx_model, gluon.trainer, mx_module),
          "_create_sparse_kvstore": (mx_model, gluon.trainer)}


def install():
    """Apply the changes above (once per process)."""
    if _stock:
        return
    replacements = {"_create_kvstore": _create_kvstore,
                    "_create_sparse_kvstore": _create_sparse_kvstore}
    for name, sites in _SITES.items():
        _stock[name] = getattr(mx_model, name)
        for site in sites:
            setattr(site, name, replacements[name])
    _stock["_allreduce_grads"] = gluon.Trainer._allreduce_grads
    _stock["excepthook"] = sys.excepthook
    gluon.Trainer._allreduce_grads = _allreduce_grads
    sys.excepthook = _excepthook
