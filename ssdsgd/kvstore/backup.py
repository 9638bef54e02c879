"""A server's part of cluster.server_replicas: 1: the backup of another server's keys.

Every worker sends this server a copy (``Flag.BACKUP``, the same request id) of each INIT,
PUSH, PULL and COMMAND get_state it sends the server it backs up, so it holds the same keys and applies the
same steps, in the same rank order, with the same optimizer: the same weights, bit for
bit. It answers none of those copies: it assembles each reply as the owner does and holds
it (before the weights change, the held replies of a shard share one copy of them).
A held reply is dropped once the worker has pushed each of its keys two steps further:
by then the worker has read the owner's reply (ssgd waits for it before its next push,
ssd one step later). When the owner dies the scheduler sends PROMOTE: the backup sends
every reply it holds, then TAKEOVER to every worker, who from then on sends the dead
server's keys here; what the workers sent before TAKEOVER reached it too, so no push is
lost or applied twice. No request is copied after that: the job has no replica left.

A worker's copies reach the backup in the order it sent them, but worker 0's INIT copy
travels on worker 0's connection: a worker whose INIT the owner answered may push before
worker 0's copy reaches the backup. Such a copy waits (``overtook``), bounded, for the
INIT its own worker is waiting for, and is taken once the keys are declared
(``caught_up``).
"""
import time

from . import protocol as P
from .replica_map import ReplicaError, ReplicaMap
from .replies import Fatal, RequestError

HELD_PER_WORKER = 4_096   # replies held for one worker at most (a bug's bound, not a rule's)
EARLY_PER_WORKER = 64     # copies of one worker waiting for worker 0's INIT copy at most


