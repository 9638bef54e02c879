"""``ssd_sync``: the KVStore MXNet sees. A thin adapter, like Horovod's MXNet binding.

It turns MXNet's calling conventions (a key or a list of keys; an NDArray or one per
device; ``out`` or not) into calls of the worker's stage machine (``ssdsgd/worker``), and
MXNet's optimizer objects and state files into what the worker client sends. It holds no
algorithm and no wire details. How the stock ``gluon.Trainer`` is brought to use it, and
the one node every store of a process shares, are in ``ssdsgd/integration.py``.
"""
import contextlib
import dataclasses
import hashlib
import json
import os

import mxnet as mx
import numpy as np
from mxnet.base import MXNetError
from mxnet.kvstore import KVStoreBase

from .integration import NAME, PROCESS, TYPES
from .key_table import KeyTable
from .kvstore.compression import AUTO, Compression, CompressionError
from .mxglue import state_file
from .mxglue.optimizer_spec import (build, describe, flatten_state, state_arrays,
                                    states_from_arrays)
from .settings import BY_NAME
from .sync.registry import refusal


def _as_list(x):
    return x if isinstance(x, (list, tuple)) else [x]


def _dense(value, what):
    """row_sparse arrays travel dense (docs/design.md); other storage is refused."""
    stype = getattr(value, "stype", "default")
    if stype == "row_sparse":
        return value.tostype("default")
    if stype != "default":
        raise MXNetError(f"{what}: {stype} arrays are not supported by ssd_sync (row_sparse "
                         "and dense are)")
    return value


def _flat(x):
    return [a for item in _as_list(x) for a in _flat(item)] if isinstance(x, (list, tuple)) \
        else [x]


def _no_sparse_outs(outs, what):
    if outs is not None and any(getattr(o, "stype", "default") != "default"
                                for o in _flat(outs)):
        raise MXNetError(f"{what} into a sparse array is not supported on a distributed "
                         "store: use row_sparse_pull")
    return outs


def _entries(keys_table, key, value, out, new=False):
    """MXNet's (key or keys, value(s), out(s)) as (wire key, dense values, outs)."""
    keys = _as_list(key)
    if len(keys) == 1:
        values = [_as_list(value)]
        outs = [None if out is None else _as_list(out)]
    else:
        values = [_as_list(v) for v in value]
        outs = [None] * len(keys) if out is None else [_as_list(o) for o in out]
    numbers = [keys_table.number(k, new=new) for k in keys]
    values = [[_dense(v, f"key {k!r}") for v in vs] for k, vs in zip(keys, values)]
    return list(zip(numbers, values, outs))


def _one_copy_each(arrays):
    """Arrays with equal contents written once (after a synchronous step a key's local
    weights can equal its last global snapshot: docs/training.md has the sizes).
    Returns (the arrays to write, {name: the name whose copy it is})."""
    kept, same_as, by_digest = {}, {}, {}
    for name, a in arrays.items():
        digest = (a.dtype.str, a.shape, hashlib.blake2b(a.data, digest_size=16).digest())
        twin = by_digest.get(digest)
        if twin is not None and np.array_equal(kept[twin], a):
            same_as[name] = twin
        else:
            kept[name] = a
            by_digest.setdefault(digest, name)
    return kept, same_as


