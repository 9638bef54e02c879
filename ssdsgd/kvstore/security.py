"""Who may talk to a job: its keys, and ZeroMQ's security mechanisms on every socket.

The launcher makes a job's keys and hands them to every process of the job in a JSON file
of mode 0600 whose path is in ``SSDSGD_SECRET_FILE`` (never on a command line; the file is
removed when the job ends). The scheduler and the servers then admit a connection only
when its handshake proves it has the file -- checked by a ZAP handler before a single
message of the peer is read:

* ``plain`` (the local launcher's default): ZeroMQ's PLAIN mechanism; the client presents
  a token derived from the job's secret. Authenticated, not encrypted: for one machine or
  a trusted network.
* ``curve`` (``--secure``; the default of launchers that span hosts): ZeroMQ's CURVE; the
  job has one server and one client key pair, and only the job's client key is admitted.
  Authenticated and encrypted.
* ``open`` (no ``SSDSGD_SECRET_FILE``, e.g. nodes started by hand): any process that
  reaches a port may connect; nodes say so once when they start.

Inside the job, who a connection is comes from the scheduler: it binds a node to the
connection it registered on, and tells the servers which connection id is which worker
(``scheduler.py``, ``server.py``).
"""
import dataclasses
import hashlib
import hmac
import json
import os
import secrets
import shutil
import stat
import tempfile
import threading

import zmq
from zmq.utils import z85

ENV_VAR = "SSDSGD_SECRET_FILE"
ZAP_DOMAIN = "ssdsgd"
PLAIN_USER = b"ssdsgd"
_CURVE_FIELDS = ("server_public", "server_secret", "client_public", "client_secret")


class SecurityError(RuntimeError):
    """The job's keys are missing, unreadable, too readable or malformed."""


@dataclasses.dataclass(frozen=True)
class JobKeys:
    secret: bytes
    curve: dict | None = None       # z85 key strings, _CURVE_FIELDS; None: not encrypted

    @property
    def mode(self):
        return "curve" if self.curve else "plain"

    @property
    def token(self):
        """What a PLAIN client presents: proves it holds the secret, is not the secret."""
        return hmac.new(self.secret, b"ssdsgd job token v1", hashlib.sha256).hexdigest().encode()

    @classmethod
    def generate(cls, secure):
        curve = None
        if secure:
            if not zmq.has("curve"):
                raise SecurityError("--secure needs libzmq with CURVE support, which this "
                                    "pyzmq's libzmq lacks")
            server_public, server_secret = zmq.curve_keypair()
            client_public, client_secret = zmq.curve_keypair()
            curve = {k: v.decode() for k, v in zip(_CURVE_FIELDS, (
                server_public, server_secret, client_public, client_secret))}
        return cls(secrets.token_bytes(32), curve)

    def write(self, path):
        """Create ``path`` with mode 0600 (fails if it exists: never reuse a file)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"version": 1, "secret": self.secret.hex(), "curve": self.curve}, f)

    @classmethod
    def load(cls, path):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise SecurityError(f"{ENV_VAR}={path}: cannot open the job's keys: "
                                f"{e.strerror}") from None
        with os.fdopen(fd) as f:
            info = os.fstat(f.fileno())
            if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise SecurityError(f"{ENV_VAR}={path} has mode {stat.S_IMODE(info.st_mode):04o}; "
                                    "the job's keys must be readable by their owner only (0600)")
            try:
                data = json.load(f)
                secret = bytes.fromhex(data["secret"])
                curve = data.get("curve")
                if curve is not None:
                    curve = {k: str(curve[k]) for k in _CURVE_FIELDS}
                    for value in curve.values():
                        z85.decode(value.encode())
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise SecurityError(f"{ENV_VAR}={path}: not a job key file ({e!r:.80})") from None
        if len(secret) < 16:
            raise SecurityError(f"{ENV_VAR}={path}: the secret is too short")
        return cls(secret, curve)


def write_job_keys(directory, secure):
    """For launchers: the job's key file in ``directory`` (which should be private);
    returns its path, to be passed in SSDSGD_SECRET_FILE."""
    path = os.path.join(directory, "job-keys.json")
    JobKeys.generate(secure).write(path)
    return path


class KeyFile:
    """A launcher's keys for one job: a fresh file in a private (0700) directory,
    ``env`` to give every process, ``remove()`` when the job is over."""

    def __init__(self, secure=False):
        self.dir = tempfile.mkdtemp(prefix="ssdsgd-keys-")
        self.path = write_job_keys(self.dir, secure)
        self.env = {ENV_VAR: self.path}

    def remove(self):
        shutil.rmtree(self.dir, ignore_errors=True)


def _gate(ctx, keys, log):
    """The ZAP handler of a scheduler or server (pyzmq's authenticator thread, imported
    here: workers, which only connect, never load asyncio for it)."""
    from zmq.auth.thread import ThreadAuthenticator

    class Gate(ThreadAuthenticator):
        """Admits the job's processes only, and says (a bounded number of times) whom
        it refused."""

        def __init__(self):
            super().__init__(ctx)
            self.refused, self.peer = 0, "?"
            self._lock = threading.Lock()

        async def handle_zap_message(self, msg):
            self.peer = msg[3].decode("utf-8", "replace") if len(msg) > 3 else "?"
            await super().handle_zap_message(msg)

        def _refuse(self, why):
            with self._lock:
                self.refused += 1
                n = self.refused
            if n <= 10 or n % 1000 == 0:
                log(f"refused a connection from {self.peer}: {why} (refusal {n})")

        def _authenticate_plain(self, domain, username, password):
            ok = (username.encode() == PLAIN_USER
                  and hmac.compare_digest(password.encode(), keys.token))
            if not ok:
                self._refuse("it does not hold this job's key file (wrong PLAIN token)")
            return ok, b"OK" if ok else b"not a process of this job"

        def callback(self, domain, key):
            """CURVE: only the job's client key."""
            ok = hmac.compare_digest(key, keys.curve["client_public"].encode())
            if not ok:
                self._refuse("its CURVE key is not this job's")
            return ok

    return Gate()


