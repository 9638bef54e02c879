"""``ssd_sync``: the KVStore MXNet sees. A thin adapter over the worker's stage machine.

Two adaptations to the stock ``gluon.Trainer`` (both documented in docs/design.md):

* ``mxnet.gluon.trainer._create_kvstore`` creates no kvstore at all for a string without
  'dist' when a worker has one device; ``import ssdsgd`` wraps it so that
  ``kvstore='ssd_sync'`` always creates this store.
* the Trainer calls ``pushpull`` once per parameter; ``Trainer._allreduce_grads`` is
  wrapped so that the calls of one ``step`` are collected and sent as one message per
  server, and the weights are in place when ``step`` returns.
"""
import atexit
import os
import sys

import mxnet as mx
import numpy as np
from mxnet import gluon
from mxnet.kvstore import KVStoreBase

from . import protocol as P
from .client import WorkerClient
from .compression import Compression, CompressionError
from .env import NodeEnv
from .optimizer_spec import build, describe, flatten_state, unflatten_state
from ..worker.machine import StageMachine

NAME = "ssd_sync"


def _as_list(x):
    return x if isinstance(x, (list, tuple)) else [x]


def _entries(key, value, out):
    keys = _as_list(key)
    if len(keys) == 1:
        values = [_as_list(value)]
        outs = [None if out is None else _as_list(out)]
    else:
        values = [_as_list(v) for v in value]
        outs = [None] * len(keys) if out is None else [_as_list(o) for o in out]
    for k in keys:
        if not isinstance(k, int):
            raise TypeError(f"ssd_sync keys are integers (the Trainer's parameter indices); "
                            f"got {k!r}")
    return list(zip(keys, values, outs))