class Backup:
    def __init__(self, env, replies, log):
        self.map = ReplicaMap(env.num_servers, env.server_replicas)
        self.replies, self.log = replies, log
        self.held = []            # complete replies to copies, oldest first
        self.held_states = {}     # worker's connection -> its latest get_state copy's reply
        self.seen = {}            # (rank, key) -> the largest step of its copied pushes
        self.keys = set()         # keys this server backs up (named by copies)
        self.took_over = None     # (dead server, time) until the first step applied
        self.owner = False        # this server took over the keys it backs up
        self.early = []           # (connection, copy) that came before its keys' INIT

    def foreign(self):
        """The keys this server holds for another that is alive (a checkpoint's state is
        the owners')."""
        return set() if self.owner else self.keys

    def not_in_state(self, msg, shards):
        """COMMAND get_state: the keys its reply leaves out. The owner's: those it backs
        up (a checkpoint's state is the owners'); a backup's copy's: all but those."""
        if msg.flags & P.Flag.BACKUP:
            return set(shards) - self.keys
        return self.foreign()

    def hold_state(self, ident, msg, reply):
        """A copy's get_state reply (the backed-up keys' state) is held, the latest of
        each worker, while the owner lives; True if held."""
        if not (msg.flags & P.Flag.BACKUP and self.map.copying):
            return False
        self.held_states[ident] = reply
        return True

    def check(self, msg):
        """A copy is taken only in a job with replicas (a stranger's flag is refused)."""
        if msg.flags & P.Flag.BACKUP and not self.map.replicas:
            raise RequestError("a backup's copy of a request, but this job has no replicas "
                               "(cluster.server_replicas: 0)")

    def overtook(self, ident, msg, declared, pending_inits):
        """Keep copy ``msg`` if it names a key not ``declared`` yet that an INIT of the same
        connection waits for (``pending_inits``: (connection, INIT) waiting for worker 0's
        values); True if kept. Anything else is handled (and refused) as it comes."""
        if not msg.flags & P.Flag.BACKUP or msg.kind not in (P.Kind.PUSH, P.Kind.PULL):
            return False
        missing = {int(k) for k in msg.records["key"]} - set(declared)
        awaited = {int(k) for i, init in pending_inits if i == ident
                   for k in init.records["key"]}
        if not missing or not missing <= awaited:
            return False
        if sum(i == ident for i, _ in self.early) >= EARLY_PER_WORKER:
            raise RequestError(f"worker {msg.sender} sent {EARLY_PER_WORKER} copies before "
                               f"worker 0's INIT of key {min(missing)} reached this server")
        self.early.append((ident, msg))
        return True

    def caught_up(self, declared):
        """The kept copies whose keys are all ``declared`` now, in the order they came."""
        ready = [(i, m) for i, m in self.early
                 if {int(k) for k in m.records["key"]} <= set(declared)]
        self.early = [e for e in self.early if e not in ready]
        return ready

    def copied(self, msg, reply):
        """``msg`` (a copy) was taken; its reply, if any, is held while the owner lives."""
        if not msg.flags & P.Flag.BACKUP:
            return
        items = list(zip(msg.records["key"].tolist(), msg.records["step"].tolist()))
        self.keys.update(key for key, _ in items)
        if reply is not None and self.map.copying:
            reply.held = True    # the steps it answers (a latest pull's: the last pushed)
            reply.wanted = [(key, step if step >= 0 else self.seen.get((msg.sender, key), 0))
                            for key, step in items]
        if msg.kind == P.Kind.PUSH:
            for key, step in items:
                mark = (msg.sender, key)
                self.seen[mark] = max(self.seen.get(mark, -1), step)
            self.held = [r for r in self.held if not self._read(r)]

    def _read(self, reply):
        """Has the worker surely read the owner's reply? It pushed every key two steps on."""
        return all(self.seen.get((reply.peer.rank, key), -1) >= step + 2
                   for key, step in reply.wanted)

    def hold(self, reply):
        """A held reply is complete (``Replies``' hook): True if taken (held, or dropped),
        False if it must be sent now. A copy that came while its owner lived but whose
        step completed after the takeover is answered by the new owner (its worker waits
        for it), and dropped by any other server (its own owner lives and answers)."""
        if not self.map.copying:
            return not self.owner
        self.held.append(reply)
        mine = [r for r in self.held if r.peer is reply.peer]
        if len(mine) > HELD_PER_WORKER:
            self.held.remove(mine[0])
            self.log(f"held more than {HELD_PER_WORKER} replies of worker {reply.peer.rank}; "
                     "dropped the oldest")
        return True

    def promote(self, meta, rank):
        """PROMOTE: server ``dead`` died and ``owner`` takes its keys."""
        dead, owner = meta["dead"], meta["owner"]
        try:
            expected = self.map.lose(dead)
        except ReplicaError as e:
            raise Fatal(f"PROMOTE of server {dead}: {e}") from None
        if owner != expected:
            raise Fatal(f"PROMOTE names server {owner} as server {dead}'s new owner; its "
                        f"backup is server {expected}")
        held, self.held = self.held, []
        states, self.held_states = self.held_states, {}
        if rank != owner:
            self.log(f"server {dead} died; server {owner} owns its keys")
            return
        for reply in held:     # sent as any reply: lent until ZeroMQ is done with it
            reply.held = False
            meta = {"lr": reply.lr} if reply.lr is not None else None
            reply.tracker = self.replies.send(reply.ident, P.Message(
                P.Kind.REPLY, sender=rank, req=reply.req, records=P.make_records(reply.records),
                tensors=reply.parts, meta=meta))
        for ident, reply in states.items():
            self.replies.send(ident, reply)
        for ident in self.replies.peers:
            self.replies.send(ident, P.Message(P.Kind.TAKEOVER, sender=rank,
                                               meta={"dead": dead, "owner": owner}))
        self.took_over, self.owner = (dead, time.time()), True
        self.log(f"server {dead} died; this server owns its {len(self.keys)} keys from now on "
                 f"(sent the {len(held)} replies it held for them); no replica is left")

    def applied(self, grads, weights):
        """After an update: the first one of the dead server's keys is said, with when."""
        if self.took_over is None:
            return
        keys = [key for key, _, _ in grads if key in self.keys]
        if keys:
            dead, since = self.took_over
            self.took_over = None
            now = time.time()
            self.log(f"first step applied as the owner of server {dead}'s keys: key "
                     f"{keys[0]} step {weights.shards[keys[0]].version - 1}, at {now:.3f} "
                     f"({now - since:.2f} s after the takeover)")
