"""Who may talk to a job: its keys, and ZeroMQ's security mechanisms on every socket.

The launcher makes the job's keys and hands each process its own in a JSON file of mode
0600 whose path is in ``SSDSGD_SECRET_FILE`` (never on a command line; the files are
removed when the job ends). Whoever binds a port (the scheduler, a server, a worker's pull
relay) admits a connection only when its handshake proves it holds a key of the job --
checked by a ZAP handler before a single message of the peer is read:

* ``plain`` (the local launcher's default): ZeroMQ's PLAIN mechanism; the client presents
  its name, a fresh nonce, the time and a MAC of them made for the port it dials
  (``plain_handshake.py``: no replayable token). Authenticated, not encrypted: for one
  machine or a trusted network.
* ``aesgcm`` (``--secure``; the default of launchers that span hosts): plain mode's
  handshake, then every frame sealed with AES-256-GCM under the connection's own keys,
  outside libzmq (``sealing.py``). Authenticated and encrypted.
* ``curve`` (``--secure --cipher curve``): ZeroMQ's CURVE. Authenticated and encrypted,
  in libzmq's I/O thread.
* ``open`` (no ``SSDSGD_SECRET_FILE``, e.g. nodes started by hand): any process that
  reaches a port may connect; nodes say so once when they start.

Two kinds of key file:

* a process's own (``NodeKeys``, version 2; what the launcher makes): one identity --
  ``scheduler``, ``server R`` or ``worker R`` -- with its own secret (a PLAIN secret, or a
  CURVE key pair) and, of every process of the job, only what checks it at this process's
  own port (its PLAIN verification key for this binder, or its CURVE public key). The
  handshake tells the receiver *who* the peer is (ZeroMQ's User-Id); the scheduler admits
  a REGISTER only for the role and rank of the key, a server a worker's messages only on
  the connection of that worker's key, so a process that read one worker's file can be
  that worker, never another rank (plain mode: and any worker at that worker's own relay
  port, whose verification keys the file holds);
* the job's (``JobKeys``, version 1: nodes started by hand, tests): one secret for all,
  so it proves membership of the job, not a rank (plain mode: its handshakes name no
  node, so one captured on its way to a node can be replayed to another within the
  window, ``plain_handshake.WINDOW_S``).

The ZAP handler itself is ``zap_gate.py``.

Inside the job, who a connection is comes from the scheduler: it binds a node to the
connection it registered on, and tells the servers which connection id is which worker
(``scheduler.py``, ``server.py``).
"""
import dataclasses
import hmac
import json
import os
import re
import secrets
import shutil
import stat
import tempfile

import zmq
from zmq.utils import z85

from . import plain_handshake as PH, sealing, zap_gate

ENV_VAR = "SSDSGD_SECRET_FILE"
ZAP_DOMAIN = "ssdsgd"
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
        _create_private(path, {"version": 1, "secret": self.secret.hex(), "curve": self.curve})

    @classmethod
    def load(cls, path):
        return cls.from_json(_read_private(path), path)

    @classmethod
    def from_json(cls, data, path):
        try:
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

    identity = None        # any rank: the job's file proves membership only

    def serve(self, sock):
        if self.curve:
            sock.curve_server = True
            sock.curve_secretkey = self.curve["server_secret"].encode()
            sock.curve_publickey = self.curve["server_public"].encode()
        else:
            sock.plain_server = True

    def connect(self, sock, peer):
        if self.curve:
            sock.curve_serverkey = self.curve["server_public"].encode()
            sock.curve_publickey = self.curve["client_public"].encode()
            sock.curve_secretkey = self.curve["client_secret"].encode()
        else:      # every holder is "job", and so is every binder: a MAC names no node
            sock.plain_username, sock.plain_password = PH.credentials(self.secret, PH.JOB,
                                                                      PH.JOB)

    def plain_key(self, name):
        """(the identity a PLAIN handshake as ``name`` proves: "" for any rank, its
        verification key here), or None: not a process of this job."""
        return ("", PH.verification_key(self.secret, PH.JOB)) if name == PH.JOB else None

    binder = PH.JOB

    def admit_curve(self, key):
        return "" if hmac.compare_digest(key, self.curve["client_public"].encode()) else None

    def may_connect(self, name):
        return True


