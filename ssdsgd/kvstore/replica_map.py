"""cluster.server_replicas: 1. Which server backs up which, and who owns a dead server's
keys: pure, the same on the scheduler, every server and every worker.

Server s's keys are backed up on server (s + 1) mod S, which receives a copy of every
request for them (``Flag.BACKUP``) and so applies the same steps in the same rank order:
the same weights, bit for bit. When s dies its backup owns its keys. After one death the
job has no replica left: nothing is copied any more, and a second death ends the job.
"""
import dataclasses

from . import protocol as P


class ReplicaError(ValueError):
    """A server died that no backup can replace."""


class ReplicaMap:
    def __init__(self, num_servers, replicas):
        self.num_servers = num_servers
        self.replicas = replicas if num_servers > 1 else 0
        self.dead = {}            # dead server -> the server that owns its keys

    @property
    def copying(self):
        """Are requests copied to backups? Only while no server has died."""
        return bool(self.replicas) and not self.dead

    def backup(self, server):
        """The server that receives copies of ``server``'s requests, or None."""
        return (server + 1) % self.num_servers if self.copying else None

    def owner(self, server):
        """Who serves the keys placed on ``server`` now."""
        return self.dead.get(server, server)

    def lose(self, server):
        """``server`` died: the server that owns its keys from now on (its backup), or
        ReplicaError saying why none can."""
        if not self.replicas:
            raise ReplicaError("cluster.server_replicas is 0: its keys have no backup")
        if self.dead:
            first = next(iter(self.dead))
            raise ReplicaError(f"server {first} died before it, and the job has no replica "
                               "left")
        owner = (server + 1) % self.num_servers
        self.dead[server] = owner
        return owner

    def take(self, dead, owner):
        """Told (a TAKEOVER) that ``owner`` owns ``dead``'s keys: check it is its backup."""
        expected = self.backup(dead)
        if expected is None or dead in self.dead or owner != expected:
            return (f"server {owner} says it took over server {dead}'s keys, but "
                    + ("this job copies no requests" if expected is None else
                       f"server {expected} is that server's backup"))
        self.dead[dead] = owner
        return None


class Routes:
    """A worker's placement as sent now: each slice to its server's owner (``split``
    reads ``routes[key]``, as it reads a ``sharding.Placement``)."""

    def __init__(self, placement, replicas):
        self.placement, self.replicas = placement, replicas

    def __getitem__(self, key):
        slices = self.placement[key]
        if not self.replicas.dead:
            return slices
        return [dataclasses.replace(sl, server=self.replicas.owner(sl.server)) for sl in slices]

    def and_backups(self):
        """A placement that also sends each slice to its backup (COMMAND set_state: the
        backup loads the optimizer state of the keys it backs up in the same message)."""
        return _AndBackups(self)


class _AndBackups:
    def __init__(self, routes):
        self.routes = routes

    def __getitem__(self, key):
        slices = self.routes[key]
        backups = [dataclasses.replace(sl, server=b) for sl in slices
                   if (b := self.routes.replicas.backup(sl.server)) is not None]
        return slices + backups


COPIED = (P.Kind.INIT, P.Kind.PUSH, P.Kind.PULL)


def backup_copies(replicas, encoded):
    """{server: [(its backup, frames), ...]}: a copy of each INIT, PUSH, PULL and
    get_state message of ``encoded`` ((server, Message, frames), numbered) for the
    server's backup, with the same request id and the BACKUP flag (kvstore/backup.py),
    a push's without its tensors (the owner hands the backup its sum, chain.py); none
    while no request is copied."""
    copies = {}
    for server, msg, frames in encoded:
        backup = replicas.backup(server)
        if backup is not None and (msg.kind in COPIED or (
                msg.kind == P.Kind.COMMAND and msg.meta["command"] == "get_state")):
            flags = msg.flags | P.Flag.BACKUP     # a push's without its tensors (chain.py)
            copies.setdefault(server, []).append((backup, P.without_tensors(msg, flags)
                                                  if msg.kind == P.Kind.PUSH else
                                                  P.reflag(frames, flags)))
    return copies
