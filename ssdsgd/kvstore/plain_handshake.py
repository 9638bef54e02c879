"""The PLAIN handshake without a replayable password (plain mode, docs/reliability.md).

ZeroMQ's PLAIN sends a username and a password in clear text, once per connection, and
its ZAP handler sees only those two strings. A static token there is replayed by whoever
captures one handshake. So each connection presents instead:

* username ``IDENTITY;NONCE;TIME``: who the client is, 16 fresh random bytes, and the
  client's clock (unix seconds) when it configured the socket;
* password ``HMAC-SHA256(V, "ssdsgd plain hello v3" | username | BINDER)``, where BINDER
  is the identity of the process whose port it dials and ``V = HMAC-SHA256(own secret,
  "ssdsgd plain verification v3" | BINDER)`` is the client's verification key at that
  binder.

The binder holds ``V`` of each process of the job for its own identity only (the launcher
computes them), never a secret, so its key file lets nobody connect elsewhere; it admits a
handshake whose MAC checks, whose time is within ``WINDOW_S`` of its own clock, and whose
nonce it has not admitted before (:class:`ReplayWindow`, bounded). A captured handshake is
therefore refused by the binder it was made for (seen, or too old), and by any other (the
MAC names the binder). HMAC is used as documented (RFC 2104; as a PRF for ``V``), nothing
else.

What this cannot tell apart: ZeroMQ reconnects with the credentials the socket had, so a
connection dropped and reconnected is a replay and is refused too (the node then misses
heartbeats and the job fails naming it); curve mode has a fresh handshake per connection.
"""
import hashlib
import heapq
import hmac
import re
import secrets
import time

WINDOW_S = 120.0          # |binder's clock - client's clock at set-up| admitted
CAPACITY = 65536          # nonces remembered at once (only handshakes whose MAC checked)
JOB = "job"               # the name of every process holding the job's one key file
_VERIFY = b"ssdsgd plain verification v3\0"
_HELLO = b"ssdsgd plain hello v3\0"
_USER = re.compile(r"(job|scheduler|(?:server|worker) (?:0|[1-9][0-9]{0,6}));"
                   r"([0-9a-f]{32});(0|[1-9][0-9]{0,11})\Z")


def verification_key(secret, binder):
    """What ``binder`` holds to check the handshakes of the holder of ``secret``."""
    return hmac.new(secret, _VERIFY + binder.encode(), hashlib.sha256).digest()


def _mac(key, username, binder):
    return hmac.new(key, _HELLO + username.encode() + b"\0" + binder.encode(),
                    hashlib.sha256).hexdigest()


def credentials(secret, identity, binder, now=None):
    """(username, password) bytes for one connection of ``identity`` to ``binder``."""
    stamp = int(time.time() if now is None else now)
    username = f"{identity};{secrets.token_hex(16)};{stamp}"
    return username.encode(), _mac(verification_key(secret, binder), username,
                                   binder).encode()


def parse(username):
    """(identity, nonce, time) of a handshake's username, or None when malformed."""
    m = _USER.match(username)
    return (m.group(1), m.group(2), int(m.group(3))) if m else None


class ReplayWindow:
    """A binder's record of the handshakes it admitted within the window: a nonce is
    admitted once, and a time outside ``window`` of this clock never."""

    def __init__(self, window=WINDOW_S, capacity=CAPACITY):
        self.window, self.capacity = window, capacity
        self._expiry = []          # heap of (time the nonce stops mattering, nonce)
        self._seen = set()

    def check(self, key, username, password, binder, now=None):
        """None when the handshake (``key``: the verification key held for the identity
        it names) is admitted, and its nonce is remembered; else why not, in words."""
        parts = parse(username)
        if parts is None or not hmac.compare_digest(password.encode(),
                                                    _mac(key, username, binder).encode()):
            return "it does not hold a key of this job (wrong PLAIN handshake MAC)"
        now = time.time() if now is None else now
        while self._expiry and self._expiry[0][0] < now:
            self._seen.discard(heapq.heappop(self._expiry)[1])
        _, nonce, stamp = parts
        if abs(now - stamp) > self.window:
            return (f"its handshake is dated {stamp - now:+.0f} s from this host's clock "
                    f"(at most {self.window:g} s): a replayed handshake, or clocks that "
                    "disagree")
        if nonce in self._seen:
            return ("it replays a handshake already admitted (a captured handshake, or a "
                    "dropped connection reconnecting)")
        if len(self._seen) >= self.capacity:
            return (f"{self.capacity} handshakes were admitted within {self.window:g} s; "
                    "no more are remembered")
        self._seen.add(nonce)
        heapq.heappush(self._expiry, (stamp + self.window, nonce))
        return None