class Guard:
    """This process's side of the job's transport security: options for the sockets it
    binds (``server``) and connects (``client``)."""

    def __init__(self, keys, log):
        self.keys, self.log, self.gate = keys, log, None

    @classmethod
    def from_env(cls, env, log):
        path = getattr(env, "secret_file", None) or None
        return cls(JobKeys.load(path) if path else None, log)

    @property
    def mode(self):
        return self.keys.mode if self.keys else "open"

    def server(self, ctx, sock):
        """Before ``bind``: the mechanism, and the ZAP handler that checks every peer."""
        if self.keys is None:
            return
        if self.gate is None:
            self.gate = _gate(ctx, self.keys, self.log)
            self.gate.start()
            if self.keys.curve:
                self.gate.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self.gate)
        sock.zap_domain = ZAP_DOMAIN.encode()
        if self.keys.curve:
            sock.curve_server = True
            sock.curve_secretkey = self.keys.curve["server_secret"].encode()
            sock.curve_publickey = self.keys.curve["server_public"].encode()
        else:
            sock.plain_server = True

    def client(self, sock):
        """Before ``connect``: prove to the scheduler and servers that this is the job's."""
        if self.keys is None:
            return
        if self.keys.curve:
            sock.curve_serverkey = self.keys.curve["server_public"].encode()
            sock.curve_publickey = self.keys.curve["client_public"].encode()
            sock.curve_secretkey = self.keys.curve["client_secret"].encode()
        else:
            sock.plain_username = PLAIN_USER
            sock.plain_password = self.keys.token

    def describe(self):
        return {"open": "open: no SSDSGD_SECRET_FILE, any process that reaches this port "
                        "may connect",
                "plain": "authenticated (the job's key file), not encrypted",
                "curve": "authenticated and encrypted (CURVE)"}[self.mode]

    def close(self):
        if self.gate is not None:
            self.gate.stop()
            self.gate = None
