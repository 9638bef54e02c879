"""The vocabulary: which messages exist, and which meta fields each carries, of what type.

Twenty-six kinds, in three groups, and four flags:

* membership (node <-> scheduler; ps-lite's control commands): REGISTER, TOPOLOGY,
  LISTEN (the servers' ports, bound once the job's message limit is known), BARRIER,
  HEARTBEAT, FINISH, SHUTDOWN, ABORT, MEMBERSHIP (a worker leaves the job), CHUNK (a
  worker asks for the next batch of an epoch: dynamic data, docs/spec/dynamic_data.md),
  JOIN (a worker joins a running job) and LEAVE (a worker leaves it at a step every
  worker hears of in time): docs/spec/membership.md;
* data (worker <-> server): INIT, PUSH, PULL, and the answers REPLY, ACK, ERROR;
  FRAGMENT carries a piece of a relayed REPLY (sync.pull_relay: chain), and DIGEST the
  digests of its pieces, from the server straight to each worker the pieces reach through
  another worker; with cluster.server_replicas: 1, PROMOTE (scheduler -> servers: a
  dead server's backup owns its keys), TAKEOVER (that backup -> each worker) and SUM
  (a key's owner -> its backup: the sum it applies; the backup's ACK answers it);
* generic: COMMAND (worker -> every server: the job's optimizer, compression, or
  optimizer state; MXNet's ``_send_command_to_servers``), and POLICY: a synchronization
  policy's own event (a quorum's round decisions, preduce's readiness, groups and
  averages, a barrier's pause), ``{"event": name, ...}``. The transport routes a POLICY
  message to the policy without reading its fields; the policy checks them against
  its own table (``ssdsgd/sync/events.py``). A PUSH's or PULL's ``policy`` object is
  the same: options for the policy (a quorum's ``latest`` and ``final``).

Flags are the transport's: PULL (a push that wants the weights back), STATE (add the
optimizer state to the reply), RELAY (the reply may come through another worker), BACKUP
(a copy of a request to a key's owner, for its backup).
"""
import enum
import re

from .. import fields as F
from .chunk_record import REPORT


class Kind(enum.IntEnum):
    REGISTER = 1      # node -> scheduler: {role, rank, host, port (a worker's relay), pid,
                      # routing_id}
    TOPOLOGY = 2      # scheduler -> node, once all registered: {rank, num_workers,
                      # num_servers, workers, relays}; no server listens yet (LISTEN)
    BARRIER = 3       # node -> scheduler, and the release back
    HEARTBEAT = 4     # node -> scheduler {progress, busy, oldest}, and the echo back
    FINISH = 5        # worker -> scheduler: done, stop watching me
    SHUTDOWN = 6      # scheduler -> node: the job is over, exit 0
    ABORT = 7         # scheduler -> node: {reason}; exit non-zero
    MEMBERSHIP = 8    # scheduler <-> server, scheduler -> worker: a dead worker leaves
    INIT = 9          # worker -> server: keys (rank 0 sends values); reply: the values
    PUSH = 10         # worker -> server: gradients of a step; flags say whether to reply
    PULL = 11         # worker -> server: weights as of a step (or latest); reply: values
    REPLY = 12        # server -> worker: values (and state) for a request id
    ACK = 13
    ERROR = 14        # {error}: the request was rejected; the server keeps serving
    FRAGMENT = 15     # server -> worker -> worker: a byte range of a relayed REPLY's
                      # frames; step: its index; {of, sizes, relay}
    COMMAND = 16      # worker -> server: {command, ...}; reply: ACK, or the state
    POLICY = 17       # any node -> any node: {event, ...}, a policy's own message
    LISTEN = 18       # worker 0 -> scheduler {max_message}: its model's largest message
                      # (none: it knows no model); scheduler -> server {max_message_bytes}:
                      # bind with it; server -> scheduler {port}: bound; scheduler ->
                      # worker {servers, max_message_bytes}: where the servers listen
    DIGEST = 19       # server -> worker: the digests of the pieces of a relayed REPLY that
                      # reach it through another worker; req: its request; {digests, relay}
                      # (docs/spec/pull_relay.md)
    CHUNK = 20        # worker -> scheduler {epoch, per_epoch, budget, start}: the next
                      # chunk of that epoch; scheduler -> worker {epoch, chunk} or
                      # {epoch, over: "epoch" | "budget"} (kvstore/chunks.py)
    PROMOTE = 21      # scheduler -> server {dead, owner}: server ``dead`` died; its
                      # backup ``owner`` takes its keys (cluster.server_replicas: 1)
    TAKEOVER = 22     # new owner -> worker {dead, owner}: after the replies it held for
                      # ``dead``'s requests; from now on send ``dead``'s keys to ``owner``
    SUM = 23          # owner -> its backup (server to server, cluster.server_replicas: 1):
                      # the sum of each key it applies, step: that step; records: one per
                      # key, one tensor each; the backup answers ACK with the same req
                      # once it holds them (kvstore/chain.py)
    REJOIN = 31       # node -> a restarted scheduler: REGISTER's fields with the rank it
                      # has, {ready, passed}: what the new one rebuilds the job from;
                      # scheduler -> node {restart, waited}: taken back, go on
                      # (kvstore/reregister.py; 24-30 are left free)
    JOIN = 41         # a worker joins a running job (docs/spec/membership.md, kvstore/
                      # join_wiring.py): scheduler -> server {joined, routing_id}: hold,
                      # and serve that connection as worker ``joined``; server ->
                      # scheduler {joined, next_step}; scheduler -> every server and the
                      # joiner {joined, from_step}: it pushes from that step on
    LEAVE = 42        # a worker leaves a running job (docs/spec/membership.md): a
                      # connection holding its key -> scheduler {leaving}: asks;
                      # scheduler -> server {leaving}: hold; server -> scheduler
                      # {leaving, next_step}; scheduler -> every server, the leaver and
                      # the asker {leaving, from_step}: it pushes the steps before it


