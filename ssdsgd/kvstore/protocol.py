"""Everything that crosses a socket, declared in one place.

A message is a ZeroMQ multipart message:

    [header, key table, meta, tensor, tensor, ...]

* header: a fixed little-endian struct (magic, version, kind, flags, sender, step, request
  id, number of key records, number of tensor frames);
* key table: ``nkeys`` fixed-size records (key, per-key step, element offset, element
  count, dtype code, number of tensors for the key, and where they are: data frame index,
  byte offset and byte length; a key's tensors -- value first, then optimizer state -- lie
  back to back). A record's ``encoding`` (``ENCODINGS``) says how its tensor is coded: 0 is
  raw (``count`` values of ``dtype`` per tensor); otherwise the record carries one
  compressed gradient of ``count`` float32 values (docs/spec/compression.md), whose byte
  length the decoder checks against the encoding's rule;
* meta: UTF-8 JSON of *scalars only* (addresses, hyper-parameters, error text), empty when
  unused; arrays never travel as JSON;
* data frames: raw bytes. A key of 64 KiB or more gets a frame of its own, sent and
  received without copying; smaller keys share one packed frame, because a frame costs
  about as much to send as 40 KB (a step of 160 small parameters would otherwise spend
  more time in per-frame overhead than on the wire).

Nothing is unpickled. ``decode`` validates every field of the format (header, key table,
JSON of bounded depth, data frames) and ``receive`` -- what nodes call -- also the type of
every meta field of the message's kind (``META``); both raise ``ProtocolError`` with the
reason (and the request id, once the header was read), so a node can reject a bad
message, answer the request it belongs to, and keep serving.
"""
import enum
import json
import math
import re
import struct

import numpy as np

MAGIC = b"SSDG"
VERSION = 2
HEADER = struct.Struct("<4sBBHiqIII")
KEY_RECORD = np.dtype([("key", "<i8"), ("step", "<i8"), ("offset", "<i8"), ("count", "<i8"),
                       ("dtype", "u1"), ("ntensors", "u1"), ("encoding", "u1"), ("pad", "u1"),
                       ("frame", "<u4"), ("boff", "<u8"), ("nbytes", "<u8")])
# Record encodings: 0 raw, else a compression type of ssdsgd.kvstore.compression.
ENCODINGS = {1: "2bit", 2: "topk"}
ENCODING_CODES = {v: k for k, v in ENCODINGS.items()}
PACK_BELOW = 64 * 1024
MAX_META_BYTES = 1 << 20
MAX_META_DEPTH = 8       # nesting of JSON objects/lists (an optimizer description needs 5)
MAX_KEYS = 1 << 16        # key records per message (a model has a few hundred arrays)
MAX_TENSORS_PER_KEY = 8


class Kind(enum.IntEnum):
    """Message kinds. Scheduler control first, then worker <-> server data."""
    REGISTER = 1      # node -> scheduler: {role, rank, host, port, pid, routing_id}
    TOPOLOGY = 2      # scheduler -> node: {rank, num_workers, num_servers, servers, workers,
                      # relays}
    BARRIER = 3       # node -> scheduler, and the release back
    HEARTBEAT = 4     # node -> scheduler, and the echo back
    FINISH = 5        # worker -> scheduler: done, stop watching me
    SHUTDOWN = 6      # scheduler -> node: the job is over, exit 0
    ABORT = 7         # scheduler -> node: {reason}; exit non-zero
    ROUND = 8         # server 0 -> scheduler -> other servers: {log} quorum decisions
    MEMBERSHIP = 9    # scheduler <-> server, scheduler -> worker: a dead worker leaves
    INIT = 10         # worker -> server: keys (rank 0 sends values); reply: the values
    SET_OPTIMIZER = 11  # worker -> server: {optimizer description}; reply: ACK
    PUSH = 12         # worker -> server: gradients of a step; flags say whether to reply
    PULL = 13         # worker -> server: weights as of a step (or latest); reply: values
    GET_STATE = 14    # worker -> server: optimizer state of all keys; reply: values+state
    SET_STATE = 15    # worker -> server: optimizer state of keys; reply: ACK
    SET_COMPRESSION = 16  # worker -> server: {compression: {type, ...}}; reply: ACK
    AVERAGE = 17      # worker -> server (preduce): weights, step = group id, {members};
                      # reply: the members' average once every member's weights arrived
    GROUP = 18        # scheduler -> worker (preduce): {group, members}: average with them
    READY = 19        # worker -> scheduler (preduce): {final}: my local step is done
    REPLY = 20        # server -> worker: values (and state) for a request id
    ACK = 21
    ERROR = 22        # {error}: the request was rejected; the server keeps serving
    FRAGMENT = 23     # server -> worker -> worker (sync.pull_relay: chain): a byte range of
                      # a relayed REPLY's frames; step: its index; {of, sizes, relay}


