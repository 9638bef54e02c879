"""The worker's stage machine: the spec's worker algorithm, in one place.

Each ``step`` is one ``Trainer.step`` (every key of the step at once):

* warm-up (t < T_w), ``ssgd`` and ``asgd``: push g_i(t) and wait for w_G(t);
* steps delay (t >= T_w): push g_i(t) without waiting; if a pull was requested at t - 1,
  wait for it and reset w_i <- w_G(t - 1) and the local rule's state (spec step 3); apply
  the local rule with g_i(t) (step 4); request w_G(t) with the push when
  (t - T_w) mod k = k - 1 (step 5).

The local weights w_i are the parameters' own arrays (the Trainer's ``out``), so the next
forward pass runs on them. Pushes and pulls travel on the client's I/O thread while the
main thread computes; it blocks only where the spec says it must. A worker has at most
k + 1 steps of pushes beyond the last global weights it received (it waits for each pull
one step after requesting it), which bounds memory on both sides.
"""
import time

import mxnet as mx
import numpy as np

from ..glu.rules import make_local_rule
from ..kvstore import hostcopy
from ..kvstore import protocol as P
from ..kvstore.optimizer_spec import build
from .schedule import Stage, plan


def _device_sum(nd_list):
    """The worker's gradient of a key: the sum over its devices."""
    if len(nd_list) == 1:
        return nd_list[0]
    return mx.nd.add_n(*[x.as_in_context(nd_list[0].context) for x in nd_list])


