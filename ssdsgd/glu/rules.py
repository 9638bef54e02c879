"""The worker's local update rules of docs/spec (glu, sgd, none).

A rule turns the worker's raw gradient into the local step d_i(t) between two resets.
It never re-implements an update formula: `glu` runs a local copy of the server's own
MXNet optimizer (through MXNet's Updater; for SGD on dense float32 keys, MXNet's own
multi-tensor SGD operator called directly with the optimizer's own lrs and wds:
``mxglue.update_groups.sgd_call``), `sgd` runs MXNet's stateless SGD. What this
module adds is only the re-seeding at a reset: the lr, the update count and the state.
The state comes from the server (`exact`) or is estimated at no extra bytes: `estimate`
(the mean global velocity of the last period) or `corrected` (the worker's own momentum
corrected by the gap to the pulled weights; docs/glu.md measures the three).

MXNet 1.9.1 state conventions (checked against the ops, see tests/test_glu_rules.py):
- sgd (momentum > 0): mom <- mu*mom - lr*(g + wd*w); w <- w + mom. So mom is the weight
  velocity per step.
- nag (momentum > 0): mom <- mu*mom - lr*(g + wd*w); w <- w + mu*mom - lr*(g + wd*w).
  The `nag_mom_update` kernel keeps mom in weight units too (the Python class docstring
  still describes the old gradient-unit state; the kernel is what runs). In a steady state
  w moves by mom per step, so for both the global velocity *is* the state: no division by
  lr is needed and lr_mult drops out.
"""
import functools

import mxnet as mx
import numpy as np

from ..mxglue import hostcopy
from ..mxglue.optimizer_spec import flatten_state, unflatten_state
from ..mxglue.update_groups import sgd_call, size_groups
from .host_sgd import HostSGD
from ..settings import BY_NAME

RULES = BY_NAME['local_rule'].choices
GLU_STATES = BY_NAME['glu_state'].choices
# glu_state values that derive the momentum from weights (no optimizer state on the wire).
ESTIMATED_STATES = ('estimate', 'corrected')
# Keys per multi-tensor update call of the local copy (MXNet's SGD default is 4, set by
# MXNET_OPTIMIZER_AGGREGATION_SIZE; its multi_sgd kernels take up to 60).
AGGREGATE = 45
# Elements per block of an in-place seed (256 KB of float32: the block's temporaries and
# its slices of 3-4 arrays stay in a 2-4 MB L2 cache).
BLOCK = 1 << 16


# ---------------------------------------------------------------------------------------
# The state estimates: pure functions on numpy arrays, writing in place, shared by the
# worker and the simulator. m is the momentum state in weight units (sgd and nag alike).

def period_model(momentum, steps, nesterov=False):
    """Linear model of one pull period of k = `steps` steps. With per-step forces f_1..f_k
    (m <- mu*m + f_j, f = -lr*(g + wd*w)) from momentum m0:
        momentum at the end  m_k = c*m0 + sum_j A_j*f_j,
        displacement         D   = a*m0 + sum_j B_j*f_j
    (sgd moves by m per step, nag by mu*m + f). Returns (a, c, A, B), A and B arrays."""
    mu, k = float(momentum), int(steps)
    if k < 1 or not 0.0 < mu < 1.0:
        raise ValueError(f"period_model needs steps >= 1 and 0 < momentum < 1; got "
                         f"steps={steps}, momentum={momentum}")
    j = np.arange(1, k + 1)
    A = mu ** (k - j)
    tail = (1.0 - mu ** (k - j + 1)) / (1.0 - mu)    # f_j's share of sum_s m_s
    S = float(np.sum(mu ** j))                         # m0's share of sum_s m_s
    if nesterov:
        return mu * S, mu ** k, A, mu * tail + 1.0
    return S, mu ** k, A, tail


@functools.lru_cache(maxsize=64)
def correction_gain(momentum, steps, nesterov=False):
    """Least-squares gain of a momentum error on a displacement error over one period:
    if the per-step forces of two runs differ by independent noise, sum_j A_j B_j /
    sum_j B_j^2 is the best linear predictor of m - m_i from D - D_i (1 at k = 1)."""
    _, _, A, B = period_model(momentum, steps, nesterov)
    return float(A @ B / (B @ B))


