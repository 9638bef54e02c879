"""cluster.server_replicas: 1 as chain replication: a key's owner hands each step's sum
to the key's backup, which applies it with the same optimizer (the same weights and
state, bit for bit), instead of every worker sending every push to both.

The owner (``ChainOwner``): each update of the keys it owns while their backup lives
sends the sum it applies (the buffer the optimizer reads, after the rank-order sum and a
departure's scaling) to the backup, one SUM message per update (a chunk of a big step is
one update), on a connection of its own to the backup's port (``security.CONNECTS_TO``:
a server's port admits the server whose keys it backs up). A reply that carries the
weights of an update waits until the backup acknowledged that update's sum (ACK, the
same request id): a reply a worker has read is a step the backup holds.

The backup (``ChainBackup``): the workers still copy every request to it (Flag.BACKUP,
the same request id), a push's copy without its tensors (``protocol.without_tensors``).
It takes each worker's copies in the order they came; a push copy waits until the
owner's sum of each of its keys' steps has come (and every copy of that worker behind
it), then goes to the policy as usual with a placeholder for each gradient; where the
policy applies a step, the owner's sum replaces the placeholders. It acknowledges a SUM
once it holds it. A message copied with its tensors (a worker of before) is summed by
the backup itself, as active replication did.

When the owner dies, the new owner's TAKEOVER (after the replies it held, as before)
tells each worker to send it again every request to the dead server it keeps: its
pushes until a reply as of their step or a later one of their keys came (ssgd: one
step; ssd: up to k + 1), and its unanswered requests. The new owner skips each whose
copy it took (it remembers the last TAKEN_KEPT ids of each worker's copies), replaces a
copy still waiting by it, and aggregates the rest as their owner: the steps the dead
owner had not handed over. So no step is lost or applied twice.

Nothing here runs in a job without replicas: the server makes no ``ChainOwner`` and its
``ChainBackup`` refuses every SUM.
"""
import collections

import numpy as np
import zmq

from . import protocol as P, sealing
from .replies import Fatal, RequestError

SUMS_HELD = 1 << 16       # sums a backup holds at most (its bytes are bounded too)
QUEUED_PER_WORKER = 4_096   # copies of one worker waiting for a sum at most
TAKEN_KEPT = 8_192        # request ids of taken copies remembered per worker (duplicates)


class Placeholder:
    """A push copy's gradient: the owner's sum stands for the step's (``use_sums``)."""
    __slots__ = ()

    def __repr__(self):
        return "<the owner's sum>"


CHAIN = Placeholder()


def tensorless(msg):
    """Is ``msg`` a push copy without tensors (chain replication's)?"""
    return (msg.kind == P.Kind.PUSH and msg.flags & P.Flag.BACKUP and len(msg.records) > 0
            and not msg.records["ntensors"].any())


