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
main thread computes, and a compressed push that does not pull is also coded on a
thread of the client's (``push_later``); the main thread blocks only where the spec says it must. A worker has at most
k + 1 steps of pushes beyond the last global weights it received (it waits for each pull
one step after requesting it), which bounds memory on both sides.

``preduce`` (docs/spec/preduce.md) has no stage schedule: its steps are ``preduce.py``'s
(the Trainer's optimizer on the worker's own weights, then its group's average).
``localsgd`` and ``diloco`` (docs/spec/localsgd_diloco.md) warm up here as ssd does; their
local steps and model syncs after it are ``periodic.py``'s. The
synchronous steps a key-by-key script queues on MXNet's engine (``step_deferred``) are
``deferred.py``'s: they complete on the I/O thread.

The machine speaks to the servers only through the client's API (``init``, ``push``,
``pull``): it builds no message and never sees how keys are split over servers.
"""
import contextlib
import dataclasses
import functools

import numpy as np

from ..glu.rules import make_local_rule
from ..kvstore.requests import ServerError
from ..mxglue import hostcopy
from ..mxglue.optimizer_spec import build
from . import checkpoint_state
from .deferred import DeferredSteps, device_sum
from .delay_on_engine import DelayStepsOnEngine
from .periodic import PeriodicSync
from .preduce import PreduceSteps
from ..kvstore.compression import Compression, measure_codecs
from ..sync.auto import CodecCost, Schedule
from ..sync.events import PolicyError, reply_fields
from ..sync.groups import GroupRecord
from ..sync.stage import Stage, delays_pulls, steps_ahead_bound, syncs_periodically
from ..timeline import RECORDER as TIMELINE, now


@dataclasses.dataclass
class KeyRecord:
    """Everything the machine keeps about one key."""
    shape: tuple
    outs: list | None = None     # the arrays that hold w_i (set in the steps-delay stage)
    params: list | None = None   # the parameter arrays kv.init wrote (where w_i lives)
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
    # The last pushpull queued on the engine for this key (deferred.KeyOp), reused while
    # the caller passes the same arrays; it keeps them alive until the next call.
    deferred: object = None

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
        self.joined_from = None      # a joiner's first step (docs/spec/membership.md)
        self.rule = None
        self.keys = {}               # key -> KeyRecord
        self.pending = None          # the pull requested at t - 1 (a Gather or PendingPull)
        self.counts = {**{stage: 0 for stage in Stage}, "pushes": 0, "pulls": 0,
                       "steps_on_engine": 0,    # steps-delay steps queued on the engine
                       "warmup_on_engine": 0}   # and warm-up steps
        self.last_step_blocked = 0.0
        # A quorum (docs/spec/quorum.md): a pull is answered once the round holding its
        # push closed (Q workers, not all), global weights are dated by the servers'
        # update count (rounds, not this worker's steps), and the end waits for every
        # worker (final pull).
        self.quorum = bool(getattr(client, "quorum", False))
        # T_w, k and the pull relay in force: pinned, or chosen by the job (sync/auto.py);
        # k and the relay are agreed at the end of the warm-up, and then this worker's
        # place in each pull period (0 unless the pulls are staggered) follows from k.
        self.schedule = Schedule(env, client.rank, client.num_workers, relay_workers=(
            client.num_workers if getattr(client, "relays", None) else 0),
            on_choice=self._take_choice)
        self.preduce = PreduceSteps(client, self.keys, self.counts)
        if env.algorithm == "preduce":     # what it was told, for a restarted scheduler
            client.record_policy_answers(GroupRecord(client.rank))
        self.periodic = (PeriodicSync(client, self.keys, self.counts, env)
                         if syncs_periodically(env.algorithm) else None)
        # steps queued on MXNet's engine
        self.deferred = DeferredSteps(client, self.keys, self._dated, self.quorum)
        self.on_engine = DelayStepsOnEngine(self)           # ssd's steps-delay steps too
        self.final_done = False      # quorum: the final pull is answered
        self.quorum_auto = None      # quorum auto: server 0's record, from the final reply
        # What hostcopy learnt of each key's gradient, weights and local state arrays, kept
        # while the Trainer passes the same ones (slots: ("g", key), ("w", key, device),
        # ("s", key, i)).
        self.views = hostcopy.Views()

    # ---- set-up --------------------------------------------------------------------
    def join_at(self, step):
        """This worker joins a running job at ``step``: its stage schedule starts there,
        as a resumed run's does (rule 5 of docs/spec/membership.md)."""
        self.t = self.joined_from = step

    def set_optimizer(self, spec, updater=None):
        """``updater``: MXNet's updater of the Trainer's own optimizer (preduce runs it)."""
        self.preduce.updater = updater
        self.schedule.learn_length(spec, self.t)
        self.schedule.learn_cap(spec)
        self.rule = None
        if self.periodic is not None:
            self.periodic.set_optimizer(spec)
        if delays_pulls(self.env.algorithm):
            self.rule = make_local_rule(self.env.local_rule, lambda: build(spec),
                                        self.client.num_workers, self.env.glu_state,
                                        self.env.lr_local)

    def shape(self, key):
        return self.keys[key].shape

    def _take_choice(self, schedule):
        """What the schedule chose (pinned, or auto at the end of the warm-up) takes
        effect: the relay, and a compression chosen by ``sync.compression: auto``."""
        self.client.relay_on = bool(schedule.relay)
        if schedule.compression not in (None, "none") and not self.client.codes_pushes:
            self.client.set_compression(Compression.from_params({"type": schedule.compression}))

    def compress_auto(self):
        """``compression_params={'type': 'auto'}``: the schedule decides at the end of the
        warm-up, from its timings and what coding a push costs here (codecs/cost.py)."""
        self.schedule.compress_auto(lambda nbytes: {
            name: CodecCost(*cost) for name, cost in measure_codecs(nbytes).items()})

    def init_keys(self, entries):
        """entries: (key, value NDArray, outs); rank 0's values win, everyone gets them."""
        self.settle()
        for key, value, _ in entries:
            self.keys.setdefault(key, KeyRecord(value.shape)).shape = value.shape
        keys = [(key, value.size, value.dtype) for key, value, _ in entries]
        if self.joined_from is not None:     # a joiner starts from w_G(s - 1), not rank 0's
            # with the servers' state as of then, which its first reset takes (rule 5)
            state = bool(self.rule is not None and self.rule.needs_state) or \
                self.periodic is not None
            replies = self.client.join_keys(keys, self.t, state=state).wait()
        else:
            values = hostcopy.read([value for _, value, _ in entries]) \
                if self.client.rank == 0 else None
            replies = self.client.init(keys, values).wait()
        for key, _, outs in entries:
            self.keys[key].remember(replies[key], self._dated(replies[key], self.t - 1))
            self.keys[key].params = list(outs) or self.keys[key].params
        hostcopy.write((out, replies[key].value) for key, _, outs in entries for out in outs)

    # ---- one training step ---------------------------------------------------------
    def step(self, entries):
        """entries: (key, grads, outs); outs None means write the result into grads."""
        self.deferred.settle()
        self.on_engine.raise_error()     # queued steps-delay steps stay queued unless
        # this step runs on this thread (_stage_step settles them then)
        self.schedule.before_step(self.t, self.client.barrier)   # a joiner takes the job's k
        TIMELINE.begin_step(self.t)
        trial = self.schedule.trial_relays(self.t)     # the relay's trial (sync/auto.py)
        if trial is not None:
            self.client.relay_on = trial
        self.client.relay_trial = trial is not None     # untimed by the pieces' tuner
        blocked0 = self.client.stats["time_blocked"]
        with self.schedule.timed(self.t, self.client.stats):
            if self.env.algorithm == "preduce":
                self.on_engine.settle()
                self.preduce.step(entries)
            else:
                self._stage_step(entries)
        self.t += 1
        TIMELINE.end_step()
        self.last_step_blocked = self.client.stats["time_blocked"] - blocked0
        self.schedule.after_step(self.t, self.client.barrier)   # every worker, same step

    def _stage_step(self, entries):
        """ssgd, asgd, ssd, and localsgd's and diloco's warm-up: the stage of step t
        (sync/stage.py)."""
        p = self.schedule.plan(self.t)
        if not p.synchronous and p.stage is not Stage.LOCAL_STEPS and \
                self.on_engine.can_queue(entries, self.pending):
            self._check_steps_delay(entries)
            self.pending = self.on_engine.queue(entries, self.t, p.request_pull,
                                                self._wants_state(p), self.pending)
            self.counts[p.stage] += 1
            self.counts["pushes"] += 1
            self.counts["pulls"] += int(p.request_pull)
            self.counts["steps_on_engine"] += 1
            return
        self.on_engine.settle()         # this step runs here, after the queued ones
        if p.stage is Stage.LOCAL_STEPS:
            return self.periodic.step(entries, self.t, p.request_pull)
        if not p.synchronous:
            self._check_steps_delay(entries)
            self._fetch_state(entries)
        # A synchronous step waits for every server's reply, which comes once the server
        # has this push: the gradients' own buffers can be sent as they are. A steps-delay
        # step returns while the next backward rewrites them: its push is a copy, or coded
        # before ``push`` returns, or (compressed, not pulling) copied by ``push_later``.
        grads, reply = self._push(entries, copy=not p.synchronous, pull=p.request_pull,
                                  state=self._wants_state(p), later=not p.synchronous)
        self.counts[p.stage] += 1
        if p.synchronous:
            self._synchronous_step(entries, reply)
        else:
            self._steps_delay_step(entries, grads, reply)

    # ---- a synchronous step queued on MXNet's engine ----------------------------------
    def can_defer(self, entries):
        """ssgd and asgd steps of dense arrays can be engine operations (``step_deferred``);
        ssd's steps-delay step keeps state on this thread, and under a quorum a step is
        one contribution to a round: a whole step only (``can_defer_step``), never one
        key's call."""
        return (self.env.algorithm in ("ssgd", "asgd") and not self.quorum
                and self.deferred.can_queue(entries))

    def can_defer_step(self, entries):
        """A Trainer's whole ssgd step can be one engine operation too (``step_deferred``
        with ``timed``): ``Trainer.step`` then returns at once, as it does on ps-lite, and
        what the script does before its next forward (its data, its own Python work, a
        straggler's wait) overlaps the exchange. Not with relayed pulls (the outbox sends
        every reply from the servers). Under a quorum too: the step is sent to every
        server as the synchronous one is, and its reply is the same round's; the script
        only waits for it later. The timeline records its wait on the engine's lane
        (``deferred.ENGINE_LANE``). ssd's, localsgd's and diloco's warm-up steps are
        ssgd's, and queue alike, but for the ones the schedule must see on this thread
        (``Schedule.queues_warmup_step``: the last, the relay's trial, and rank 0's that
        an auto choice is timed on)."""
        if self.env.pull_relay == "chain" or self.client.relay_on or \
                not self.deferred.can_queue(entries):
            return False
        return self.env.algorithm == "ssgd" or self.schedule.queues_warmup_step(self.t)

    def step_deferred(self, entries, priority=0, timed=False):
        """A synchronous step queued on MXNet's engine, as ps-lite queues a pushpull: it
        returns at once; the push leaves when the gradients are computed, and the outputs
        (the gradients where ``outs`` is None) are pending until the I/O thread has written
        w_G(t) into them. So a script calling pushpull key by key has all keys in flight
        and waits once (``wait_to_read``, ``waitall``). A failure is raised at the next
        call of the machine (``settle``); the outputs then keep their old values.
        ``timed``: the entries are a whole step (a Trainer's), timed for the pipeline
        pieces as a synchronous step is."""
        if timed:
            TIMELINE.begin_step(self.t)
        self.deferred.queue(entries, self.t, priority, timed)
        if timed:
            TIMELINE.end_step()
        stage = self.schedule.stage_of(self.t).stage     # ssgd, asgd, or a warm-up's
        if stage is Stage.WARMUP:
            self.counts["warmup_on_engine"] += 1
            self.schedule.skip_timing()
        self.counts[stage] += 1
        self.counts["pushes"] += 1
        self.counts["pulls"] += 1
        self.t += 1

    def raise_deferred(self):
        """Raise the failure of a step queued on the engine (once)."""
        self.deferred.raise_error()

    def settle(self):
        """Wait for the steps queued on the engine and raise a failure among them."""
        self.deferred.settle()
        self.on_engine.settle()

    def _check_steps_delay(self, entries):
        if self.rule is None:
            raise RuntimeError("algorithm ssd needs the optimizer on the kvstore: create the "
                               "Trainer with update_on_kvstore left at its default (True)")
        if any(outs is None for _, _, outs in entries):
            raise RuntimeError("algorithm ssd needs pushpull with out= (the weights)")

    def _wants_state(self, p):
        """The exact glu state travels with the pulls that reset the local rule: every
        steps-delay pull, and the last warm-up step's (the first reset's; localsgd's and
        diloco's local optimizer continues from it)."""
        needs_state = (self.rule is not None and self.rule.needs_state) or \
            self.periodic is not None
        return needs_state and p.request_pull and \
            (not p.synchronous or self.t == self.schedule.warmup_steps - 1)

    def _dated(self, reply, step):
        """When the global weights of ``reply`` are from: this worker's step, or with a
        quorum the servers' update count (the rounds closed)."""
        return reply.version if self.quorum else step

    def _push(self, entries, *, copy, pull=False, state=False, later=False):
        """Spec step 2, shared by every stage and ``kv.push``: push g_i(t), each key's
        gradients summed over the worker's devices. Returns them and the pull's reply.
        ``later``: a compressed push that does not pull is coded off this thread: the reply
        is then ``push_later`` to call once the local update is queued (``_steps_delay_step``;
        an uncompressed one has little to code, and measured no faster so)."""
        later = later and not pull and self.client.codes_pushes
        t0 = now()
        grads = {key: device_sum(grad_list) for key, grad_list, _ in entries}
        one_device = {key for key, grad_list, _ in entries if len(grad_list) == 1}
        flats = hostcopy.read(list(grads.values()), copy=copy and not self.client.codes_pushes,
                              views=self.views, slots=[("g", key) if key in one_device else None
                                                       for key in grads])
        reply = functools.partial(self.client.push_later, self.t, list(zip(grads, flats)),
                                  steps_ahead_bound(self.env.algorithm, self.schedule.delay_steps)) \
            if later else self.client.push(self.t, list(zip(grads, flats)), pull=pull, state=state)
        self.counts["pushes"] += 1
        if pull:
            self.counts["pulls"] += 1
        TIMELINE.span("push", t0, key="step", value=self.t)
        return grads, reply

    def _synchronous_step(self, entries, reply):
        """Warm-up, ssgd, asgd: wait for w_G(t) and write it into the parameters."""
        t0 = now()
        replies = reply.wait()
        for key, _, outs in entries:
            self.keys[key].remember(replies[key], self._dated(replies[key], self.t))
            if self.quorum and outs is not None:    # the final pull writes them
                self.keys[key].outs = outs
        pairs, slots = [], []
        for key, grad_list, outs in entries:
            for device, out in enumerate(outs if outs is not None else grad_list):
                pairs.append((out, replies[key].value))
                slots.append(("w" if outs is not None else "g", key, device))
        hostcopy.write(pairs, views=self.views, slots=slots)
        TIMELINE.span("pull", t0, key="waits_for", value=self.t)  # timeline_merge

    def _steps_delay_step(self, entries, grads, reply):
        """Spec steps 3-5 after the push (which carried the pull request of step 5)."""
        if self.pending is not None:
            self._reset_to_pulled()
        unseeded = []
        for key, _, outs in entries:
            self.keys[key].outs = outs
            if not self.keys[key].seeded:   # first steps-delay step: w_i = w_G(T_w - 1)
                unseeded.append(key)
        if unseeded:
            self._reset(unseeded)
        t0 = now()
        self.rule.update_many([key for key, _, _ in entries],
                              [outs[0] for _, _, outs in entries],
                              [grads[key] for key, _, _ in entries])
        TIMELINE.span("local_update", t0)
        for _, _, outs in entries:
            for out in outs[1:]:
                outs[0].copyto(out)
        if callable(reply):     # the push, coded once the update is done (not competing)
            reply = reply(after=[outs[0] for _, _, outs in entries])
        self.pending = reply           # None unless this step requested w_G(t)

    def _reset_to_pulled(self):
        """Spec step 3: w_i <- w_G(t - 1) from the pull requested at t - 1."""
        t0 = now()
        replies, self.pending = self.pending.wait(), None
        for key, reply in replies.items():
            self.keys[key].remember(reply, self._dated(reply, self.t - 1))
        self._reset(list(replies), write_weights=True)
        TIMELINE.span("reset", t0, key="waits_for", value=self.t - 1)

    def _reset(self, keys, write_weights=False, held=False):
        """Spec step 3 for ``keys``: re-seed the local rule from the global model and (with
        ``write_weights``) w_i <- w_G. Both happen in place in host memory, through views
        of the rule's state arrays and of the parameters taken after one engine
        synchronisation (``hostcopy.edit``): no array is made and the pulled bytes are
        copied once. The rule reads w_i ('corrected') before w_G overwrites it.
        ``held``: inside an engine operation that holds these arrays (delay_on_engine.py),
        which must not wait on the engine."""
        records = [self.keys[key] for key in keys]
        slots = [self.rule.state_arrays(key, r.outs[0]) for key, r in zip(keys, records)]
        edited = [s for key_slots in slots for s in key_slots]
        names = [("s", key, i) for key, key_slots in zip(keys, slots)
                 for i in range(len(key_slots))]
        if write_weights:
            edited += [r.outs[0] for r in records]
            names += [("w", key, 0) for key in keys]
        edit = (contextlib.nullcontext(hostcopy.held(edited, views=self.views, slots=names))
                if held else hostcopy.edit(edited, views=self.views, slots=names))
        with edit as views:
            views = iter(views)
            slot_views = [[next(views) for _ in key_slots] for key_slots in slots]
            for key, r, key_slots in zip(keys, records, slot_views):
                local = next(views) if write_weights else None
                between = r.pulled_at - r.prev_pulled_at
                self.rule.reseed(key, key_slots, r.value,
                                 prev_global_weight=r.prev_value if between > 0 else r.value,
                                 steps_between=max(between, 1), state=r.state, lr=r.lr,
                                 num_update=r.version, local_weight=local)
                if write_weights:
                    local[...] = r.value
                r.seeded = True
        if write_weights:
            hostcopy.write((out, r.value) for r in records for out in r.outs[1:])

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

    # ---- outside the step schedule ----------------------------------------------------
    def push(self, entries):
        """A push on its own (``kv.push``; ssgd/asgd only): no reply, no local update; a
        later ``pull`` waits until the step is applied."""
        self.settle()
        self._push(entries, copy=True)

    def pull(self, keys_outs, latest=False):
        """Weights as of the last step this worker pushed (or the latest, if asked)."""
        self.settle()
        replies = self.client.pull([key for key, _ in keys_outs], latest=latest).wait()
        hostcopy.write((out, replies[key].value) for key, outs in keys_outs for out in outs)
        return replies

    def finish(self):
        """End of training in the steps-delay stage: replace w_i by the global weights of
        the last step, so every worker ends with the same, global, model. preduce: the
        last group, of every worker, averages all their models. localsgd, diloco: a last
        sync of the local steps since the previous one."""
        self.settle()
        if self.env.algorithm == "preduce":
            return self.preduce.finish()
        if self.periodic is not None:
            return self.periodic.finish(self.t - 1)
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        if self.quorum:
            return self._final_pull()
        local = [(key, r.outs) for key, r in self.keys.items() if r.outs is not None]
        if local and any(r.seeded for r in self.keys.values()):
            self.pull(local)

    # ---- a checkpoint of this worker (the adapter's save/load_worker_state) ----------
    def state_dict(self):
        """This worker's state that the servers' checkpoint does not hold, as
        ({name: ndarray}, JSON-able meta); taken between two steps (checkpoint_state.py)."""
        return checkpoint_state.state_dict(self)

    def load_state_dict(self, arrays, meta):
        """Continue exactly where ``state_dict`` was taken (checkpoint_state.py)."""
        checkpoint_state.load_state_dict(self, arrays, meta)

    def _final_pull(self):
        """Quorum: tell every server this worker is done and take the final weights, once
        every worker is done and every push applied (every worker ends on one model)."""
        if not self.keys or self.final_done:
            return
        self.final_done = True
        gather = self.client.pull(list(self.keys), final=True)
        replies = gather.wait()
        try:
            self.quorum_auto = reply_fields(gather.meta.get("policy")).get("quorum_auto")
        except PolicyError as e:
            raise ServerError(f"server 0's final reply: {e}") from None
        hostcopy.write((out, replies[key].value) for key, r in self.keys.items()
                       if r.outs is not None for out in r.outs)

    def metrics(self):
        stats = dict(self.client.stats)
        stats.update(self.counts)
        stats["step"] = self.t
        stats["stage"] = self.schedule.stage_of(max(self.t - 1, 0)).stage
        stats["warmup_steps"] = self.schedule.warmup_steps
        stats["delay_steps"] = self.schedule.delay_steps
        stats["pull_relay"] = self.schedule.choices.get("pull_relay", {}).get("value")
        stats["choices"] = self.schedule.choices
        stats["last_step_blocked"] = self.last_step_blocked
        stats["left"] = list(self.client.left)
        # docs/spec/membership.md: who joined, from which step, when this worker heard
        times = getattr(getattr(self.client, "io", None), "join_times", {})
        stats["joined"] = [{"rank": r, "from_step": s, "time": times.get(r, 0.0)}
                           for r, s in sorted(dict(getattr(self.client, "joins", {})).items())]
        times = getattr(getattr(self.client, "io", None), "leave_times", {})
        stats["leaves"] = [{"rank": r, "from_step": s, "time": times.get(r, 0.0)}
                           for r, s in sorted(dict(getattr(self.client, "leaves", {})).items())]
        if self.quorum_auto is not None:
            stats["quorum_auto"] = self.quorum_auto
        return stats
