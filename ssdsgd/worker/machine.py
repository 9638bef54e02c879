"""The worker's stage machine: the spec's worker algorithm, in one place.

Each ``step`` is one ``Trainer.step`` (every key of the step at once). Every stage starts
with the same push of g_i(t) (spec step 2), then:

* warm-up (t < T_w), ``ssgd`` and ``asgd`` (``_synchronous_step``): wait for w_G(t);
* steps delay (t >= T_w, ``_steps_delay_step``): do not wait; if a pull was requested at
  t - 1, wait for it and reset w_i <- w_G(t - 1) and the local rule's state (spec step 3);
  apply the local rule with g_i(t) (step 4); the push requested w_G(t) when
  (t - T_w) mod k = k - 1 (step 5).

The local weights w_i are the parameters' own arrays (the Trainer's ``out``), so the next
forward pass runs on them. Pushes and pulls travel on the client's I/O thread while the
main thread computes; it blocks only where the spec says it must. A worker has at most
k + 1 steps of pushes beyond the last global weights it received (it waits for each pull
one step after requesting it), which bounds memory on both sides.

``preduce`` (``_preduce_step``, docs/spec/preduce.md): the worker applies the Trainer's
optimizer to its own weights with its own gradient, reports ready, and averages its
weights with the group the scheduler forms; ``finish`` joins the last group, of all N.

The machine speaks to the servers only through the client's API (``init``, ``push``,
``pull``): it builds no message and never sees how keys are split over servers.
"""
import dataclasses

import mxnet as mx
import numpy as np

from ..glu.rules import make_local_rule
from ..kvstore import hostcopy
from ..kvstore.optimizer_spec import build
from .schedule import Stage, plan


def _device_sum(nd_list):
    """The worker's gradient of a key: the sum over its devices."""
    if len(nd_list) == 1:
        return nd_list[0]
    return mx.nd.add_n(*[x.as_in_context(nd_list[0].context) for x in nd_list])


@dataclasses.dataclass
class KeyRecord:
    """Everything the machine keeps about one key."""
    shape: tuple
    outs: list | None = None     # the arrays that hold w_i (set in the steps-delay stage)
    seeded: bool = False         # the local rule has been reset from w_G at least once
    # The global weights of the last two resets (estimate mode needs both) and the steps
    # they are as of; with the newest, the server's optimizer state, lr and update count.
    value: np.ndarray | None = None
    pulled_at: int | None = None
    prev_value: np.ndarray | None = None
    prev_pulled_at: int | None = None
    state: list | None = None
    lr: float | None = None
    version: int | None = None

    def remember(self, reply, step):
        """A reply as of ``step`` becomes the newest global weights."""
        if self.value is None:
            self.prev_value, self.prev_pulled_at = reply.value, step
        else:
            self.prev_value, self.prev_pulled_at = self.value, self.pulled_at
        self.value, self.pulled_at = reply.value, step
        self.take_state(reply)

    def take_state(self, reply):
        self.state, self.lr, self.version = reply.state, reply.lr, reply.version


