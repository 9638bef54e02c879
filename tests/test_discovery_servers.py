"""What the host-discovery loop does with the job's servers on a host the script no
longer lists (ssdsgd/launch/discovery.py), with real child processes standing in for the
servers' ssh clients: with cluster.server_replicas: 1 the first such server is stopped
(its backup takes its keys), a second one stays (no replica is left), and with no
replicas every one stays; each is said once. The job-level run is
test_launch_remote.py's host-discovery test."""
import os
import sys
import time

import pytest

from ssdsgd.launch.discovery import HostDiscovery
from ssdsgd.launch.local import LocalProcess, start_child


def _servers(*hosts):
    return [LocalProcess("server", rank, start_child(
        [sys.executable, "-c", "import time; time.sleep(120)"], dict(os.environ)), host)
        for rank, host in enumerate(hosts)]


def _loop(servers, replicas, lines):
    return HostDiscovery("/bin/true", "/nonexistent", set(), 0, lines.append, None, None,
                         servers=servers, replicas=replicas)


def _ended(proc, timeout=10):
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc.poll() is not None


def _stop(servers):
    for p in servers:
        if p.poll() is None:
            p.signal(9)
        p.popen.wait(timeout=10)


def test_with_a_replica_the_first_server_of_a_gone_host_stops_and_a_second_stays():
    servers, lines = _servers("a", "b", "b"), []
    try:
        loop = _loop(servers, 1, lines)
        loop._stop_servers("b")
        assert _ended(servers[1]), "server 1 was not stopped"
        assert servers[0].poll() is None and servers[2].poll() is None
        assert lines == [
            "host discovery: b is no longer listed; server 1 stops there and its backup "
            "takes its keys (cluster.server_replicas: 1; no replica is left after it)",
            "host discovery: b is no longer listed; server 2 stays there (server 1 was lost "
            "before it and the job has no replica left)"]
        loop._stop_servers("b")          # the next poll: said once, nothing more stopped
        loop._stop_servers("a")
        assert servers[0].poll() is None and len(lines) == 3
        assert lines[2].startswith("host discovery: a is no longer listed; server 0 stays "
                                   "there (server 1 was lost before it")
    finally:
        _stop(servers)


@pytest.mark.parametrize("replicas, why", [
    (0, "no backup holds its keys (cluster.server_replicas: 0)"),
    (1, "server 0 was lost before it and the job has no replica left")])
def test_a_server_stays_without_replicas_or_once_a_server_was_lost(replicas, why):
    """Server 0 died before; its host's other server (rank 1) is the one on the host
    that goes: it stays, named with the reason; the dead one is not named."""
    servers, lines = _servers("a", "a"), []
    try:
        servers[0].signal(9)
        assert _ended(servers[0])
        _loop(servers, replicas, lines)._stop_servers("a")
        assert servers[1].poll() is None
        assert lines == [f"host discovery: a is no longer listed; server 1 stays there "
                         f"({why})"]
    finally:
        _stop(servers)
