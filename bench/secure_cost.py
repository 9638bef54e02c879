"""Where a secure job's time goes: the cost of each way to protect a connection, per byte.

    python bench/secure_cost.py [--mb 100] [--reps 5] [--workers 2] [--message-mb 4]
                                [--modes plain,curve,curve-io2,aesgcm,...] [--json FILE]

One server process (a ROUTER) and ``--workers`` worker processes (DEALERs) on loopback,
with the transport's message size (``chunk_bytes``, 4 MB). Each round every worker sends
``--mb`` MB and the server answers each message with one of the same size, as it answers a
pushpull of a big key. The modes run one after the other in one invocation:

  plain      no protection (ZeroMQ's NULL mechanism): what the link and the copies cost
  curve      ZeroMQ CURVE, as ssdsgd's ``--secure`` (libsodium's XSalsa20-Poly1305, in
             libzmq's one I/O thread per process, message by message)
  curve-io2  the same, the server's context with 2 I/O threads, so that two workers'
             connections are encrypted at once
  aesgcm     the NULL mechanism, every message sealed with AES-256-GCM (the
             ``cryptography`` package over OpenSSL, as ``--cipher aesgcm`` uses it) on the
             sending process's thread and opened on the receiver's, into buffers reused
             once sent (what a transport that encrypts outside libzmq would pay; the keys
             and nonces here are the benchmark's own, not a protocol)
  aesgcm-fresh  the same into a fresh buffer per message (as libzmq's CURVE allocates)
  plain-keep  plain, every process's allocator told to keep the memory it frees
             (glibc's mallopt: messages up to 32 MB from its heaps, nothing trimmed), so
             libzmq's receive buffers are pages already touched, not fresh ones; a
             message over 32 MB is always a fresh mapping (glibc's ceiling)

Reported per mode: GB/s per worker ((bytes sent + received) / the median round's wall
time), its ratio to plain, and the CPU seconds each process spent per GB it moved
(getrusage, user + system, every thread: the figure the machine's other load disturbs
least), and the page faults each process took per GB it moved (a fresh page is zeroed and
mapped on first touch). The workers' figures are their mean.
"""
import argparse
import json
import multiprocessing as mp
import os
import queue
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import zmq

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.common import machine_info  # noqa: E402

MODES = ("plain", "curve", "curve-io2", "aesgcm", "aesgcm-fresh", "plain-keep")
TAG = 16            # AES-GCM's tag
DEADLINE_S = 600    # a whole mode, every process


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=100, help="MB each worker sends per round")
    p.add_argument("--reps", type=int, default=5, help="timed rounds (after 1 warm-up)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--message-mb", type=float, default=4.0, help="bytes per message, MB")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        p.error(f"unknown mode(s) {sorted(unknown)}; choose from {', '.join(MODES)}")
    return args


class Sealer:
    """AES-256-GCM over one direction of one connection: a counter as the nonce. Sealed
    buffers are reused once ZeroMQ has sent them (its MessageTracker), opened ones when
    the caller is done (``reuse``): fresh 4 MB buffers cost page faults, not cipher."""

    def __init__(self, key, reuse):
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        self.aead, self.sent, self.seen, self.reuse = AESGCM(key), 0, 0, reuse
        self.pool, self.opened = [], None

    def _buffer(self, size):
        self.pool = self.pool[-64:]       # bounded: what is still unsent is not reused
        for i, (buf, tracker) in enumerate(self.pool):
            if len(buf) == size and tracker.done:
                del self.pool[i]
                return buf
        return np.empty(size, np.uint8)

    def seal(self, data, send):
        """Seal ``data`` and ``send(buffer) -> MessageTracker`` it."""
        self.sent += 1
        out = self._buffer(len(data) + TAG)
        self.aead.encrypt_into(self.sent.to_bytes(12, "little"), data, None, out)
        tracker = send(out)
        if self.reuse:
            self.pool.append((out, tracker))

    def open(self, data):
        self.seen += 1
        out = self.opened
        if not self.reuse or out is None or len(out) != len(data) - TAG:
            out = np.empty(len(data) - TAG, np.uint8)
        self.aead.decrypt_into(self.seen.to_bytes(12, "little"), data, None, out)
        self.opened = out
        return out


