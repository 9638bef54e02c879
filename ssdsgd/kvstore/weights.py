"""A server's part of the model: its key shards, the optimizer that updates them, and the
pushes' decoding. ``apply`` is the one place the weights change: a key's gradients summed
in the order given (a policy gives rank order) straight into the buffer the optimizer
reads, then MXNet's updater once for all the keys of the update."""
import mxnet as mx
import numpy as np

from ..mxglue import hostcopy
from ..mxglue.batch_schedule import GlobalBatchSchedule
from ..mxglue.optimizer_spec import (OptimizerSpecError, build, describe, flatten_state,
                                     unflatten_state)
from ..mxglue.update_groups import sgd_call, size_groups
from . import protocol as P
from .codecs import CompressionError, Packed
from .replies import RequestError
from ..timeline import traced

AGGREGATE_KEYS = 45      # keys per multi-tensor optimizer call (MXNet's kernels take <= 45)


class KeyShard:
    """The server's part of one key: a flat slice of the weights and its sum's buffer."""
    __slots__ = ("key", "offset", "count", "dtype", "_weight", "_weight_view", "grad",
                 "_grad_view", "version", "lent")

    def __init__(self, key, offset, values):
        self.key = key
        self.offset = offset
        self.count = values.size
        self.dtype = values.dtype
        self.weight = mx.nd.array(values, dtype=values.dtype)
        self.grad = mx.nd.zeros(values.shape, dtype=values.dtype)   # staging for the sum
        self._grad_view = None
        self.version = 0          # updates applied
        self.lent = []            # replies holding a view of ``weight``: unsent, or trackers

    # Views of the two buffers, made once per array (a key of a key-by-key script is a few
    # KB: making them per step cost as much as the sum). Only while no MXNet operation on
    # the array is pending (after ``mx.nd.waitall()``).
    @property
    def weight(self):
        return self._weight

    @weight.setter
    def weight(self, nd):      # Replies.reclaim moves the weights to a copy
        self._weight, self._weight_view = nd, None

    def weight_view(self):
        if self._weight_view is None:
            self._weight_view = hostcopy.raw_view(self._weight, self.dtype, self.count)
        return self._weight_view

    def grad_view(self):
        if self._grad_view is None:
            self._grad_view = hostcopy.raw_view(self.grad, self.dtype, self.count)
        return self._grad_view


def _summed_packed(parts, target):
    """Did the codec of ``parts``, all kept packed by it, sum them into ``target``
    (exactly as adding their decoded values would: ``Packed.sum_into``)?"""
    kind = type(parts[0])
    return issubclass(kind, Packed) and all(type(p) is kind for p in parts) and \
        kind.sum_into(parts, target)


def _decoded(parts):
    """``parts`` with every packed push decoded (the float32 values the server adds)."""
    return [p.decode() if isinstance(p, Packed) else p for p in parts]