@KVStoreBase.register
class SSD_Sync(KVStoreBase):
    """A distributed KVStore running SSD-SGD (or SSGD / ASGD) on ssdsgd's servers.

    Created by ``mx.kv.create('ssd_sync')`` or ``gluon.Trainer(..., kvstore='ssd_sync')``
    in a process started by ``launch/dist.py`` (configuration from SSDSGD_* variables)."""

    def __init__(self):
        if os.environ.get("DMLC_ROLE"):
            raise RuntimeError("DMLC_ROLE is set: this process is configured for MXNet's own "
                               "ps-lite, not ssdsgd; unset it (ssdsgd uses SSDSGD_* variables)")
        shared = SSD_Sync._process_state
        if shared is None or shared["closed"]:
            env = NodeEnv.from_environ()
            if env.role != "worker":
                raise RuntimeError(f"ssd_sync is created by workers; SSDSGD_ROLE is {env.role}")
            client = WorkerClient(env)
            shared = {"env": env, "client": client, "machine": StageMachine(client, env),
                      "closed": False}
            SSD_Sync._process_state = shared
            atexit.register(self._close_at_exit)
        # A process is one node of the job (as with ps-lite): every instance shares it.
        self._shared = shared
        self._env, self._client, self._machine = shared["env"], shared["client"], shared["machine"]
        self._updater = None
        self._batch = None

    _process_state = None
    uncaught_error = None    # set by ssdsgd's excepthook: close() then reports a failure

    # ---- identity ----------------------------------------------------------------
    @property
    def type(self):
        return NAME

    @property
    def rank(self):
        return self._client.rank

    @property
    def num_workers(self):
        return self._client.num_workers

    @property
    def algorithm(self):
        return self._env.algorithm

    def is_capable(self, capability):
        return capability == KVStoreBase.OPTIMIZER

    def set_gradient_compression(self, compression_params):
        """MXNet's interface (the Trainer calls it with ``compression_params``): compress
        every later push, with a residual per key on this worker (docs/spec/compression.md).
        Pulls are not compressed."""
        spec = Compression.from_params(compression_params)
        if spec is None:
            raise CompressionError("set_gradient_compression needs a dict with a 'type', "
                                   "e.g. {'type': '2bit', 'threshold': 0.5}")
        self._client.set_compression(spec)

    # ---- data --------------------------------------------------------------------
    def init(self, key, value):
        self.broadcast(key, value, out=None)

    def broadcast(self, key, value, out, priority=0):
        entries = []
        for k, values, outs in _entries(key, value, out):
            entries.append((k, values[0], outs or []))
        self._machine.init_keys(entries)

    def pushpull(self, key, value, out=None, priority=0):
        entries = _entries(key, value, out)
        if self._batch is not None:
            self._batch.extend(entries)
        else:
            self._machine.step(entries)

    def push(self, key, value, priority=0):
        if self._env.algorithm == "ssd":
            raise NotImplementedError("with algorithm ssd use pushpull (as the Trainer does): "
                                      "a separate push and pull cannot follow the step schedule")
        self._machine.push(_entries(key, value, None))

    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        self._machine.pull([(k, _as_list(o)) for k, o, _ in _entries(key, out, None)])

    class _StepBatch:
        def __init__(self, store):
            self.store = store

        def __enter__(self):
            self.store._batch = []

        def __exit__(self, exc_type, *_):
            batch, self.store._batch = self.store._batch, None
            if exc_type is None and batch:
                self.store._machine.step(batch)

    def step_batch(self):
        """Collect the pushpulls of one training step into one exchange per server."""
        return self._StepBatch(self)

    # ---- optimizer ---------------------------------------------------------------
    def set_optimizer(self, optimizer):
        spec = describe(optimizer)      # a clear error for an optimizer it cannot send
        self._updater = mx.optimizer.get_updater(optimizer)
        self._machine.set_optimizer(spec)
        if self.rank == 0:
            futures = [self._client.request(s, P.Message(P.Kind.SET_OPTIMIZER,
                                                         meta={"optimizer": spec}))
                       for s in range(self._client.num_servers)]
            for f in futures:
                self._client.wait(f)
        self._client.barrier()   # no worker pushes before every server has the optimizer

    def _server_states(self):
        futures = [self._client.request(s, P.Message(P.Kind.GET_STATE))
                   for s in range(self._client.num_servers)]
        return [self._client.wait(f) for f in futures]

    def save_optimizer_states(self, fname, dump_optimizer=False):
        """Gather the servers' optimizer state into a file in MXNet's own format."""
        if self._updater is None:
            raise RuntimeError("set_optimizer must be called before save_optimizer_states")
        replies = self._server_states()
        spec = next((r.meta["optimizer"] for r in replies if r.meta.get("optimizer")), None)
        optimizer = build(spec) if spec else self._updater.optimizer
        optimizer.param_dict = self._updater.optimizer.param_dict
        parts = {}
        for msg in replies:
            for rec, arrays in zip(msg.records, msg.tensors):
                parts.setdefault(int(rec["key"]), []).append((int(rec["offset"]), arrays[1:]))
        updater = mx.optimizer.get_updater(optimizer)
        for key, pieces in parts.items():
            pieces.sort(key=lambda p: p[0])
            shape = self._machine.shapes[key]
            flat = [np.concatenate([p[1][i] for p in pieces]) for i in range(len(pieces[0][1]))]
            template = optimizer.create_state_multi_precision(key, mx.nd.zeros(shape))
            arrays = [mx.nd.array(a.reshape(shape)) for a in flat]
            updater.states[key] = unflatten_state(template, arrays)
            updater.states_synced[key] = True
        with open(fname, "wb") as f:
            f.write(updater.get_states(dump_optimizer=dump_optimizer))

    def load_optimizer_states(self, fname):
        """Read a file written by save_optimizer_states (or MXNet) and send it to the servers."""
        if self._updater is None:
            raise RuntimeError("set_optimizer must be called before load_optimizer_states")
        updater = mx.optimizer.get_updater(self._updater.optimizer)
        with open(fname, "rb") as f:
            updater.set_states(f.read())     # a local file the user chose, as MXNet does
        self._updater = updater
        spec = describe(updater.optimizer)
        self._machine.set_optimizer(spec)
        if self.rank == 0:
            futures = []
            for server in range(self._client.num_servers):
                recs, tens = [], []
                for key, slices in self._client.placement.slices.items():
                    state = flatten_state(updater.states.get(key))
                    for sl in slices:
                        if sl.server != server:
                            continue
                        arrays = [s.asnumpy().reshape(-1)[sl.offset:sl.offset + sl.count]
                                  for s in state]
                        dtype = arrays[0].dtype if arrays else "float32"
                        recs.append((key, 0, sl.offset, sl.count, dtype, len(arrays)))
                        tens.append(arrays)
                futures.append(self._client.request(server, P.Message(
                    P.Kind.SET_STATE, records=P.make_records(recs), tensors=tens,
                    meta={"optimizer": spec})))
            for f in futures:
                self._client.wait(f)
        self._client.barrier()

    # ---- lifecycle and metrics ----------------------------------------------------
    def barrier(self):
        self._client.barrier()

    _barrier = barrier

    def metrics(self):
        """Counters for the user: steps per stage, pushes, pulls, bytes, time blocked."""
        return self._machine.metrics()

    def _close_at_exit(self):
        try:
            self.close()
        except Exception as e:    # the interpreter is exiting: one line, not a traceback
            print(f"ssdsgd: leaving the job at exit failed: {e}", file=sys.stderr)

    def close(self):
        """Finish the steps-delay stage on the global weights and leave the job cleanly."""
        if self._shared["closed"]:
            return
        self._shared["closed"] = True
        error = SSD_Sync.uncaught_error
        try:
            if self._client._failure is None and error is None:
                self._machine.finish()
        finally:
            self._client.close(error)


# ---- the two adaptations to gluon.Trainer --------------------------------------------
_create_kvstore = gluon.trainer._create_kvstore


def _create_kvstore_ssd(kvstore, num_device, arg_params):
    if isinstance(kvstore, str) and kvstore.lower() == NAME:
        kv = mx.kv.create(NAME)
        return kv, bool(int(os.getenv("MXNET_UPDATE_ON_KVSTORE", "1")))
    return _create_kvstore(kvstore, num_device, arg_params)


_allreduce_grads = gluon.Trainer._allreduce_grads


def _allreduce_grads_batched(self):
    if isinstance(self._kvstore, SSD_Sync):
        with self._kvstore.step_batch():
            _allreduce_grads(self)
    else:
        _allreduce_grads(self)


gluon.trainer._create_kvstore = _create_kvstore_ssd
gluon.Trainer._allreduce_grads = _allreduce_grads_batched