def _cpu_s():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _keep_freed_memory(mode):
    """plain-keep: glibc keeps what is freed (M_TRIM_THRESHOLD, M_TOP_PAD) and serves
    blocks up to 32 MB (M_MMAP_THRESHOLD's ceiling) from its heaps, in every thread's
    arena, libzmq's I/O thread's included. glibc only (Linux): elsewhere the mode's
    processes fail, naming the library they could not load."""
    if mode != "plain-keep":
        return
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    for param, value in ((-1, 1 << 30), (-2, 256 << 20), (-3, 32 << 20)):
        if not libc.mallopt(param, value):
            raise RuntimeError(f"mallopt({param}, {value}) refused")


def _protect(sock, mode, keys, server):
    if mode.startswith("curve"):
        if server:
            sock.curve_server = True
            sock.curve_secretkey, sock.curve_publickey = keys["server_secret"], keys["server_public"]
        else:
            public, secret = zmq.curve_keypair()
            sock.curve_serverkey = keys["server_public"]
            sock.curve_publickey, sock.curve_secretkey = public, secret


def serve(mode, keys, messages, warmup, port_q, out_q):
    """The server: answer every message with one of its size; its CPU and page faults
    per GB moved after the first ``warmup`` messages (the workers' untimed round)."""
    _keep_freed_memory(mode)
    ctx = zmq.Context(io_threads=2 if mode == "curve-io2" else 1)
    sock = ctx.socket(zmq.ROUTER)
    sock.rcvtimeo = sock.sndtimeo = DEADLINE_S * 1000
    _protect(sock, mode, keys, server=True)
    port_q.put(sock.bind_to_random_port("tcp://127.0.0.1"))
    sealers, moved = {}, 0
    for i in range(messages):
        if i == warmup:         # the workers' untimed round is in: count from here
            cpu0, faults0, moved = _cpu_s(), _faults(), 0
        ident, frame = sock.recv_multipart(copy=False)
        ident, body = ident.bytes, frame.buffer
        if mode.startswith("aesgcm"):
            reuse = mode == "aesgcm"
            inbound, outbound = sealers.setdefault(ident, (Sealer(keys["up"], reuse),
                                                                 Sealer(keys["down"], reuse)))
            outbound.seal(inbound.open(body), lambda buf: sock.send_multipart(
                [ident, buf], copy=False, track=True))
        else:
            sock.send_multipart([ident, body], copy=False)
        moved += 2 * len(frame.buffer)
    out_q.put(("server", {"cpu_s_per_gb": (_cpu_s() - cpu0) / (moved / 1e9),
                          "faults_per_gb": (_faults() - faults0) / (moved / 1e9)}))
    sock.close(linger=DEADLINE_S * 1000)
    ctx.term()


