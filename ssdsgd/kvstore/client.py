"""The worker's side of the wire: a KVWorker-like API (ps-lite's) over one I/O thread.

What the layers above see (``Gather``: the replies of one request, to be waited for):

    init(keys, values)                  place keys on the servers; rank 0's values win -> Gather
    push(step, grads, pull=, state=)    a step's gradients; with ``pull`` the reply is w_G
                                        as of this step (and the optimizer state) -> Gather
    push_later(step, grads, bound)      a push nobody waits for: copied, then coded and sent
                                        on the push queue's thread -> None
    pull(keys, latest=, state=)         w_G as of this worker's last push (or the latest) -> Gather
    set_optimizer(spec), get_state(), set_state(states, spec)    every server -> Gather
    set_compression(spec)               every later push compressed (and every server told)
    barrier(), close(error)
    ready(final=) -> (group number, members)    preduce: wait for the scheduler's group
    average(group, members, weights)    preduce: the members' average of weights -> Gather

The client numbers each key's pushes (the per-key step a server aggregates by, in
key_tables), splits every request over the servers by the key placement (slices of big
keys included; splitting), and ``Gather.wait`` puts the replies back together (requests):
nothing above builds a message. Every request takes one send path (``_request``):
split, numbered, encoded, checked against the message limit, its futures registered,
handed to the I/O thread (io_thread), which owns the sockets; a push nobody waits for
(``push_later``) is coded and sent on the push queue's thread (push_queue), and every
request waits for the pushes queued before it. With compression
(docs/spec/compression.md) it keeps this worker's residual per key and sends each push's
slices in their compressed form.
"""
import functools

from . import protocol as P
from . import fragments as F
from .io_thread import IOThread
from .key_tables import KeyTable
from .piece_tuner import PieceTuner
from .push_queue import PushCoder, PushOutbox, PushQueue  # noqa: F401 - PushOutbox: API
from .relay import asks_relay
from .replica_map import ReplicaMap, Routes, backup_copies
from .requests import ENDED, Gather, KeyReply, Requests, ServerError  # noqa: F401 - API
from .scheduler import JobAborted
from .splitting import split
from .startup import WorkerStart
from .topology import relay_address
from .. import fields
from .. import timeline
from ..settings import count_or_auto, quorum_rounds