class Flag(enum.IntFlag):
    NONE = 0
    PULL = 1          # PUSH: reply with the weights once this step is applied
    STATE = 2         # PUSH/PULL: add the optimizer state to the reply
    LATEST = 4        # PUSH with PULL, quorum: reply with the newest closed round
    FINAL = 8         # PULL, quorum: this worker is done; reply with the final weights
    PAUSE = 16        # PULL (no keys), quorum: this worker enters a barrier (rounds.pause)
    RELAY = 32        # PUSH with PULL, PULL: the reply may come through another worker
                      # (sync.pull_relay: chain; docs/spec/pull_relay.md)


DTYPES = {0: np.dtype("<f4"), 1: np.dtype("<f8"), 2: np.dtype("<f2"),
          3: np.dtype("<i4"), 4: np.dtype("<i8"), 5: np.dtype("u1")}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}
ITEMSIZE = np.zeros(256, np.int64)       # dtype code -> bytes per value
ITEMSIZE[list(DTYPES)] = [d.itemsize for d in DTYPES.values()]


class ProtocolError(ValueError):
    """A message that does not follow this module's format. ``req`` is the request id
    from its header (0 when the header itself was unreadable), so the reply can name it."""

    def __init__(self, text, req=0):
        super().__init__(text)
        self.req = req


def dtype_code(dtype):
    try:
        return DTYPE_CODES[np.dtype(dtype).newbyteorder("<")]
    except KeyError:
        raise ProtocolError(f"dtype {np.dtype(dtype)} cannot be sent; supported: "
                            f"{', '.join(str(d) for d in DTYPES.values())}") from None


class Message:
    """A decoded (or to-be-encoded) message. ``tensors[i]`` is a list per key record."""
    __slots__ = ("kind", "flags", "sender", "step", "req", "records", "meta", "tensors")

    def __init__(self, kind, *, flags=0, sender=-1, step=0, req=0, records=None, meta=None,
                 tensors=None):
        self.kind = Kind(kind)
        self.flags = Flag(flags)
        self.sender = sender
        self.step = step
        self.req = req
        self.records = records if records is not None else np.zeros(0, KEY_RECORD)
        self.meta = meta or {}
        self.tensors = tensors or []

    def __repr__(self):
        return (f"Message({self.kind.name}, flags={self.flags!r}, sender={self.sender}, "
                f"step={self.step}, req={self.req}, keys={len(self.records)})")


def make_records(entries):
    """entries: iterable of (key, step, offset, count, dtype, ntensors[, encoding]);
    ``encoding`` is a compression type ('2bit', ...) for a compressed gradient."""
    rows_ = []
    for key, step, offset, count, dtype, ntensors, *encoding in entries:
        code = ENCODING_CODES[encoding[0]] if encoding and encoding[0] else 0
        dcode = _DTYPE_CODE_CACHE.get(dtype)
        if dcode is None:
            dcode = dtype_code(dtype)
        rows_.append((key, step, offset, count, dcode, ntensors, code, 0, 0, 0, 0))
    return np.array(rows_, KEY_RECORD) if rows_ else np.zeros(0, KEY_RECORD)


# dtype -> wire code for the dtypes (and their type objects) records are usually made of.
_DTYPE_CODE_CACHE = {**{d: c for d, c in DTYPE_CODES.items()},
                     **{d.type: c for d, c in DTYPE_CODES.items()}}


_FIELDS = KEY_RECORD.names


def rows(records):
    """The key records as dicts of Python ints (``rec["key"]`` as on a record): reading
    fields of a numpy record one by one costs about 1 us each, these 0.05."""
    return [dict(zip(_FIELDS, row)) for row in records.tolist()]