def velocity_into(out, global_weight, prev_global_weight, steps):
    """`estimate`, written into ``out`` (numpy, in its dtype): the mean global velocity
    over the period, (w_G(t_p) - w_G(t_q)) / k."""
    steps = out.dtype.type(steps)
    for part in _blocks(out.size):
        np.subtract(global_weight[part], prev_global_weight[part], out=out[part],
                    dtype=out.dtype)
        np.divide(out[part], steps, out=out[part])


def corrected_into(momentum, global_weight, local_weight, gain):
    """`corrected`, in place on numpy arrays: the worker's own momentum after the period's
    local steps plus the gain times the gap to the global weights,
    m_i <- m_i + beta * (w_G(t_p) - w_i), in m_i's dtype.
    Each local copy's force is N times its own gradient and the server's is the sum of
    the N gradients, so the workers' momenta and displacements average to the server's:
    the gaps average to zero and the mean seed is the server's momentum, period after
    period (exactly for wd = 0), and a seed that was wrong for all alike heals by the
    factor c - beta*a per period. The gap removes part of each worker's own noise. Exact
    for identical workers, and at k = 1 for sgd (for nag once the previous seed was)."""
    dtype = momentum.dtype
    gain, gap = dtype.type(gain), np.empty(min(BLOCK, momentum.size), dtype)
    for part in _blocks(momentum.size):
        d = gap[:part.stop - part.start]
        np.subtract(global_weight[part], local_weight[part], out=d, dtype=dtype)
        np.multiply(d, gain, out=d)
        np.add(momentum[part], d, out=momentum[part])


def _blocks(size):
    """Slices of BLOCK elements: an in-place seed applies all its operations to one block
    while it is in the cache, so it reads and writes each array once (about 1.6x faster
    than whole-array operations on ResNet-50's 25.6 M floats, bench/reset_cost.py)."""
    return (slice(lo, min(lo + BLOCK, size)) for lo in range(0, size, BLOCK))


def make_local_rule(name, make_optimizer, num_workers, glu_state='estimate', lr_local=None):
    """Build the worker's local rule; make_optimizer() must return a fresh optimizer
    configured exactly like the server's."""
    if name not in RULES:
        raise ValueError(f"local_rule must be one of {', '.join(RULES)}; got {name!r}")
    if glu_state not in GLU_STATES:
        raise ValueError(f"glu_state must be one of {', '.join(GLU_STATES)}; got {glu_state!r}")
    if lr_local is not None:    # the bounds the config and the environment reader apply
        try:
            BY_NAME['lr_local'].check(lr_local)
        except ValueError as e:
            raise ValueError(f"lr_local: {e}, got {lr_local!r}") from None
    if name == 'none':
        return NoneRule()
    if name == 'sgd':
        return SGDRule(make_optimizer(), num_workers, lr_local)
    return GLURule(make_optimizer(), num_workers, glu_state, lr_local)