class Flag(enum.IntFlag):
    NONE = 0
    PULL = 1          # PUSH: reply with the weights once this step is applied
    STATE = 2         # PUSH/PULL: add the optimizer state to the reply
    RELAY = 4         # PUSH with PULL, PULL: the reply may come through another worker
                      # (sync.pull_relay: chain; docs/spec/pull_relay.md)
    BACKUP = 8        # INIT, PUSH, PULL: a copy of a request to a key's owner, sent to its
                      # backup with the same request id; its reply is held until the owner
                      # dies (cluster.server_replicas: 1; kvstore/backup.py)


FLAGS = int(Flag.PULL | Flag.STATE | Flag.RELAY | Flag.BACKUP)

_ROLE = F.one_of("server", "worker")
_GROUP = F.one_of("worker", "server", "all")
_AGREEMENT = (lambda v: isinstance(v, str) and re.fullmatch(r"[a-z_]{1,32}", v) is not None,
              "a name of 1 to 32 lowercase letters or underscores")
_RELAY_TO = (lambda v: isinstance(v, list) and len(v) <= F.MAX_RANK and all(
    isinstance(p, list) and len(p) == 2 and F.int_in(0, F.MAX_RANK)(p[0])
    and F.int_in(1, (1 << 32) - 1)(p[1]) for p in v),
    "a list of [worker rank, request id]")
_SIZES = (lambda v: isinstance(v, list) and 3 <= len(v) <= (1 << 16) + 3
          and all(F.int_in(0, F.MAX_STEP)(x) for x in v), "a list of frame sizes")
_DIGESTS = (lambda v: isinstance(v, list) and 1 <= len(v) <= 1 << 16 and all(
    isinstance(d, str) and bool(_HEX64.match(d)) for d in v),
    "a list of 64-digit hexadecimal digests")
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_EVENT_NAME = re.compile(r"[a-z_]{1,32}\Z")
_EVENT = (lambda v: isinstance(v, str) and bool(_EVENT_NAME.match(v)),
          "an event name (1 to 32 of a-z and _)")
