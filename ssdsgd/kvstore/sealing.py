"""Every frame of a connection sealed with AES-256-GCM (security mode ``aesgcm``,
docs/reliability.md): encryption outside libzmq, so that it runs on the thread that
sends (OpenSSL, through the ``cryptography`` package, which releases the GIL) rather than
in libzmq's one I/O thread per process, where CURVE encrypts message by message.

The connection is authenticated as in plain mode (``plain_handshake.py``: the client's
MAC with its verification key V at the binder, a fresh nonce, no replay). Both ends then
derive the connection's two keys with HKDF-SHA256 (RFC 5869) from V, bound to that
handshake's username (identity, nonce, time) and the binder: only the client and the
binder hold V, so only they hold the keys, and every connection has its own.

A sealed message is one frame more than the message: ``counter (8 bytes, little-endian)``
of its first frame, then each frame as ``ciphertext | tag (16)``. Counters count the
frames this end sent on the connection, from 1; frame i of the message has counter
first + i, and that is the GCM nonce's last 8 bytes (its first 4 are zero: each key
seals in one direction only, so a nonce is never used twice under one key). The
associated data says whether more frames of the message follow. The receiver opens a
message only if its first counter is above every counter it has opened: a replayed,
reordered or altered frame, or a message cut short, is refused (``SealError``, one line)
before anything reads it. A gap is allowed: a binder may drop a message to a peer that
does not read (ZeroMQ's high-water mark).
AES-GCM is used as documented (NIST SP 800-38D, 96-bit nonces, one key per direction);
HKDF as documented; nothing else is built here.
"""
import struct
import weakref

import zmq

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

_INFO = b"ssdsgd aesgcm frames v1\0"
COUNTER = struct.Struct("<Q")
_NONCE = b"\0\0\0\0"         # a nonce: these 4 bytes, then the frame's counter
TAG = 16
_MORE, _LAST = b"more", b"last"


class SealError(ValueError):
    """A frame that does not open: altered, replayed, out of order, or of a stranger."""


def session_keys(verification_key, username, binder):
    """(client -> binder key, binder -> client key) of the connection whose PLAIN
    handshake presented ``username`` to ``binder``."""
    okm = HKDF(algorithm=hashes.SHA256(), length=64, salt=None,
               info=_INFO + username.encode() + b"\0" + binder.encode()
               ).derive(verification_key)
    return okm[:32], okm[32:]


def _buffer(frame):
    """The bytes of a frame to send or received (bytes, a buffer, a zmq.Frame)."""
    view = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class Opened:
    """A frame once opened: its plaintext (``buffer``, ``bytes``: a view of the frame it
    came in, decrypted in place) and that frame's ZeroMQ properties (``get``: the
    connection's User-Id)."""
    __slots__ = ("_data", "_frame")

    def __init__(self, data, frame):
        self._data, self._frame = data, frame

    @property
    def buffer(self):
        return self._data

    @property
    def bytes(self):
        return bytes(self._data)

    def __len__(self):
        return self._data.nbytes

    @property
    def nbytes(self):
        return self._data.nbytes

    def get(self, name):
        return self._frame.get(name)


REUSED_FROM = 1 << 20     # frames of this many bytes or more are sealed into kept buffers
KEPT = 4                 # kept buffers per connection (the frames it sends)
KEPT_BYTES = 256 << 20   # and their bytes: more in flight at once gets fresh buffers


class _Buffers:
    """Ciphertext buffers of big frames, kept and reused once ZeroMQ has sent them and
    every frame over them is freed (the frame's tracker says so). A fresh buffer per frame costs its pages' first touch:
    100 MB sealed into a new one took 41-49 ms here, into a kept one 5 ms (AES-GCM
    itself). At most KEPT of at most KEPT_BYTES together are kept; a frame finding none
    free gets a new one, kept if the bounds allow (replacing the smallest free one)."""

    def __init__(self):
        self.kept = []           # [bytearray, the tracker of the frame that last sent it]
        self.keeps = True        # False: the peer left, every frame gets a fresh buffer

    def frame_for(self, nbytes, fill):
        """A tracked zmq.Frame of ``nbytes`` that ``fill(view)`` wrote."""
        slot = next((s for s in self.kept if len(s[0]) >= nbytes
                     and (s[1] is None or s[1].done)), None)
        if slot is None:
            slot = [bytearray(nbytes), None]
            if self.keeps:
                self._keep(slot, nbytes)
        view = memoryview(slot[0])[:nbytes]
        fill(view)
        frame = zmq.Frame(view, copy=False, track=True)
        slot[1] = frame.tracker     # not the frame: it holds a reference until it is freed
        return frame

    def _keep(self, slot, nbytes):
        """Keep a new buffer if the bounds allow, replacing the smallest free one."""
        free = [s for s in self.kept if s[1] is None or s[1].done]
        smallest = min(free, key=lambda s: len(s[0])) if free else None
        held = sum(len(s[0]) for s in self.kept)
        if len(self.kept) < KEPT and held + nbytes <= KEPT_BYTES:
            self.kept.append(slot)
        elif smallest is not None and held - len(smallest[0]) + nbytes <= KEPT_BYTES:
            self.kept[self.kept.index(smallest)] = slot