class StageMachine:
    def __init__(self, client, env):
        self.client, self.env = client, env
        self.t = env.start_step      # a resumed job continues the stage schedule
        self.key_steps = {}
        self.optimizer_spec = None
        self.rule = None
        self.seeded = set()
        self.pending = None           # Gather of the pull requested at t - 1
        self.outs = {}                # key -> the arrays that hold w_i
        self.shapes = {}              # key -> the array's shape (flat on the wire)
        # the last two global weights each key was reset to (estimate mode needs both)
        self.global_now, self.global_prev = {}, {}
        self.pulled_at, self.prev_pulled_at = {}, {}
        self.state_now, self.lr_now, self.version_now = {}, {}, {}
        self.counts = {**{s.value: 0 for s in Stage}, "pushes": 0, "pulls": 0}
        self.last_step_blocked = 0.0

    # ---- set-up --------------------------------------------------------------------
    def set_optimizer(self, spec):
        self.optimizer_spec = spec
        self.rule = None
        if self.env.algorithm == "ssd":
            self.rule = make_local_rule(self.env.local_rule, lambda: build(spec),
                                        self.client.num_workers, self.env.glu_state,
                                        self.env.lr_local)

    def _remember(self, key, reply, step):
        self.global_prev[key] = self.global_now.get(key, reply.value)
        self.prev_pulled_at[key] = self.pulled_at.get(key, step)
        self.global_now[key], self.pulled_at[key] = reply.value, step
        self.state_now[key] = reply.state
        self.lr_now[key], self.version_now[key] = reply.lr, reply.version

    def init_keys(self, entries):
        """entries: (key, value NDArray, outs); rank 0's values win, everyone gets them."""
        for key, value, _ in entries:
            self.client.placement.place(key, value.size, np.dtype(value.dtype).itemsize)
            self.key_steps.setdefault(key, 0)
            self.shapes[key] = value.shape
        values = hostcopy.read([value for _, value, _ in entries]) if self.client.rank == 0 \
            else [None] * len(entries)
        ents = [(key, 0, flat, value.dtype) for (key, value, _), flat in zip(entries, values)]
        replies = self.client.exchange(P.Kind.INIT, ents).wait()
        for key, _, _ in entries:
            self._remember(key, replies[key], self.t - 1)   # w_G before the first step
        hostcopy.write((out, replies[key].value) for key, _, outs in entries for out in outs)

    # ---- one training step ---------------------------------------------------------
    def step(self, entries):
        """entries: (key, grads, outs); outs None means write the result into grads."""
        blocked0 = self.client.stats["time_blocked"]
        p = plan(self.t, self.env.algorithm, self.env.warmup_steps, self.env.delay_steps)
        if not p.synchronous and self.rule is None:
            raise RuntimeError("algorithm ssd needs the optimizer on the kvstore: create the "
                               "Trainer with update_on_kvstore left at its default (True)")
        needs_state = self.rule is not None and self.rule.needs_state
        flags = P.Flag.PULL if p.request_pull else P.Flag.NONE
        if needs_state and p.request_pull and (not p.synchronous or self.t == self.env.warmup_steps - 1):
            flags |= P.Flag.STATE
        for key, _, _ in entries:
            if key not in self.key_steps:
                raise KeyError(f"key {key} was never initialized (call init or broadcast first)")
        grads = {key: _device_sum(grad_list) for key, grad_list, _ in entries}
        # A synchronous step waits for every server's reply, and a server replies only
        # after it has received this push: the gradients' own buffers can be sent as they
        # are. A steps-delay step returns while the push may still be on the wire and the
        # next backward pass rewrites the gradients, so it sends a copy.
        flats = hostcopy.read(list(grads.values()), copy=not p.synchronous)
        wire = [(key, self.key_steps[key], flat, flat.dtype) for key, flat in zip(grads, flats)]
        gather = self.client.exchange(P.Kind.PUSH, wire, step=self.t, flags=flags,
                                      reply=p.request_pull)
        for key, _, _ in entries:
            self.key_steps[key] += 1
        self.counts["pushes"] += 1
        self.counts[p.stage.value] += 1
        if p.synchronous:
            self.counts["pulls"] += 1
            replies = gather.wait()
            for key, _, _ in entries:
                self._remember(key, replies[key], self.t)
            hostcopy.write((out, replies[key].value) for key, grad_list, outs in entries
                           for out in (outs if outs is not None else grad_list))
        else:
            if self.pending is not None:
                replies, self.pending = self.pending.wait(), None
                for key, reply in replies.items():
                    self._remember(key, reply, self.t - 1)
                hostcopy.write((out, replies[key].value) for key in replies
                               for out in self.outs[key])
                for key in replies:
                    self._reset(key, self.outs[key])
            unseeded = [key for key, _, _ in entries if key not in self.seeded]
            if unseeded and self.rule.needs_state:
                self._fetch_state([k for k in unseeded if not self.state_now.get(k)])
            for key, grad_list, outs in entries:
                if outs is None:
                    raise RuntimeError("algorithm ssd needs pushpull with out= (the weights)")
                self.outs[key] = outs
                if key not in self.seeded:      # first steps-delay step: w_i = w_G(T_w - 1)
                    self._reset(key, outs)
                self.rule.update(key, outs[0], grads[key])
                for out in outs[1:]:
                    outs[0].copyto(out)
            if p.request_pull:
                self.counts["pulls"] += 1
                self.pending = gather
        self.t += 1
        self.last_step_blocked = self.client.stats["time_blocked"] - blocked0

    def _reset(self, key, outs):
        """Spec step 3 (the caller has set w_i <- w_G): re-seed the local rule from the
        global model."""
        ctx = outs[0].context
        now = self.global_now[key].reshape(outs[0].shape)
        state = None
        if self.rule.needs_state:
            state = [mx.nd.array(s.reshape(outs[0].shape), ctx=ctx, dtype=s.dtype)
                     for s in self.state_now[key]]
        between = self.pulled_at[key] - self.prev_pulled_at[key]
        prev = self.global_prev[key] if between > 0 else self.global_now[key]
        self.rule.reset(key, mx.nd.array(now, ctx=ctx, dtype=now.dtype),
                        prev_global_weight=mx.nd.array(prev.reshape(now.shape), ctx=ctx,
                                                       dtype=now.dtype),
                        steps_between=max(between, 1), state=state, lr=self.lr_now.get(key),
                        num_update=self.version_now.get(key))
        self.seeded.add(key)

    def push(self, entries):
        """A push on its own (``kv.push``; ssgd/asgd only): no reply, no local update; a
        later ``pull`` waits until the step is applied."""
        for key, _, _ in entries:
            if key not in self.key_steps:
                raise KeyError(f"key {key} was never initialized (call init or broadcast first)")
        flats = hostcopy.read([_device_sum(grads) for _, grads, _ in entries])
        wire = [(key, self.key_steps[key], flat, flat.dtype)
                for (key, _, _), flat in zip(entries, flats)]
        self.client.exchange(P.Kind.PUSH, wire, step=self.t, reply=False)
        for key, _, _ in entries:
            self.key_steps[key] += 1
        self.counts["pushes"] += 1

    def _fetch_state(self, keys):
        """The servers' optimizer state, lr and update count for keys that enter the
        steps-delay stage without a warm-up pull that carried them (no warm-up, or a
        resumed job whose servers loaded their state from a checkpoint)."""
        if not keys:
            return
        ents = [(key, -1, None, self.global_now[key].dtype) for key in keys]
        replies = self.client.exchange(P.Kind.PULL, ents, flags=P.Flag.STATE).wait()
        for key in keys:
            self.state_now[key] = replies[key].state
            self.lr_now[key], self.version_now[key] = replies[key].lr, replies[key].version

    # ---- pulls and the end of training ----------------------------------------------
    def pull(self, keys_outs, latest=False):
        """Weights as of the last step this worker pushed (or the latest, if asked)."""
        ents = [(key, -1 if latest else self.key_steps[key] - 1, None, outs[0].dtype)
                for key, outs in keys_outs]
        replies = self.client.exchange(P.Kind.PULL, ents).wait()
        hostcopy.write((out, replies[key].value) for key, outs in keys_outs for out in outs)
        return replies

    def finish(self):
        """End of training in the steps-delay stage: replace w_i by the global weights of
        the last step, so every worker ends with the same, global, model."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        if self.outs and self.seeded:
            self.pull(list(self.outs.items()))

    def metrics(self):
        stats = dict(self.client.stats)
        stats.update(self.counts)
        stats["step"] = self.t
        stats["stage"] = plan(max(self.t - 1, 0), self.env.algorithm, self.env.warmup_steps,
                              self.env.delay_steps).stage
        stats["last_step_blocked"] = self.last_step_blocked
        return stats
