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
  unused; arrays never travel as JSON. Which kinds exist and which meta fields each
  carries is ``kinds.py``;
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
import json
import re
import struct

import numpy as np

from . import codecs
from .kinds import FLAGS, Kind, Flag, check_meta as _check_meta

MAGIC = b"SSDG"
VERSION = 9        # 9: SUM (server to server); 8: LEAVE; 7: JOIN, and a DIGEST names the worker that relays; 6: PROMOTE, TAKEOVER, REJOIN and the BACKUP flag
HEADER = struct.Struct("<4sBBHiqIII")
KEY_RECORD = np.dtype([("key", "<i8"), ("step", "<i8"), ("offset", "<i8"), ("count", "<i8"),
                       ("dtype", "u1"), ("ntensors", "u1"), ("encoding", "u1"), ("pad", "u1"),
                       ("frame", "<u4"), ("boff", "<u8"), ("nbytes", "<u8")])
# Record encodings: 0 raw, else the wire code of a codec of ssdsgd/kvstore/codecs/.
ENCODINGS = codecs.ENCODINGS
ENCODING_CODES = {v: k for k, v in ENCODINGS.items()}
PACK_BELOW = 64 * 1024
MAX_META_BYTES = 1 << 20
MAX_META_DEPTH = 8       # nesting of JSON objects/lists (an optimizer description needs 5)
MAX_KEYS = 1 << 16        # key records per message (a model has a few hundred arrays)
MAX_TENSORS_PER_KEY = 8


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
    ``encoding`` is a codec's name (codecs.BY_NAME) for a compressed gradient."""
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


def reflag(frames, flags):
    """``encode``'s frames with other flags in the header (a backup's copy of a request,
    ``Flag.BACKUP``: the same frames otherwise, the tensors not copied)."""
    fields = list(HEADER.unpack(frames[0]))
    fields[3] = int(flags)
    return [HEADER.pack(*fields)] + frames[1:]


def without_tensors(msg, flags):
    """A request's frames as ``msg`` (an encoded Message) with ``flags`` and no tensors:
    the records keep each key's step, slice and encoding, and say none is sent (a push's
    copy for its owner's backup, which gets the owner's sum instead: kvstore/chain.py)."""
    records = msg.records.copy()
    if len(records):
        records["ntensors"] = 0
    return encode(Message(msg.kind, flags=flags, sender=msg.sender, step=msg.step,
                          req=msg.req, records=records, tensors=[[] for _ in records],
                          meta=msg.meta))


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
        if flags & ~FLAGS:
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
                            + (" (the job's message limit: SSDSGD_MAX_MESSAGE_BYTES, or "
                               "what worker 0's model needs)" if max_bytes else ""))
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
                codecs.BY_NAME[encoding].length_error(count, nbytes)
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


# ---- meta: JSON of a bounded depth, every field of a kind type-checked (kinds.py) -------
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


def check_meta(kind, meta):
    """Every meta field of ``kind`` is one it may carry, of the type it must have
    (``kinds.META``)."""
    _check_meta(kind, meta, ProtocolError)


def check_size(frames, max_bytes, limit=None):
    """Before sending: the message fits the receiver's limit (the job's, which the
    scheduler sent: ``limit`` says where it comes from; SSDSGD_MAX_MESSAGE_BYTES by
    default), so it is not dropped unanswered by the transport."""
    data = sum(memoryview(f).nbytes for f in frames[3:])
    if data > max_bytes:
        raise ProtocolError(f"a message of {data} data bytes exceeds " + (
            limit or f"SSDSGD_MAX_MESSAGE_BYTES={max_bytes}; raise the limit (or lower "
                     "SSDSGD_CHUNK_BYTES / SSDSGD_BIGARRAY_BOUND)"))
    for f in frames[:3]:
        if memoryview(f).nbytes > frame_limit(max_bytes):
            raise ProtocolError(f"a message's header frame of {memoryview(f).nbytes} bytes "
                                f"exceeds the limit {frame_limit(max_bytes)}")


def message_bound(key_bytes):
    """The most data bytes any message of a worker to a server carries, for a model whose
    keys have ``key_bytes`` bytes each: a message names a key at most once, with at most
    MAX_TENSORS_PER_KEY tensors of its size (a COMMAND set_state: the key's optimizer
    state; a push, an INIT, a preduce average: one), and a packed key is padded by less
    than 8 bytes. Chunking (SSDSGD_CHUNK_BYTES) only makes messages smaller; a quorum's
    push and a set_state go to a server whole."""
    key_bytes = list(key_bytes)
    return MAX_TENSORS_PER_KEY * sum(key_bytes) + 8 * len(key_bytes)


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
