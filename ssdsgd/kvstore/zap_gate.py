"""The ZAP handler of a process's bound ports: who may connect, decided in ZeroMQ's
handshake before a single message of the peer is read (``security.Guard.server``).

PLAIN (plain mode): the handshake must carry a MAC this process can check, fresh and
never seen (``plain_handshake.py``), and the User-Id it gives the connection is the
identity the MAC proves. CURVE: the client's public key must be one of the job's, and
the User-Id is the identity it was issued to. Either way the identity must be of a role
that connects to this process's ports (``keys.may_connect``). Refusals are logged, a
bounded number of times.
"""
import threading

from zmq.utils import z85

from . import plain_handshake as PH, sealing


def plain_identity(keys, replays, username, password, sessions=None):
    """(the identity a PLAIN handshake proves, None): "" for the job's one file; or
    (None, why not). ``replays``: the binder's plain_handshake.ReplayWindow. With
    ``sessions`` (aesgcm): the connection's keys go there by its nonce, and the identity
    names it (``identity#nonce``, the User-Id ``sealing.BinderChannels`` reads)."""
    parts = PH.parse(username)
    held = keys.plain_key(parts[0]) if parts else None
    if held is None:
        return None, "it does not hold a key of this job (not this job's PLAIN handshake)"
    why = replays.check(held[1], username, password, keys.binder)
    if why:
        return None, why
    if sessions is None:
        return held[0], None
    if len(sessions) >= PH.CAPACITY:
        return None, f"{PH.CAPACITY} sealed sessions wait for their first message"
    sessions[parts[1]] = sealing.session_keys(held[1], username, keys.binder)
    return f"{held[0]}#{parts[1]}", None


def make_gate(ctx, keys, log):
    """The ZAP handler of a process that binds a port (pyzmq's authenticator thread,
    imported here: a worker without a pull relay only connects, and never loads asyncio
    for it); ``keys``: a security.NodeKeys or JobKeys; not started."""
    from zmq.auth.base import VERSION
    from zmq.auth.thread import ThreadAuthenticator

    class Gate(ThreadAuthenticator):
        """Admits the job's processes only, and says (a bounded number of times) whom
        it refused."""

        def __init__(self):
            super().__init__(ctx)
            self.refused, self.peer = 0, "?"
            self._lock = threading.Lock()
            self._names = {}      # a CURVE key (raw) -> the identity it was issued to
            self._replays = PH.ReplayWindow()
            # aesgcm: the keys of each admitted connection, by its handshake's nonce,
            # until its first message binds them to it (sealing.BinderChannels)
            self.sessions = {} if keys.mode == "aesgcm" else None

        async def handle_zap_message(self, msg):
            self.peer = msg[3].decode("utf-8", "replace") if len(msg) > 3 else "?"
            if len(msg) == 8 and msg[0] == VERSION and msg[5] == b"PLAIN":
                name, why = plain_identity(keys, self._replays,
                                           *(c.decode("utf-8", "replace") for c in msg[6:]),
                                           sessions=self.sessions)
                ok = name == "" or self._admitted(name and name.partition("#")[0], why)
                if not ok and name and "#" in name:
                    self.sessions.pop(name.partition("#")[2], None)
                self._send_zap_reply(msg[1], b"200" if ok else b"400",
                                     b"OK" if ok else b"not a process of this job", name or "")
                return
            await super().handle_zap_message(msg)

        def _refuse(self, why):
            with self._lock:
                self.refused += 1
                n = self.refused
            if n <= 10 or n % 1000 == 0:
                log(f"refused a connection from {self.peer}: {why} (refusal {n})")

        def _admitted(self, name, wrong):
            if name is None:
                self._refuse(wrong)
            elif not keys.may_connect(name):
                self._refuse(f"it holds {name}'s key, and no {name.split(' ')[0]} connects "
                             "to this port")
            else:
                return True
            return False

        def callback(self, domain, key):
            """CURVE: only the job's keys; remembers whose key it is (the User-Id)."""
            name = keys.admit_curve(key)
            if not self._admitted(name, "its CURVE key is not one of this job's"):
                return False
            self._names[z85.decode(key)] = name
            return True

        def curve_user_id(self, client_public_key):
            return self._names.get(client_public_key, "")

    return Gate()
