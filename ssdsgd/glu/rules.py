"""The worker's local update rules of docs/spec (glu, sgd, none).

A rule turns the worker's raw gradient into the local step d_i(t) between two resets.
It never re-implements an update formula: `glu` runs a local copy of the server's own
MXNet optimizer (through MXNet's Updater), `sgd` runs MXNet's stateless SGD. What this
module adds is only the re-seeding at a reset: the lr, the update count and the state.

MXNet 1.9.1 state conventions (checked against the ops, see tests/test_glu_rules.py):
- sgd (momentum > 0): mom <- mu*mom - lr*(g + wd*w); w <- w + mom. So mom is the weight
  velocity per step.
- nag (momentum > 0): mom <- mu*mom - lr*(g + wd*w); w <- w + mu*mom - lr*(g + wd*w).
  The `nag_mom_update` kernel keeps mom in weight units too (the Python class docstring
  still describes the old gradient-unit state; the kernel is what runs). In a steady state
  w moves by mom per step, so for both the global velocity *is* the state: no division by
  lr is needed and lr_mult drops out.
"""
import mxnet as mx

from ..kvstore.optimizer_spec import flatten_state, unflatten_state
from ..settings import BY_NAME

RULES = BY_NAME['local_rule'].choices
GLU_STATES = BY_NAME['glu_state'].choices


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
    needs_state = False

    def reset(self, key, global_weight, *, prev_global_weight=None, steps_between=None,
              state=None, lr=None, num_update=None):
        """Re-seed the rule for `key` from a pull reply (spec step 3)."""

    def update(self, key, weight, grad):
        """Apply d_i(t) to `weight` in place; `grad` is the raw (unrescaled) gradient."""

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
        self.opt = opt
        self.updater = mx.optimizer.get_updater(opt)
        self.lr_local = lr_local
        self._lr = {}

    def reset(self, key, global_weight, *, prev_global_weight=None, steps_between=None,
              state=None, lr=None, num_update=None):
        self._lr[key] = self.lr_local if self.lr_local is not None else lr

    def update(self, key, weight, grad):
        lr = self._lr.get(key)
        if lr is None:
            lr = self.lr_local if self.lr_local is not None else self._default_lr
        self.opt.lr = lr
        self.updater(key, grad, weight)

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
        if glu_state == 'estimate' and not (isinstance(opt, (mx.optimizer.SGD, mx.optimizer.NAG))
                                            and opt.momentum > 0):
            raise ValueError(
                f"glu_state: estimate needs sgd or nag with momentum > 0 (got "
                f"{type(opt).__name__.lower()}, momentum={getattr(opt, 'momentum', None)}); "
                f"use glu_state: exact")
        super().__init__(opt, num_workers, lr_local)
        self.glu_state = glu_state
        self.needs_state = glu_state == 'exact'

    def reset(self, key, global_weight, *, prev_global_weight=None, steps_between=None,
              state=None, lr=None, num_update=None):
        super().reset(key, global_weight, lr=lr)
        local = self.opt.create_state_multi_precision(key, global_weight)
        slots = flatten_state(local)
        if self.glu_state == 'exact':
            if state is None or len(state) != len(slots):
                raise ValueError(f"key {key}: exact glu_state needs the server's {len(slots)} "
                                 f"state arrays, got {None if state is None else len(state)}")
            for slot, value in zip(slots, state):
                slot[:] = value
        else:
            if prev_global_weight is None or not steps_between:
                raise ValueError(f"key {key}: estimate glu_state needs prev_global_weight and "
                                 f"steps_between > 0 (pass the weight itself for no history)")
            # slots[0] is the momentum; a multi-precision state also holds the fp32 master
            # weight, which must restart from the global weights.
            velocity = (global_weight - prev_global_weight) / steps_between
            slots[0][:] = velocity.astype(slots[0].dtype)
            for master in slots[1:]:
                master[:] = global_weight.astype(master.dtype)
        self.updater.states[key] = local
        self.updater.states_synced[key] = True
        if num_update is not None:
            # Adam's bias correction (and any count-driven rule) continues the server's count.
            self.opt._set_current_context(global_weight.context.device_id)
            for counts in self.opt._all_index_update_counts.values():
                counts[key] = num_update