_ANY = (lambda v: True, "any JSON value")
_SERVER = (F.int_in(0, F.MAX_RANK), "a server rank")
_WORKER = (F.int_in(0, F.MAX_RANK), "a worker rank")
_BYTES = (F.int_in(1, F.MAX_STEP), "a number of bytes from 1 to 2^62")
_CLOCK = (F.is_number, "a clock reading in seconds")
_OLDEST = (lambda v: isinstance(v, list) and len(v) == 2 and _SERVER[0](v[0])
           and F.is_number(v[1]) and v[1] >= 0,
           "[a server rank, seconds >= 0] (the oldest request waiting for its reply)")
_EPOCH = (F.int_in(0, 1 << 31), "an epoch number from 0 to 2^31")
_CHUNKS = (F.int_in(1, F.MAX_STEP), "a number of chunks from 1 to 2^62")

_PASSED = (lambda v: isinstance(v, dict) and set(v) <= {"worker", "server", "all"} and all(
    isinstance(p, list) and len(p) == 2 and F.int_in(0, F.MAX_STEP)(p[0])
    and F.int_in(0, 1 << 31)(p[1]) for p in v.values()),
    "an object of barrier group -> [barriers passed, the last value]")
# kind -> {field: ((check, what it must be), required)}; kinds not listed carry no meta.
META = {
    Kind.REGISTER: {"role": (_ROLE, True), "rank": (F.RANK, False),
                    "host": ((F.optional(F.text(255)), "a host name or null"), False),
                    "port": ((F.optional(F.int_in(0, 65535)), "a TCP port or null"), False),
                    "pid": ((F.int_in(0, 1 << 32), "a process id"), False),
                    "hostname": ((F.text(255), "a host name"), False),
                    "routing_id": (F.ID, False)},
    # a node's REGISTER fields and its rank; ``ready``: a worker heard where the servers
    # listen, a server listens; ``passed``: the barriers it has passed, per group
    Kind.REJOIN: {"role": (_ROLE, False), "rank": (F.RANK, False),
                  "host": ((F.optional(F.text(255)), "a host name or null"), False),
                  "port": ((F.optional(F.int_in(0, 65535)), "a TCP port or null"), False),
                  "pid": ((F.int_in(0, 1 << 32), "a process id"), False),
                  "hostname": ((F.text(255), "a host name"), False),
                  "routing_id": (F.ID, False), "ready": (F.BOOL, False),
                  "passed": (_PASSED, False),
                  # dynamic data: the chunks this worker got (chunk_record.py)
                  "chunks": ((F.optional(REPORT[0]), REPORT[1]), False),
                  # the policy's own record (preduce's groups); the policy checks it
                  "policy": (F.OBJ, False),
                  "restart": ((F.int_in(1, 100), "a restart number from 1 to 100"), False),
                  "waited": (_CLOCK, False)},
    Kind.TOPOLOGY: {"rank": (F.RANK, True), "num_workers": (F.COUNT, True),
                    "num_servers": (F.COUNT, True),
                    "workers": ((lambda v: isinstance(v, list) and all(F.ID[0](x) for x in v),
                                 "a list of connection ids"), False),
                    "relays": ((lambda v: isinstance(v, list) and all(
                        x is None or F.is_address(x) for x in v),
                        "a list of [host, port] or null, one per worker"), False)},
    Kind.LISTEN: {"max_message": (_BYTES, False), "max_message_bytes": (_BYTES, False),
                  "port": ((F.int_in(1, 65535), "a TCP port"), False),
                  "servers": ((lambda v: isinstance(v, list) and all(map(F.is_address, v)),
                               "a list of [host, port]"), False)},
    Kind.BARRIER: {"group": (_GROUP, False),
                   "value": ((F.int_in(0, 1 << 31), "an integer from 0 to 2^31"), False),
                   # a barrier whose value the scheduler keeps (barriers.py)
                   "agreement": (_AGREEMENT, False),
                   # the barrier of the workers in the job at this step (membership.md)
                   "step": (F.STEP, False)},
    Kind.FINISH: {"error": (F.STR, False)},
    # a worker's: requests its training thread made, and whether it is busy with
    # something else (rank 0's validation); kvstore/liveness.py. A node that records a
    # timeline adds its clock's ``sent``; the echo carries it back with the scheduler's
    # ``time`` (ssdsgd/timeline.py: the offset between the two clocks)
    Kind.HEARTBEAT: {"progress": (F.STEP, False), "busy": (F.BOOL, False),
                     "oldest": (_OLDEST, False), "sent": (_CLOCK, False),
                     "time": (_CLOCK, False)},
    # scheduler -> server {removed}: which step does it not have from that worker?
    # server -> scheduler {removed, next_step}; scheduler -> all {removed, from_step}
    Kind.MEMBERSHIP: {"removed": (F.WORKER, True), "next_step": (F.STEP, False),
                      "from_step": (F.STEP, False)},
    Kind.ABORT: {"reason": (F.STR, False)},
    # dynamic data (kvstore/chunks.py): the request names the epoch and the job's data
    # plan (chunks per epoch, the budget in chunks, the chunk it started at); the answer
    # a chunk of it, or why there is none
    Kind.CHUNK: {"epoch": (_EPOCH, True), "per_epoch": (_CHUNKS, False),
                 "budget": (_CHUNKS, False), "start": (F.STEP, False),
                 "chunk": (F.STEP, False),
                 "over": (F.one_of("epoch", "budget", "pause"), False),
                 # a mid-epoch checkpoint: worker 0 asks to pause; the answer's cursor
                 "pause": (F.BOOL, False), "at": (F.STEP, False)},
    Kind.PUSH: {"policy": (F.OBJ, False)},
    Kind.PULL: {"policy": (F.OBJ, False)},
    # ``policy``: the policy's own fields (a quorum auto leader's record on the final
    # replies), checked where they are read (sync/events.py)
    Kind.REPLY: {"lr": ((F.optional(F.is_number), "a finite number or null"), False),
                 "optimizer": ((F.optional(F.OBJ[0]), "a JSON object or null"), False),
                 "policy": (F.OBJ, False)},
    Kind.ERROR: {"error": (F.STR, True)},
    Kind.FRAGMENT: {"of": (F.COUNT, True), "relay": (_RELAY_TO, False),
                    "sizes": (_SIZES, False)},
    Kind.DIGEST: {"digests": (_DIGESTS, True), "relay": (_RELAY_TO, False),
                  "from": (_WORKER, True)},
    Kind.PROMOTE: {"dead": (_SERVER, True), "owner": (_SERVER, True)},
    Kind.JOIN: {"joined": (F.WORKER, True), "routing_id": (F.ID, False),
                "next_step": (F.STEP, False), "from_step": (F.STEP, False)},
    Kind.LEAVE: {"leaving": (F.WORKER, True), "next_step": (F.STEP, False),
                 "from_step": (F.STEP, False)},
    Kind.TAKEOVER: {"dead": (_SERVER, True), "owner": (_SERVER, True)},
}

# COMMAND's commands and the fields each carries besides ``command``.
COMMANDS = {"optimizer": {"optimizer": (F.OBJ, True)},
            "compression": {"compression": (F.OBJ, True)},
            "get_state": {},
            "set_state": {"optimizer": (F.OBJ, False)}}
_COMMAND = F.one_of(*COMMANDS)


def _command_fields(meta):
    name = meta.get("command")
    return {"command": (_COMMAND, True),
            **(COMMANDS.get(name, {}) if isinstance(name, str) else {})}


def _policy_fields(meta):
    """The event's name; its other fields are the policy's to check (sync/events.py)."""
    return {"event": (_EVENT, True), **{name: (_ANY, False) for name in meta if name != "event"}}


FIELDS_OF = {Kind.COMMAND: _command_fields, Kind.POLICY: _policy_fields}


def check_meta(kind, meta, error):
    """Every meta field of ``kind`` is one it may carry, of the type it must have."""
    table = FIELDS_OF[kind](meta) if kind in FIELDS_OF else META.get(kind, {})
    F.check_fields(kind.name, table, meta, error, noun="meta field")
