"""ssd's steps-delay steps queued on MXNet's engine, as ssgd's steps are (deferred.py).

A steps-delay step (spec steps 2-5) is one asynchronous engine operation that reads the
key's gradient and writes its weights and local state. ``Trainer.step`` then returns at
once, as on ps-lite, and what the script does before its next forward (its data, its
metrics, a straggler's wait) overlaps the step; the next forward waits inside the engine
for the weights this step writes. The operation runs when the gradients are computed:

1. it pushes a copy of g_i(t) (with the pull request of step 5 when the schedule says);
2. if step t - 1 requested w_G(t - 1), it hands the rest to the I/O thread, which resets
   w_i and the local rule's state from that reply when it arrives (step 3);
3. the local rule's update (step 4), in numpy on the arrays' own buffers (host_sgd), and
   the engine is told the operation is done.

So the worker waits for each pull one step after requesting it, as the synchronous path
does, but inside the engine. Every operation also writes one token array, so they run in
the order they were queued. Only steps whose whole update runs in numpy qualify (SGD
with momentum, small dense float32 keys on the CPU, one device, no compression:
``DelayStepsOnEngine.can_queue``; with or without a quorum): an MXNet operator cannot be called inside an
operation that holds its arrays, and its lr is the reply's, known only inside. Other
steps run on the caller's thread (``StageMachine._steps_delay_step``) after the queued
ones are settled. A failure keeps the arrays' old values and is raised by the machine's
next call, as for ssgd's queued steps.
"""
import threading

import mxnet as mx
import numpy as np

from ..mxglue import engineop, hostcopy, layout
from ..timeline import RECORDER as TIMELINE, now
from .deferred import ENGINE_LANE


class PendingPull:
    """The pull a queued step requested: its Gather exists once the engine ran the step.
    The machine keeps it as its pending pull (``wait``) and the next queued step takes
    its reply on the I/O thread (``then``)."""
    __slots__ = ("gather", "steps")

    def __init__(self, steps):
        self.gather, self.steps = None, steps

    def wait(self):
        """The replies (the caller's thread, after the queued steps are settled)."""
        self.steps.settle()
        if self.gather is None:
            raise RuntimeError("the queued step that requested this pull failed to push")
        return self.gather.wait()

    def then(self, callback):
        if self.gather is None:
            callback(None, RuntimeError("the queued step that requested this pull failed "
                                        "to push"))
        else:
            self.gather.then(callback)