def work(mode, keys, port, args, rank, out_q):
    """A worker: rounds of --mb MB sent and answered; its rate, and its CPU and page
    faults per GB moved after the untimed first round."""
    _keep_freed_memory(mode)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.rcvtimeo = sock.sndtimeo = DEADLINE_S * 1000
    sock.identity = b"worker %d" % rank
    _protect(sock, mode, keys, server=False)
    sock.connect(f"tcp://127.0.0.1:{port}")
    size = int(args.message_mb * 1e6)
    count = max(1, int(args.mb * 1e6) // size)
    message = np.random.default_rng(rank).integers(0, 255, size, np.uint8)
    reuse = mode == "aesgcm"
    up, down = ((Sealer(keys["up"], reuse), Sealer(keys["down"], reuse))
                if mode.startswith("aesgcm") else (None, None))
    rounds, cpu0, faults0, moved = [], None, None, 0
    for rep in range(args.reps + 1):
        if rep == 1:
            cpu0, faults0 = _cpu_s(), _faults()
        t0 = time.perf_counter()
        for _ in range(count):
            if up:
                up.seal(message, lambda buf: sock.send(buf, copy=False, track=True))
            else:
                sock.send(message, copy=False)
        for _ in range(count):
            frame = sock.recv(copy=False)
            if down:
                down.open(frame.buffer)
        rounds.append(time.perf_counter() - t0)
        if rep:
            moved += 2 * count * size
    out_q.put((f"worker {rank}", {"gbps": 2 * count * size / 1e9 / statistics.median(rounds[1:]),
                                  "cpu_s_per_gb": (_cpu_s() - cpu0) / (moved / 1e9),
                                  "faults_per_gb": (_faults() - faults0) / (moved / 1e9)}))
    sock.close(linger=0)
    ctx.term()


def run_mode(mode, args):
    """One mode's figures: {gbps, server_ and worker_ cpu_s_per_gb and faults_per_gb}."""
    spub, ssec = zmq.curve_keypair()
    keys = {"server_public": spub, "server_secret": ssec,
            "up": os.urandom(32), "down": os.urandom(32)}
    count = max(1, int(args.mb * 1e6) // int(args.message_mb * 1e6))
    messages = args.workers * count * (args.reps + 1)
    mpc = mp.get_context("spawn")
    port_q, out_q = mpc.Queue(), mpc.Queue()
    procs = [mpc.Process(target=serve, args=(mode, keys, messages, args.workers * count,
                                                  port_q, out_q))]
    procs[0].start()
    port = port_q.get(timeout=60)
    procs += [mpc.Process(target=work, args=(mode, keys, port, args, r, out_q))
              for r in range(args.workers)]
    for p in procs[1:]:
        p.start()
    results, deadline = {}, time.monotonic() + DEADLINE_S
    while len(results) < len(procs):
        try:
            name, figures = out_q.get(timeout=1)
            results[name] = figures
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"{mode}: a process failed (exit {dead[0].exitcode})"
                                   if dead else f"{mode}: no result in {DEADLINE_S} s")
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
            raise RuntimeError(f"{mode}: a process did not exit")
    workers = [v for k, v in results.items() if k.startswith("worker")]
    return {"gbps": statistics.mean(w["gbps"] for w in workers),
            "server_cpu_s_per_gb": results["server"]["cpu_s_per_gb"],
            "worker_cpu_s_per_gb": statistics.mean(w["cpu_s_per_gb"] for w in workers),
            "server_faults_per_gb": results["server"]["faults_per_gb"],
            "worker_faults_per_gb": statistics.mean(w["faults_per_gb"] for w in workers)}


def table(figures, args):
    lines = [f"{args.workers} workers, 1 server, loopback; {args.mb} MB a round in messages of "
             f"{args.message_mb:g} MB, {args.reps} rounds (median)",
             f"{'mode':<13}{'GB/s/worker':>13}{'/ plain':>9}{'server CPU s/GB':>17}"
             f"{'worker CPU s/GB':>17}{'server faults/GB':>18}{'worker faults/GB':>18}"]
    plain = figures.get("plain", {}).get("gbps")
    for mode, f in figures.items():
        ratio = f"{f['gbps'] / plain:.2f}" if plain else "-"
        lines.append(f"{mode:<13}{f['gbps']:>13.3f}{ratio:>9}{f['server_cpu_s_per_gb']:>17.2f}"
                     f"{f['worker_cpu_s_per_gb']:>17.2f}{f['server_faults_per_gb']:>18.0f}"
                     f"{f['worker_faults_per_gb']:>18.0f}")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if any(m.startswith("curve") for m in args.modes) and not zmq.has("curve"):
        sys.exit("this pyzmq's libzmq has no CURVE")
    figures = {mode: run_mode(mode, args) for mode in args.modes}
    print(table(figures, args))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "args": vars(args),
                                               "figures": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