def _payload_rule(encoding, count, nbytes):
    """None if ``nbytes`` is a valid length for ``count`` values coded as ``encoding``,
    else what is wrong."""
    if encoding == "2bit":
        want = 4 * (-(-count // 16))
        return None if nbytes == want else f"2bit data for {count} values is {want} bytes"
    if nbytes % 8 or nbytes > 8 * count:     # topk: (uint32, float32) pairs, <= count
        return f"topk data for {count} values is a multiple of 8 bytes up to {8 * count}"
    return None


def _dtype_code_of(dtype):
    """The wire code of an array's dtype (None if it has none), as ``dtype_code``."""
    code = DTYPE_CODES.get(dtype)
    return code if code is not None else DTYPE_CODES.get(dtype.newbyteorder("<"))


_ZEROS = bytes(8)


def encode(msg):
    """Return the list of frames for ``msg``: big tensors go out as their own buffers,
    uncopied; small ones are packed into one frame. Fills the records' frame/boff.
    The per-key work is plain Python on lists (``tolist`` once per field, one assignment
    per field at the end): numpy's per-element access cost ~20 us a key here."""
    if len(msg.tensors) != len(msg.records):
        raise ProtocolError("one tensor list per key record is required")
    frames, blob, packed, packed_size = [], [], [], 0
    records = msg.records
    n = len(records)
    keys, counts = records["key"].tolist(), records["count"].tolist()
    dtypes, ntensors = records["dtype"].tolist(), records["ntensors"].tolist()
    encodings = records["encoding"].tolist()
    nbytes_of, frame_of, boff_of = [0] * n, [0] * n, [0] * n
    for i, arrays in enumerate(msg.tensors):
        if len(arrays) != ntensors[i]:
            raise ProtocolError(f"key {keys[i]}: {len(arrays)} tensors, record says "
                                f"{ntensors[i]}")
        views = []
        for a in arrays:
            a = np.ascontiguousarray(a)
            if encodings[i]:
                if a.dtype != np.uint8 or len(arrays) != 1:
                    raise ProtocolError(f"key {keys[i]}: a compressed gradient is one "
                                        f"uint8 tensor")
            elif a.size != counts[i] or _dtype_code_of(a.dtype) != dtypes[i]:
                raise ProtocolError(f"key {keys[i]}: tensor {a.dtype}[{a.size}] does not "
                                    f"match its record")
            views.append(a)
        nbytes = nbytes_of[i] = sum(v.nbytes for v in views)
        if not views:
            continue
        if nbytes >= PACK_BELOW:
            frame_of[i] = len(frames)
            frames.append(views[0].reshape(-1).view(np.uint8) if len(views) == 1 else
                          np.concatenate([v.reshape(-1).view(np.uint8) for v in views]))
            continue
        boff_of[i] = packed_size
        packed.append(i)
        blob += views
        pad = -nbytes % 8              # keep every tensor 8-byte aligned
        if pad:
            blob.append(_ZEROS[:pad])
        packed_size += nbytes + pad
    if packed:
        for i in packed:
            frame_of[i] = len(frames)
        frames.append(b"".join(blob))     # one copy of the small tensors, into one frame
    if n:
        records["nbytes"], records["frame"], records["boff"] = nbytes_of, frame_of, boff_of
    meta = json.dumps(msg.meta, separators=(",", ":"), allow_nan=True).encode() if msg.meta else b""
    if len(meta) > MAX_META_BYTES:
        raise ProtocolError(f"meta of {len(meta)} bytes exceeds {MAX_META_BYTES}")
    header = HEADER.pack(MAGIC, VERSION, int(msg.kind), int(msg.flags), msg.sender, msg.step,
                         msg.req, len(records), len(frames))
    return [header, records.tobytes(), meta] + frames


def readdress(frames, req):
    """``encode``'s frames with another request id in the header (the same reply to
    several requests is encoded once)."""
    fields = list(HEADER.unpack(frames[0]))
    fields[6] = req
    return [HEADER.pack(*fields)] + frames[1:]


def frame_buffer(frame):
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


def decode(frames, *, max_bytes=None):
    """Validate and decode a list of frames (bytes or zmq.Frame). Tensors are views of
    the received frames (no copy); copy before mutating. Every error is a
    ``ProtocolError`` carrying the request id once the header has been read."""
    if len(frames) < 3:
        raise ProtocolError(f"a message has at least 3 frames, got {len(frames)}")
    head = bytes(frame_buffer(frames[0]))
    if len(head) != HEADER.size:
        raise ProtocolError(f"header is {len(head)} bytes, expected {HEADER.size}")
    magic, version, kind, flags, sender, step, req, nkeys, nframes = HEADER.unpack(head)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}; not an ssdsgd peer")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version}, this node speaks {VERSION}")
    try:
        try:
            kind = Kind(kind)
        except ValueError:
            raise ProtocolError(f"unknown message kind {kind}") from None
        if flags & ~int(Flag.PULL | Flag.STATE | Flag.LATEST | Flag.FINAL | Flag.PAUSE | Flag.RELAY):
            raise ProtocolError(f"unknown flag bits {flags:#x}")
        records = _key_table(frames, nkeys, nframes)
        meta = _meta(bytes(frame_buffer(frames[2])))
        tensors = _tensors(records, [frame_buffer(f) for f in frames[3:]], max_bytes)
    except ProtocolError as e:
        e.req = req
        raise
    return Message(kind, flags=flags, sender=sender, step=step, req=req, records=records,
                   meta=meta, tensors=tensors)