class LocalRule:
    """Interface the worker stage machine calls (see make_local_rule)."""
    needs_state = False          # pulls must carry the server's optimizer state
    needs_local_weight = False   # reset() needs the worker's weights from before the reset

    def reset(self, key, global_weight, *, prev_global_weight=None, steps_between=None,
              state=None, lr=None, num_update=None, local_weight=None):
        """Re-seed the rule for `key` from a pull reply (spec step 3), NDArray arguments
        (the simulator's call): ``reseed`` on host copies. The worker calls
        ``state_arrays`` and ``reseed`` itself, on views of its own arrays."""
        slots = self.state_arrays(key, global_weight)
        with hostcopy.edit(slots) as views:
            self.reseed(key, views, _host(global_weight),
                        prev_global_weight=_host(prev_global_weight),
                        steps_between=steps_between,
                        state=None if state is None else [_host(a) for a in state],
                        lr=lr, num_update=num_update, local_weight=_host(local_weight))

    def state_arrays(self, key, template):
        """The NDArrays of the key's local state that a reset re-seeds in place, made once
        like ``template`` (the key's weights); [] for a rule without state."""
        return []

    def reseed(self, key, slots, global_weight, *, prev_global_weight=None,
               steps_between=None, state=None, lr=None, num_update=None, local_weight=None):
        """``reset`` on flat numpy arrays: ``slots`` are views of ``state_arrays(key)``,
        written in place; ``local_weight``: w_i before the reset ('corrected')."""

    def update(self, key, weight, grad):
        """Apply d_i(t) to `weight` in place; `grad` is the raw (unrescaled) gradient."""

    def update_many(self, keys, weights, grads):
        """``update`` for several keys at once (the same result, fewer MXNet calls)."""
        for key, weight, grad in zip(keys, weights, grads):
            self.update(key, weight, grad)

    def updates_on_host(self, keys, weights, grads):
        """Would ``update_many`` for these keys run in numpy alone? Then it can run inside
        an engine operation that holds their arrays (``update_held``)."""
        return False

    def update_state(self, key):
        """The NDArrays the local update of ``key`` writes besides its weights (an
        engine operation that runs it must hold them)."""
        return []

    def update_held(self, keys, weights, grads):
        """``update_many`` inside an engine operation that holds the keys' weights,
        gradients and state (``updates_on_host`` was True for them): it must not wait
        on the engine."""
        raise NotImplementedError(type(self).__name__)

    def state_dict(self, arrays):
        """The rule's own state for a worker checkpoint: arrays go into ``arrays``
        (names prefixed ``r``), the rest is returned (JSON-able)."""
        return {}

    def load_state_dict(self, arrays, meta, weights):
        """Restore ``state_dict``; ``weights``: key -> an NDArray of the key's shape and
        device (the template of the optimizer's state)."""


class NoneRule(LocalRule):
    """d = 0: the worker computes on the last pulled weights (k-step-stale SGD)."""