class StageMachine:
    def __init__(self, client, env):
        self.client, self.env = client, env
        self.t = env.start_step      # a resumed job continues the stage schedule
        self.rule = None
        self.keys = {}               # key -> KeyRecord
        self.pending = None          # Gather of the pull requested at t - 1
        self.counts = {**{stage: 0 for stage in Stage}, "pushes": 0, "pulls": 0}
        self.last_step_blocked = 0.0
        self.updater = None          # preduce: the Trainer's optimizer, run on this worker
        self.groups = []             # preduce: (group number, members) of every group joined
        self.groups_done = False     # preduce: the final group (of every worker) is done

    # ---- set-up --------------------------------------------------------------------
    def set_optimizer(self, spec, updater=None):
        """``updater``: MXNet's updater of the Trainer's own optimizer (preduce runs it)."""
        self.updater = updater
        self.rule = None
        if self.env.algorithm == "ssd":
            self.rule = make_local_rule(self.env.local_rule, lambda: build(spec),
                                        self.client.num_workers, self.env.glu_state,
                                        self.env.lr_local)

    def shape(self, key):
        return self.keys[key].shape

    def init_keys(self, entries):
        """entries: (key, value NDArray, outs); rank 0's values win, everyone gets them."""
        for key, value, _ in entries:
            self.keys.setdefault(key, KeyRecord(value.shape)).shape = value.shape
        values = hostcopy.read([value for _, value, _ in entries]) \
            if self.client.rank == 0 else None
        replies = self.client.init([(key, value.size, value.dtype) for key, value, _ in entries],
                                   values).wait()
        for key, _, _ in entries:
            self.keys[key].remember(replies[key], self.t - 1)   # w_G before the first step
        hostcopy.write((out, replies[key].value) for key, _, outs in entries for out in outs)

    # ---- one training step ---------------------------------------------------------
    def step(self, entries):
        """entries: (key, grads, outs); outs None means write the result into grads."""
        blocked0 = self.client.stats["time_blocked"]
        if self.env.algorithm == "preduce":
            self._preduce_step(entries)
            self.t += 1
            self.last_step_blocked = self.client.stats["time_blocked"] - blocked0
            return
        p = plan(self.t, self.env.algorithm, self.env.warmup_steps, self.env.delay_steps)
        if not p.synchronous:
            self._check_steps_delay(entries)
            self._fetch_state(entries)
        # A synchronous step waits for every server's reply, and a server replies only
        # after it has received this push: the gradients' own buffers can be sent as they
        # are. A steps-delay step returns while the push may still be on the wire and the
        # next backward pass rewrites the gradients, so it sends a copy.
        grads, reply = self._push(entries, copy=not p.synchronous, pull=p.request_pull,
                                  state=self._wants_state(p))
        self.counts[p.stage] += 1
        if p.synchronous:
            self._synchronous_step(entries, reply)
        else:
            self._steps_delay_step(entries, grads, reply)
        self.t += 1
        self.last_step_blocked = self.client.stats["time_blocked"] - blocked0

    def _check_steps_delay(self, entries):
        if self.rule is None:
            raise RuntimeError("algorithm ssd needs the optimizer on the kvstore: create the "
                               "Trainer with update_on_kvstore left at its default (True)")
        if any(outs is None for _, _, outs in entries):
            raise RuntimeError("algorithm ssd needs pushpull with out= (the weights)")

    def _wants_state(self, p):
        """The exact glu state travels with the pulls that reset the local rule: every
        steps-delay pull, and the last warm-up step's (the first reset's)."""
        needs_state = self.rule is not None and self.rule.needs_state
        return needs_state and p.request_pull and \
            (not p.synchronous or self.t == self.env.warmup_steps - 1)

    def _push(self, entries, *, copy, pull=False, state=False):
        """Spec step 2, shared by every stage and ``kv.push``: push g_i(t), each key's
        gradients summed over the worker's devices. Returns them and the pull's reply."""
        grads = {key: _device_sum(grad_list) for key, grad_list, _ in entries}
        flats = hostcopy.read(list(grads.values()), copy=copy)
        reply = self.client.push(self.t, list(zip(grads, flats)), pull=pull, state=state)
        self.counts["pushes"] += 1
        if pull:
            self.counts["pulls"] += 1
        return grads, reply

    def _synchronous_step(self, entries, reply):
        """Warm-up, ssgd, asgd: wait for w_G(t) and write it into the parameters."""
        replies = reply.wait()
        for key, _, _ in entries:
            self.keys[key].remember(replies[key], self.t)
        hostcopy.write((out, replies[key].value) for key, grad_list, outs in entries
                       for out in (outs if outs is not None else grad_list))

    def _steps_delay_step(self, entries, grads, reply):
        """Spec steps 3-5 after the push (which carried the pull request of step 5)."""
        if self.pending is not None:
            self._reset_to_pulled()
        for key, _, outs in entries:
            record = self.keys[key]
            record.outs = outs
            if not record.seeded:      # first steps-delay step: w_i = w_G(T_w - 1)
                self._reset(key, record)
            self.rule.update(key, outs[0], grads[key])
            for out in outs[1:]:
                outs[0].copyto(out)
        self.pending = reply           # None unless this step requested w_G(t)

    def _reset_to_pulled(self):
        """Spec step 3: w_i <- w_G(t - 1) from the pull requested at t - 1."""
        replies, self.pending = self.pending.wait(), None
        for key, reply in replies.items():
            self.keys[key].remember(reply, self.t - 1)
        hostcopy.write((out, reply.value) for key, reply in replies.items()
                       for out in self.keys[key].outs)
        for key in replies:
            self._reset(key, self.keys[key])

    def _reset(self, key, record):
        """Spec step 3 (the caller has set w_i <- w_G): re-seed the local rule from the
        global model."""
        shape, ctx = record.outs[0].shape, record.outs[0].context
        now = record.value.reshape(shape)
        state = None
        if self.rule.needs_state:
            state = [mx.nd.array(s.reshape(shape), ctx=ctx, dtype=s.dtype) for s in record.state]
        between = record.pulled_at - record.prev_pulled_at
        prev = record.prev_value if between > 0 else record.value
        self.rule.reset(key, mx.nd.array(now, ctx=ctx, dtype=now.dtype),
                        prev_global_weight=mx.nd.array(prev.reshape(now.shape), ctx=ctx,
                                                       dtype=now.dtype),
                        steps_between=max(between, 1), state=state, lr=record.lr,
                        num_update=record.version)
        record.seeded = True

    def _fetch_state(self, entries):
        """The servers' optimizer state, lr and update count for keys that enter the
        steps-delay stage without a warm-up pull that carried them (no warm-up, or a
        resumed job whose servers loaded their state from a checkpoint). Fetched before
        this step's push, which may complete step t: the state must be as of the weights
        of the first reset, w_G(t - 1)."""
        if not self.rule.needs_state:
            return
        keys = [key for key, _, _ in entries
                if key in self.keys and not self.keys[key].seeded and not self.keys[key].state]
        if keys:
            replies = self.client.pull(keys, latest=True, state=True).wait()
            for key in keys:
                self.keys[key].take_state(replies[key])

    def _preduce_step(self, entries):
        """docs/spec/preduce.md: the local step with the Trainer's optimizer (key by key,
        in the Trainer's order), then ready, then the group's average."""
        if self.updater is None or any(outs is None for _, _, outs in entries):
            raise RuntimeError("algorithm preduce runs the Trainer's optimizer inside the "
                               "store: create the Trainer with update_on_kvstore left at its "
                               "default (True)")
        for key, grad_list, outs in entries:
            self.keys[key].outs = outs
            self.updater(key, _device_sum(grad_list), outs[0])
        self.counts[Stage.PREDUCE] += 1
        self._average([(key, outs) for key, _, outs in entries], final=False)

    def _average(self, keys_outs, final):
        """Report ready, wait for the group, and replace the weights by its average."""
        group, members = self.client.ready(final=final)
        self.groups.append((group, members))
        if len(members) > 1:
            flats = hostcopy.read([outs[0] for _, outs in keys_outs])
            reply = self.client.average(group, members,
                                        [(key, flat) for (key, _), flat in
                                         zip(keys_outs, flats)])
            self.counts["pushes"] += 1
            replies = reply.wait()
            hostcopy.write((outs[0], replies[key].value) for key, outs in keys_outs)
        for _, outs in keys_outs:
            for out in outs[1:]:
                outs[0].copyto(out)

    # ---- outside the step schedule ----------------------------------------------------
    def push(self, entries):
        """A push on its own (``kv.push``; ssgd/asgd only): no reply, no local update; a
        later ``pull`` waits until the step is applied."""
        self._push(entries, copy=True)

    def pull(self, keys_outs, latest=False):
        """Weights as of the last step this worker pushed (or the latest, if asked)."""
        replies = self.client.pull([key for key, _ in keys_outs], latest=latest).wait()
        hostcopy.write((out, replies[key].value) for key, outs in keys_outs for out in outs)
        return replies

    def finish(self):
        """End of training in the steps-delay stage: replace w_i by the global weights of
        the last step, so every worker ends with the same, global, model. preduce: the
        last group, of every worker, averages all their models."""
        if self.env.algorithm == "preduce":
            local = [(key, r.outs) for key, r in self.keys.items() if r.outs is not None]
            if local and not self.groups_done:
                self.groups_done = True
                self._average(local, final=True)
            return
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        local = [(key, r.outs) for key, r in self.keys.items() if r.outs is not None]
        if local and any(r.seeded for r in self.keys.values()):
            self.pull(local)

    def metrics(self):
        stats = dict(self.client.stats)
        stats.update(self.counts)
        stats["step"] = self.t
        stats["stage"] = plan(max(self.t - 1, 0), self.env.algorithm, self.env.warmup_steps,
                              self.env.delay_steps).stage
        stats["last_step_blocked"] = self.last_step_blocked
        return stats