def _key_table(frames, nkeys, nframes):
    if nkeys > MAX_KEYS:
        raise ProtocolError(f"{nkeys} keys exceeds the limit {MAX_KEYS}")
    if len(frames) != 3 + nframes:
        raise ProtocolError(f"header announces {nframes} data frames, message has "
                            f"{len(frames) - 3}")
    table = frame_buffer(frames[1])
    if len(table) != nkeys * KEY_RECORD.itemsize:
        raise ProtocolError(f"key table is {len(table)} bytes, {nkeys} records need "
                            f"{nkeys * KEY_RECORD.itemsize}")
    if not nkeys:
        return np.zeros(0, KEY_RECORD)
    records = np.frombuffer(table, KEY_RECORD).copy()
    if (records["key"] < 0).any() or (records["offset"] < 0).any() or (records["count"] < 0).any():
        raise ProtocolError("negative key, offset or count in the key table")
    if (records["ntensors"] > MAX_TENSORS_PER_KEY).any():
        raise ProtocolError(f"more than {MAX_TENSORS_PER_KEY} tensors for one key")
    bad = [c for c in np.unique(records["dtype"]) if int(c) not in DTYPES]
    if bad:
        raise ProtocolError(f"unknown dtype code {int(bad[0])}")
    bad = [c for c in np.unique(records["encoding"]) if c and int(c) not in ENCODINGS]
    if bad:
        raise ProtocolError(f"unknown encoding code {int(bad[0])}")
    return records


def _tensors(records, buffers, max_bytes):
    total = sum(len(b) for b in buffers)
    if max_bytes is not None and total > max_bytes:
        raise ProtocolError(f"message carries {total} data bytes, limit is {max_bytes}"
                            + (" (SSDSGD_MAX_MESSAGE_BYTES)" if max_bytes else ""))
    tensors, spans = [], []
    # Plain Python on the records' rows (one ``tolist``): numpy's per-field access cost
    # ~10 us a key here.
    for key, _, _, count, dcode, n, ecode, _, frame, boff, nbytes in records.tolist():
        if n == 0:
            tensors.append([])
            continue
        dt = DTYPES[dcode]
        encoding = ENCODINGS.get(ecode)
        if frame >= len(buffers):
            raise ProtocolError(f"key {key}: data frame {frame} does not exist "
                                f"({len(buffers)} frames)")
        if encoding is None and nbytes != n * count * dt.itemsize:
            raise ProtocolError(f"key {key}: {n} tensors of {count} {dt} are "
                                f"{n * count * dt.itemsize} bytes, the record says {nbytes}")
        if encoding is not None:
            wrong = (f"a compressed gradient is one tensor of float32 values, the record has "
                     f"{n} of {dt}") if n != 1 or dt != np.float32 else \
                _payload_rule(encoding, count, nbytes)
            if wrong:
                raise ProtocolError(f"key {key}: {wrong}")
        buf = buffers[frame]
        need = boff + nbytes
        if need > len(buf):
            raise ProtocolError(f"key {key}: its tensors need bytes up to {need} "
                                f"of data frame {frame}, which has {len(buf)}")
        spans.append((frame, boff, need, key))
        if encoding is not None:
            tensors.append([np.frombuffer(buf, np.uint8, nbytes, boff)])
        elif n == 1:
            tensors.append([np.frombuffer(buf, dt, count, boff)])
        else:
            tensors.append([np.frombuffer(buf, dt, count, boff + j * count * dt.itemsize)
                            for j in range(n)])
    spans.sort()
    for (f1, _, end1, k1), (f2, start2, _, k2) in zip(spans, spans[1:]):
        if f1 == f2 and start2 < end1:
            raise ProtocolError(f"keys {k1} and {k2} claim the same bytes of data frame {f1}")
    return tensors