def identity(role, rank):
    """The name a process's key is issued to."""
    return "scheduler" if role == "scheduler" else f"{role} {rank}"


def claim_error(who, role, rank):
    """None if a connection holding ``who``'s key (None: keys name no node) may act as
    ``role`` ``rank``; else why not, in one line."""
    claimed = identity(role, rank)
    if who is None or who == claimed:
        return None
    return (f"a connection holding {who}'s key cannot act as {claimed} (each process "
            "holds its own key; SSDSGD_SECRET_FILE)")


# Whose processes connect to the ports of a role: the scheduler's, servers and workers;
# a server's, workers only (with cluster.server_replicas: 1 also servers, REPLICA_LINKS:
# the server whose keys it backs up sends its sums, kvstore/chain.py); a worker's pull
# relay, workers only.
CONNECTS_TO = {"scheduler": ("server", "worker"), "server": ("worker",), "worker": ("worker",)}
REPLICA_LINKS = {"server": ("server",)}
_IDENTITY = re.compile(r"(scheduler|(server|worker) (0|[1-9][0-9]{0,6}))\Z")


@dataclasses.dataclass(frozen=True)
class NodeKeys:
    """One process's keys (version 2): its ``identity``, its own secret (``own``: a PLAIN
    secret, or a CURVE key pair) and, per identity of the job, what checks that process at
    this one's port (``peers``: its PLAIN verification key for this binder, or its CURVE
    public key) -- never another's secret, nor what checks it at another port."""
    identity: str
    curve: bool
    own: dict
    peers: dict
    sealed: bool = False      # aesgcm: plain mode's keys, every frame sealed (sealing.py)
    replicas: bool = False    # the job has server replicas: servers connect to servers

    @property
    def mode(self):
        return "curve" if self.curve else "aesgcm" if self.sealed else "plain"

    @classmethod
    def generate_job(cls, secure, identities, cipher="curve"):
        """{identity: NodeKeys} of a job: a fresh secret for every process; ``secure``
        with ``cipher`` aesgcm or curve."""
        if secure and cipher == "aesgcm":
            return {name: dataclasses.replace(keys, sealed=True)
                    for name, keys in cls.generate_job(False, identities).items()}
        if secure and not zmq.has("curve"):
            raise SecurityError("--secure needs libzmq with CURVE support, which this "
                                "pyzmq's libzmq lacks")
        own = {}
        for name in identities:
            if secure:
                public, secret = zmq.curve_keypair()
                own[name] = {"public": public.decode(), "secret": secret.decode()}
            else:
                own[name] = {"secret": secrets.token_hex(32)}
        if secure:
            public = {name: mine["public"] for name, mine in own.items()}
            return {name: cls(name, True, own[name], public) for name in identities}
        return {name: cls(name, False, own[name], {
            peer: PH.verification_key(bytes.fromhex(own[peer]["secret"]), name).hex()
            for peer in identities}) for name in identities}

    def write(self, path):
        _create_private(path, {"version": 2, "identity": self.identity, "mode": self.mode,
                               "own": self.own, "peers": self.peers})

    @classmethod
    def from_json(cls, data):
        """Raises ValueError/KeyError/TypeError on anything but a version 2 file."""
        name, mode, own, peers = data["identity"], data["mode"], data["own"], data["peers"]
        if mode not in ("plain", "curve", "aesgcm") or not isinstance(peers, dict):
            raise ValueError(f"mode {mode!r}")
        for who in [name] + list(peers):
            if not isinstance(who, str) or not _IDENTITY.match(who):
                raise ValueError(f"identity {who!r}")
        if name not in peers:
            raise ValueError("its own identity is not among the job's")
        if mode == "curve":
            own = {k: str(own[k]) for k in ("public", "secret")}
            for value in list(own.values()) + list(peers.values()):
                z85.decode(str(value).encode())
            if own["public"] != peers[name]:
                raise ValueError("its public key is not the job's record of it")
        else:
            own = {"secret": str(own["secret"])}
            if len(bytes.fromhex(own["secret"])) < 16:
                raise ValueError("the secret is too short")
            for value in peers.values():
                if len(bytes.fromhex(str(value))) != 32:
                    raise ValueError("a verification key is not 32 bytes")
        return cls(name, mode == "curve", own, {k: str(v) for k, v in peers.items()},
                   mode == "aesgcm")

    def serve(self, sock):
        if self.curve:
            sock.curve_server = True
            sock.curve_secretkey = self.own["secret"].encode()
            sock.curve_publickey = self.own["public"].encode()
        else:
            sock.plain_server = True

    def connect(self, sock, peer):
        """``peer``: the identity of the process that bound the port (CURVE checks it
        is that process, by its public key). The connection's channel: what seals its
        frames (aesgcm), or ``sealing.PLAIN``."""
        if self.curve:
            if peer not in self.peers:
                raise SecurityError(f"{peer} has no key in this job's key file")
            sock.curve_serverkey = self.peers[peer].encode()
            sock.curve_publickey = self.own["public"].encode()
            sock.curve_secretkey = self.own["secret"].encode()
            return sealing.PLAIN
        secret = bytes.fromhex(self.own["secret"])
        sock.plain_username, sock.plain_password = PH.credentials(secret, self.identity, peer)
        if not self.sealed:
            return sealing.PLAIN
        return sealing.Channel(*sealing.session_keys(
            PH.verification_key(secret, peer), sock.plain_username.decode(), peer))

    def plain_key(self, name):
        """(``name``, its verification key at this process's port), or None: no process
        of this job."""
        key = self.peers.get(name)
        return (name, bytes.fromhex(key)) if key is not None else None

    @property
    def binder(self):
        return self.identity

    def admit_curve(self, key):
        key = key.decode() if isinstance(key, bytes) else key
        for name, public in self.peers.items():
            if hmac.compare_digest(public, key):
                return name
        return None

    def may_connect(self, name):
        """Does a process of ``name`` ever connect to this process's ports?"""
        role = self.identity.split(" ")[0]
        return name.split(" ")[0] in CONNECTS_TO[role] + (
            REPLICA_LINKS.get(role, ()) if self.replicas else ())