class ChainOwner:
    """The owner's side: its connection to its backup, the sums not yet acknowledged,
    and the replies that wait for them."""

    def __init__(self, rank, backup, log):
        self.rank, self.backup, self.log = rank, backup, log
        self.sock = None
        self.early = []            # SUMs of updates before the backup's address came
        self.pending = {}          # SUM request id -> [(key, version after it)]
        self.acked = {}            # key -> the version the backup acknowledged
        self.waiting = []          # complete replies waiting for an acknowledgement
        self._req = 0
        self.sent_sums = 0
        self.sent_bytes = 0
        self.open = True

    def connect(self, ctx, guard, address, max_bytes):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, P.frame_limit(max_bytes))
        guard.client(sock, f"server {self.backup}")
        host, port = address
        sock.connect(f"tcp://{host}:{port}")
        self.sock = sock
        for frames in self.early:
            sock.send_multipart(sealing.of(sock).seal(frames), copy=False)
        self.early = []
        self.log(f"sends the sums of its keys to server {self.backup}, their backup "
                 "(chain replication)")

    def send(self, items):
        """``items``: [(key, step, offset, count, dtype, sum array)] of one update."""
        if not self.open or not items:
            return
        self._req = self._req % ((1 << 32) - 1) + 1
        msg = P.Message(P.Kind.SUM, sender=self.rank, req=self._req,
                        step=max(i[1] for i in items),
                        records=P.make_records((k, s, o, c, d, 1) for k, s, o, c, d, _ in items),
                        tensors=[[a] for *_, a in items])
        self.pending[self._req] = [(k, s + 1) for k, s, *_ in items]
        frames = P.encode(msg)
        if self.sock is None:      # a worker's push came before the scheduler's LISTEN
            self.early.append(frames)
        else:
            self.sock.send_multipart(sealing.of(self.sock).seal(frames), copy=False)
        self.sent_sums += 1
        self.sent_bytes += sum(a.nbytes for *_, a in items)

    def must_wait(self, reply):
        """Does ``reply`` carry a step of an owned key the backup has not acknowledged?
        Then it waits (``on_ack`` gives it back)."""
        if not self.open:
            return False
        for key, version in reply.needs:
            if self.acked.get(key, 0) < version and self.is_owned(key):
                self.waiting.append(reply)
                return True
        return False

    @staticmethod
    def is_owned(key):      # the server's: a key this server owns (not one it backs up)
        return True

    def receive(self):
        """The backup's messages: the replies its acknowledgements release."""
        out = []
        while True:
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                frames = sealing.of(self.sock).open(frames)
                msg = P.decode(frames, max_bytes=1 << 16)
            except (sealing.SealError, P.ProtocolError) as e:
                raise Fatal(f"server {self.rank}: its backup, server {self.backup}, sent a "
                            f"message that does not open or decode ({e})") from None
            if msg.kind == P.Kind.ERROR:
                raise Fatal(f"server {self.rank}: its backup, server {self.backup}, "
                            f"refused its sums: {msg.meta.get('error')}")
            done = self.pending.pop(msg.req, None) if msg.kind == P.Kind.ACK else None
            if done is None or msg.sender != self.backup:
                raise Fatal(f"server {self.rank}: its backup, server {self.backup}, sent "
                            f"{msg.kind.name} {msg.req}, which answers no sum of it")
            for key, version in done:
                if version > self.acked.get(key, 0):
                    self.acked[key] = version
            out += self._released()
        return out

    def _released(self):
        ready, still = [], []
        for reply in self.waiting:
            (still if any(self.acked.get(k, 0) < v and self.is_owned(k)
                          for k, v in reply.needs) else ready).append(reply)
        self.waiting = still
        return ready

    def lost(self):
        """The backup died (or this server's keys went to it: this one died): nothing
        waits for it any more. The replies that waited."""
        self.open = False
        if self.sock is not None:
            self.sock.close(0)
            self.sock = None
        self.early = []
        waiting, self.waiting = self.waiting, []
        return waiting