# ---- meta: JSON of a bounded depth, every field of a kind type-checked ------------------
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_OPENERS, _CLOSERS = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


def json_depth(raw):
    """How deep the objects and lists of JSON text ``raw`` nest, found without parsing it
    (a parser recurses once per level: 4 KB of brackets exhaust Python's stack)."""
    b = np.frombuffer(_JSON_STRING.sub(b'""', raw), np.uint8)
    level = np.cumsum(np.isin(b, _OPENERS).astype(np.int64) - np.isin(b, _CLOSERS))
    return int(level.max(initial=0))


def _meta(raw):
    if len(raw) > MAX_META_BYTES:
        raise ProtocolError(f"meta of {len(raw)} bytes exceeds {MAX_META_BYTES}")
    meta = {}
    if raw:
        depth = json_depth(raw)
        if depth > MAX_META_DEPTH:
            raise ProtocolError(f"meta JSON nests {depth} levels deep, the limit is "
                                f"{MAX_META_DEPTH}")
        try:
            meta = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise ProtocolError(f"meta is not UTF-8 JSON: {e}") from None
        if not isinstance(meta, dict):
            raise ProtocolError("meta must be a JSON object")
    return meta


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v):
    """A finite int or float (not a bool, not NaN or infinite)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int_in(lo, hi):
    return lambda v: _is_int(v) and lo <= v <= hi


def _text(limit=None):
    return lambda v: isinstance(v, str) and (limit is None or len(v) <= limit)


def _optional(check):
    return lambda v: v is None or check(v)


def _address(v):
    return (isinstance(v, list) and len(v) == 2 and _text(255)(v[0])
            and _int_in(1, 65535)(v[1]))


_HEX_ID = re.compile(r"[0-9a-f]{8,64}\Z")
MAX_RANK = 1 << 20
_RANK = (_int_in(-1, MAX_RANK), "an integer from -1 to 2^20")
_COUNT = (_int_in(1, MAX_RANK), "an integer from 1 to 2^20")
_ID = (lambda v: isinstance(v, str) and bool(_HEX_ID.match(v)), "8 to 64 lowercase hex digits")
_STR = (_text(), "a string")
_OBJ = (lambda v: isinstance(v, dict), "a JSON object")
_ROLE = (lambda v: v in ("server", "worker") if isinstance(v, str) else False,
         "'server' or 'worker'")
_RANKS = (lambda v: isinstance(v, list) and 1 <= len(v) <= MAX_RANK
           and all(_int_in(0, MAX_RANK)(r) for r in v) and v == sorted(set(v)),
           "a non-empty increasing list of worker ranks")
_RELAY_TO = (lambda v: isinstance(v, list) and len(v) <= MAX_RANK and all(
    isinstance(p, list) and len(p) == 2 and _int_in(0, MAX_RANK)(p[0])
    and _int_in(1, (1 << 32) - 1)(p[1]) for p in v),
    "a list of [worker rank, request id]")
_GROUP = (lambda v: v in ("worker", "server", "all") if isinstance(v, str) else False,
          "'worker', 'server' or 'all'")

# kind -> {field: ((check, what it must be), required)}; kinds not listed carry no meta.
META = {
    Kind.REGISTER: {"role": (_ROLE, True), "rank": (_RANK, False),
                    "host": ((_optional(_text(255)), "a host name or null"), False),
                    "port": ((_optional(_int_in(0, 65535)), "a TCP port or null"), False),
                    "pid": ((_int_in(0, 1 << 32), "a process id"), False),
                    "hostname": ((_text(255), "a host name"), False),
                    "routing_id": (_ID, False)},
    Kind.TOPOLOGY: {"rank": (_RANK, True), "num_workers": (_COUNT, True),
                    "num_servers": (_COUNT, True),
                    "servers": ((lambda v: isinstance(v, list) and all(map(_address, v)),
                                 "a list of [host, port]"), True),
                    "workers": ((lambda v: isinstance(v, list) and all(_ID[0](x) for x in v),
                                 "a list of connection ids"), False),
                    "relays": ((lambda v: isinstance(v, list) and all(
                        x is None or _address(x) for x in v),
                        "a list of [host, port] or null, one per worker"), False)},
    Kind.BARRIER: {"group": (_GROUP, False),
                   "value": ((_int_in(0, 1 << 31), "an integer from 0 to 2^31"), False)},
    Kind.READY: {"final": ((lambda v: isinstance(v, bool), "true or false"), False)},
    Kind.GROUP: {"group": ((_int_in(0, 1 << 62), "a group number"), True),
                 "members": (_RANKS, True)},
    Kind.AVERAGE: {"members": (_RANKS, True)},
    Kind.FINISH: {"error": (_STR, False)},
    # scheduler -> server {removed}: which step does it not have from that worker?
    # server -> scheduler {removed, next_step}; scheduler -> all {removed, from_step}
    Kind.MEMBERSHIP: {"removed": ((_int_in(0, MAX_RANK), "a worker rank"), True),
                      "next_step": ((_int_in(0, 1 << 62), "a step"), False),
                      "from_step": ((_int_in(0, 1 << 62), "a step"), False)},
    Kind.ABORT: {"reason": (_STR, False)},
    Kind.ROUND: {"log": ((_text(MAX_META_BYTES // 2), "a string of round decisions"), True)},
    Kind.SET_OPTIMIZER: {"optimizer": (_OBJ, True)},
    Kind.SET_STATE: {"optimizer": (_OBJ, False)},
    Kind.SET_COMPRESSION: {"compression": (_OBJ, True)},
    Kind.REPLY: {"lr": ((_optional(is_number), "a finite number or null"), False),
                 "optimizer": ((_optional(_OBJ[0]), "a JSON object or null"), False)},
    Kind.ERROR: {"error": (_STR, True)},
    Kind.FRAGMENT: {"of": (_COUNT, True), "relay": (_RELAY_TO, False),
                    "sizes": ((lambda v: isinstance(v, list) and 3 <= len(v) <= MAX_KEYS + 3
                               and all(_int_in(0, 1 << 62)(x) for x in v),
                               "a list of frame sizes"), False)},
}


def _short(value, limit=60):
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def check_meta(kind, meta):
    """Every meta field of ``kind`` is one it may carry, of the type it must have."""
    fields = META.get(kind, {})
    for name in meta:
        if name not in fields:
            expected = f"expected {', '.join(fields)}" if fields else "it carries none"
            raise ProtocolError(f"{kind.name}: unexpected meta field {_short(name)} ({expected})")
    for name, ((check, what), required) in fields.items():
        if name not in meta:
            if required:
                raise ProtocolError(f"{kind.name}: meta field {name!r} is missing")
        elif not check(meta[name]):
            raise ProtocolError(f"{kind.name}: meta field {name!r} must be {what}, got "
                                f"{_short(meta[name])}")


def check_size(frames, max_bytes):
    """Before sending: the message fits the receiver's limit (the same
    SSDSGD_MAX_MESSAGE_BYTES as ours), so it is not dropped unanswered by the transport."""
    data = sum(memoryview(f).nbytes for f in frames[3:])
    if data > max_bytes:
        raise ProtocolError(f"a message of {data} data bytes exceeds "
                            f"SSDSGD_MAX_MESSAGE_BYTES={max_bytes}; raise the limit (or lower "
                            f"SSDSGD_CHUNK_BYTES / SSDSGD_BIGARRAY_BOUND)")
    for f in frames[:3]:
        if memoryview(f).nbytes > frame_limit(max_bytes):
            raise ProtocolError(f"a message's header frame of {memoryview(f).nbytes} bytes "
                                f"exceeds the limit {frame_limit(max_bytes)}")


def frame_limit(max_bytes):
    """The largest single frame a node accepts (ZeroMQ's MAXMSGSIZE: a bigger frame is
    refused without being buffered): a data frame up to the limit, a meta of up to
    MAX_META_BYTES or a key table of up to MAX_KEYS records."""
    return max(max_bytes, MAX_META_BYTES, MAX_KEYS * KEY_RECORD.itemsize) + 4096


def receive(frames, *, max_bytes=None):
    """What a node does with a message from a peer: ``decode`` it and check that every meta
    field is one its kind carries, of the right type (``check_meta``), before any use."""
    msg = decode(frames, max_bytes=max_bytes)
    try:
        check_meta(msg.kind, msg.meta)
    except ProtocolError as e:
        e.req = msg.req
        raise
    return msg


def control(kind, meta=None, **kw):
    """Frames of a message with no tensors."""
    return encode(Message(kind, meta=meta, **kw))
