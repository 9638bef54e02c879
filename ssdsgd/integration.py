"""Everything ssdsgd changes outside its own code, and what a process keeps, in one place.

``install()`` (called by ``import ssdsgd``, idempotent) makes three changes, each because
of a fact of MXNet 1.9.1 or of the job:

1. ``gluon.trainer._create_kvstore`` creates no kvstore at all for a name without 'dist'
   when a worker has one device, so ``Trainer(kvstore='ssd_sync')`` would silently train
   each worker alone. The wrapper makes that name always create the store.
2. The stock Trainer calls ``pushpull`` once per parameter. ``Trainer._allreduce_grads``
   is wrapped so that the calls of one ``step`` are collected (``store.step_batch``) and
   run as one step of the stage machine: one message per server, and the weights are in
   place when ``step`` returns.
3. ``sys.excepthook``: a worker that dies of an uncaught exception must tell the job it
   failed, not that it finished (``Node.close`` reads ``PROCESS.uncaught_error``); and
   ssdsgd's own errors, which already name the peer or setting at fault, print one line
   instead of a traceback through the transport.

Not a patch, but a fact the adapter honours: ``Trainer.load_states`` reads
``kvstore._updater.optimizer``, so ``SSD_Sync`` keeps an MXNet updater under that name.

The process state: as with ps-lite, a process is one node of the job. The first
``ssd_sync`` store connects it (``Node``) and every later store shares that connection,
so ``mx.kv.create('ssd_sync')`` followed by ``Trainer(kvstore='ssd_sync')`` works. It is
closed once, by ``kv.close()`` or at exit.
"""
import atexit
import os
import sys

import mxnet as mx
from mxnet import gluon

from .kvstore.client import ServerError, WorkerClient
from .kvstore.env import EnvError, NodeEnv
from .mxglue.state_file import StateFileError
from .mxglue.optimizer_spec import OptimizerSpecError
from .kvstore.scheduler import JobAborted
from .worker.machine import StageMachine

NAME = "ssd_sync"   # what users pass as kvstore=; MXNet registers SSD_Sync under it

# ssdsgd's own errors already say what went wrong and which peer or setting caused it.
ONE_LINE_ERRORS = (JobAborted, ServerError, EnvError, OptimizerSpecError, StateFileError)


class Node:
    """This process's part in the job: its environment, connection and stage machine."""

    def __init__(self):
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
        self.client = WorkerClient(self.env)
        self.machine = StageMachine(self.client, self.env)
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

    def connect(self):
        """The process's node, connected on first use (again after a close)."""
        if self.node is None or self.node.closed:
            self.node = Node()
            atexit.register(self.node.close_at_exit)
        return self.node


PROCESS = Process()

_stock = {}   # what install() replaced: name -> the original


def _create_kvstore(kvstore, num_device, arg_params):
    if isinstance(kvstore, str) and kvstore.lower() == NAME:
        kv = mx.kv.create(NAME)
        return kv, bool(int(os.getenv("MXNET_UPDATE_ON_KVSTORE", "1")))
    return _stock["_create_kvstore"](kvstore, num_device, arg_params)


def _allreduce_grads(trainer):
    kv = trainer._kvstore
    if getattr(kv, "type", None) == NAME:
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


def install():
    """Apply the three changes above (once per process)."""
    if _stock:
        return
    _stock["_create_kvstore"] = gluon.trainer._create_kvstore
    _stock["_allreduce_grads"] = gluon.Trainer._allreduce_grads
    _stock["excepthook"] = sys.excepthook
    gluon.trainer._create_kvstore = _create_kvstore
    gluon.Trainer._allreduce_grads = _allreduce_grads
    sys.excepthook = _excepthook