class ChainBackup:
    """The backup's side: the owner's sums, and each worker's copies in its order."""

    def __init__(self, replicas, log):
        self.replicas = replicas          # the server's ReplicaMap (backup.py's)
        self.log = log
        self.sums = {}                    # (key, step) -> the owner's sum
        self.sum_bytes = 0
        self.queued = {}                  # worker's connection -> deque of its copies
        self.taken = {}                   # worker rank -> deque of taken copies' ids
        self.taken_set = {}               # worker rank -> set of the same
        self.owner_ident = None           # the connection the owner's sums come on

    # ---- the owner's sums --------------------------------------------------------
    def check_sum(self, ident, msg, frame0, guard, weights, rank, worker, bound_bytes):
        """A SUM: checked field by field; only the server this one backs up, on one
        connection, may send it. Raises RequestError naming what is wrong."""
        if worker is not None:
            raise RequestError(f"worker {worker.rank} sent a SUM; only the server whose "
                               "keys this one backs up sends sums")
        if not self.replicas.copying:
            if self.replicas.dead and ident == self.owner_ident:
                return []      # sent before its owner heard of the death: not needed
            raise RequestError("a SUM, but this job copies no requests (cluster."
                               "server_replicas: 0, or a server died)")
        owner = msg.sender
        if not 0 <= owner < self.replicas.num_servers or owner == rank or \
                self.replicas.backup(owner) != rank:
            raise RequestError(f"a SUM in the name of server {owner}, whose keys this "
                               f"server does not back up")
        wrong = guard.wrong_claim(frame0, "server", owner)
        if wrong:
            raise RequestError(wrong)
        if self.owner_ident is not None and ident != self.owner_ident:
            raise RequestError(f"a SUM of server {owner} on another connection than its "
                               "first")
        if msg.flags:
            raise RequestError("a SUM carries no flags")
        if len(msg.records) == 0:
            raise RequestError("a SUM names no key")
        if len(np.unique(msg.records["key"])) != len(msg.records):
            raise RequestError("a SUM names a key twice")
        items = []
        for rec, arrays in zip(P.rows(msg.records), msg.tensors):
            key, step = int(rec["key"]), int(rec["step"])
            if rec["encoding"] or len(arrays) != 1:
                raise RequestError(f"key {key}: a SUM carries one uncompressed sum per key")
            shard = weights.shards.get(key)
            if shard is not None:
                weights.shard_for(rec, with_values=True)     # its slice and dtype
                if step < shard.version:
                    raise RequestError(f"key {key}: the sum of step {step}, but step "
                                       f"{shard.version - 1} is already applied here")
            array = arrays[0]
            if array.size != int(rec["count"]):
                raise RequestError(f"key {key}: a sum of {array.size} values for a slice of "
                                   f"{int(rec['count'])}")
            if (key, step) in self.sums:
                raise RequestError(f"key {key}: the sum of step {step} came twice")
            items.append(((key, step), array))
        size = sum(a.nbytes for _, a in items)
        if len(self.sums) + len(items) > SUMS_HELD or self.sum_bytes + size > bound_bytes:
            raise RequestError(f"the owner's sums not yet used would exceed "
                               f"{bound_bytes} bytes (its backup's copies lag too far)")
        return items

    def keep(self, ident, items):
        self.owner_ident = ident
        for mark, array in items:
            self.sums[mark] = array     # a view of the message's frame, kept with it
            self.sum_bytes += array.nbytes

    def ready(self, msg, weights):
        """May copy ``msg`` be taken now (a tensorless push: every sum of it came)?"""
        if not tensorless(msg):
            return True
        for key, step in zip(msg.records["key"].tolist(), msg.records["step"].tolist()):
            shard = weights.shards.get(key)
            if (key, step) not in self.sums and (shard is None or step >= shard.version):
                return False
        return True

    def use_sums(self, grads, weights):
        """The policy applies ``grads`` ([(key, parts, scale)]): where the owner's sum of
        the step came, it is the step's sum (one part, scaled already)."""
        out = []
        for key, parts, scale in grads:
            mark = (key, weights.shards[key].version)
            total = self.sums.pop(mark, None)
            if total is not None:
                shard = weights.shards[key]
                if total.dtype != shard.dtype or total.size != shard.count:
                    raise Fatal(f"key {key}: the owner's sum of step {mark[1]} is "
                                f"{total.dtype}[{total.size}], the key {shard.dtype}"
                                f"[{shard.count}]")
                self.sum_bytes -= total.nbytes
                out.append((key, [total], None))
            elif any(p is CHAIN for p in parts):
                raise Fatal(f"key {key}: step {mark[1]} is complete here without the "
                            "owner's sum")
            else:
                out.append((key, parts, scale))
        return out

    # ---- each worker's copies, in order ------------------------------------------
    def queue(self, ident, msg, peer, weights, promoted, pushed=None):
        """Keep copy ``msg`` behind its worker's waiting ones or while its sums have not
        come (True: kept). After a takeover, a request sent again whose copy was taken
        is skipped (True), and one whose copy waits replaces it (False). ``pushed(rank,
        key, step)``: has the policy that push already (a push sent again whose copy
        was taken longer ago than the ids remembered is skipped too)."""
        rank = peer.rank
        if not msg.flags & P.Flag.BACKUP:
            if not promoted:
                return False
            if msg.req in self.taken_set.get(rank, ()):
                return True                  # its copy was taken: answered from it
            if msg.kind == P.Kind.PUSH and pushed is not None and len(msg.records) and all(
                    pushed(rank, k, s) for k, s in zip(msg.records["key"].tolist(),
                                                       msg.records["step"].tolist())):
                return True
            waiting = self.queued.get(ident)
            if waiting and any(m.req == msg.req for m in waiting):
                while waiting and waiting[0].req != msg.req:
                    waiting.popleft()
                waiting.popleft()
            return False
        waiting = self.queued.setdefault(ident, collections.deque())
        if waiting or not self.ready(msg, weights):
            if len(waiting) >= QUEUED_PER_WORKER:
                raise RequestError(f"worker {rank} has {len(waiting)} copies waiting for "
                                   "their owner's sums already")
            waiting.append(msg)
            return True
        return False

    def next_ready(self, weights):
        """(connection, copy) of the first waiting copy that may be taken now, or None."""
        for ident, waiting in self.queued.items():
            if waiting and self.ready(waiting[0], weights):
                return ident, waiting.popleft()
        return None

    def took(self, rank, msg):
        """Copy ``msg`` of worker ``rank`` was taken (handled, or refused)."""
        if not msg.flags & P.Flag.BACKUP:
            return
        ids = self.taken.setdefault(rank, collections.deque())
        seen = self.taken_set.setdefault(rank, set())
        ids.append(msg.req)
        seen.add(msg.req)
        if len(ids) > TAKEN_KEPT:
            seen.discard(ids.popleft())


