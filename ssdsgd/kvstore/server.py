"""A parameter server: the transport that carries out a synchronization policy's decisions.

The policy (``ssdsgd.sync``; the node wiring passes the factory that chooses it, so this
module names none) decides: it takes the events a message means -- a push, a pull, a
barrier's pause, a group's weights, a worker leaving, the leader's round decisions -- and
returns actions (apply an update, answer a reply, fill one). This module does everything
else: the socket loop, the peers and their checks, decoding pushes, rank 0's initial
values, the optimizer and checkpoint state (``weights.py``), and the replies, which lend
the weights' buffers and never wait on a peer (``replies.py``).

A ``Server`` takes no network action of its own: ``start`` hands it the scheduler's
topology and the socket to the scheduler, ``listen`` the ROUTER the workers connect to
(bound with the job's message limit), and ``handle`` takes one worker message at a time. Binding, registering and
the loop are the process's (``server_node.py``), so a test can feed a real server real
messages in process and read what it sends (tests/test_server_in_process.py).

A malformed or inconsistent message is answered with an ERROR naming the problem (and its
request id) and the server keeps serving. Only the job's workers are served, each on the
connection it registered (the scheduler says which connection id is which rank), and only
as that rank. What one worker can make the server hold is bounded by the model's size and
the staleness the policy allows; a worker that stops reading its replies fails the job,
saying so.
"""
import sys

import numpy as np
import zmq

from ..mxglue.optimizer_spec import OptimizerSpecError, build
from . import protocol as P, sealing
from .compression import Compression, CompressionError
from .backup import Backup
from .chain import CHAIN, ChainBackup, ChainOwner, tensorless
from .env import NodeEnv
from .replies import Fatal, Peer, Replies, RequestError
from .scheduler import JobAborted, Rejections
from .security import Guard
from .topology import relay_address
from .weights import Weights
from ..timeline import RECORDER as TIMELINE, now

PENDING_INITS = 4_096    # INIT messages one worker may have waiting for rank 0's values

