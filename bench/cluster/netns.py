"""An emulated cluster on one machine: one network namespace per host, a switch, tc.

Topology (every name carries this process's pid, so parallel runs and a crashed run's
leftovers never collide)::

    ssdb-<pid>-sw   the switch: a bridge b<pid> and, per host i, the veth end s<pid>-<i>
    ssdb-<pid>-h<i> host i: loopback and the veth end h<pid>-<i> with 198.18.0.<10+i>/24

The root namespace is not touched at all (no bridge, no veth, no firewall rule there):
the switch is a namespace of its own, so a root firewall (e.g. Docker's FORWARD DROP with
br_netfilter) cannot interfere, and the addresses (RFC 2544's benchmarking range) exist
only inside the run's namespaces.

Shaping: every host's link is shaped in both directions with a token bucket (tbf) at the
configured rate: egress on the host's own veth end (what the host sends, its uplink) and
egress on the switch's end of the same veth (what the switch delivers to the host, its
downlink). That is a full-duplex switch port of that rate: a server receiving N pushes at
once shares its one downlink between them, as behind a real NIC. An optional one-way
latency uses netem (root) with tbf below it, when the kernel has netem.

Everything is removed by :meth:`Cluster.close` (processes still inside a namespace are
killed first); :func:`clean_stale` removes the namespaces of runs whose process is gone.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time

from ssdsgd.launch.local import process_exists

PREFIX = 'ssdb-'
SUBNET = '198.18.0.'          # RFC 2544 benchmarking range; never routed anywhere
HOST_BASE = 10                # host i is 198.18.0.<HOST_BASE + i>
_NAME_RE = re.compile(r'^ssdb-(\d+)-(sw|h\d+)$')


class NetnsUnavailable(RuntimeError):
    """Network namespaces (or tc) cannot be used here; the message says why."""


def _ip(*args, check=True, capture=False):
    r = subprocess.run(['ip', *args], stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f'ip {" ".join(args)}: {r.stderr.strip()}')
    return r


def _tc(ns, *args, check=True):
    r = subprocess.run(['ip', 'netns', 'exec', ns, 'tc', *args], stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f'tc {" ".join(args)} (in {ns}): {r.stderr.strip()}')
    return r


def list_namespaces():
    r = _ip('netns', 'list', check=False, capture=True)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def namespace_pids(ns):
    r = _ip('netns', 'pids', ns, check=False, capture=True)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def kill_inside(ns):
    """SIGKILL every process inside ``ns`` (all of them were started by a run of this
    harness: the namespace exists only for it); returns their pids."""
    pids = namespace_pids(ns)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return pids


def _delete(ns):
    kill_inside(ns)
    for _ in range(20):
        if _ip('netns', 'del', ns, check=False).returncode == 0 or ns not in list_namespaces():
            return True
        time.sleep(0.1)
    return False


def clean_stale(log=print):
    """Remove the namespaces of earlier runs whose harness process no longer exists."""
    removed = []
    for ns in list_namespaces():
        m = _NAME_RE.match(ns)
        if not m:
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or process_exists(pid):
            continue      # ours, or a run still going (parallel runs must not collide)
        if _delete(ns):
            removed.append(ns)
    if removed:
        log(f'removed {len(removed)} namespaces left by earlier runs: {", ".join(removed)}')
    return removed


def check_available():
    """Raise NetnsUnavailable with the reason when namespaces cannot be made here."""
    if os.geteuid() != 0:
        raise NetnsUnavailable('the emulated cluster needs root (network namespaces, veth, '
                               'tc); run it as root, e.g. with sudo')
    for tool in ('ip', 'tc'):
        if subprocess.run(['which', tool], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode != 0:
            raise NetnsUnavailable(f'{tool!r} (iproute2) is not installed')
    probe = f'{PREFIX}{os.getpid()}-probe'
    r = _ip('netns', 'add', probe, check=False)
    if r.returncode != 0:
        raise NetnsUnavailable(f'cannot create a network namespace: {r.stderr.strip()}')
    try:
        r = _ip('-n', probe, 'link', 'add', 'p0', 'type', 'veth', 'peer', 'name', 'p1',
                check=False)
        if r.returncode != 0:
            raise NetnsUnavailable(f'cannot create a veth pair: {r.stderr.strip()}')
        r = _tc(probe, 'qdisc', 'add', 'dev', 'p0', 'root', 'tbf', 'rate', '1gbit',
                'burst', '256kb', 'latency', '10ms', check=False)
        if r.returncode != 0:
            raise NetnsUnavailable(f'tc tbf does not work: {r.stderr.strip()}')
    finally:
        _delete(probe)


def netem_available():
    probe = f'{PREFIX}{os.getpid()}-probe'
    _ip('netns', 'add', probe, check=False)
    try:
        return _tc(probe, 'qdisc', 'add', 'dev', 'lo', 'root', 'netem', 'delay', '1ms',
                   check=False).returncode == 0
    finally:
        _delete(probe)


def parse_rate(text):
    """'1gbit', '10Gbit', '100mbit', '500kbit' or a number of bit/s -> bit/s (float)."""
    m = re.fullmatch(r'\s*([0-9.]+)\s*([kmgt]?)(bit|bps)?\s*', str(text).lower())
    if not m:
        raise ValueError(f'rate {text!r}: expected e.g. 1gbit, 10gbit, 100mbit')
    value = float(m.group(1)) * {'': 1, 'k': 1e3, 'm': 1e6, 'g': 1e9, 't': 1e12}[m.group(2)]
    if m.group(3) == 'bps':
        value *= 8
    return value


def rate_label(bits):
    for unit, f in (('Gbit/s', 1e9), ('Mbit/s', 1e6), ('kbit/s', 1e3)):
        if bits >= f:
            return f'{bits / f:g} {unit}'
    return f'{bits:g} bit/s'


class Cluster:
    """``hosts`` network namespaces behind one switch; shape with :meth:`shape`.

    Use as a context manager (or call close()); close() runs at most once."""

    def __init__(self, hosts, log=None, mtu=1500):
        self.pid = os.getpid()
        self.log = log or (lambda text: None)
        self.switch = f'{PREFIX}{self.pid}-sw'
        self.bridge = f'b{self.pid}'
        self.names = [f'{PREFIX}{self.pid}-h{i}' for i in range(hosts)]
        self.devs = [f'h{self.pid}-{i}' for i in range(hosts)]      # the host's end
        self.ports = [f's{self.pid}-{i}' for i in range(hosts)]     # the switch's end
        self.addresses = [f'{SUBNET}{HOST_BASE + i}' for i in range(hosts)]
        self.mtu = mtu
        self.rate_bits = None
        self.latency_ms = 0.0
        self._made = []
        self._closed = False
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ---- set-up and tear-down ----------------------------------------------------------
    def _add_ns(self, ns):
        _ip('netns', 'add', ns)
        self._made.append(ns)
        _ip('-n', ns, 'link', 'set', 'lo', 'up')

    def _build(self):
        self._add_ns(self.switch)
        _ip('-n', self.switch, 'link', 'add', self.bridge, 'type', 'bridge')
        _ip('-n', self.switch, 'link', 'set', self.bridge, 'up')
        for ns, dev, port, addr in zip(self.names, self.devs, self.ports, self.addresses):
            self._add_ns(ns)
            _ip('-n', self.switch, 'link', 'add', port, 'mtu', str(self.mtu), 'type', 'veth',
                'peer', 'name', dev, 'mtu', str(self.mtu), 'netns', ns)
            _ip('-n', self.switch, 'link', 'set', port, 'master', self.bridge)
            _ip('-n', self.switch, 'link', 'set', port, 'up')
            _ip('-n', ns, 'addr', 'add', f'{addr}/24', 'dev', dev)
            _ip('-n', ns, 'link', 'set', dev, 'up')
        self.log(f'made {len(self.names)} hosts ({self.addresses[0]}..{self.addresses[-1]}) '
                 f'behind switch {self.switch}')

    def close(self):
        if self._closed:
            return
        self._closed = True
        for ns in self._made:          # kill what runs inside first: a namespace with a
            kill_inside(ns)           # process in it outlives `ip netns del`
        left = [ns for ns in reversed(self._made) if not _delete(ns)]
        self._made = []
        if left:
            self.log(f'could not remove namespaces: {", ".join(left)}')

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- shaping -----------------------------------------------------------------------
    def shape(self, rate_bits, latency_ms=0.0):
        """Every host link: ``rate_bits`` each way (tbf), plus ``latency_ms`` one way
        (netem, each direction gets half) when > 0."""
        burst = max(int(rate_bits / 8 * 0.002), 32 * 1024)   # 2 ms of traffic, >= 32 KB
        rate = f'{int(rate_bits)}bit'
        for ns, dev, port in zip(self.names, self.devs, self.ports):
            for where, d in ((ns, dev), (self.switch, port)):
                _tc(where, 'qdisc', 'del', 'dev', d, 'root', check=False)
                tbf = ['tbf', 'rate', rate, 'burst', str(burst), 'latency', '20ms']
                if latency_ms > 0:
                    _tc(where, 'qdisc', 'add', 'dev', d, 'root', 'handle', '1:', 'netem',
                        'delay', f'{latency_ms / 2:g}ms', 'limit', '100000')
                    _tc(where, 'qdisc', 'add', 'dev', d, 'parent', '1:', 'handle', '2:', *tbf)
                else:
                    _tc(where, 'qdisc', 'add', 'dev', d, 'root', *tbf)
        self.rate_bits, self.latency_ms = rate_bits, latency_ms

    def qdisc_summary(self, i=0):
        """`tc qdisc show` of host i's two shaped ends (for the record)."""
        out = []
        for where, d in ((self.names[i], self.devs[i]), (self.switch, self.ports[i])):
            r = subprocess.run(['ip', 'netns', 'exec', where, 'tc', 'qdisc', 'show', 'dev', d],
                               capture_output=True, text=True)
            out.append(f'{where} {d}: {r.stdout.strip()}')
        return out

    def counters(self):
        """{host index: (tx_bytes, rx_bytes)} seen at the switch end (tx = to the host)."""
        res = {}
        for i, port in enumerate(self.ports):
            vals = []
            for what in ('tx_bytes', 'rx_bytes'):
                r = subprocess.run(['ip', 'netns', 'exec', self.switch, 'cat',
                                    f'/sys/class/net/{port}/statistics/{what}'],
                                   capture_output=True, text=True)
                vals.append(int(r.stdout.strip() or 0))
            res[i] = tuple(vals)
        return res

    # ---- running things on a host ------------------------------------------------------
    def prefix(self, i):
        return ['ip', 'netns', 'exec', self.names[i]]

    def popen(self, i, cmd, **kw):
        kw.setdefault('start_new_session', True)
        return subprocess.Popen(self.prefix(i) + list(cmd), **kw)