class WorkerClient:
    """``model``: the bytes of each of the model's keys, if this worker knows its model
    when it joins (else ``start.declare_model`` once it does): worker 0 states the
    largest message it will send a server (``protocol.message_bound``), which becomes the
    job's message limit; the servers bind their ports with it (``startup.WorkerStart``,
    docs/reliability.md). ``relay``: open a pull relay (default: if pull_relay is
    chain; with auto, the stage machine sets ``relay_on`` once the job chose)."""

    # A reply (``Gather.then``) can complete a callback on the I/O thread, and ``push``
    # may be called from an engine thread: steps can be queued on MXNet's engine.
    gathers_then = True

    def __init__(self, env, model=None, relay=None):
        self.env = env
        self.stats = {"bytes_sent": 0, "bytes_received": 0, "messages_sent": 0,
                      "messages_received": 0, "time_blocked": 0.0,
                      "replies_relayed_in": 0, "replies_relayed_out": 0,
                      "digest_s": 0.0}      # checking relayed pieces (piece_digests.py)
        self.requests = Requests(self.stats)
        self.outbox = PushOutbox(self.requests.lock, functools.partial(
            self._request, P.Kind.PUSH, flags=P.Flag.PULL, chunk_bytes=env.chunk_bytes,
            flush=False))
        self.pushes = PushQueue(self.stats)   # push_later's, coded on a thread of their own
        self.io = IOThread(env, self.requests, self.stats, self.outbox.flush, self._abandon)
        self.topology = self.io.start(env.pull_relay == "chain" if relay is None else relay)
        self.left = self.io.left  # workers that left the job (cluster.on_worker_failure)
        self.joins = self.io.joins   # rank -> the step it joined from (membership.md)
        self.leaves = self.io.leaves  # rank -> the first step it does not push
        self.rank = self.topology["rank"]
        timeline.start_node(env, "worker", self.rank)   # if SSDSGD_TIMELINE (timeline.py)
        self.num_workers = self.topology["num_workers"]
        self.num_servers = self.topology["num_servers"]
        self.start = WorkerStart(env, self.rank, self.io, self.requests)
        # cluster.server_replicas: 1 places every key whole (a server's backup holds
        # another server's keys, one slice of each), and copies requests to backups
        self.replicas = ReplicaMap(self.num_servers, env.server_replicas)
        self.io.replicas = self.replicas
        self.keys = KeyTable(self.num_servers, (1 << 62) if self.replicas.replicas
                             else env.bigarray_bound)
        self.placement = self.keys.placement
        self.routes = Routes(self.placement, self.replicas)
        # With a quorum (docs/spec/quorum.md) a push is one contribution to a round: one
        # message per server, to every server, so every server counts the same pushes.
        # (The settings refuse a quorum with asgd and with relayed pulls.)
        self.quorum = quorum_rounds(env.quorum, self.num_workers)
        # a worker asks for relayed replies only if it relays itself: the table of relays
        # comes with the start's topology, so a joiner is in no chain (membership.md)
        self.relays = self.topology.get("relays")     # the job's, or None: it relays none
        self.relaying = relay_address(self.relays, self.rank) is not None
        self.relay_on = env.pull_relay == "chain"   # auto: the stage machine's choice
        self.relay_trial = False     # this step is the relay's trial's (the stage machine)
        self.coder = PushCoder()  # the job's compression and this worker's residuals
        # SSDSGD_PIPELINE_PIECES: fixed, or timed on this worker's pulling pushes (auto)
        self.pieces = PieceTuner(count_or_auto(env.pipeline_pieces))
        self.stats["pipeline_pieces"] = self.pieces.value
        if model is not None:
            self.start.declare_model(model)

    # ---- the API -----------------------------------------------------------------------
    def init(self, keys, values=None):
        """keys: (key, size, dtype) in the same order on every worker (it decides the
        placement); values: their flat initial values (only rank 0's are taken) or None.
        The reply is the values every worker starts from."""
        for key, size, dtype in keys:
            self.keys.add(key, size, dtype)
        values = [None] * len(keys) if values is None else values
        return self.exchange(P.Kind.INIT, [(key, 0, value, dtype) for (key, _, dtype), value
                                           in zip(keys, values)])

    def await_join(self):
        """A joiner (SSDSGD_JOINING): the step the servers admit it from, once the
        scheduler says (bounded: JobAborted if it does not in time)."""
        timeout = max(60.0, 4 * self.env.heartbeat_timeout)
        if not self.io.joined_at.wait(timeout):
            raise self.requests.failure or JobAborted(
                f"worker {self.rank}: no decision on its join within {timeout:.0f} s")
        return self.io.join_step

    def join_keys(self, keys, step, state=False):
        """A joiner's ``init``: the keys (as ``init`` takes them) and the weights as of
        ``step`` - 1, which its first step s = ``step`` computes its gradient at
        (docs/spec/membership.md rule 5); a late INIT would get the current weights
        instead. Its pushes are numbered from ``step`` on."""
        for key, size, dtype in keys:
            self.keys.add(key, size, dtype)
            self.keys[key].pushes = step
        return self.pull([key for key, _, _ in keys], state=state)

    def push(self, step, grads, *, pull=False, state=False, latest=False):
        """grads: (key, flat gradient) of one step of this worker. With ``pull`` the reply
        (a Gather; else None) holds the weights once the step is applied (with ``latest``,
        a quorum's newest closed round), with ``state`` also the optimizer state, lr and
        update count. With compression each key is coded with this worker's residual (so
        the arrays may be reused as soon as this returns). Sent after the queued pushes."""
        self.pushes.flush()
        flags = (P.Flag.PULL if pull else P.Flag.NONE) | (P.Flag.STATE if state else P.Flag.NONE)
        if pull and not self.quorum:        # a timed step (a quorum's pushes are not cut)
            self._mark_step()
        entries, keys = self._numbered(grads)
        gather = self._send_push(step, entries, flags, latest)
        self._count(keys)       # once sent: a refused push takes no number
        return gather

    def push_later(self, step, grads, bound, after=()):
        """``push(step, grads)`` for a push nobody waits for: copied and numbered now, coded
        and queued for the I/O thread on the push queue's thread (push_queue.py), if it is
        compressed once ``after`` (NDArrays: the caller's update) is written. Blocks while
        ``bound`` pushes wait there. A failure there is raised by the next call that sends."""
        entries, keys = self._numbered(self.coder.copy(grads))
        self._count(keys)
        self.pushes.put(lambda: self._send_push(step, entries, P.Flag.NONE, False, True),
                        bound, after if self.codes_pushes else ())

    def _send_push(self, step, entries, flags, latest, spare=False):
        """Code a push's numbered entries and send them; the Gather if it pulls."""
        pull = bool(flags & P.Flag.PULL)
        entries = self.coder.code(entries, self.placement, spare)
        return self.exchange(P.Kind.PUSH, entries, step=step,
                             flags=flags, reply=pull, every=self.quorum,
                             meta={"policy": {"latest": True}} if pull and latest else None)

    def push_then(self, grads, callback):
        """``push(step, grads, pull=True).then(callback)`` for callers that queue key by key
        (``kv.pushpull`` outside a Trainer step): the entries wait in an outbox that the I/O
        thread empties whenever it wakes, into one message per server (chunked), so the
        keys queued while it was busy travel together and the servers answer them
        together; ps-lite sends a message per key, which costs far more in Python."""
        self.pushes.flush()
        with self.requests.lock:      # numbered and queued in one order, whichever thread
            self.requests.check_open()
            entries, keys = self._numbered(grads)
            entries = self.coder.code(entries, self.placement)
            self._count(keys)
            if self.outbox.add(entries, callback):
                self.io.wake()

    @property
    def codes_pushes(self):
        """Are pushes compressed? Then ``push`` has read the gradients when it returns,
        and the caller may hand it views of buffers it rewrites later (no copy)."""
        return self.coder.spec is not None

    def _numbered(self, grads):
        """A push's entries, each key's with its next push number, and the keys."""
        keys = [self.keys[key] for key, _ in grads]
        return [(key, k.pushes, flat, flat.dtype) for (key, flat), k in zip(grads, keys)], keys

    def _count(self, keys):
        """A push of ``keys`` is made: their next numbers, and the stall watch's count."""
        for k in keys:
            k.pushes += 1
        self.io.progress += 1

    def mark_step(self):
        """A timed step's push leaves now (piece_tuner.py)."""
        self._mark_step()

    def _mark_step(self):
        # a step of the relay's trial is timed by that trial, not by the pieces' tuner
        self.pieces.mark(timed=not self.relay_trial)
        self.stats["pipeline_pieces"] = self.pieces.value

    def pull(self, keys, *, latest=False, state=False, final=False):
        """The weights of ``keys`` as of this worker's last push of each (or the latest).
        ``final`` (quorum): this worker is done; the reply waits for every worker's end
        and holds the final weights (sent to every server: each must hear it)."""
        if not (latest or final or self.quorum):       # kv.pull after kv.push: a timed step
            self._mark_step()
        entries = []
        for key in keys:
            k = self.keys[key]
            entries.append((key, -1 if latest else k.pushes - 1, None, k.dtype))
        return self.exchange(P.Kind.PULL, entries, flags=P.Flag.STATE if state else P.Flag.NONE,
                             every=final, meta={"policy": {"final": True}} if final else None)

    def set_optimizer(self, spec):
        """Every server rebuilds the optimizer from its description (optimizer_spec)."""
        return self._every_server(P.Kind.COMMAND, meta={"command": "optimizer",
                                                        "optimizer": spec})

    def set_compression(self, spec):
        """Compress every later push with ``spec`` (a Compression) and tell every server
        (each worker does; the servers check that they agree). Once only: MXNet cannot
        change or unset it either."""
        if self.coder.set(spec):
            self._every_server(P.Kind.COMMAND, meta={"command": "compression",
                                                     "compression": spec.params()}).wait()
            self.coder.start(spec)

    def residuals(self):
        """This worker's compression residuals {key: flat float32} ({} without
        compression), after the queued pushes: part of a worker's checkpoint."""
        self.pushes.flush()
        return self.coder.state()

    def load_residuals(self, residuals):
        self.pushes.flush()
        self.coder.load(residuals)

    def get_state(self):
        """Every key's weights and optimizer state (``Gather.meta['optimizer']``: the
        servers' optimizer description)."""
        return self._every_server(P.Kind.COMMAND, meta={"command": "get_state"})

    def set_state(self, states, spec):
        """states: key -> flat optimizer state arrays (none for a key without state); every
        server takes its slices and the optimizer ``spec``."""
        entries = []
        for key in self.placement.slices:
            arrays = states.get(key, [])
            entries.append((key, 0, arrays, arrays[0].dtype if arrays else self.keys[key].dtype))
        return self._request(P.Kind.COMMAND, entries, every=True, whole_table=True,
                             meta={"command": "set_state", "optimizer": spec},
                             routes=self.routes.and_backups())

    def barrier(self, value=0, agreement=None, step=None):
        """Wait until every worker has reached the barrier; returns the largest ``value``
        (an integer >= 0) any worker passed (so rank 0 can tell all a decision). An
        ``agreement`` name makes the scheduler keep the value: a worker that comes to
        it later (a joiner) hears it at once (kvstore/barriers.py). A ``step``: only the
        workers in the job at that step are waited for (a job whose workers join)."""
        self.pushes.flush()
        if self.requests.failure is not None:
            raise self.requests.failure
        if self.quorum:
            # the servers must not wait for this worker's pushes while it waits here for
            # the others (docs/spec/quorum.md, rule 2a): a slow one may need them to close
            # the round of its own push before it can reach the barrier
            self.exchange(P.Kind.POLICY, [], meta={"event": "pause"}, every=True).wait()
        self.start.declare_model(None)     # worker 0 never waits for the others unstated
        meta = {"group": "worker", "value": int(value)}
        if agreement is not None:
            meta["agreement"] = agreement
        if step is not None:
            meta["step"] = int(step)
        msg = self.io.call_scheduler(P.Kind.BARRIER, meta, P.Kind.BARRIER)
        return int((msg.meta or {}).get("value", 0))

    def record_policy_answers(self, record):
        """``record.received(meta)`` takes each POLICY answer of the scheduler as it
        arrives, and ``record.report()`` goes in a REJOIN (a restarted scheduler rebuilds
        the policy's state from the workers': preduce's groups)."""
        with self.requests.lock:
            self.io.policy_record = record

    def ready(self, final=False):
        """preduce: report this worker's local step done (``final``: its last) and wait
        for the group the scheduler forms with it: (group number, member ranks)."""
        self.pushes.flush()
        if self.requests.failure is not None:
            raise self.requests.failure
        self.start.declare_model(None)
        meta = self.io.call_scheduler(P.Kind.POLICY, {"event": "ready", "final": final},
                                      P.Kind.POLICY).meta
        if (meta.get("event") != "group" or not fields.int_in(0, fields.MAX_STEP)(
                meta.get("group")) or not fields.RANKS[0](meta.get("members"))):
            raise JobAborted(f"the scheduler answered a ready with {fields.short(meta)}, "
                             "not a group")
        return meta["group"], tuple(meta["members"])

    def average(self, group, members, weights):
        """preduce: weights: (key, flat weights); every member of ``group`` sends its own,
        and each server answers with the members' average of its slices."""
        entries = [(key, group, flat, flat.dtype) for key, flat in weights]
        for key, _ in weights:
            self.keys[key]
        self.io.progress += 1
        return self.exchange(P.Kind.POLICY, entries, step=group, meta={
            "event": "average", "group": group, "members": list(members)})

    def ask_chunk(self, epoch, plan, pause=False):
        """Dynamic data: ask the scheduler for the next chunk of ``epoch`` (``plan``:
        per_epoch, budget and start, kvstore/chunks.py); returns at once. ``take_chunk``
        waits for the answer: one request at a time, so a worker asks for the next chunk
        while it trains the current one. ``pause`` (worker 0): stop the job's dealing for
        a mid-epoch checkpoint."""
        if self.requests.failure is not None:
            raise self.requests.failure
        meta = dict(plan, epoch=epoch, **({"pause": True} if pause else {}))
        return self.io.ask_scheduler(P.Kind.CHUNK, meta, P.Kind.CHUNK)

    def take_chunk(self, fut, epoch, per_epoch):
        """The answer to ``ask_chunk(epoch, ...)``: (chunk, None), (None, "epoch" |
        "budget") when that epoch's (the job's) chunks are all handed out, or (the
        cursor, "pause"): a mid-epoch checkpoint first."""
        meta = self.requests.wait(fut).meta
        if (meta.get("epoch") != epoch or ("chunk" in meta) == ("over" in meta)
                or not 0 <= meta.get("chunk", 0) < per_epoch
                or ("at" in meta) != (meta.get("over") == "pause")):
            raise JobAborted(f"the scheduler answered a chunk request of epoch {epoch} with "
                             f"{fields.short(meta)}")
        if meta.get("over") == "pause":
            return meta["at"], "pause"
        return meta.get("chunk"), meta.get("over")

    def busy(self):
        """``with client.busy():`` the training thread does something other than steps
        (rank 0's validation): the stall watch does not count that time (liveness.py)."""
        return self.io.busy_while()

    def close(self, error=None):
        """Send the queued pushes, tell the scheduler this worker is done (or failed, with
        ``error``), flush what is queued, stop the thread. A queued push's failure no call
        has raised yet is the error the scheduler is told, then raised here."""
        unseen = self.pushes.close()
        if unseen is not None and error is None:
            error = f"{type(unseen).__name__}: {unseen}"
        if self.io.alive and self.requests.failure is None:
            try:
                self.start.declare_model(None)     # the servers bind, then shut down
                self.io.call_scheduler(P.Kind.FINISH, {"error": error} if error else None,
                                       P.Kind.ACK)
            except JobAborted:
                pass
        self.io.stop()
        timeline.RECORDER.flush()
        if unseen is not None:
            raise unseen

    def wait(self, fut):
        """The future's result; raises why if the I/O thread failed or ended."""
        return self.requests.wait(fut)

    @property
    def failure(self):
        """Why the I/O thread stopped (a JobAborted), or None while it serves."""
        return self.requests.failure

    # ---- requests to the servers: one send path ------------------------------------------
    def exchange(self, kind, entries, *, step=0, flags=0, meta=None, reply=True, every=False):
        """The one request every call above is made of (tests also use it to send what a
        correct worker never would): send each server the slices it owns of every key, one
        message per server, or, when a server's part exceeds ``SSDSGD_CHUNK_BYTES``,
        consecutive messages of about that size, so the server applies and answers the
        first keys while the rest are still arriving (both directions of its link busy, as
        ps-lite's per-key messages achieve, with far fewer messages).

        entries: (key, per-key step, tensors (None, one flat array or a list) or a
        ``Coded`` gradient, dtype); every key must be placed already. ``every``: exactly
        one message to every server, keys for it or not (a quorum's contributions and
        final pulls)."""
        if self.relaying and self.relay_on and reply and not every and asks_relay(kind, flags):
            flags |= P.Flag.RELAY
        return self._request(kind, entries, step=step, flags=flags, meta=meta, reply=reply,
                             every=every, chunk_bytes=None if every else self.env.chunk_bytes)

    def _every_server(self, kind, entries=(), meta=None):
        """One message to every server, keys or not (each must act on ``meta``), unchunked;
        the replies may hold any key this worker placed."""
        return self._request(kind, entries, meta=meta, every=True, whole_table=True)

    def _request(self, kind, entries, *, step=0, flags=0, meta=None, reply=True, every=False,
                 chunk_bytes=None, whole_table=False, flush=True, routes=None):
        """Split, number, encode, check the size of, and queue a request's messages; the
        Gather of their replies (None without ``reply``). Nothing is queued unless every
        message is within SSDSGD_MAX_MESSAGE_BYTES (else the server would drop it unread).
        Sent after the queued pushes (``flush``: False on the I/O thread, whose outbox
        was filled after them). ``routes``: another placement than the routes of now."""
        self.start.await_servers()
        if flush:
            self.pushes.flush()
        deaths = len(self.replicas.dead)
        messages = self._split(entries, chunk_bytes, every, routes)
        sizes, dtypes = self.keys.shapes(None if whole_table else entries)
        with self.requests.lock:
            self.requests.check_open()
            if len(self.replicas.dead) != deaths:   # a server died meanwhile (TAKEOVER)
                messages = self._split(entries, chunk_bytes, every, routes)
            encoded = [(server, msg, self._encoded(msg)) for server, msg in _messages(
                messages, kind, flags, step, meta)]
            copies = backup_copies(self.replicas, encoded)
            relayed = bool(flags & P.Flag.RELAY)
            futures = [self.requests.expect(
                msg.req, (server, F.reply_bound(msg.records), msg.records["key"].tolist())
                if relayed else None, server=server, copied=server in copies)
                for server, msg, _ in encoded] if reply else []
            for server, msg, frames in encoded:
                if server in copies:      # kept until its backup holds it (chain.py)
                    self.io.kept.keep(server, msg, frames)
                self.io.send(server, frames)
                if server in copies:
                    self.io.send(*copies[server].pop(0))
        return Gather(self.requests, futures, sizes, dtypes) if reply else None

    def _split(self, entries, chunk_bytes, every, routes=None):
        """Each server's messages (``splitting.split``) along the routes of now."""
        messages = split(routes or self.routes, entries, chunk_bytes, self.pieces.value)
        if every:
            for server in range(self.num_servers):
                if server not in self.replicas.dead:
                    messages.setdefault(server, [[[], [], 0]])
        return messages

    def _encoded(self, msg):
        """A message numbered (under the requests' lock), encoded and checked."""
        self.requests.number(msg, self.rank)
        frames = P.encode(msg)
        P.check_size(frames, self.start.max_message_bytes, self.start.limit)
        return frames

    def _abandon(self):
        """The I/O thread ended: fail what still waits for a reply (an engine operation
        waits on its future's callback, not on ``wait``'s poll of the thread)."""
        error = self.requests.failure or JobAborted(ENDED)
        self.requests.end(error)
        self.outbox.fail(error)


def _messages(split_messages, kind, flags, step, meta):
    """(server, Message) of a request split per server (``splitting.split``), in server
    order."""
    return [(server, P.Message(kind, flags=flags, step=step, records=P.make_records(recs),
                               tensors=tens, meta=meta))
            for server in sorted(split_messages) for recs, tens, _ in split_messages[server]]
