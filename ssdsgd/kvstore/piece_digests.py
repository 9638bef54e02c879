"""The digests of a relayed reply's pieces (sync.pull_relay: chain; docs/spec/pull_relay.md).

A worker that passes pieces on could alter them; its key lets it connect, not lie. So the
server sends every worker that gets a reply through another worker, on its own
authenticated connection, one DIGEST message: a SHA-256 digest of each piece (its server,
index, count, the frame sizes the first announces, and its bytes) and the rest of the
chain after that worker. The worker checks each relayed piece against it before it uses
or passes it on, and names the worker that sent it if it does not match.
"""
import hashlib
import hmac
import json
import struct
import time

from .protocol import HEADER, MAX_META_BYTES, ProtocolError, frame_buffer

SIZE = 32                       # bytes of a digest (64 hexadecimal digits on the wire)
PERSON = b"ssdsgd-piece-v1\0"   # hashed first: these digests and no others
# SHA-256, not BLAKE2b: OpenSSL's SHA-256 (SHA extensions) hashed 2.2x faster here
# (295 against 131 MB/s on a loaded 2-core machine), and a relay job hashes every piece.
_IDENTITY = struct.Struct("<iII")   # server, piece index, number of pieces


def digest(server, index, count, sizes, data):
    """The hexadecimal digest of piece ``index`` of ``count`` of server ``server``'s
    reply: ``sizes`` (the first piece's frame sizes, else None), ``data`` its data frames
    (bytes, memoryviews or zmq.Frames; hashed in place, no copy)."""
    h = hashlib.sha256(PERSON)
    h.update(_IDENTITY.pack(server, index, count))
    if sizes is not None:
        h.update(struct.pack(f"<I{len(sizes)}q", len(sizes), *sizes))
    for d in data:
        h.update(frame_buffer(d))
    return h.hexdigest()


def of_pieces(pieces):
    """The digests of ``fragments.fragments``' pieces of one reply, in order."""
    out = []
    for frames in pieces:
        fields = HEADER.unpack(bytes(frame_buffer(frames[0])))
        meta = json.loads(bytes(frame_buffer(frames[2])))
        out.append(digest(fields[4], fields[5], meta["of"], meta.get("sizes"), frames[3:]))
    return out


def of_message(msg, data):
    """The digest of a received FRAGMENT ``msg`` (decoded, meta checked) with ``data``,
    its data frames."""
    return digest(msg.sender, msg.step, msg.meta["of"], msg.meta.get("sizes"), data)


def keys_text(keys, most=4):
    """'key 5', 'keys 3, 4, 5', 'keys 0, 1, 2, 3, ... (12 keys)': which keys a reply
    carries, for an error message."""
    keys = sorted(set(int(k) for k in keys))
    if len(keys) == 1:
        return f"key {keys[0]}"
    shown = ", ".join(map(str, keys[:most]))
    return f"keys {shown}" + (f", ... ({len(keys)} keys)" if len(keys) > most else "")


MAX_HELD = 1 << 16      # pieces held for one reply before its digests (the digests' bound)


class Expected:
    """One relayed reply at a worker that gets it through another: the server's digests,
    the rest of the chain and the worker that passes the pieces on, once its DIGEST is
    in, and the pieces passed on before they came, held (at most the bytes a reply to
    the request can carry). ``clock``: when the last of them came (``overdue``)."""

    def __init__(self, server, bound, keys, clock=time.monotonic):
        self.server, self.bound, self.keys, self.clock = server, bound, keys, clock
        self.digests = self.relay = self.relayer = None
        self.waiting, self.held = [], 0
        self.checked = 0          # pieces that matched (they come in order)
        self.since = clock()      # the DIGEST or the last piece that matched

    def given(self, msg):
        """The server's DIGEST ``msg``; returns the pieces held for it, to be checked."""
        if self.digests is not None:
            raise ProtocolError(f"server {self.server} sent the digests of its reply to "
                                f"request {msg.req} twice")
        self.digests, self.relay = msg.meta["digests"], msg.meta.get("relay")
        self.relayer, self.since = msg.meta["from"], self.clock()
        waiting, self.waiting, self.held = self.waiting, [], 0
        return waiting

    def hold(self, frames, msg, relayer):
        """A piece worker ``relayer`` passed on: returned to be checked now if the
        digests are in, else held."""
        if self.digests is not None:
            return [(frames, msg, relayer)]
        self.held += sum(len(frame_buffer(f)) for f in frames[3:])
        if self.held > self.bound + MAX_META_BYTES or len(self.waiting) >= MAX_HELD:
            raise ProtocolError(f"worker {relayer} passed on {self.held} bytes in "
                                f"{len(self.waiting) + 1} pieces of server {self.server}'s "
                                f"reply before the server's digests came; a reply to the "
                                f"request carries at most {self.bound}")
        self.waiting.append((frames, msg, relayer))
        return []

    def mismatch(self, msg, data, relayer):
        """Why piece ``msg`` (``data``: its data frames) is not the one its server sent,
        naming the worker that passed it on; None if it is."""
        what = (f"piece {msg.step} of server {self.server}'s reply ({keys_text(self.keys)}) "
                f"relayed by worker {relayer}")
        count = len(self.digests)
        if msg.meta["of"] != count or msg.step != self.checked:
            return (f"{what} claims to be piece {msg.step} of {msg.meta['of']}; server "
                    f"{self.server}'s digests are of {count} pieces, and piece "
                    f"{self.checked} is next")
        if msg.meta.get("relay") != self.relay:
            return (f"{what} names the chain {msg.meta.get('relay')}, server "
                    f"{self.server}'s is {self.relay}")
        if not hmac.compare_digest(of_message(msg, data), self.digests[msg.step]):
            return (f"{what} does not match server {self.server}'s digest: it was altered "
                    "after the server sent it; stopping the job")
        self.checked += 1
        self.since = self.clock()
        return None

    def overdue(self, timeout):
        """Why the pieces stopped coming, naming the worker that should pass them on, if
        none came for ``timeout`` seconds since the server's digests or the last piece;
        else None. The server sends the pieces right after the digests, so only that
        worker (or its link) can hold them up: without this, a worker that dropped what
        it should relay held the next one, and the job, until the stall watch named the
        victim (docs/spec/pull_relay.md)."""
        if self.digests is None or self.done or self.clock() - self.since <= timeout:
            return None
        return (f"worker {self.relayer} stopped passing on server {self.server}'s reply "
                f"({keys_text(self.keys)}): {self.checked} of its {len(self.digests)} "
                f"pieces came, none in the {timeout:g} s since server {self.server}'s "
                f"digests or the last piece (cluster.heartbeat_timeout + interval); "
                "stopping the job")

    @property
    def done(self):
        """Has every piece of the reply matched?"""
        return self.digests is not None and self.checked == len(self.digests)