class _UpdaterRule(LocalRule):
    """Shared plumbing: one local MXNet optimizer + Updater, lr held per key."""

    def __init__(self, opt, num_workers, lr_local):
        # The worker's gradient stands for the whole step: scale it as N gradients.
        opt.rescale_grad = opt.rescale_grad * num_workers
        self._default_lr = opt.learning_rate  # only if a reset never reports an lr
        opt.lr_scheduler = None  # lr is the server's, held constant until the next reset
        if opt.aggregate_num > 0:   # optimizers with a multi-tensor kernel: fewer calls
            opt.aggregate_num = AGGREGATE
        self.opt = opt
        self.updater = mx.optimizer.get_updater(opt)
        self.lr_local = lr_local
        self._lr = {}
        self._sizes = {}     # key -> (weight array, its element count)
        self._plain = {}     # key -> what update_groups.sgd_call learnt of its arrays
        self._host = HostSGD()   # small dense CPU keys of SGD with momentum: numpy

    def reseed(self, key, slots, global_weight, *, prev_global_weight=None,
               steps_between=None, state=None, lr=None, num_update=None, local_weight=None):
        self._lr[key] = self.lr_local if self.lr_local is not None else lr

    def _key_lr(self, key):
        lr = self._lr.get(key)
        if lr is None:
            lr = self.lr_local if self.lr_local is not None else self._default_lr
        return lr

    def update(self, key, weight, grad):
        self.opt.lr = self._key_lr(key)
        self.updater(key, grad, weight)

    def update_many(self, keys, weights, grads):
        """One Updater call per lr and group of similar sizes (mxglue.update_groups):
        MXNet's SGD then runs ``multi_sgd_mom_update`` on up to ``AGGREGATE`` keys per
        operator call instead of one call per key, bit for bit the same weights
        (tests/test_glu_rules.py); other optimizers loop inside the Updater. SGD with
        momentum updates its small CPU keys in numpy instead (``host_sgd``), also bit
        for bit."""
        by_lr = {}
        host = self._host if HostSGD.applies(self.opt) else None
        for key, weight, grad in zip(keys, weights, grads):
            by_lr.setdefault(self._key_lr(key), []).append((key, grad, weight))
        for lr, items in by_lr.items():
            self.opt.lr = lr
            if host is not None:        # small keys in numpy (host_sgd), the rest below
                small, rest = [], []
                for key, grad, weight in items:
                    (small if host.take(self.updater, key, weight, grad) else rest).append(
                        (key, grad, weight))
                if small:
                    host.update(self.opt, self.updater, [k for k, _, _ in small],
                                [w for _, _, w in small], [g for _, g, _ in small])
                items = rest
            for group in size_groups([self._size(key, w) for key, _, w in items], AGGREGATE):
                keys_, grads_, weights_ = map(list, zip(*(items[i] for i in group)))
                if not sgd_call(self.opt, self.updater, keys_, grads_, weights_, self._plain):
                    self.updater(keys_, grads_, weights_)

    def updates_on_host(self, keys, weights, grads):
        """SGD with momentum on small dense float32 CPU keys whose state exists
        (``host_sgd``): every key must be one."""
        return HostSGD.applies(self.opt) and all(
            self._host.take(self.updater, key, weight, grad)
            for key, weight, grad in zip(keys, weights, grads))

    def update_state(self, key):
        state = self.updater.states.get(key)
        return [] if state is None else list(flatten_state(state))

    def update_held(self, keys, weights, grads):
        """``update_many``'s numpy path on views taken without waiting: the same lr
        groups, the same arithmetic, so the same weights bit for bit."""
        by_lr = {}
        for key, weight, grad in zip(keys, weights, grads):
            by_lr.setdefault(self._key_lr(key), []).append((key, weight, grad))
        for lr, items in by_lr.items():
            self.opt.lr = lr
            keys_, weights_, grads_ = map(list, zip(*items))
            self._host.update(self.opt, self.updater, keys_, weights_, grads_, held=True)

    def _size(self, key, weight):
        """The key's element count, remembered per weight array (the parameter's own,
        the same every step)."""
        known = self._sizes.get(key)
        if known is None or known[0] is not weight:
            known = self._sizes[key] = (weight, weight.size)
        return known[1]

    def state_dict(self, arrays):
        """The lr of each key, the local optimizer's state per key and its update counts
        (what a count-driven rule such as Adam continues from)."""
        states = {}
        for key, state in self.updater.states.items():
            flat = flatten_state(state)
            states[str(key)] = len(flat)
            for j, a in enumerate(flat):
                arrays[f"r{key}.{j}"] = a.asnumpy()
        counts = {str(dev): {str(k): int(v) for k, v in c.items()}
                  for dev, c in self.opt._all_index_update_counts.items()}  # noqa: SLF001
        return {"lr": {str(k): v for k, v in self._lr.items()}, "states": states,
                "counts": counts, "num_update": int(self.opt.num_update)}

    def load_state_dict(self, arrays, meta, weights):
        self._lr = {int(k): v for k, v in meta["lr"].items()}
        for skey, n in meta["states"].items():
            key = int(skey)
            w = weights[key]
            template = self.opt.create_state_multi_precision(key, w)
            if len(flatten_state(template)) != n:
                raise ValueError(f"key {key}: the saved local state has {n} arrays, the "
                                 f"optimizer's has {len(flatten_state(template))}")
            self.updater.states[key] = unflatten_state(template, [
                mx.nd.array(arrays[f"r{key}.{j}"], ctx=w.context, dtype=arrays[f"r{key}.{j}"].dtype)
                for j in range(n)])
            self.updater.states_synced[key] = True
        for dev, c in meta["counts"].items():
            held = self.opt._all_index_update_counts.setdefault(int(dev), {})  # noqa: SLF001
            held.clear()          # in place: _index_update_count is one of these dicts
            held.update({int(k): v for k, v in c.items()})
        self.opt.num_update = int(meta["num_update"])