def _create_private(path, data):
    """Create ``path`` with mode 0600 (fails if it exists: never reuse a file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)


def _read_private(path):
    """The JSON of a key file that only its owner can read."""
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
        except (ValueError, UnicodeDecodeError) as e:
            raise SecurityError(f"{ENV_VAR}={path}: not a job key file ({e!r:.80})") from None
    if not isinstance(data, dict):
        raise SecurityError(f"{ENV_VAR}={path}: not a job key file (not a JSON object)")
    return data


def load_keys(path):
    """A process's keys from ``path``: its own (version 2) or the job's (version 1)."""
    data = _read_private(path)
    if data.get("version") != 2:
        return JobKeys.from_json(data, path)
    try:
        return NodeKeys.from_json(data)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise SecurityError(f"{ENV_VAR}={path}: not a process's key file ({e!r:.80})") from None


def write_job_keys(directory, secure):
    """For launchers: the job's key file in ``directory`` (which should be private);
    returns its path, to be passed in SSDSGD_SECRET_FILE."""
    path = os.path.join(directory, "job-keys.json")
    JobKeys.generate(secure).write(path)
    return path


class KeyFile:
    """A launcher's keys for one job in a private (0700) directory, made in ``parent``
    (default: the system's temporary directory), ``remove()`` when the job is over. With
    ``identities`` (the launcher's): one file per process, ``env_for(role, rank)`` for
    each; without: the job's one file, ``env`` for every process (nodes started by hand,
    tests)."""

    def __init__(self, secure=False, identities=None, parent=None, cipher="curve"):
        self.dir = tempfile.mkdtemp(prefix=".ssdsgd-keys-" if parent else "ssdsgd-keys-",
                                    dir=parent)
        self.files = {}
        if identities is None:
            self.path = write_job_keys(self.dir, secure)
            self.env = {ENV_VAR: self.path}
            return
        self.path, self.env = None, {}
        for name, keys in NodeKeys.generate_job(secure, identities, cipher).items():
            path = self.files[name] = os.path.join(self.dir, f"keys-{name.replace(' ', '-')}.json")
            keys.write(path)

    def env_for(self, role, rank):
        """The variables of one process: the path of its own key file."""
        if not self.files:
            return dict(self.env)
        return {ENV_VAR: self.files[identity(role, rank)]}

    def remove(self):
        shutil.rmtree(self.dir, ignore_errors=True)


class Guard:
    """This process's side of the job's transport security: options for the sockets it
    binds (``server``) and connects (``client``)."""

    def __init__(self, keys, log):
        self.keys, self.log, self.gate = keys, log, None

    @classmethod
    def from_env(cls, env, log):
        path = getattr(env, "secret_file", None) or None
        keys = load_keys(path) if path else None
        if isinstance(keys, NodeKeys) and getattr(env, "server_replicas", 0):
            keys = dataclasses.replace(keys, replicas=True)     # REPLICA_LINKS
        return cls(keys, log)

    @property
    def mode(self):
        return self.keys.mode if self.keys else "open"

    def server(self, ctx, sock):
        """Before ``bind``: the mechanism, and the ZAP handler that checks every peer."""
        if self.keys is None:
            return
        if self.gate is None:
            self.gate = zap_gate.make_gate(ctx, self.keys, self.log)
            self.gate.start()
            if self.keys.curve:
                self.gate.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self.gate)
        sock.zap_domain = ZAP_DOMAIN.encode()
        self.keys.serve(sock)

    def client(self, sock, peer="scheduler"):
        """Before ``connect`` to ``peer`` (the identity of the process that bound the
        port: ``scheduler``, ``server R``, ``worker R``): prove that this is the job's.
        Returns the connection's channel (``sealing``): what every message sent on it
        goes through, and every message received."""
        channel = self.keys.connect(sock, peer) if self.keys is not None else None
        return sealing.use(sock, channel or sealing.PLAIN)

    def binder_channels(self):
        """The channels of a port this process bound with ``server`` (by connection)."""
        if self.keys is None or self.keys.mode != "aesgcm":
            return sealing.PLAIN_BINDER
        return sealing.BinderChannels(self.gate.sessions)

    def sender(self, frame):
        """Whose key the connection that delivered ``frame`` (a zmq.Frame) proved, e.g.
        "worker 1"; None when keys bind no rank (the job's one file, or open mode)."""
        if self.keys is None or self.keys.identity is None:
            return None
        try:
            # aesgcm: "identity#nonce", the nonce naming the connection's session
            return (frame.get("User-Id") or "nobody").partition("#")[0]
        except (zmq.ZMQError, AttributeError):
            return "nobody"

    def wrong_claim(self, frame, role, rank):
        """None if the connection of ``frame`` may act as ``role`` ``rank``; else why not,
        in one line."""
        return claim_error(self.sender(frame), role, rank)

    def describe(self):
        return {"open": "open: no SSDSGD_SECRET_FILE, any process that reaches this port "
                        "may connect",
                "plain": "authenticated (the job's key file), not encrypted",
                "curve": "authenticated and encrypted (CURVE)",
                "aesgcm": "authenticated and encrypted (AES-256-GCM on every frame)"}[self.mode]

    def close(self):
        if self.gate is not None:
            self.gate.stop()
            self.gate = None