class KeptRequests:
    """A worker's side: every request it sent a server whose backup got a copy, kept
    (its frames, tensors and all) until the backup surely holds what it needs: a request
    that wants a reply until the reply came, a push until a reply as of its step (or a
    later one) of each of its keys came -- the owner sent that reply only once the backup
    acknowledged the step's sum. When the owner dies, TAKEOVER's server gets them all
    again (``again``). The caller holds the client's requests lock."""

    def __init__(self):
        self.entries = collections.OrderedDict()  # request id -> [server, frames, pushes,
        #                                           asks, waits for a reply]
        self.done = {}          # key -> the latest step a reply was as of

    def keep(self, server, msg, frames):
        keys, steps = msg.records["key"].tolist(), msg.records["step"].tolist()
        push = msg.kind == P.Kind.PUSH
        pull = msg.kind == P.Kind.PULL or (push and msg.flags & P.Flag.PULL)
        if (msg.meta or {}).get("policy", {}).get("latest"):
            pull = False        # a reply of the newest weights says nothing of a step
        self.entries[msg.req] = [server, frames,
                                 list(zip(keys, steps)) if push else [],
                                 [(k, s) for k, s in zip(keys, steps) if s >= 0] if pull
                                 else [],
                                 not push or bool(msg.flags & P.Flag.PULL)]

    def answered(self, req):
        entry = self.entries.get(req)
        if entry is None:
            return
        for key, step in entry[3]:
            if step > self.done.get(key, -1):
                self.done[key] = step
        entry[4] = False
        for r in [r for r, (_, _, pushes, _, waits) in self.entries.items()
                  if not waits and all(self.done.get(k, -1) >= s for k, s in pushes)]:
            del self.entries[r]

    def again(self, dead, owner):
        """The frames of every request kept for ``dead``, in the order they were sent;
        from now on they are ``owner``'s."""
        out = []
        for entry in self.entries.values():
            if entry[0] == dead:
                entry[0] = owner
                out.append(entry[1])
        return out

    def __len__(self):
        return len(self.entries)
