"""What one message of many frames, each under a port's frame limit, makes a node hold
(docs/reliability.md, "Size"; issue 30 item 4).

    python bench/many_frames.py [--frames 1000000] [--size 0]

A ROUTER with a server port's options (MAXMSGSIZE = ``protocol.frame_limit`` of a small
model's limit, the server's RCVHWM) in a process of its own, and a DEALER that sends it
one multipart message of ``--frames`` frames of ``--size`` bytes. Printed, in MiB of the
receiver's RSS above its start: what libzmq holds once the message is in (before the
application has read a byte: libzmq hands over a multipart message only whole), what
reading it with ``recv_multipart(copy=False)`` (the server's loop) holds, and how long
that read takes; then what is left once the frames are dropped. ZeroMQ's MAXMSGSIZE
bounds each frame; nothing bounds how many a message has.
"""
import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import zmq

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ssdsgd.kvstore import protocol as P  # noqa: E402
from ssdsgd.kvstore.server_node import RCVHWM  # noqa: E402


def rss_mib():
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def receive():
    """The receiving process: says its port, then the figures of the one message."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.MAXMSGSIZE, P.frame_limit(1 << 20))
    sock.setsockopt(zmq.RCVHWM, RCVHWM)
    print(sock.bind_to_random_port("tcp://127.0.0.1"), flush=True)
    base = rss_mib()
    if not sock.poll(600_000):
        sys.exit("no message within 10 minutes")
    held = rss_mib() - base
    start = time.monotonic()
    frames = sock.recv_multipart(copy=False)
    took, read = time.monotonic() - start, rss_mib() - base
    count = len(frames) - 1     # the first frame is the sender's id
    del frames
    time.sleep(0.5)
    print(f"{count} frames: held by libzmq before the read {held:.0f} MiB; read "
          f"(recv_multipart) {read:.0f} MiB in {took:.1f} s; after the drop "
          f"{rss_mib() - base:.0f} MiB", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=1_000_000)
    p.add_argument("--size", type=int, default=0, help="bytes per frame")
    p.add_argument("--receive", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.receive:
        return receive()
    receiver = subprocess.Popen([sys.executable, __file__, "--receive"],
                                stdout=subprocess.PIPE, text=True)
    port = int(receiver.stdout.readline())
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    frame = b"x" * a.size
    for _ in range(a.frames - 1):
        sock.send(frame, zmq.SNDMORE, copy=a.size > 4096)
    sock.send(frame, copy=a.size > 4096)
    wire = a.frames * (a.size + (2 if a.size < 256 else 10))
    print(f"sent {a.frames} frames of {a.size} bytes ({wire / 2**20:.1f} MiB on the wire)")
    print(receiver.stdout.read().strip())
    receiver.wait()
    sock.close(linger=0)


if __name__ == "__main__":
    main()
