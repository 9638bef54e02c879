"""The worker's I/O thread: it owns every socket of the worker (ZeroMQ sockets belong to
one thread). SSD-SGD needs pushes and pulls in flight while the main thread computes, so
the main thread queues encoded messages here and waits on futures. The same thread keeps
the heartbeats going while the main thread computes, and turns a scheduler ABORT (a dead
peer) or a silent scheduler into an exception on every waiting future.

Each turn it sends at most SEND_PER_TURN queued messages and reads at most RECV_PER_TURN
from each socket, then serves the others: neither a sender that queues without pause nor
a peer that sends without pause can hold it from its heartbeats and replies."""
import contextlib
import os
import queue
import sys
import threading
import time

import zmq

from . import protocol as P, sealing
from . import fragments as F
from .relay import PullRelay, RelayFault
from .requests import await_reply, take_oldest
from .joins import JoinError, joins_of
from .chain import KeptRequests
from .chunk_record import ChunkRecord
from .scheduler import JobAborted, bind_router
from .scheduler_link import SchedulerLink
from .security import Guard
from ..timeline import RECORDER as TIMELINE

RECV_PER_TURN = 64
SEND_PER_TURN = 64
EXIT_AFTER_ABORT = 10.0   # s a launched worker's training thread has to end after an abort
TELL_LINGER_MS = 2000     # for the FINISH that tells the scheduler why this worker stops