class SGDRule(_UpdaterRule):
    """Stateless local SGD with the server's lr, wd, clipping and per-key multipliers."""

    def __init__(self, server_opt, num_workers, lr_local):
        opt = mx.optimizer.SGD(momentum=0.0, learning_rate=server_opt.learning_rate,
                               wd=server_opt.wd, clip_gradient=server_opt.clip_gradient,
                               rescale_grad=server_opt.rescale_grad)
        opt.lr_mult, opt.wd_mult = dict(server_opt.lr_mult), dict(server_opt.wd_mult)
        opt.idx2name, opt.param_dict = server_opt.idx2name, server_opt.param_dict
        super().__init__(opt, num_workers, lr_local)


class GLURule(_UpdaterRule):
    """Local copy of the server optimizer whose state is re-seeded at every reset."""

    def __init__(self, opt, num_workers, glu_state, lr_local):
        if glu_state in ESTIMATED_STATES and not (
                isinstance(opt, (mx.optimizer.SGD, mx.optimizer.NAG)) and opt.momentum > 0):
            raise ValueError(
                f"glu_state: {glu_state} needs sgd or nag with momentum > 0 (got "
                f"{type(opt).__name__.lower()}, momentum={getattr(opt, 'momentum', None)}); "
                f"use glu_state: exact")
        super().__init__(opt, num_workers, lr_local)
        self.glu_state = glu_state
        self.needs_state = glu_state == 'exact'
        self.needs_local_weight = glu_state == 'corrected'
        self.nesterov = isinstance(opt, mx.optimizer.NAG)
        self._seeded = set()     # keys reset at least once ('corrected' then has history)

    def state_arrays(self, key, template):
        """The local optimizer's state of ``key`` (a reset overwrites all of it), made at
        the key's first reset; the update counts of its device with it."""
        if key not in self.updater.states:
            self.opt._set_current_context(template.context.device_id)   # noqa: SLF001
            self.updater.states[key] = self.opt.create_state_multi_precision(key, template)
            self.updater.states_synced[key] = True
        return flatten_state(self.updater.states[key])

    def reseed(self, key, slots, global_weight, *, prev_global_weight=None,
               steps_between=None, state=None, lr=None, num_update=None, local_weight=None):
        """exact: the server's state into the slots; estimate, corrected: the momentum
        (slots[0]) computed in place, and a multi-precision state's fp32 master weight
        (slots[1]) restarted from the global weights."""
        super().reseed(key, slots, global_weight, lr=lr)
        if self.glu_state == 'exact':
            for slot, value in zip(slots, self._check_state(key, len(slots), state)):
                slot[...] = value
        else:
            self._seed_momentum(key, slots[0], global_weight, prev_global_weight,
                                steps_between, local_weight)
            for master in slots[1:]:
                master[...] = global_weight
        self._seeded.add(key)
        if num_update is not None:
            # Adam's bias correction (and any count-driven rule) continues the server's count.
            for counts in self.opt._all_index_update_counts.values():   # noqa: SLF001
                counts[key] = num_update

    def load_state_dict(self, arrays, meta, weights):
        super().load_state_dict(arrays, meta, weights)
        self._seeded = set(self.updater.states)

    @staticmethod
    def _check_state(key, count, state):
        if state is None or len(state) != count:
            raise ValueError(f"key {key}: exact glu_state needs the server's {count} "
                             f"state arrays, got {None if state is None else len(state)}")
        return state

    def _seed_momentum(self, key, mom, now, prev, steps, local):
        """The momentum to seed, per glu_state, written into ``mom``. The first reset of a
        key has no local history, so 'corrected' starts as the velocity."""
        if prev is None or not steps:
            raise ValueError(f"key {key}: {self.glu_state} glu_state needs "
                             f"prev_global_weight and steps_between > 0 (pass the weight "
                             f"itself for no history)")
        if self.glu_state == 'corrected' and key in self._seeded:
            if local is None:
                raise ValueError(f"key {key}: corrected glu_state needs local_weight, the "
                                 f"worker's weights before the reset")
            corrected_into(mom, now, local,
                           correction_gain(self.opt.momentum, steps, self.nesterov))
        else:
            velocity_into(mom, now, prev, steps)


def _host(array):
    """A flat numpy copy of an NDArray (None stays None)."""
    return None if array is None else array.asnumpy().reshape(-1)
