"""Host lists and placement for the multi-host launchers (pure functions).

Host lists follow the two conventions MXNet and Horovod users know:

* a hostfile (``-H/--hostfile FILE``): one host a line, either dmlc-tracker's
  ``host[:port]`` (``port`` is the ssh port) or Horovod's / OpenMPI's ``host slots=N``
  (both at once: ``host:port slots=N``); blank lines and ``#`` comments are ignored;
* a list (``--hosts h1:2,h2:2`` or ``cluster.hosts: [h1:2, h2:2]``): Horovod's ``host:slots``.

Placement rule (docs/launch.md): the scheduler runs on the launcher's host unless told
otherwise; servers, then workers, take the hosts' slots round-robin: the first slot of
every host in list order, then the second slot of every host that has two, and so on,
wrapping around when there are more processes than slots.
"""
from __future__ import annotations

import dataclasses
import re


class HostError(ValueError):
    """A host list or hostfile is malformed; the message is one line naming the cause."""


@dataclasses.dataclass(frozen=True)
class Host:
    name: str                 # a hostname or IPv4 address, as ssh and mpirun take it
    slots: int = 1
    port: int | None = None   # ssh port (dmlc's host:port); None: ssh's default


def role_label(role, rank):
    """How a process is named in every line: 'scheduler', 'server 0', 'worker 3'."""
    return "scheduler" if role == "scheduler" else f"{role} {rank}"


@dataclasses.dataclass(frozen=True)
class Slot:
    role: str                 # scheduler, server or worker
    rank: int
    host: str                 # a Host.name, or LAUNCHER_HOST for the scheduler's default
    port: int | None = None

    @property
    def label(self):
        return role_label(self.role, self.rank)


LAUNCHER_HOST = ""            # the scheduler's host when nobody chose one: the launcher's
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def host_name(text, where):
    """``text`` if it is a host name or an IPv4 address (never one ssh would read as an
    option); HostError naming ``where`` if not."""
    if not _NAME.match(text) or text.startswith("-"):
        raise HostError(f"{where}: {text!r} is not a host name or IPv4 address")
    return text


def _positive(text, what, where):
    if not text.isdigit() or int(text) < 1:
        raise HostError(f"{where}: {what} must be an integer >= 1, got {text!r}")
    return int(text)


def parse_hostfile_line(line, where="hostfile"):
    """One hostfile line -> Host, or None for a blank or comment line."""
    text = line.split("#", 1)[0].strip()
    if not text:
        return None
    parts = text.split()
    head, opts = parts[0], parts[1:]
    name, sep, port = head.partition(":")
    host = Host(host_name(name, where), 1,
                _positive(port, "the ssh port (host:port)", where) if sep else None)
    for opt in opts:
        key, eq, value = opt.partition("=")
        if not eq:
            raise HostError(f"{where}: expected 'host[:port]' or 'host slots=N', got {text!r}")
        if key == "slots":
            host = dataclasses.replace(host, slots=_positive(value, "slots", where))
        elif key != "max_slots":          # OpenMPI's hostfile key; it does not change slots
            raise HostError(f"{where}: unknown key {key!r} (expected slots=N)")
    if host.port is not None and host.port > 65535:
        raise HostError(f"{where}: ssh port {host.port} is not a TCP port")
    return host


def parse_hostfile(text, source="hostfile"):
    """The hosts of a hostfile's text (``source`` names it in errors)."""
    hosts = []
    for i, line in enumerate(text.splitlines(), 1):
        host = parse_hostfile_line(line, f"{source}:{i}")
        if host is not None:
            hosts.append(host)
    return _check(hosts, source)


def read_hostfile(path):
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise HostError(f"hostfile {path}: cannot read it ({e.strerror})") from None
    return parse_hostfile(text, str(path))


def parse_hosts(items, source="--hosts"):
    """``"h1:2,h2:2"`` or ``["h1:2", "h2"]`` (Horovod's host[:slots]) -> hosts."""
    if isinstance(items, str):
        items = items.split(",")
    hosts = []
    for item in items:
        item = str(item).strip()
        if not item:
            raise HostError(f"{source}: empty host name in the list")
        name, sep, slots = item.partition(":")
        hosts.append(Host(host_name(name, source),
                          _positive(slots, f"slots of {name}", source) if sep else 1))
    return _check(hosts, source)


def _check(hosts, source):
    if not hosts:
        raise HostError(f"{source}: no hosts")
    seen = set()
    for h in hosts:
        if (h.name, h.port) in seen:
            raise HostError(f"{source}: host {h.name} is listed twice (give it slots=N)")
        seen.add((h.name, h.port))
    return hosts


def slot_order(hosts):
    """Every slot once, round-robin: first slot of each host, then second slots, ..."""
    order = []
    for j in range(max(h.slots for h in hosts)):
        order += [h for h in hosts if h.slots > j]
    return order


def place(hosts, num_workers, num_servers, scheduler=LAUNCHER_HOST):
    """The job's processes in start order (scheduler, servers, workers), each on a host."""
    if num_workers < 1 or num_servers < 1:
        raise HostError("placement needs at least one worker and one server")
    order = slot_order(hosts)
    sched_port = next((h.port for h in hosts if h.name == scheduler), None)
    plan = [Slot("scheduler", 0, scheduler, sched_port)]
    roles = [("server", r) for r in range(num_servers)] + \
            [("worker", r) for r in range(num_workers)]
    for i, (role, rank) in enumerate(roles):
        h = order[i % len(order)]
        plan.append(Slot(role, rank, h.name, h.port))
    return plan


def oversubscribed(hosts, num_workers, num_servers):
    """How many processes share a slot at most (1: none do)."""
    total = sum(h.slots for h in hosts)
    return -(-(num_workers + num_servers) // total)


def describe(plan, launcher_host="this host"):
    """One line per host: ``198.18.0.11: server 0, worker 1``, in the order first used."""
    by_host = {}
    for slot in plan:
        name = slot.host or f"{launcher_host} (the launcher's host)"
        by_host.setdefault(name, []).append(slot.label)
    return [f"{host}: {', '.join(labels)}" for host, labels in by_host.items()]