class IOThread:
    """``on_turn()`` runs on this thread every turn before the queue is sent (the client
    queues push_then's outbox there); ``on_end()`` once it has ended."""

    def __init__(self, env, requests, stats, on_turn, on_end):
        self.env, self.requests, self.stats = env, requests, stats
        self.on_turn, self.on_end = on_turn, on_end
        self.ctx = zmq.Context.instance()
        self.topology = None
        # resolved once every server listens and this thread has connected to each
        # (the scheduler's LISTEN, startup.py): a worker's first message to a server waits
        self.listening = requests.expect_control(P.Kind.LISTEN)
        self._sockets = []        # a DEALER to each server, once they listen
        self._poller = zmq.Poller()
        self.left = []            # workers that left the job (cluster.on_worker_failure)
        # workers that joined the job (docs/spec/membership.md): rank -> the step it pushes
        # from, as every REPLY of a server that admitted it says; and this worker's own
        # step if it is the joiner (the scheduler's JOIN)
        self.joins = {}
        self.join_times = {}      # rank -> when this worker heard of it (the summary's)
        # workers that leave at a step every worker hears of in time (the same rule):
        # rank -> the first step it does not push, and when this worker heard of it
        self.leaves = {}
        self.leave_times = {}
        self.joined_at = threading.Event()
        self.join_step = None
        self.progress = 0         # pushes the training thread made (liveness.py)
        self._told_pushing = False    # has a heartbeat counted a push yet?
        self.busy = False         # it says it does something else (rank 0's validation)
        # a launched worker whose training thread is stuck (it cannot see the abort)
        # would hold its launcher for ever: the process exits this long after (None: never)
        self.exit_after_abort = None
        self.relay = None
        self.replicas = None      # the client's ReplicaMap (cluster.server_replicas)
        # cluster.server_replicas: the requests a dead server's backup may need again
        self.kept = KeptRequests()
        self._link = None
        self._commands = queue.SimpleQueue()
        # reply kind -> the scheduler requests awaiting it, oldest first: sent again to a restarted
        # scheduler (cluster.scheduler_restarts, reregister.py)
        self._asked = {}
        self.chunks = ChunkRecord()   # dynamic data: told to a restarted scheduler
        # the policy's record of the scheduler's POLICY answers (preduce's groups:
        # sync/groups.py GroupRecord), fed as each arrives and told to a restarted one
        self.policy_record = None
        self._stopping = False
        self._ready = threading.Event()
        addr = f"inproc://ssdsgd-wake-{id(self)}"
        self._wake_in = self.ctx.socket(zmq.PAIR)
        self._wake_in.bind(addr)
        self._wake_out = self.ctx.socket(zmq.PAIR)
        self._wake_out.connect(addr)
        self._thread = threading.Thread(target=self._run, name="ssdsgd-io", daemon=True)
        requests.alive = self._thread.is_alive

    def start(self, relay=False):
        """Register with the scheduler (``relay``: open a pull relay); returns the
        topology (raises why it failed)."""
        self._listen_relay = relay
        self._thread.start()
        self._ready.wait()
        if self.requests.failure is not None:
            raise self.requests.failure
        return self.topology

    def send(self, target, frames):
        """Queue ``frames`` for server ``target`` (or "scheduler")."""
        with self.requests.lock:
            self._commands.put((target, frames))
            self._wake()

    def _wake(self):
        """Wake the I/O thread (called with the lock held: the socket is not thread-safe).
        Never blocks: a full pipe means wake-ups are pending already, and blocking here
        while the I/O thread waits for the lock to hand over a reply deadlocked both."""
        try:
            self._wake_out.send(b"", flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    def wake(self):
        with self.requests.lock:
            self._wake()

    def ask_scheduler(self, kind, meta, reply_kind):
        """Send the scheduler ``kind``; the future of its ``reply_kind`` (one at a time of
        each reply kind, but CHUNK: dynamic data keeps ``CHUNKS_IN_FLIGHT`` requests in
        flight, answered in order). What waits for an answer is sent again to a
        restarted scheduler."""
        queued = kind == P.Kind.CHUNK
        with self.requests.lock:
            fut = self.requests.expect_control(reply_kind, queued=queued)
            frames = P.control(kind, meta)
            await_reply(self._asked, reply_kind, frames, queued)
            if kind == P.Kind.CHUNK:
                self.chunks.asked(meta)
            self._commands.put(("scheduler", frames))
            self._wake()
        return fut

    def call_scheduler(self, kind, meta, reply_kind):
        """Send the scheduler ``kind`` and wait for its ``reply_kind``."""
        fut = self.ask_scheduler(kind, meta, reply_kind)
        waited = time.perf_counter()
        try:
            return self.requests.wait(fut)
        finally:
            self.stats["time_blocked"] += time.perf_counter() - waited
            TIMELINE.span(kind.name.lower(), waited)     # a barrier, a finish, a group

    def stop(self):
        """End the thread once what is queued is sent (the client has said FINISH)."""
        self._stopping = True
        with self.requests.lock:
            try:
                self._wake_out.send(b"", flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self._thread.join(timeout=self.env.heartbeat_timeout + 5)
        self._wake_out.close(0)

    @contextlib.contextmanager
    def busy_while(self):
        """The training thread does something other than steps inside the block."""
        self.busy = True
        try:
            yield
        finally:
            self.busy = False

    @property
    def alive(self):
        return self._thread.is_alive()

    @property
    def backlog(self):
        """Messages queued and not yet sent."""
        return self._commands.qsize()

    def _run(self):
        try:
            link = self._connect()
        except Exception as e:   # registration failed: report it to the constructor
            self.requests.failure = e if isinstance(e, JobAborted) else JobAborted(str(e))
            self._wake_in.close(0)
            return
        finally:
            self._ready.set()
        told = False
        try:
            self._serve(link)
        except JobAborted as e:
            rank = self.topology["rank"] if self.topology else "?"
            print(f"ssdsgd worker {rank}: {e}", file=sys.stderr, flush=True)
            if isinstance(e, RelayFault):      # the scheduler ends the job, naming it
                link.send(P.Kind.FINISH, {"error": str(e)})
                told = True
            self.requests.fail(e)
            if self.exit_after_abort is not None:
                threading.Thread(target=_exit_later, args=(self.exit_after_abort, rank),
                                 name="ssdsgd-exit", daemon=True).start()
        except Exception as e:  # a bug here must not leave the main thread waiting
            self.requests.fail(JobAborted(f"the worker's I/O thread failed: {e!r}"))
        finally:
            for s in self._sockets:
                if s is not None:   # LINGER flushes queued pushes (bounded by the timeout)
                    s.close()
            self.relay.close()
            link.sock.close(TELL_LINGER_MS if told else 0)
            self._wake_in.close(0)
            self.on_end()

    def _connect(self):
        """Register with the scheduler (with the address of this worker's pull relay, if
        it has one); the servers come later (``_connect_servers``)."""
        host = port = None
        relay_in = guard = None
        if self._listen_relay:
            guard = Guard.from_env(self.env, lambda text: print(
                f"ssdsgd worker: {text}", file=sys.stderr, flush=True))
            relay_in, port = bind_router(
                self.ctx, self.env.node_host, 0, "a worker's pull relay", guard,
                maxmsgsize=F.relay_frame_limit())
            host = self.env.node_host
            print(f"ssdsgd worker: pull relay listening on {host}:{port}; "
                  f"{guard.describe()}", file=sys.stderr, flush=True)
        self.relay = PullRelay(self.ctx, self.env, self.requests, self.stats, self._sent,
                               relay_in, guard, deliver=self._reply)
        link = SchedulerLink(self.ctx, self.env, "worker", host, port, guard)
        try:
            self.topology = link.register()
            self.relay.join(self.topology, link.routing_id)
        except Exception:
            link.sock.close(0)
            self.relay.close()
            raise
        return link

    def _connect_servers(self, link, meta):
        """The scheduler's LISTEN: every server listens, with the job's message limit; a
        DEALER to each, then the waiting first request may go."""
        self.topology.update(meta)
        for server, (host, port) in enumerate(meta["servers"]):
            s = self.ctx.socket(zmq.DEALER)
            self._sockets.append(s)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, 0)
            s.setsockopt(zmq.LINGER, int(self.env.heartbeat_timeout * 1000))
            link.secure(s, server)     # this worker's connection id and keys
            s.connect(f"tcp://{host}:{port}")
            self._poller.register(s, zmq.POLLIN)
        fut = self.requests.take_control(P.Kind.LISTEN)
        if fut is not None:
            fut.set_result(meta)

    def _serve(self, link):
        """Poll until ``close``: send what the main thread queued, hand replies to their
        futures, keep the heartbeats going."""
        poller = self._poller
        self._link = link
        link.on_rejoined = lambda: [self._sent(link.sock, f) for waiting in
                                    list(self._asked.values()) for f in list(waiting)]
        link.rejoin_fields = self._rejoin_fields
        for s in [self._wake_in, link.sock]:
            poller.register(s, zmq.POLLIN)
        if self.relay.sock is not None:
            poller.register(self.relay.sock, zmq.POLLIN)
        wait_ms = max(1, int(self.env.heartbeat_interval * 1000 / 2))
        backlog = False
        while True:
            events = dict(poller.poll(0 if backlog else wait_ms))
            if self._wake_in in events:
                for _ in range(RECV_PER_TURN):
                    try:
                        self._wake_in.recv(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
            self.on_turn()
            backlog = self._send_queued(link, None if self._stopping else SEND_PER_TURN)
            if link.sock in events and self._on_scheduler(link):
                return      # the scheduler acknowledged FINISH: no more heartbeats
            for server, s in enumerate(self._sockets):
                if s in events:
                    self._receive(s, server)
            if self.relay.sock in events:
                self.relay.receive(RECV_PER_TURN)
            self.relay.overdue()
            # the first push is told at once: until the scheduler knows of one, worker
            # 0's death ends the job (removals.removal_refusal)
            first = self.progress > 0 and not self._told_pushing
            link.tick(self._progress, now_due=first)
            self._told_pushing = self._told_pushing or first
            if self._stopping and not backlog:
                return

    def _progress(self):
        meta = {"progress": self.progress, "busy": self.busy}
        oldest = self.requests.oldest()
        if oldest is not None:
            meta["oldest"] = oldest
        return meta

    def _rejoin_fields(self):
        with self.requests.lock:      # the main thread records its requests under it
            fields = {"chunks": self.chunks.report()}
            if self.policy_record is not None:
                fields["policy"] = self.policy_record.report()
            return fields

    def _send_queued(self, link, limit):
        """Send up to ``limit`` queued messages (None: all); True if some are left."""
        sent = 0
        while limit is None or sent < limit:
            try:
                target, frames = self._commands.get_nowait()
            except queue.Empty:
                return False
            if target != "scheduler":
                sock = self._sockets[target]
                if sock is not None:      # None: a dead server's (its backup has a copy)
                    self._sent(sock, frames)
            elif link.rejoining is None:   # else sent again once rejoined, if asked
                self._sent(link.sock, frames)
            sent += 1
        return True

    def _sent(self, sock, frames):
        t0 = time.perf_counter()
        sock.send_multipart(sealing.of(sock).seal(frames), copy=False)
        TIMELINE.span("send", t0)
        self.stats["messages_sent"] += 1
        self.stats["bytes_sent"] += sum(
            len(f) if isinstance(f, bytes) else len(f.buffer) if isinstance(f, zmq.Frame)
            else f.nbytes for f in frames)

    def _on_scheduler(self, link):
        """A scheduler message: resolve the barrier or finish it answers. True after the
        acknowledgement of FINISH."""
        msg = link.receive()
        if msg.kind == P.Kind.LISTEN and "servers" in msg.meta and not self._sockets:
            self._connect_servers(link, msg.meta)
            return False
        if msg.kind == P.Kind.JOIN and "from_step" in msg.meta:
            if msg.meta["joined"] == self.topology["rank"] and self.join_step is None:
                self.join_step = msg.meta["from_step"]
                self.joins[msg.meta["joined"]] = msg.meta["from_step"]
                self.join_times[msg.meta["joined"]] = time.time()
                self.joined_at.set()
            return False
        if msg.kind == P.Kind.LEAVE and "from_step" in msg.meta:
            self._heard(self.leaves, self.leave_times, msg.meta["leaving"],
                        msg.meta["from_step"], "leaves")
            return False
        if msg.kind == P.Kind.MEMBERSHIP and "from_step" in msg.meta:
            self.left.append({"rank": msg.meta["removed"], "from_step": msg.meta["from_step"],
                              "time": time.time()})
            return False
        if msg.kind == P.Kind.BARRIER:
            self.chunks.released()
        fut = self.requests.take_control(msg.kind)
        if fut is None:
            return False
        with self.requests.lock:
            take_oldest(self._asked, msg.kind)
            if msg.kind == P.Kind.CHUNK:
                self.chunks.answered(msg.meta)
            if msg.kind == P.Kind.POLICY and self.policy_record is not None:
                self.policy_record.received(msg.meta or {})
        fut.set_result(msg)
        return msg.kind == P.Kind.ACK

    def _receive(self, sock, server):
        for _ in range(RECV_PER_TURN):
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                frames = sealing.of(sock).open(frames)
            except sealing.SealError as e:
                raise JobAborted(f"a message of server {server} does not open: {e}") from None
            self.stats["messages_received"] += 1
            self.stats["bytes_received"] += sum(len(f.buffer) for f in frames)
            try:
                msg = P.decode(frames)
                if msg.kind in (P.Kind.FRAGMENT, P.Kind.DIGEST, P.Kind.TAKEOVER):
                    P.check_meta(msg.kind, msg.meta)
            except P.ProtocolError as e:
                raise JobAborted(f"server {server} sent a malformed message: {e}") from None
            if msg.kind == P.Kind.FRAGMENT:
                self.relay.on_fragment(frames, msg, server, f"server {server}")
            elif msg.kind == P.Kind.DIGEST:
                self.relay.on_digest(msg, server)
            elif msg.kind == P.Kind.TAKEOVER:
                self._takeover(msg.meta, server)
                return
            else:
                self._reply(msg, server)

    def _reply(self, msg, server):
        """A server's message for a request, whether it came from the server or through a
        pull relay: the membership changes a REPLY names are heard before its future
        resolves."""
        if msg.kind == P.Kind.REPLY and msg.meta and msg.meta.get("policy"):
            self._joins(msg.meta["policy"], server)
        if self.kept.entries:
            with self.requests.lock:
                self.kept.answered(msg.req)
        self.requests.deliver(msg, server)

    def _joins(self, policy, server):
        """The joins and departures a REPLY's ``policy`` field names (before its future
        resolves: the training thread knows them once it has the reply)."""
        if not isinstance(policy, dict):
            raise JobAborted(f"server {server} sent a REPLY whose policy is not an object")
        try:
            for rank, step in joins_of(policy).items():
                self._heard(self.joins, self.join_times, rank, step, "joins")
            for rank, step in joins_of(policy, "leaves").items():
                self._heard(self.leaves, self.leave_times, rank, step, "leaves")
        except JoinError as e:
            raise JobAborted(f"server {server}: {e}") from None

    @staticmethod
    def _heard(steps, times, rank, step, verb):
        """Worker ``rank`` joins or leaves from ``step``: the same step whoever says it."""
        if rank not in steps:
            times[rank] = time.time()
        if steps.setdefault(rank, step) != step:
            raise JoinError(f"worker {rank} {verb} from step {steps[rank]} and from step {step}")

    def _takeover(self, meta, server):
        """TAKEOVER from ``server``: the server it backs up died; it has sent the replies
        it held, so what it was not copied fails, and its keys go to ``server`` from now
        on (kvstore/backup.py)."""
        dead, owner = meta["dead"], meta["owner"]
        with self.requests.lock:
            wrong = (f"server {server} sent a TAKEOVER in the name of server {owner}"
                     if owner != server else self.replicas.take(dead, owner))
            if wrong:
                raise JobAborted(wrong)
            sock, self._sockets[dead] = self._sockets[dead], None
            # what was queued before goes first (a copy of a request goes before the
            # request itself, sent again below: the new owner takes one of them)
            if self._link is not None:
                self._send_queued(self._link, None)
            again = self.kept.again(dead, owner)
            for frames in again:      # the new owner skips those whose copy it took
                self._sent(self._sockets[owner], frames)
        self._poller.unregister(sock)
        sock.close(0)
        lost = self.requests.server_lost(dead, JobAborted(
            f"server {dead} died with a request of this worker its backup has no copy of"))
        print(f"ssdsgd worker {self.topology['rank']}: server {dead} died; server {owner} "
              f"owns its keys from now on" + (f" ({lost} requests lost)" if lost else "")
              + (f"; sent it the {len(again)} requests it may lack again" if again else ""),
              file=sys.stderr, flush=True)


def _exit_later(seconds, rank):
    """Exit the process unless the training thread ended it first (a daemon thread:
    a process that ends on its own is not kept)."""
    time.sleep(seconds)
    print(f"ssdsgd worker {rank}: the training thread did not end within {seconds:g} s "
          "of the abort; exiting", file=sys.stderr, flush=True)
    os._exit(1)
