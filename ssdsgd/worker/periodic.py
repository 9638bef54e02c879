"""localsgd's and diloco's steps after the warm-up (docs/spec/localsgd_diloco.md): the
worker's own copy of the Trainer's optimizer on its own gradient, and every H steps a
sync: push the model delta d_i = w_G - w_i (w_G: the global weights of the last sync),
wait for the servers' new global weights, start the next period from them.

The warm-up is the stage machine's (ssd's synchronous steps; its last pull carries the
servers' optimizer state, which the worker's copy continues from). At the first local
step rank 0 switches every server to the outer optimizer (``glu/outer.py``) and every
worker waits for it at a barrier, so no delta meets the warm-up's optimizer. The servers'
policy is the dense one (a sync is one step of N pushes, summed in rank order); the
client numbers a key's pushes, so the k-th sync is the servers' step T_w + k.
"""
import mxnet as mx

from ..glu.outer import inner_copy, outer_optimizer, seed
from ..mxglue import hostcopy
from ..mxglue.optimizer_spec import build, describe
from ..sync.stage import Stage
from ..timeline import RECORDER as TIMELINE, now
from .deferred import device_sum


class PeriodicSync:
    def __init__(self, client, keys, counts, env):
        self.client, self.keys, self.counts, self.env = client, keys, counts, env  # machine's
        self.spec = None          # the Trainer's optimizer, as the servers got it
        self.opt = self.updater = None   # this worker's copy, made at the first local step
        self.since_sync = 0       # local steps since the last sync (the final sync's)

    def set_optimizer(self, spec):
        """The Trainer's optimizer, as described to the servers: the worker's copy is
        built from it at the first local step."""
        if self.opt is not None:
            raise RuntimeError(f"algorithm {self.env.algorithm}: the optimizer was set again "
                               "after the warm-up; the servers run the outer step now")
        self.spec = spec

    def step(self, entries, t, sync):
        """One local step; with ``sync`` (every H-th), the model sync after it."""
        if self.spec is None or any(outs is None for _, _, outs in entries):
            raise RuntimeError(f"algorithm {self.env.algorithm} runs the Trainer's optimizer "
                               "inside the store: create the Trainer with update_on_kvstore "
                               "left at its default (True)")
        if self.opt is None:
            self._start(entries)
        t0 = now()
        for key, _, outs in entries:
            self.keys[key].outs = outs
        self.updater([key for key, _, _ in entries],
                     [device_sum(grads) for _, grads, _ in entries],
                     [outs[0] for _, _, outs in entries])
        for _, _, outs in entries:
            for out in outs[1:]:
                outs[0].copyto(out)
        TIMELINE.span("local_update", t0)
        self.counts[Stage.LOCAL_STEPS] += 1
        self.since_sync += 1
        if sync:
            self._sync(t)

    def finish(self, t):
        """The end: a last sync of the steps since the previous one, so every worker ends
        on the same global model and no step is lost (every worker ends at the same t)."""
        if self.opt is not None and self.since_sync:
            self._sync(t)

    def _start(self, entries):
        """The first local step: the servers take the outer optimizer; this worker's copy
        of the Trainer's continues the warm-up's state and update count (the last warm-up
        pull's; without a warm-up, a fresh one, as the servers' was)."""
        if self.client.rank == 0:
            outer = outer_optimizer(self.env.algorithm, self.client.num_workers,
                                    self.env.outer_lr, self.env.outer_momentum)
            self.client.set_optimizer(describe(outer)).wait()
        self.client.barrier()     # no worker pushes a delta before every server switched
        self.opt = inner_copy(build(self.spec), self.client.num_workers)
        self.updater = mx.optimizer.get_updater(self.opt)
        for key, _, outs in entries:
            r = self.keys[key]
            seed(self.opt, self.updater, key, outs[0], r.state, r.version)

    def _sync(self, t):
        """Push d_i = w_G - w_i of every key, wait for the new w_G, and take it."""
        t0 = now()
        records = [(key, r) for key, r in self.keys.items() if r.outs is not None]
        flats = hostcopy.read([r.outs[0] for _, r in records])
        deltas = [(key, r.value - flat) for (key, r), flat in zip(records, flats)]
        replies = self.client.push(t, deltas, pull=True).wait()
        for key, r in records:
            r.remember(replies[key], t)
        hostcopy.write((out, replies[key].value) for key, r in records for out in r.outs)
        self.counts["pushes"] += 1
        self.counts["pulls"] += 1
        self.since_sync = 0
        TIMELINE.span("pull", t0, key="waits_for", value=t)
