"""``ssd_sync``: the KVStore MXNet sees. A thin adapter, like Horovod's MXNet binding.

It turns MXNet's calling conventions (a key or a list of keys; an NDArray or one per
device; ``out`` or not) into calls of the worker's stage machine (``ssdsgd/worker``), and
MXNet's optimizer objects and state files into what the worker client sends. It holds no
algorithm and no wire details. How the stock ``gluon.Trainer`` is brought to use it, and
the one node every store of a process shares, are in ``ssdsgd/integration.py``.
"""
import contextlib
import dataclasses
import json
import os

import mxnet as mx
import numpy as np
from mxnet.kvstore import KVStoreBase

from .integration import NAME, PROCESS
from .kvstore.compression import Compression, CompressionError
from .mxglue import state_file
from .mxglue.optimizer_spec import (build, describe, flatten_state, state_arrays,
                                    states_from_arrays)
from .settings import BY_NAME
from .sync.registry import refusal


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


@KVStoreBase.register      # as NAME: MXNet registers a store by its lower-cased class name
class SSD_Sync(KVStoreBase):
    """A distributed KVStore running SSD-SGD (or SSGD / ASGD) on ssdsgd's servers.

    Created by ``mx.kv.create('ssd_sync')`` or ``gluon.Trainer(..., kvstore='ssd_sync')``
    in a process started by ``launch/dist.py`` (configuration from SSDSGD_* variables)."""

    def __init__(self):
        self._node = PROCESS.connect()
        self._env, self._client, self._machine = (self._node.env, self._node.client,
                                                  self._node.machine)
        self._updater = None     # Trainer.load_states reads _updater.optimizer
        self._batch = None       # the pushpulls of the Trainer step being collected

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
        """MXNet's interface (the Trainer calls it with ``compression_params``): every later
        push is compressed, with a residual per key on this worker; pulls are not
        (docs/spec/compression.md)."""
        spec = Compression.from_params(compression_params)
        if spec is None:
            raise CompressionError("set_gradient_compression needs a dict with a 'type', "
                                   "e.g. {'type': '2bit', 'threshold': 0.5}")
        # the combinations the config check refuses, for a script that sets it itself
        refused = refusal({**dataclasses.asdict(self._env), "compression": spec.type},
                          lambda name: "compression_params" if name == "compression"
                          else BY_NAME[name].env)
        if refused:
            raise CompressionError(refused)
        self._client.set_compression(spec)

    # ---- data --------------------------------------------------------------------
    def init(self, key, value):
        self.broadcast(key, value, out=None)

    def broadcast(self, key, value, out, priority=0):
        self._machine.init_keys([(k, values[0], outs or [])
                                 for k, values, outs in _entries(key, value, out)])

    def pushpull(self, key, value, out=None, priority=0):
        entries = _entries(key, value, out)
        if self._batch is not None:
            self._batch.extend(entries)
        elif self._machine.can_defer(entries):    # queued on MXNet's engine, as ps-lite's
            self._machine.step_deferred(entries, priority)
        else:
            self._machine.step(entries)

    def push(self, key, value, priority=0):
        if self._env.algorithm in ("ssd", "preduce"):
            raise NotImplementedError(f"with algorithm {self._env.algorithm} use pushpull (as "
                                      "the Trainer does): a separate push and pull cannot "
                                      "follow the step schedule")
        self._machine.push(_entries(key, value, None))

    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        if self._env.algorithm == "preduce":
            raise NotImplementedError("with algorithm preduce every worker keeps its own model "
                                      "and the servers hold none to pull; the model is in the "
                                      "parameters (all workers' average after close())")
        self._machine.pull([(k, _as_list(o)) for k, o, _ in _entries(key, out, None)])

    @contextlib.contextmanager
    def step_batch(self):
        """Collect the pushpulls of one training step into one step of the stage machine
        (one exchange per server); not run if the step raised."""
        self._batch = []
        try:
            yield
        finally:
            batch, self._batch = self._batch, None
        if batch:
            self._machine.step(batch)

    # ---- optimizer ---------------------------------------------------------------
    def set_optimizer(self, optimizer):
        self._updater = mx.optimizer.get_updater(optimizer)
        if self._env.algorithm == "preduce":
            # docs/spec/preduce.md: the Trainer's own optimizer object runs on this worker
            # (rescale_grad and the lr scheduler as the Trainer sets them); no server has one.
            self._machine.set_optimizer(None, self._updater)
            self._client.barrier()
            return
        spec = describe(optimizer)      # a clear error for an optimizer it cannot send
        self._machine.set_optimizer(spec)
        if self.rank == 0:
            self._client.set_optimizer(spec).wait()
        self._client.barrier()   # no worker pushes before every server has the optimizer

    def save_optimizer_states(self, fname, dump_optimizer=False):
        """Gather the servers' optimizer state into ``fname``: arrays and the optimizer's
        description, never a pickle (mxglue/state_file.py; ``dump_optimizer`` is accepted
        for MXNet's signature: the description is always written)."""
        if self._updater is None:
            raise RuntimeError("set_optimizer must be called before save_optimizer_states")
        if self._env.algorithm == "preduce":     # each worker's own optimizer state
            state_file.save(fname, describe(self._updater.optimizer),
                            state_arrays(self._updater.states))
            return
        request = self._client.get_state()
        replies = request.wait()
        spec = request.meta.get("optimizer") or describe(self._updater.optimizer)
        states = {key: [np.asarray(a).reshape(self._machine.shape(key)) for a in reply.state]
                  for key, reply in replies.items()}
        state_file.save(fname, spec, states)

    def load_optimizer_states(self, fname):
        """Read a file written by save_optimizer_states and send it to the servers; a
        pickle (MXNet's own format) is refused in one line, never loaded."""
        if self._updater is None:
            raise RuntimeError("set_optimizer must be called before load_optimizer_states")
        spec, arrays = state_file.load(fname)
        optimizer = build(spec)                       # MXNet's classes, checked
        optimizer.param_dict = self._updater.optimizer.param_dict
        updater = mx.optimizer.get_updater(optimizer)
        updater.states = states_from_arrays(optimizer, arrays)
        updater.states_synced = {key: True for key in updater.states}
        self._updater = updater
        if self._env.algorithm == "preduce":
            self._machine.set_optimizer(None, updater)
            return
        spec = describe(updater.optimizer)
        self._machine.set_optimizer(spec)
        if self.rank == 0:
            states = {key: [s.asnumpy().reshape(-1) for s in flatten_state(state)]
                      for key, state in updater.states.items()}
            self._client.set_state(states, spec).wait()
        self._client.barrier()

    # ---- this worker's own state, next to a checkpoint -------------------------------
    def save_worker_state(self, fname):
        """This worker's state that the servers do not hold (the stage machine's: local
        weights, the pending pull, the local rule's state, the step) to ``fname``, an
        .npz file (JSON meta, no pickles). Call it between two steps, on every worker at
        the same step; ``load_worker_state`` then continues bit-identically."""
        arrays, meta = self._machine.state_dict()
        arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
        arrays["__meta__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        tmp = f"{fname}.tmp"
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, fname)

    def load_worker_state(self, fname):
        """Restore a file of ``save_worker_state`` (after the Trainer has initialized the
        kvstore and loaded the optimizer state); w_i is written into the parameters."""
        with np.load(fname, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
        meta = json.loads(arrays.pop("__meta__").tobytes().decode())
        self._machine.load_state_dict(arrays, meta)

    # ---- lifecycle and metrics ----------------------------------------------------
    def barrier(self, value=0):
        """MXNet's barrier; also returns the largest ``value`` any worker passed."""
        self._machine.raise_deferred()
        return self._client.barrier(value)

    _barrier = barrier

    def average_all(self):
        """preduce: join the last group, of every worker, now rather than at ``close()``:
        afterwards the parameters hold the average of all workers' models (every worker
        must call it; a no-op for the other algorithms, and the second time)."""
        if self._env.algorithm == "preduce":
            self._machine.finish()

    def finish(self):
        """End this worker's steps now rather than at ``close()`` where the final model
        needs every worker: preduce's last group (``average_all``), a quorum's final pull
        (docs/spec/quorum.md rule 4). Returns True if it did (the parameters hold the
        final model), False (a no-op) otherwise. A worker that waits for the others
        after its last step (rank 0 for their end records) must call it first: a slow
        worker's rounds may still count on it."""
        if self._env.algorithm == "preduce" or self._machine.quorum:
            self._machine.finish()
            return True
        return False

    @property
    def groups(self):
        """preduce: (group number, member ranks) of every group this worker joined."""
        return list(self._machine.groups)

    def metrics(self):
        """Counters for the user: steps per stage, pushes, pulls, bytes, time blocked."""
        return self._machine.metrics()

    def close(self):
        """Finish the steps-delay stage on the global weights and leave the job cleanly."""
        self._node.close()
