"""A relayed reply's pieces (sync.pull_relay: chain; docs/spec/pull_relay.md): a server
cuts the frames of one REPLY into FRAGMENT messages, every worker of the chain forwards
each piece as it arrives, and each rebuilds the reply into a buffer bounded by what a
reply to its request can carry. The message format itself is ``protocol.py``'s.
"""
import json

import numpy as np

from .protocol import (HEADER, KEY_RECORD, MAGIC, MAX_META_BYTES, MAX_TENSORS_PER_KEY,
                       VERSION, ITEMSIZE, Kind, ProtocolError, frame_buffer, frame_limit)

# A relayed reply's pieces (each hop passes one on as it arrives): about 1/8 of the reply,
# so a chain of N workers takes about (1 + (N - 1) / 8) times one copy's time on a link;
# not below 128 KB (Python's cost per message), not above 2 MB.
FRAGMENT_MIN, FRAGMENT_MAX, FRAGMENT_SHARE = 128 << 10, 2 << 20, 8


def relay_frame_limit():
    """The largest frame a worker's pull relay accepts, whatever the model or the message
    limit: relayed replies travel only as ``fragments``, pieces of at most FRAGMENT_MAX
    data bytes (docs/spec/pull_relay.md), so a bigger frame is refused by ZeroMQ without
    being buffered."""
    return frame_limit(FRAGMENT_MAX)


def forward(frames, req, meta):
    """A received piece of a relayed reply for the next worker of its chain
    (docs/spec/pull_relay.md): that worker's request id in the header, ``meta`` (the rest
    of the chain) re-encoded; the key table and the data frames are the received ones,
    sent on without a copy."""
    fields = list(HEADER.unpack(bytes(frame_buffer(frames[0]))))
    fields[6] = req
    raw = json.dumps(meta, separators=(",", ":"), allow_nan=True).encode() if meta else b""
    return [HEADER.pack(*fields), frames[1], raw] + list(frames[3:])


def fragments(frames, req, sender, meta=None, size=None):
    """``encode``'s frames of a REPLY as FRAGMENT messages of at most ``size`` data bytes
    (default: ``FRAGMENT_*``'s rule), views of the frames (no copy). The first carries
    every frame's size, so the last worker of a chain can rebuild the frames
    (``Reassembly``); ``meta`` (the chain) goes with every piece."""
    views = [memoryview(frame_buffer(f)).cast("B") for f in frames]
    total = sum(len(v) for v in views)
    if size is None:
        size = min(FRAGMENT_MAX, max(FRAGMENT_MIN, -(-total // FRAGMENT_SHARE)))
    count = max(1, -(-total // size))
    out, frame, pos = [], 0, 0
    for index in range(count):
        left, data = min(size, total - index * size), []
        while left:
            take = min(left, len(views[frame]) - pos)
            if take:
                data.append(views[frame][pos:pos + take])
            pos, left = pos + take, left - take
            if pos == len(views[frame]):
                frame, pos = frame + 1, 0
        head = dict(meta or {}, of=count)
        if index == 0:
            head["sizes"] = [len(v) for v in views]
        raw = json.dumps(head, separators=(",", ":")).encode()
        out.append([HEADER.pack(MAGIC, VERSION, int(Kind.FRAGMENT), 0, sender, index, req, 0,
                                len(data)), b"", raw] + data)
    return out


def reply_bound(records):
    """The most bytes of a reply to a request naming ``records``: every key's values and
    optimizer state (at most MAX_TENSORS_PER_KEY arrays of its size), its key table and
    header (the meta has a margin of its own in ``Reassembly``). A relayed reply bigger
    than that cannot be one, whatever SSDSGD_MAX_MESSAGE_BYTES allows."""
    data = int((records["count"].astype(np.int64) * ITEMSIZE[records["dtype"]]).sum())
    # + per key: its record, and the padding of a packed frame (< 8 bytes)
    return MAX_TENSORS_PER_KEY * data + len(records) * (KEY_RECORD.itemsize + 8) + HEADER.size


class Reassembly:
    """One relayed reply's FRAGMENT messages, in order, back into its frames: a bounded
    buffer (the first piece states the size; at most ``max_bytes``, e.g. ``reply_bound``
    of the request), every piece checked against what the first announced."""

    def __init__(self, msg, max_bytes):
        if msg.step != 0 or "sizes" not in msg.meta:
            raise ProtocolError(f"fragment {msg.step} of a reply arrived before its first")
        self.sizes, self.count = msg.meta["sizes"], msg.meta["of"]
        total = sum(self.sizes)
        if max_bytes and total > max_bytes + MAX_META_BYTES:
            raise ProtocolError(f"a fragmented reply of {total} bytes exceeds the limit "
                                f"{max_bytes} (what a reply to its request can carry)")
        self.buf, self.pos, self.next = np.empty(total, np.uint8), 0, 0

    def add(self, msg, data):
        """The frames once ``msg`` (the pieces' next, with ``data``, its data frames) was
        the last piece; else None."""
        if msg.step != self.next or msg.meta["of"] != self.count:
            raise ProtocolError(f"fragment {msg.step} of {msg.meta['of']} arrived; expected "
                                f"{self.next} of {self.count}")
        for d in data:
            b = frame_buffer(d)
            if self.pos + len(b) > self.buf.size:
                raise ProtocolError(f"fragments carry more than the {self.buf.size} bytes "
                                    "the first announced")
            self.buf[self.pos:self.pos + len(b)] = np.frombuffer(b, np.uint8)
            self.pos += len(b)
        self.next += 1
        if self.next < self.count:
            return None
        if self.pos != self.buf.size:
            raise ProtocolError(f"fragments carried {self.pos} of the {self.buf.size} bytes "
                                "the first announced")
        ends = np.cumsum([0] + self.sizes)
        return [self.buf[a:b] for a, b in zip(ends[:-1], ends[1:])]
