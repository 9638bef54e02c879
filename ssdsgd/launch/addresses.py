"""Which address a process advertises, and whether a peer can be reached (Linux, IPv4).

A process advertises the source address of its route to the scheduler by default (the
interface the others' traffic arrives on), or the address of ``--interface NAME``, like
``DMLC_INTERFACE``. A reachability check is a TCP connect with a deadline, so a node that
cannot reach its peer fails with the host and address named instead of waiting forever.
"""
from __future__ import annotations

import errno
import fcntl
import ipaddress
import socket
import struct
import time

SIOCGIFADDR = 0x8915


class AddressError(RuntimeError):
    """No usable address; the message names the host, interface or address."""


def hostname():
    return socket.gethostname()


def resolve(host):
    """An IPv4 address for ``host`` (a name or an address)."""
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise AddressError(f"cannot resolve host {host!r}: {e}") from None


def interface_address(name):
    """The IPv4 address of interface ``name`` on this host."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR,
                                 struct.pack("256s", name.encode()[:15]))
        except OSError as e:
            have = ", ".join(sorted(n for _, n in socket.if_nameindex()))
            what = "no IPv4 address" if e.errno == errno.EADDRNOTAVAIL else e.strerror
            raise AddressError(f"interface {name!r}: {what} (interfaces here: {have})") from None
    return socket.inet_ntoa(packed[20:24])


def route_source(dest):
    """The source address this host uses to reach ``dest`` (no packet is sent)."""
    addr = resolve(dest)
    if ipaddress.ip_address(addr).is_loopback:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((addr, 9))
        except OSError as e:
            raise AddressError(f"no route to {dest} ({addr}): {e.strerror}") from None
        return s.getsockname()[0]


def advertised(toward, interface=None):
    """The address this host's process tells the others: ``interface``'s, or the route
    source toward ``toward``."""
    return interface_address(interface) if interface else route_source(toward)


def is_local(host):
    """True when ``host`` is this machine (an address of one of its interfaces)."""
    try:
        addr = resolve(host)
    except AddressError:
        return False
    if ipaddress.ip_address(addr).is_loopback:
        return True
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((addr, 0))      # binds only to an address this host has
        except OSError:
            return False
    return True


def wait_reachable(host, port, timeout, refused_timeout=None, interval=0.25):
    """Connect to host:port until it accepts; returns None, or the last error's text once
    ``timeout`` s passed (``refused_timeout`` s while the host answers "connection
    refused": it is reachable, its listener is still starting)."""
    t0 = time.monotonic()
    refused_timeout = max(timeout, refused_timeout or 0)
    while True:
        try:
            with socket.create_connection((host, port), timeout=3.0):
                return None
        except ConnectionRefusedError as e:
            last, limit = e.strerror or "connection refused", refused_timeout
        except OSError as e:
            last, limit = e.strerror or str(e) or "timed out", timeout
        if time.monotonic() - t0 >= limit:
            return last
        time.sleep(interval)