class Weights:
    """``reclaim(shard)`` runs before a shard's weights change (the replies lending them)."""

    def __init__(self, num_workers, reclaim):
        self.num_workers = num_workers
        self.reclaim = reclaim
        self.rank = -1            # the server's, for messages
        self.shards = {}
        self.model_bytes = 0
        self.optimizer = None
        self.updater = None
        self.compression = None   # the job's push compression (COMMAND compression), if any
        self._sgd_seen = {}       # update_groups.sgd_call's knowledge of the arrays
        self.snapshots = None     # snapshots.Snapshots, if the job asks for them
        # cluster.server_replicas: 1: called with an update's shards once their sums are
        # in the buffers the optimizer reads, before it runs (chain.py); None: not at all
        self.on_sum = None

    def declare(self, key, offset, values):
        self.shards[key] = KeyShard(key, offset, values)
        self.model_bytes += values.nbytes

    def shard_for(self, rec, *, with_values):
        """The shard a request's record names, if it names it exactly."""
        key = int(rec["key"])
        shard = self.shards.get(key)
        if shard is None:
            raise RequestError(f"key {key} was never initialized on server {self.rank}")
        if int(rec["offset"]) != shard.offset or int(rec["count"]) != shard.count:
            raise RequestError(f"key {key}: slice [{int(rec['offset'])}, +{int(rec['count'])}) "
                               f"does not match this server's [{shard.offset}, +{shard.count})")
        if with_values and P.DTYPES[int(rec["dtype"])] != shard.dtype:
            raise RequestError(f"key {key}: dtype {P.DTYPES[int(rec['dtype'])]} but the key "
                               f"holds {shard.dtype}")
        return shard

    # ---- the optimizer -------------------------------------------------------------
    def use_optimizer(self, optimizer, global_batches):
        """``global_batches``: the policy's updates hold fewer than N pushes (a quorum's
        rounds), so the lr schedule counts global batches (pushes / N), not updates."""
        # Multi-tensor updates (MXNet's own multi_* kernels) for the keys of a step, in
        # calls of similar sizes (update_groups): the same arithmetic as one update per
        # key, far fewer engine calls.
        if optimizer.aggregate_num > 0:
            optimizer.aggregate_num = AGGREGATE_KEYS
        sched = optimizer.lr_scheduler
        if isinstance(sched, GlobalBatchSchedule) and sched.num_workers != self.num_workers:
            raise RequestError(f"the lr schedule's clock counts pushes of "
                               f"{sched.num_workers} workers; this job has {self.num_workers}")
        if global_batches and sched is not None and not isinstance(sched, GlobalBatchSchedule):
            # count the schedule in global batches (from a step, where every worker has
            # pushed that many times)
            optimizer.lr_scheduler = GlobalBatchSchedule(
                sched, self.num_workers, pushes=int(optimizer.num_update) * self.num_workers)
        elif not global_batches and isinstance(sched, GlobalBatchSchedule):
            optimizer.lr_scheduler = sched.inner     # Q = N: the update count is the clock
        self.optimizer = optimizer
        self.updater = mx.optimizer.get_updater(optimizer)
        self._sgd_seen = {}

    def learning_rate(self):
        return None if self.optimizer is None else float(self.optimizer.learning_rate)

    def update_count(self, shard):
        """A reply record's step: the optimizer's update count for the key (what a
        worker's local copy continues from); the updates applied unless states were loaded."""
        if self.optimizer is None:
            return shard.version
        return self.optimizer._index_update_count.get(shard.key, 0)

    def state_arrays(self, shard):
        if self.updater is None:
            return []
        if shard.key not in self.updater.states:
            self.updater.states[shard.key] = self.optimizer.create_state_multi_precision(
                shard.key, shard.weight)
            self.updater.states_synced[shard.key] = True
        return [a.asnumpy() for a in flatten_state(self.updater.states[shard.key])]

    def state(self, skip=()):
        """COMMAND get_state: every key's weights and optimizer state, with the optimizer's
        description: (records, arrays, meta); ``skip``: keys another server owns (this
        one backs them up)."""
        shards = sorted((s for s in self.shards.values() if s.key not in skip),
                        key=lambda s: s.key)
        arrays = [[s.weight.asnumpy()] + self.state_arrays(s) for s in shards]
        records = P.make_records((s.key, s.version, s.offset, s.count, s.dtype, len(a))
                                 for s, a in zip(shards, arrays))
        return records, arrays, {"optimizer": describe(self.optimizer) if self.optimizer
                                 else None}

    def load_states(self, meta, records, tensors, global_batches):
        """COMMAND set_state: the optimizer ``meta`` describes (none: the current one) and every
        record's state arrays, all checked before any is used."""
        optimizer, updater = self.optimizer, self.updater
        if "optimizer" in meta:
            try:
                optimizer = build(meta["optimizer"])
            except OptimizerSpecError as e:
                raise RequestError(f"COMMAND set_state: {e}") from None
            updater = mx.optimizer.get_updater(optimizer)
        if updater is None:
            raise RequestError("COMMAND set_state before any optimizer was set")
        states = {}
        for rec, arrays in zip(P.rows(records), tensors):
            shard = self.shard_for(rec, with_values=True)
            template = optimizer.create_state_multi_precision(shard.key, shard.weight)
            want = len(flatten_state(template))
            if len(arrays) != want:
                raise RequestError(f"key {shard.key}: {len(arrays)} state arrays, the "
                                   f"optimizer keeps {want}")
            states[shard.key] = unflatten_state(
                template, [mx.nd.array(a, dtype=a.dtype) for a in arrays])
        if optimizer is not self.optimizer:
            self.use_optimizer(optimizer, global_batches)
        for key, state in states.items():
            self.updater.states[key] = state
            self.updater.states_synced[key] = True

    # ---- pushes --------------------------------------------------------------------
    def gradient(self, rec, arrays, shard):
        """A push's gradient of ``shard``: as sent, or decoded from its compressed form."""
        code = int(rec["encoding"])
        if not code:
            return arrays[0]
        encoding = P.ENCODINGS[code]
        if shard.dtype != np.float32:
            raise RequestError(f"key {shard.key}: a compressed push for a {shard.dtype} key "
                               f"(compression needs float32)")
        if self.compression is None or encoding != self.compression.type:
            raise RequestError(f"key {shard.key}: a {encoding} push, but the job's compression "
                               f"is {self.compression.type if self.compression else 'none'}")
        try:
            return self.compression.receive(arrays[0], shard.count)
        except CompressionError as e:
            raise RequestError(f"key {shard.key}: {e}") from None

    @traced("apply")
    def apply(self, grads, pushes=0):
        """grads: ``[(key, gradients in rank order, scale)]`` (a policy's apply action).
        The sum is written straight into the buffer the optimizer reads (no extra copy of
        big arrays), then MXNet's updater runs once for all keys."""
        if pushes and self.optimizer is not None and \
                isinstance(self.optimizer.lr_scheduler, GlobalBatchSchedule):
            self.optimizer.lr_scheduler.pushes += pushes
        if not grads:
            return
        shards = [self.shards[key] for key, _, _ in grads]
        for shard in shards:
            self.reclaim(shard)
        mx.nd.waitall()
        for shard, (_, parts, scale) in zip(shards, grads):
            if scale is not None:     # a worker left: keep the mean gradient
                parts = [np.sum(_decoded(parts), axis=0) * np.float32(scale)]
            self._add(parts, shard.weight_view() if self.updater is None else shard.grad_view())
        if self.on_sum is not None:
            self.on_sum(shards)
        if self.updater is not None:   # without an optimizer the store keeps the sum (MXNet's rule)
            for group in size_groups([s.count for s in shards], AGGREGATE_KEYS):
                keys, sums, weights = ([shards[i].key for i in group],
                                       [shards[i].grad for i in group],
                                       [shards[i].weight for i in group])
                if not sgd_call(self.optimizer, self.updater, keys, sums, weights,
                                self._sgd_seen):
                    self.updater(keys, sums, weights)
            mx.nd.waitall()   # once per step: replies then read the weights' buffers directly
        for shard in shards:
            shard.version += 1
        if self.snapshots is not None:
            self.snapshots.after_apply(self.shards, len(grads[0][1]))

    @staticmethod
    def _add(parts, target):
        if _summed_packed(parts, target):
            return
        parts = _decoded(parts)
        if len(parts) == 1:
            np.copyto(target, parts[0])
        else:
            np.add(parts[0], parts[1], out=target)
            for g in parts[2:]:
                target += g