class Server:
    """``make_policy(env, rank)``: this server's synchronization policy (a
    ``ssdsgd.sync.policy.ServerPolicy``), made once the scheduler has given the rank."""

    def __init__(self, env: NodeEnv, make_policy, log=None):
        self.env = env
        self.make_policy = make_policy
        self.log = log or self._print
        self.guard = Guard.from_env(env, lambda text: self.log(text))    # reads a key file
        self.weights = Weights(env.num_workers, reclaim=None)
        self.replies = Replies(None, self.weights, env, lambda text: self.log(text))
        self.weights.reclaim = self.replies.reclaim
        self.backup = Backup(env, self.replies, lambda text: self.log(text))
        self.replies.hold = self.backup.hold
        # cluster.server_replicas: 1 (chain.py): the sums this server receives as a
        # backup (it refuses them in a job without replicas), and, made by ``start``,
        # its connection to its own keys' backup
        self.chain_in = ChainBackup(self.backup.map, lambda text: self.log(text))
        self.chain_out = None
        self.actions = {"apply": self._apply, "answer": self.replies.answer,
                        "fill": self.replies.fill, "note": self.replies.note,
                        "say": lambda text: self.log(text)}
        self.scheduler = None     # the socket to the scheduler, from ``start``
        self.scheduler_lost = lambda: False   # the node's link: waiting for a restarted one
        self.policy = None        # made by ``start``, once the rank is known
        self.pending_inits = []
        self.rank = -1
        self.max_message_bytes = env.max_message_bytes   # the job's, from ``listen``
        self.rejected = Rejections(lambda text: self.log(text))
        self.relays = None        # the topology's pull relays (``start``)

    # ---- carrying out the policy's decisions ------------------------------------------
    def _decide(self, reply, event, *args, **kwargs):
        """Run a policy event and carry out its actions; a refusal is the request's error
        (and ``reply``, if any, will never be answered)."""
        try:
            actions = event(*args, **kwargs)
        except self.policy.Error as e:
            if reply is not None:
                self.replies.release(reply)
            raise RequestError(str(e)) from None
        self._carry_out(actions)

    def _apply(self, grads, pushes=0):
        """A policy's update. With chain replication the keys this server backs up (or
        took over) and those it owns are two updates: the first on the owner's sums and
        clock, the second as always. A push's step completes one kind only, but a
        departure or a removal completes every key's step at once."""
        theirs = [g for g in grads if g[0] in self.backup.keys] if self.chain_out else []
        mine = [g for g in grads if g[0] not in self.backup.keys] if theirs else grads
        if theirs:      # the pushes' count (the lr clock of a quorum's rounds) once
            self._apply_backed_up(self.chain_in.use_sums(theirs, self.weights),
                                  0 if mine else pushes)
        if mine or not theirs:
            self.weights.apply(mine, pushes)
        self.backup.applied(grads, self.weights)

    def _apply_backed_up(self, grads, pushes):
        """An update of keys this server backs up (or took over): the owner's sum where
        it came, and the owner's clock. The lr schedule reads the optimizer's update
        count, the largest of the keys it updated: on the owner, its own keys' (which
        move in step), here also this server's own keys' (ahead, or behind, of the
        owner's sums). So the update runs with its keys' own count, as on their owner,
        and leaves this server's clock as it was (or, after the takeover, the larger)."""
        opt = self.weights.optimizer
        if opt is None:
            self.weights.apply(grads, pushes)
            return
        saved = opt.num_update
        counts = opt._index_update_count      # noqa: SLF001 - MXNet's per-key counts
        opt.num_update = max(counts.get(key, 0) for key, _, _ in grads)
        try:
            self.weights.apply(grads, pushes)
        finally:
            opt.num_update = max(saved, opt.num_update) if self.backup.owner else saved

    def _pushed(self, rank, key, step):
        """Has the policy worker ``rank``'s push of ``key`` at ``step`` (applied, or
        waiting for the others')? A takeover's request sent again is skipped if so."""
        shard = self.weights.shards.get(key)
        if shard is None or key not in self.backup.keys:
            return False
        return step < shard.version or self.policy.has_push(rank, key, step)

    def _lr_of(self, shard):
        """The lr a reply of ``shard`` carries: its owner's, whose clock is its keys'
        update count (``_apply_backed_up``)."""
        opt = self.weights.optimizer
        if opt is None or opt.lr_scheduler is None or shard.key not in self.backup.keys:
            return self.weights.learning_rate()
        return float(opt.lr_scheduler(opt._index_update_count.get(shard.key, 0)))   # noqa: SLF001

    def _sums_out(self, shards):
        """An update's sums (Weights.on_sum) of the keys this server owns go to their
        backup while it lives (chain.py), before any reply carries the update."""
        if not self.backup.map.copying:
            return
        updater = self.weights.updater
        items = [(sh.key, sh.version, sh.offset, sh.count, sh.dtype,
                  np.array(sh.weight_view() if updater is None else sh.grad_view()))
                 for sh in shards if sh.key not in self.backup.keys]
        self.chain_out.send(items)

    def _carry_out(self, actions):
        for kind, *what in actions:
            self.actions[kind](*what)

    def _new_reply(self, ident, msg, shards, with_state):
        relay = bool(msg.flags & P.Flag.RELAY)
        if relay and relay_address(self.relays, msg.sender) is None:   # a chain would break
            raise RequestError(f"worker {msg.sender} asked for a relayed reply, but it has "
                               "no pull relay (the table of relays is the job's start's)")
        reply = self.replies.new(ident, msg.req, shards, with_state, relay=relay)
        self.backup.copied(msg, reply)    # a copy's reply is held (backup.py)
        return reply

    def _reject(self, ident, req, text):
        peer = self.replies.peers.get(ident)
        self.rejected(text, peer and f"worker {peer.rank}")
        self.replies.send(ident, P.Message(P.Kind.ERROR, sender=self.rank, req=req,
                                           meta={"error": text}))

    def _only_rank0(self, msg, what):
        if msg.sender != 0:
            raise RequestError(f"only worker 0 may send {what} (this is worker {msg.sender})")

    def _between_steps(self, what):
        """Changing the optimizer while a step is half aggregated would apply two
        optimizers within one step."""
        busy = self.policy.busy()
        if busy is not None:
            raise RequestError(f"{what} while step {busy[1]} of key {busy[0]} is being "
                               "aggregated; set it between steps")

    def _distinct_keys(self, msg, what):
        if len(np.unique(msg.records["key"])) != len(msg.records):
            raise RequestError(f"{what} names a key twice")

    # ---- handlers ------------------------------------------------------------------
    def on_init(self, ident, msg):
        """Each key is declared once, by worker 0's values (the model it declares); the
        other workers' INITs wait for them, holding no tensors."""
        new = {}
        for rec, arrays in zip(P.rows(msg.records), msg.tensors):
            key = int(rec["key"])
            if key in self.weights.shards or key in new or not arrays:
                continue
            self._only_rank0(msg, f"the initial values of key {key}")
            if len(arrays) != 1:
                raise RequestError(f"key {key}: INIT carries one tensor per key")
            new[key] = (int(rec["offset"]), arrays[0])
        peer = self.replies.peers[ident]
        if peer.inits >= PENDING_INITS:
            raise RequestError(f"worker {peer.rank} has {peer.inits} INITs waiting already")
        for key, (offset, values) in new.items():
            self.weights.declare(key, offset, values)
            self.policy.declare(key)
        # Waiting INITs keep their key table only, never the tensors of the message.
        self.pending_inits.append((ident, P.Message(P.Kind.INIT, sender=msg.sender,
                                                    req=msg.req, records=msg.records,
                                                    flags=msg.flags)))
        peer.inits += 1
        still = []
        for ident_i, msg_i in self.pending_inits:
            if not all(int(r["key"]) in self.weights.shards for r in msg_i.records):
                still.append((ident_i, msg_i))
                continue
            self.replies.peers[ident_i].inits -= 1
            try:
                shards = [self.weights.shard_for(rec, with_values=False)
                          for rec in P.rows(msg_i.records)]
                self.replies.answer(self._new_reply(ident_i, msg_i, shards, False), None)
            except RequestError as e:     # that worker's request, not this one's
                self._reject(ident_i, msg_i.req, str(e))
        self.pending_inits = still

    def on_command(self, ident, msg):
        """COMMAND: the job's optimizer, compression or optimizer state."""
        self.COMMANDS[msg.meta["command"]](self, ident, msg)

    def on_set_optimizer(self, ident, msg):
        self._only_rank0(msg, "the optimizer")
        self._between_steps("setting the optimizer")
        try:
            optimizer = build(msg.meta["optimizer"])
        except OptimizerSpecError as e:
            raise RequestError(f"COMMAND optimizer: {e}") from None
        self.weights.use_optimizer(optimizer, self.policy.global_batches)
        self.replies.empty(ident, msg.req, P.Kind.ACK)

    def on_set_compression(self, ident, msg):
        """Every worker sends the job's compression; they must agree (as they do when the
        same script calls kv.set_gradient_compression on each)."""
        try:
            spec = Compression.from_params(msg.meta["compression"])
        except CompressionError as e:
            raise RequestError(f"COMMAND compression: {e}") from None
        if spec is None:
            raise RequestError("COMMAND compression without a compression")
        current = self.weights.compression
        if current is not None and spec != current:
            raise RequestError(f"worker {msg.sender} sets compression {spec.params()}, but the "
                               f"job compresses with {current.params()}")
        self.weights.compression = spec
        self.replies.empty(ident, msg.req, P.Kind.ACK)

    def on_push(self, ident, msg):
        """Every record is checked and decoded before the policy sees the push. A push's
        copy without tensors (chain.py) gives the policy placeholders: the owner's sum
        is the step's."""
        self._distinct_keys(msg, "a push")
        shards, items = [], []
        chained = self.chain_out is not None and tensorless(msg)
        for rec, arrays in zip(P.rows(msg.records), msg.tensors):
            if chained:
                shard = self.weights.shard_for(rec, with_values=False)
                shards.append(shard)
                items.append((shard.key, int(rec["step"]), CHAIN))
                continue
            shard = self.weights.shard_for(rec, with_values=not rec["encoding"])
            if len(arrays) != 1:
                raise RequestError(f"key {shard.key}: a push carries one gradient per key")
            shards.append(shard)
            items.append((shard.key, int(rec["step"]), self.weights.gradient(rec, arrays, shard)))
        reply = None
        if msg.flags & P.Flag.PULL:
            reply = self._new_reply(ident, msg, shards, bool(msg.flags & P.Flag.STATE))
        else:
            self.backup.copied(msg, None)
        self._decide(reply, self.policy.request, "push", msg.sender, items, reply,
                     msg.meta.get("policy", {}))

    def on_pull(self, ident, msg):
        shards = [self.weights.shard_for(rec, with_values=False) for rec in P.rows(msg.records)]
        items = [(shard.key, int(rec["step"])) for rec, shard in zip(P.rows(msg.records), shards)]
        reply = self._new_reply(ident, msg, shards, bool(msg.flags & P.Flag.STATE))
        self._decide(reply, self.policy.request, "pull", msg.sender, items, reply,
                     msg.meta.get("policy", {}))

    def on_policy(self, ident, msg):
        """A policy's own request (a barrier's pause, a preduce group's weights): the
        keys it names, each with its weights or nothing; the policy reads the rest."""
        self._distinct_keys(msg, "a POLICY message")
        shards, items = [], []
        for rec, arrays in zip(P.rows(msg.records), msg.tensors):
            shard = self.weights.shard_for(rec, with_values=bool(arrays))
            if len(arrays) > 1 or rec["encoding"]:
                raise RequestError(f"key {shard.key}: a POLICY message carries at most "
                                   "the weights, once")
            shards.append(shard)
            items.append((shard.key, arrays[0] if arrays else None))
        reply = self._new_reply(ident, msg, shards, False)
        self._decide(reply, self.policy.on_event, msg.sender, msg.meta, items, reply)

    def on_get_state(self, ident, msg):
        """The state of the keys this server owns; a backup's copy: of those it backs up,
        held while their owner lives (backup.py)."""
        skip = self.backup.not_in_state(msg, self.weights.shards)
        records, arrays, meta = self.weights.state(skip=skip)
        reply = P.Message(P.Kind.REPLY, sender=self.rank, req=msg.req, records=records,
                          tensors=arrays, meta=meta)
        if not self.backup.hold_state(ident, msg, reply):
            self.replies.send(ident, reply)

    def on_set_state(self, ident, msg):
        self._only_rank0(msg, "the optimizer state")
        self._between_steps("setting the optimizer state")
        self.weights.load_states(msg.meta, msg.records, msg.tensors, self.policy.global_batches)
        self.replies.empty(ident, msg.req, P.Kind.ACK)

    COMMANDS = {"optimizer": on_set_optimizer, "compression": on_set_compression,
                "get_state": on_get_state, "set_state": on_set_state}
    HANDLERS = {P.Kind.INIT: on_init, P.Kind.PUSH: on_push, P.Kind.PULL: on_pull,
                P.Kind.COMMAND: on_command, P.Kind.POLICY: on_policy}

    # ---- from the scheduler ---------------------------------------------------------
    def on_membership(self, meta):
        """cluster.on_worker_failure: continue. Asked (no from_step): answer the first step
        this server has not received from the dead worker. Told (from_step E): the policy
        aggregates without it from E on."""
        rank = meta["removed"]
        if "from_step" not in meta:
            self._tell_scheduler(P.Kind.MEMBERSHIP, {
                "removed": rank, "next_step": self.policy.first_missing(rank)})
            return
        step = meta["from_step"]
        self.log(f"worker {rank} left the job; aggregating without it from step {step}")
        self._carry_out(self.policy.leave(rank, step))
        self.replies.gone(rank)
        self.replies.forget()

    def on_join(self, meta):
        """A worker joins (docs/spec/membership.md). Asked (``routing_id``): serve that
        connection as worker ``joined``, hold from the first step no push reached, and
        say which. Told (``from_step``): it pushes from that step on; every reply from
        now on carries the decision."""
        rank = meta["joined"]
        try:
            if "routing_id" in meta:
                self.replies.peers[bytes.fromhex(meta["routing_id"])] = Peer(rank)
                held = self.policy.hold(rank)
                self.log(f"worker {rank} asks to join; holding from step {held}")
                self._tell_scheduler(P.Kind.JOIN, {"joined": rank, "next_step": held},
                                     lost="answer to a join")
            elif "from_step" in meta:
                actions = self.policy.admit(rank, meta["from_step"])
                self.replies.announce(rank, meta["from_step"], "joins")
                self.log(f"worker {rank} joined; aggregating it from step {meta['from_step']}")
                self._carry_out(actions)
        except self.policy.Error as e:
            raise Fatal(f"server {self.rank}: {e}") from None
        finally:
            self.replies.forget()

    def on_leave(self, meta):
        """A worker leaves (docs/spec/membership.md), as a join is decided. Asked (no
        ``from_step``): hold from the first step no push reached, and say which. Told:
        it pushes the steps before ``from_step`` only; every reply from now on says so."""
        rank = meta["leaving"]
        try:
            if "from_step" not in meta:
                held = self.policy.hold_departure(rank)
                self.log(f"worker {rank} asks to leave; holding from step {held}")
                self._tell_scheduler(P.Kind.LEAVE, {"leaving": rank, "next_step": held},
                                     lost="answer to a departure")
            else:
                actions = self.policy.depart(rank, meta["from_step"])
                self.replies.announce(rank, meta["from_step"], "leaves")
                self.log(f"worker {rank} leaves; aggregating without it from step "
                         f"{meta['from_step']}")
                self._carry_out(actions)
                self.replies.gone(rank)
        except self.policy.Error as e:
            raise Fatal(f"server {self.rank}: {e}") from None
        finally:
            self.replies.forget()

    def _tell_scheduler(self, kind, meta, lost=None):
        """Never waits. A message the job cannot lose (``lost``: what losing it would do)
        stops the job when the scheduler does not take it; the heartbeats tell the rest."""
        try:
            self.scheduler.send_multipart(sealing.of(self.scheduler).seal(P.control(kind, meta)),
                                          flags=zmq.NOBLOCK)
        except zmq.Again:
            if lost:
                raise Fatal(f"the scheduler does not take server {self.rank}'s {lost}") from None

    def _send_decisions(self):
        """The leader's decisions of this message go to the other servers (via the
        scheduler); a decision lost would stall them, so a full queue stops the job.
        While the scheduler is lost they are only kept (the policy numbers and keeps
        them), and all kept ones go again once a restarted scheduler took this server
        back (``rejoined``)."""
        for payload in self.policy.to_servers():
            if not self.scheduler_lost():
                self._tell_scheduler(P.Kind.POLICY, payload, lost="policy messages")

    def rejoined(self):
        """A restarted scheduler has every node back (cluster.scheduler_restarts): the
        decisions it or its predecessor may not have passed on go again; the other
        servers skip those they have."""
        again = self.policy.sent_again()
        for payload in again:
            self._tell_scheduler(P.Kind.POLICY, payload, lost="policy messages")
        if again:
            self._print(f"sent its kept round decisions again after the scheduler restart "
                        f"({len(again)} message(s); the other servers skip those they have)")

    def _follow(self, payload):
        try:
            actions = self.policy.from_servers(payload)
        except self.policy.Error as e:
            raise Fatal(f"server {self.rank}: {e}") from None
        self._carry_out(actions)
        self.replies.forget()

    # ---- loop ----------------------------------------------------------------------
    def handle(self, frames):
        """One message. Nothing in it can stop the server: a bad one gets an ERROR with
        its request id (the worker fails, naming it); only Fatal ends the loop."""
        ident, req, kind, t0 = frames[0].bytes, 0, "a message", now()
        try:
            frames = sealing.of(self.replies.sock).open(frames)
        except sealing.SealError as e:      # only the job's processes pass the handshake
            peer = self.replies.peers.get(ident)
            if peer is None:      # a connection of the job that is no worker of it
                self.rejected(f"a message that does not open: {e}")
                return
            raise Fatal(f"server {self.rank}: a message on worker {peer.rank}'s connection "
                        f"does not open ({e}); stopping the job") from None
        try:
            msg = P.decode(frames[1:], max_bytes=self.max_message_bytes)
            req, kind = msg.req, msg.kind.name
            peer = self.replies.peers.get(ident)
            if msg.kind == P.Kind.SUM:
                P.check_meta(msg.kind, msg.meta)
                self._on_sum(ident, frames[1], msg, peer)
                return
            handler = self.HANDLERS.get(msg.kind)
            if handler is None:
                raise RequestError(f"a server does not handle {msg.kind.name}")
            P.check_meta(msg.kind, msg.meta)
            self.backup.check(msg)
            if peer is None:
                raise RequestError("this connection is not one of the job's workers")
            if msg.sender != peer.rank:
                raise RequestError(f"worker {peer.rank}'s connection sent a message as "
                                   f"worker {msg.sender}")
            wrong = self.guard.wrong_claim(frames[1], "worker", peer.rank)
            if wrong:       # its key is another worker's (security.py)
                raise RequestError(wrong)
            if self.chain_out is not None:
                if self.chain_in.queue(ident, msg, peer, self.weights, self.backup.owner,
                                       self._pushed):
                    return       # behind its worker's copies that wait for sums
                self.chain_in.took(peer.rank, msg)
            if self.backup.overtook(ident, msg, self.weights.shards, self.pending_inits):
                return
            handler(self, ident, msg)
            self._take_early_copies()
            if self.chain_out is not None:
                self._take_chain_copies()
            self._send_decisions()
        except (P.ProtocolError, RequestError) as e:
            self._reject(ident, getattr(e, "req", 0) or req, str(e))
        except JobAborted:
            raise
        except Exception as e:    # noqa: BLE001 - a bug must not take the node down
            self.log(f"internal error on {kind}: {e!r}")
            self._reject(ident, req, f"internal error on {kind}: {e!r}")
        finally:
            self.replies.forget()
            TIMELINE.span(kind, t0)     # the timeline: PUSH, PULL, ...

    def _on_sum(self, ident, header, msg, peer):
        """SUM (chain.py): the owner's sums of an update of the keys this server backs
        up, checked, kept and acknowledged; the copies that waited for them are taken."""
        bound = (self.policy.steps_ahead + 2) * max(self.weights.model_bytes,
                                                    self.max_message_bytes or 0)
        items = self.chain_in.check_sum(ident, msg, header, self.guard, self.weights,
                                        self.rank, peer, bound)
        if not items:      # its owner had not heard of a death yet: nothing to hold
            return
        self.chain_in.keep(ident, items)
        self.replies.send(ident, P.Message(P.Kind.ACK, sender=self.rank, req=msg.req))
        self._take_chain_copies()
        self._send_decisions()

    def _take_chain_copies(self):
        """Copies that waited for their owner's sums (or behind such a copy of their
        worker), in each worker's order; a refusal names each one's own request."""
        while True:
            nxt = self.chain_in.next_ready(self.weights)
            if nxt is None:
                return
            ident, msg = nxt
            self.replies.forget()
            self.chain_in.took(self.replies.peers[ident].rank, msg)
            try:
                if not self.backup.overtook(ident, msg, self.weights.shards,
                                            self.pending_inits):
                    self.HANDLERS[msg.kind](self, ident, msg)
                    self._take_early_copies()
            except (P.ProtocolError, RequestError) as e:
                self._reject(ident, getattr(e, "req", 0) or msg.req, str(e))

    def _take_early_copies(self):
        """Copies that came before worker 0's INIT (``Backup.overtook``), once it came; a
        refusal names each one's own request."""
        for ident, msg in self.backup.caught_up(self.weights.shards):
            try:
                self.HANDLERS[msg.kind](self, ident, msg)
            except (P.ProtocolError, RequestError) as e:
                self._reject(ident, getattr(e, "req", 0) or msg.req, str(e))

    def on_scheduler(self, msg):
        """A message from the scheduler (the node's loop acts on SHUTDOWN itself)."""
        if msg.kind == P.Kind.MEMBERSHIP:
            self.on_membership(msg.meta)
        elif msg.kind == P.Kind.JOIN:
            self.on_join(msg.meta)
        elif msg.kind == P.Kind.LEAVE:
            self.on_leave(msg.meta)
        elif msg.kind == P.Kind.PROMOTE:
            self.backup.promote(msg.meta, self.rank)
            if self.chain_out is not None:     # no replica is left: nothing waits for one
                for reply in self.chain_out.lost():
                    self.replies.dispatch(reply)
                self._take_chain_copies()
                self.replies.forget()
        elif msg.kind == P.Kind.POLICY:
            self._follow(msg.meta)

    def start(self, topo, scheduler):
        """Serve the job of the scheduler's topology ``topo``: this server's rank, its
        workers' connection ids, and so its policy. ``scheduler``: the socket to the
        scheduler (a quorum leader's decisions, a removed worker's last step)."""
        self.rank = self.replies.rank = self.weights.rank = topo["rank"]
        self.scheduler = scheduler
        self.replies.peers = {bytes.fromhex(h): Peer(r)
                              for r, h in enumerate(topo.get("workers", []))}
        self.relays = topo.get("relays")
        self.policy = self.make_policy(self.env, self.rank)
        self.replies.steps_ahead = self.policy.steps_ahead
        backup = self.backup.map.backup(self.rank)
        if backup is not None:         # chain replication (chain.py)
            self.chain_out = ChainOwner(self.rank, backup, lambda text: self.log(text))
            self.chain_out.is_owned = lambda key: key not in self.backup.keys
            self.replies.gate = self.chain_out.must_wait
            self.replies.lr_of = self._lr_of
            self.weights.on_sum = self._sums_out

    def connect_backup(self, ctx, servers):
        """The scheduler's LISTEN with every server's address: connect to this server's
        keys' backup (chain replication), once."""
        if self.chain_out is not None and self.chain_out.sock is None and \
                self.chain_out.open:
            self.chain_out.connect(ctx, self.guard, servers[self.chain_out.backup],
                                   self.max_message_bytes)

    def from_backup(self):
        """The backup's acknowledgements: the replies that waited for them go."""
        try:
            for reply in self.chain_out.receive():
                self.replies.dispatch(reply)
        finally:
            self.replies.forget()

    def listen(self, sock, max_message_bytes):
        """``sock``: the ROUTER the workers connect to, bound with the job's message
        limit ``max_message_bytes`` (startup.py); replies leave on it, never waiting."""
        self.replies.sock, self.max_message_bytes = sock, max_message_bytes

    def _print(self, text):
        rank = f" {self.rank}" if self.rank >= 0 else ""
        print(f"ssdsgd server{rank}: {text}", file=sys.stderr, flush=True)

    def tick(self):
        """Between messages: drop the buffers ZeroMQ has finished sending."""
        self.replies.prune_retired()