@KVStoreBase.register      # as NAME: MXNet registers a store by its lower-cased class name
class SSD_Sync(KVStoreBase):
    """A distributed KVStore running SSD-SGD (or SSGD / ASGD) on ssdsgd's servers.

    Created by ``mx.kv.create('ssd_sync')`` or ``gluon.Trainer(..., kvstore='ssd_sync')``
    in a process started by ``launch/dist.py`` (configuration from SSDSGD_* variables)."""

    ALGORITHMS = tuple(TYPES)     # the algorithms this name may run (a mode name: fewer)

    def __init__(self):
        self._node = PROCESS.connect()
        self._env, self._client, self._machine = (self._node.env, self._node.client,
                                                  self._node.machine)
        self._keys = KeyTable()     # per store, as MXNet's (key_table.py)
        name = type(self).__name__.lower()
        if self._env.algorithm not in self.ALGORITHMS:
            raise ValueError(f"kvstore '{name}' runs {'/'.join(self.ALGORITHMS)}, but the "
                             f"job's algorithm (SSDSGD_ALGORITHM) is {self._env.algorithm}: "
                             f"use '{TYPES[self._env.algorithm]}' or '{NAME}'")
        self._updater = None     # Trainer.load_states reads _updater.optimizer
        self._batch = None       # the pushpulls of the Trainer step being collected

    # ---- identity ----------------------------------------------------------------
    @property
    def type(self):
        """The native type whose semantics the algorithm has (integration.py: MXNet
        decides by substrings of it)."""
        return TYPES[self._env.algorithm]

    def busy(self):
        """``with kv.busy():`` around work that is not training steps and takes long
        (validation): cluster.stall_timeout does not count it (docs/reliability.md)."""
        return self._client.busy()

    @property
    def rank(self):
        return self._client.rank

    @property
    def num_workers(self):
        return self._client.num_workers

    @property
    def algorithm(self):
        return self._env.algorithm

    @staticmethod
    def is_capable(capability):
        """The servers run the optimizer (callable on the class, as MXNet's stores)."""
        return capability == KVStoreBase.OPTIMIZER

    @property
    def handle(self):
        raise AttributeError("ssd_sync has no native handle: MXNet's server profiler "
                             "(profile_process='server') is not supported; profile workers")

    def _set_updater(self, updater):
        raise NotImplementedError("ssd_sync runs the optimizer on its servers: use "
                                  "kv.set_optimizer (a local updater is for local stores)")

    def _send_command_to_servers(self, head, body):
        raise NotImplementedError("ssd_sync servers take no custom commands (MXNet's are "
                                  "pickles); the optimizer goes with kv.set_optimizer")

    def set_gradient_compression(self, compression_params):
        """MXNet's interface (the Trainer calls it with ``compression_params``): every later
        push is compressed, with a residual per key on this worker; pulls are not
        (docs/spec/compression.md). ``{'type': 'auto'}``: the job chooses at the end of
        the warm-up (docs/auto.md)."""
        auto = compression_params == {"type": AUTO}
        spec = None if auto else Compression.from_params(compression_params)
        if spec is None and not auto:
            raise CompressionError("set_gradient_compression needs a dict with a 'type', "
                                   "e.g. {'type': '2bit', 'threshold': 0.5}")
        # the combinations the config check refuses, for a script that sets it itself
        refused = refusal({**dataclasses.asdict(self._env),
                           "compression": AUTO if auto else spec.type},
                          lambda name: "compression_params" if name == "compression"
                          else BY_NAME[name].env)
        if refused:
            raise CompressionError(refused)
        self._machine.settle()      # steps queued on the engine go out as they were made
        if auto:
            self._machine.compress_auto()
        else:
            self._client.set_compression(spec)

    # ---- data --------------------------------------------------------------------
    def init(self, key, value):
        self.broadcast(key, value, out=None)

    def broadcast(self, key, value, out, priority=0):
        self._machine.init_keys([(k, values[0], _no_sparse_outs(outs, "broadcast") or [])
                                 for k, values, outs in _entries(self._keys, key, value, out,
                                                                 new=True)])

    def _check_gradients_apply(self):
        if self._env.algorithm == "asgd" and self._updater is None:
            raise RuntimeError("algorithm asgd applies every push on the servers (as "
                               "dist_async): set the optimizer first (kv.set_optimizer, or "
                               "the Trainer's default update_on_kvstore=True); without it "
                               "each worker would get back only its own gradient")

    def pushpull(self, key, value, out=None, priority=0):
        self._check_gradients_apply()
        _no_sparse_outs(value if out is None else out, "pushpull")
        entries = _entries(self._keys, key, value, out)
        if self._batch is not None:
            self._batch.extend(entries)
        elif self._machine.can_defer(entries):    # queued on MXNet's engine, as ps-lite's
            self._machine.step_deferred(entries, priority)
        else:
            self._machine.step(entries)

    def push(self, key, value, priority=0):
        if self._env.algorithm in ("ssd", "preduce", "localsgd", "diloco"):
            raise NotImplementedError(f"with algorithm {self._env.algorithm} use pushpull (as "
                                      "the Trainer does): a separate push and pull cannot "
                                      "follow the step schedule")
        self._check_gradients_apply()
        self._machine.push(_entries(self._keys, key, value, None))

    def _check_pull(self):
        if self._env.algorithm == "preduce":
            raise NotImplementedError("with algorithm preduce every worker keeps its own model "
                                      "and the servers hold none to pull; the model is in the "
                                      "parameters (all workers' average after close())")

    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        """MXNet's pull. Into a row_sparse ``out``: skipped if ``ignore_sparse`` (as
        MXNet's distributed stores), else refused (use row_sparse_pull)."""
        self._check_pull()
        keys_outs = []
        for k, outs in zip(_as_list(key), _as_list(out) if len(_as_list(key)) > 1 else [out]):
            outs = _as_list(outs)
            if ignore_sparse:
                outs = [o for o in outs if getattr(o, "stype", "default") == "default"]
            keys_outs.append((self._keys.number(k), _no_sparse_outs(outs, "pull")))
        keys_outs = [(k, outs) for k, outs in keys_outs if outs]
        if keys_outs:
            self._machine.pull(keys_outs)

    def row_sparse_pull(self, key, out=None, priority=0, row_ids=None):
        """MXNet's row_sparse_pull, dense on the wire: the whole value is pulled and the
        rows ``row_ids`` kept (docs/design.md, "Keys and the rest of the KVStore API")."""
        self._check_pull()
        if row_ids is None:
            raise ValueError("row_sparse_pull needs row_ids")
        keys, outs = _as_list(key), _as_list(out)
        if len(keys) > 1:
            outs = [_as_list(o) for o in out]
            rows = [_as_list(r) for r in row_ids]
        else:
            outs, rows = [outs], [_as_list(row_ids)]
        for k, key_outs, key_rows in zip(keys, outs, rows):
            if len(key_rows) == 1:
                key_rows = key_rows * len(key_outs)
            number = self._keys.number(k)
            dense = mx.nd.zeros(self._machine.shape(number), dtype=key_outs[0].dtype)
            self._machine.pull([(number, [dense])])
            with mx.autograd.pause():     # a store's write, not an op of the graph
                for o, r in zip(key_outs, key_rows):
                    ids = np.unique(np.asarray(r.asnumpy() if hasattr(r, "asnumpy") else r,
                                               dtype=np.int64))
                    kept = mx.nd.sparse.retain(dense.tostype("row_sparse"),
                                               mx.nd.array(ids, dtype="int64"))
                    kept.copyto(o)

    @contextlib.contextmanager
    def step_batch(self):
        """Collect the pushpulls of one training step into one step of the stage machine
        (one exchange per server); not run if the step raised."""
        self._batch = []
        try:
            yield
        finally:
            batch, self._batch = self._batch, None
        if batch and self._machine.can_defer_step(batch):  # returns at once, as ps-lite's
            self._machine.step_deferred(batch, timed=True)
        elif batch:
            self._machine.step(batch)

    # ---- optimizer ---------------------------------------------------------------
    def set_optimizer(self, optimizer):
        self._machine.settle()      # a step queued on the engine is applied by the old one
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
        if self._machine.joined_from is None:    # a joiner comes long after it
            self._client.barrier()   # no worker pushes before every server has the optimizer

    def save_optimizer_states(self, fname, dump_optimizer=False):
        """Gather the servers' optimizer state into ``fname``: arrays and the optimizer's
        description, never a pickle (mxglue/state_file.py; ``dump_optimizer`` is accepted
        for MXNet's signature: the description is always written)."""
        if self._updater is None:
            raise RuntimeError("set_optimizer must be called before save_optimizer_states")
        self._machine.settle()      # the state of every step made, queued ones included
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
        self._machine.settle()      # a queued step must not land on the loaded state
        spec, arrays = state_file.load(fname)
        optimizer = build(spec)                       # MXNet's classes, checked
        optimizer.param_dict = self._updater.optimizer.param_dict
        updater = mx.optimizer.get_updater(optimizer)
        updater.states = states_from_arrays(optimizer, arrays, {
            key: self._machine.shape(key) for key in arrays if key in self._machine.keys})
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
        arrays, meta["__same_as__"] = _one_copy_each(
            {k: np.ascontiguousarray(v) for k, v in arrays.items()})
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
        for name, same in meta.pop("__same_as__", {}).items():
            arrays[name] = arrays[same].copy()
        self._machine.load_state_dict(arrays, meta)

    # ---- lifecycle and metrics ----------------------------------------------------
    def barrier(self, value=0, step=None):
        """MXNet's barrier; also returns the largest ``value`` any worker passed. With
        ``step``, in a job whose workers join and leave: the barrier of the workers in
        the job at that step (docs/spec/membership.md rule 11)."""
        if self._machine.quorum:
            # the barrier tells the servers not to wait for this worker's pushes (quorum.md
            # rule 2a): its queued steps must have pushed first
            self._machine.settle()
        self._machine.raise_deferred()
        return self._client.barrier(value, step=step)

    _barrier = barrier

    def average_all(self):
        """preduce: join the last group, of every worker, now rather than at ``close()``:
        afterwards the parameters hold the average of all workers' models (every worker
        must call it; a no-op for the other algorithms, and the second time)."""
        if self._env.algorithm == "preduce":
            self._machine.finish()

    @property
    def joined_from(self):
        """The step this worker joined the job at (launch/dist.py --join), or None."""
        return self._machine.joined_from

    def joins_before(self, step):
        """{rank: first step} of the workers that joined this job, every one whose step
        is <= ``step`` known for sure: the servers' replies say so before this worker
        makes the batch of that step (docs/spec/membership.md rule 6). Waits for the
        steps queued on the engine, whose replies may carry one."""
        self._machine.settle()
        return dict(self._client.joins)

    def leaves_before(self, step):
        """{rank: first step it does not push} of the workers that leave this job, as
        ``joins_before`` (a departure is decided as a join is; this worker's own too)."""
        self._machine.settle()
        return dict(self._client.leaves)

    def ask_chunk(self, epoch, plan, pause=False):
        """Dynamic data (ssdsgd.data.dynamic): ask for the next chunk of ``epoch`` (worker
        0: and for a pause, a mid-epoch checkpoint); a future for ``take_chunk``
        (kvstore/chunks.py)."""
        return self._client.ask_chunk(epoch, plan, pause)

    def take_chunk(self, fut, epoch, per_epoch):
        """(chunk, None), (None, "epoch" | "budget") or (cursor, "pause"): the answer
        ``fut`` waits for."""
        return self._client.take_chunk(fut, epoch, per_epoch)

    def finish(self):
        """End this worker's steps now rather than at ``close()`` where the final model
        needs every worker: preduce's last group (``average_all``), a quorum's final pull
        (docs/spec/quorum.md rule 4), localsgd's and diloco's last sync of the steps
        since the previous one (docs/spec/localsgd_diloco.md). Returns True if it did
        (the parameters hold the final model), False (a no-op) otherwise. A worker that
        waits for the others after its last step (rank 0 for their end records) must
        call it first: a slow worker's rounds may still count on it."""
        if self._env.algorithm == "preduce" or self._machine.quorum or \
                self._machine.periodic is not None:
            self._machine.finish()
            return True
        return False

    @property
    def groups(self):
        """preduce: (group number, member ranks) of every group this worker joined."""
        return list(self._machine.preduce.groups)

    def metrics(self):
        """Counters for the user: steps per stage, pushes, pulls, bytes, time blocked."""
        return self._machine.metrics()

    def close(self):
        """Finish the steps-delay stage on the global weights and leave the job cleanly."""
        self._node.close()


# The names that say the mode (integration.TYPES), for scripts that decide by the name they
# pass (``'dist' in args.kv_store``); each refuses a job whose algorithm has another mode.
@KVStoreBase.register
class Dist_Sync_SSDSGD(SSD_Sync):
    ALGORITHMS = ("ssgd", "ssd", "localsgd", "diloco")


@KVStoreBase.register
class Dist_Async_SSDSGD(SSD_Sync):
    ALGORITHMS = ("asgd",)


@KVStoreBase.register
class Dist_Preduce_SSDSGD(SSD_Sync):
    ALGORITHMS = ("preduce",)