class DelayStepsOnEngine:
    """The steps-delay steps queued since the last ``settle`` and their first failure.
    ``machine``: the stage machine whose keys, rule and reset these steps use."""

    def __init__(self, machine):
        self.machine = machine
        self.client = machine.client
        self.usable = engineop.available() and getattr(self.client, "gathers_then", False)
        self.token = mx.nd.zeros((1,), ctx=mx.cpu()) if self.usable else None
        self.queued = False
        self.error = None
        self.layouts = layout.QueuedArrays()   # what was restored last, per key
        self._lock = threading.Lock()

    def can_queue(self, entries, pending):
        """Can this steps-delay step be one engine operation? See the module's doc."""
        m = self.machine
        if not self.usable or m.rule is None or self.client.codes_pushes:
            return False
        if pending is not None and not callable(getattr(pending, "then", None)):
            return False
        for key, grads, outs in entries:
            record = m.keys.get(key)
            if (record is None or not record.seeded or outs is None or len(grads) != 1
                    or len(outs) != 1):
                return False
            for nd in (grads[0], outs[0]):
                if type(nd) is not mx.nd.NDArray or nd.context.device_type != "cpu":
                    return False
        return m.rule.updates_on_host([key for key, _, _ in entries],
                                      [outs[0] for _, _, outs in entries],
                                      [grads[0] for _, grads, _ in entries])

    def queue(self, entries, t, pull, state, previous):
        """Queue step ``t``: push (``pull``: with the pull request, ``state``: carrying the
        optimizer state), reset from ``previous`` (the pull requested at t - 1, or None),
        local update. Returns the PendingPull of this step's pull, or None."""
        self.raise_error()
        m = self.machine
        keys = [key for key, _, _ in entries]
        grads = [g[0] for _, g, _ in entries]
        weights = [outs[0] for _, _, outs in entries]
        for key, weight in zip(keys, weights):
            m.keys[key].outs = [weight]
        states = {}     # what the reset re-seeds and the update writes, each array once
        for key, w in zip(keys, weights):
            for nd in m.rule.state_arrays(key, w) + m.rule.update_state(key):
                states.setdefault(nd.handle.value, nd)
        mine = PendingPull(self) if pull else None

        def run(done):
            times = {"began": now()}
            try:
                flats = [np.array(v) for v in hostcopy.held(
                    grads, views=m.views, slots=[("g", key) for key in keys])]
                gather = self.client.push(t, list(zip(keys, flats)), pull=pull, state=state)
                if mine is not None:
                    mine.gather = gather
            except Exception as e:
                self._fail(e, done)
                return
            times["pushed"] = now()
            if previous is None:
                self._update(t, times, keys, weights, grads, done)
                return
            previous.then(lambda replies, error: self._reset(
                replies, error, t, times, keys, weights, grads, done))

        # The operation reads and writes the arrays' buffers: one that an inference pass
        # left in a oneDNN layout is put back first, here (mxglue/layout.py; inside the
        # operation MXNet cannot, and the next forward would reorder it only after).
        self.layouts.before_queue(
            (key, (w, g)) for key, w, g in zip(keys, weights, grads))
        engineop.push(run, grads, [self.token, *weights, *states.values()])
        self.queued = True
        return mine

    def _reset(self, replies, error, t, times, keys, weights, grads, done):
        """On the I/O thread (or wherever the reply completed): spec step 3, then 4."""
        times["arrived"] = now()
        if error is not None:
            self._fail(error, done)
            return
        try:
            m = self.machine
            for key, reply in replies.items():
                m.keys[key].remember(reply, m._dated(reply, t - 1))   # noqa: SLF001
            m._reset(list(replies), write_weights=True, held=True)   # noqa: SLF001
        except Exception as e:
            self._fail(e, done)
            return
        times["reset"] = now()
        self._update(t, times, keys, weights, grads, done)

    def _update(self, t, times, keys, weights, grads, done):
        """Spec step 4, then the engine is told; the step's spans on the lane ``engine``."""
        try:
            self.machine.rule.update_held(keys, weights, grads)
        except Exception as e:
            self._fail(e, done)
            return
        if TIMELINE.on:
            _record(t, times, now())
        done()

    def _fail(self, error, done):
        with self._lock:
            if self.error is None:
                self.error = error
        done()

    def raise_error(self):
        """Raise the failure of a queued step (once)."""
        with self._lock:
            error, self.error = self.error, None
        if error is not None:
            raise error

    def settle(self):
        """Wait for the queued steps (their replies are taken on the I/O thread, so this
        cannot wait on itself) and raise a failure among them."""
        if self.queued:
            mx.nd.waitall()
            self.queued = False
        self.raise_error()


def _record(t, times, end):
    """A queued step's spans, recorded once all their times are known so they nest:
    ``step`` (t) holding ``push``, ``reset`` (waits_for t - 1, holding ``blocked``: the
    wait for the reply) and ``local_update``."""
    began, pushed = times["began"], times["pushed"]
    TIMELINE.span("step", began, end, lane=ENGINE_LANE, key="step", value=t)
    TIMELINE.span("push", began, pushed, lane=ENGINE_LANE, key="step", value=t)
    update_from = pushed
    if "reset" in times:
        TIMELINE.span("reset", pushed, times["reset"], lane=ENGINE_LANE, key="waits_for",
                      value=t - 1)
        TIMELINE.span("blocked", pushed, times["arrived"], lane=ENGINE_LANE)
        update_from = times["reset"]
    TIMELINE.span("local_update", update_from, end, lane=ENGINE_LANE)