class Channel:
    """Both directions of one connection: ``seal`` the frames of a message to send,
    ``open`` the frames of one received."""

    def __init__(self, send_key, receive_key):
        self._out, self._in = AESGCM(send_key), AESGCM(receive_key)
        self.sent = 0          # the counter of the last frame sealed
        self.opened = 0        # the largest counter opened
        self._buffers = _Buffers()

    def stop_keeping(self):
        """Big frames are sealed into fresh buffers from now on, and the kept ones go."""
        self._buffers.keeps, self._buffers.kept = False, []

    def seal(self, frames):
        """``[counter of the first frame, sealed frame, ...]``: a small frame's ciphertext
        and tag come from OpenSSL in a buffer of its own; a big one's go into a kept
        buffer (``_Buffers``), sent as a tracked zmq.Frame."""
        first = self.sent + 1
        last = len(frames) - 1
        out = [COUNTER.pack(first)]
        for i, frame in enumerate(frames):
            self.sent += 1
            nonce, data = _NONCE + COUNTER.pack(self.sent), _buffer(frame)
            extra = _LAST if i == last else _MORE
            if data.nbytes < REUSED_FROM:
                out.append(self._out.encrypt(nonce, data, extra))
            else:
                out.append(self._buffers.frame_for(
                    data.nbytes + TAG,
                    lambda view: self._out.encrypt_into(nonce, data, extra, view)))
        return out

    def open(self, frames):
        """The frames of a message ``seal`` made, each opened in place (the plaintext
        takes the ciphertext's bytes of the frame it came in, as OpenSSL's GCM allows;
        a read-only frame gets a buffer of its own)."""
        if len(frames) < 2 or _buffer(frames[0]).nbytes != COUNTER.size:
            raise SealError("not a sealed message (no counter frame, or no frame after it)")
        first, = COUNTER.unpack_from(_buffer(frames[0]))
        if first <= self.opened:
            raise SealError(f"frame {first} comes after frame {self.opened}: replayed or out "
                            "of order")
        out = []
        last = len(frames) - 2
        for i, frame in enumerate(frames[1:]):
            data = _buffer(frame)
            if data.nbytes < TAG:
                raise SealError(f"a frame of {data.nbytes} bytes is shorter than a sealed "
                                f"one ({TAG} bytes at least)")
            plain = (data[:data.nbytes - TAG] if not data.readonly
                     else memoryview(bytearray(data.nbytes - TAG)))
            try:
                self._in.decrypt_into(_NONCE + COUNTER.pack(first + i), data,
                                      _LAST if i == last else _MORE, plain)
            except InvalidTag:
                raise SealError(f"frame {first + i} does not open with this connection's "
                                "key (altered, cut short, or not sealed by the peer)") from None
            out.append(Opened(plain, frame))
        self.opened = first + last
        return out


class Plain:
    """A connection that seals nothing (modes open, plain, curve)."""

    @staticmethod
    def seal(frames):
        return frames

    @staticmethod
    def open(frames):
        return frames


PLAIN = Plain()


class BinderChannels:
    """A bound ROUTER's channels, one per connection (its routing id), each made from the
    session keys its ZAP handler derived (``sessions``: the handshake's nonce -> keys,
    filled by ``zap_gate``; the connection's User-Id ends with ``#nonce``)."""

    def __init__(self, sessions):
        self.sessions = sessions
        self.by_id = {}

    def open(self, frames):
        """``frames``: a ROUTER's (the routing id first, never sealed)."""
        ident = frames[0].bytes
        channel = self.by_id.get(ident)
        if channel is None:
            try:
                user = frames[1].get("User-Id") or ""
            except Exception:      # noqa: BLE001 - no such property: not a sealed peer
                user = ""
            keys = self.sessions.pop(user.rpartition("#")[2], None) if "#" in user else None
            if keys is None:
                raise SealError("a connection without a sealed session sent a message")
            channel = self.by_id[ident] = Channel(keys[1], keys[0])
        return [frames[0]] + channel.open(frames[1:])

    def seal(self, ident, frames):
        channel = self.by_id.get(ident)
        if channel is None:
            raise SealError("a message to a connection that never sent one (no session)")
        return channel.seal(frames)

    def release(self, ident):
        """The peer ``ident`` leaves the job: its channel keeps no buffer from now on (up
        to KEPT_BYTES each), so a job whose workers come and go holds none for the ones
        gone. The channel stays (a few hundred bytes): a reply up to the departure is
        still sealed, into a fresh buffer, and frames in flight keep their own."""
        channel = self.by_id.get(ident)
        if channel is not None:
            channel.stop_keeping()


class PlainBinder:
    """A bound ROUTER that seals nothing."""

    @staticmethod
    def open(frames):
        return frames

    @staticmethod
    def seal(ident, frames):
        return frames

    @staticmethod
    def release(ident):
        pass


PLAIN_BINDER = PlainBinder()


# Each socket's channels, set by ``security.Guard`` when it prepares the socket (``client``
# before a connect, ``server`` before a bind): every send and receive of the transport
# goes through ``of(sock)``, which is a no-op unless the job's mode is aesgcm.
_BY_SOCKET = weakref.WeakKeyDictionary()


def use(sock, channels):
    """``sock``'s frames go through ``channels`` from now on (a new connection's)."""
    _BY_SOCKET[sock] = channels
    return channels


def of(sock):
    """The channel (a DEALER's) or channels (a ROUTER's) of ``sock``; a socket no Guard
    prepared (open mode, a test's own) seals nothing."""
    channels = _BY_SOCKET.get(sock)
    if channels is None:
        channels = PLAIN_BINDER if sock.type == zmq.ROUTER else PLAIN
    return channels
