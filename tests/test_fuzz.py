"""Fuzzing (issue 12): malformed and well-formed-but-hostile messages, seeded and bounded.

In process: the decoder turns any bytes into a message or a ProtocolError, never anything
else. Live: a process holding the job's keys (but no node of the job) sends its scheduler
and server a stream of such messages while the job trains; the job ends with the weights
of an undisturbed run, and no node restarted or crashed."""
import json
import random
import time

import numpy as np
import pytest
import zmq

from livejob import LiveJob, dealer, job_keys, undisturbed_weights
from ssdsgd.kvstore import protocol as P
from ssdsgd.kvstore.security import Guard

F32 = np.float32
KINDS = list(P.Kind)


def _random_json(rng, depth=0):
    pick = rng.randrange(9 if depth < 12 else 6)
    if pick == 0:
        return rng.choice([None, True, False])
    if pick == 1:
        return rng.choice([0, -1, 1, 2 ** 31, -2 ** 63, 2 ** 70, 7])
    if pick == 2:
        return rng.choice([0.5, -1e308, 1e-300, float("nan"), float("inf")])
    if pick in (3, 4, 5):
        return rng.choice(["", "worker", "server", "all", "sgd", "abc", "x" * 300, "\u2603",
                           "aa" * 16, "momentum"])
    if pick in (6, 7):
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["role", "rank", "optimizer", "group", "error", "lr", "host", "port",
                        "routing_id", "name", "params", "momentum", "servers", "workers"]):
            _random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


def _hostile_meta(rng, kind):
    """A meta that type-checks for some kind, with values meant to hurt."""
    spec = {"name": rng.choice(["sgd", "adam", "nag", "groupadagrad", "zzz"]),
            "params": {rng.choice(["learning_rate", "momentum", "wd", "clip_gradient",
                                   "lazy_update", "beta1"]):
                       rng.choice([0.0, -5.0, 1e30, "abc", True, None, [1, 2]])},
            "lr_scheduler": rng.choice([None, {"class": "FactorScheduler",
                                               "params": {"step": rng.choice([0, 1, -3])}},
                                        {"class": "LRScheduler", "params": {}}]),
            "num_update": rng.choice([0, -1, 10 ** 12])}
    return rng.choice([
        {"role": rng.choice(["worker", "server"]), "rank": rng.randrange(-1, 4),
         "routing_id": bytes(rng.randrange(256) for _ in range(16)).hex(),
         "host": "127.0.0.1", "port": rng.randrange(1, 65536)},
        {"group": rng.choice(["worker", "server", "all"])},
        {"error": "I am worker 0 and I failed"},
        {"reason": "abort everything"},
        {"optimizer": spec},
        {"lr": 0.0},
        {},
    ])


def _records(rng):
    n = rng.randrange(4)
    entries = [(rng.choice([0, 1, 2, 3, 99, 2 ** 40]), rng.choice([-1, 0, 1, 5, 10 ** 9]),
                rng.choice([0, 0, 3]), rng.choice([0, 1, 4, 12, 80]), F32,
                rng.choice([0, 1, 1, 2])) for _ in range(n)]
    tensors = [[np.full(e[3], rng.choice([0.0, 1e6, np.nan]), F32) for _ in range(e[5])]
               for e in entries]
    return P.make_records(entries), tensors


def fuzz_message(rng):
    """One message: well-formed but hostile (valid frames, chosen to hurt) or malformed
    (valid frames, then one part broken)."""
    kind = rng.choice(KINDS)
    records, tensors = _records(rng) if rng.random() < 0.6 else (None, None)
    msg = P.Message(kind, flags=rng.choice([0, 1, 2, 3]), sender=rng.choice([-5, 0, 1, 2, 7]),
                    step=rng.choice([0, 3, 2 ** 40]), req=rng.randrange(1, 2 ** 32),
                    records=records, tensors=tensors)
    frames = [bytes(f) for f in P.encode(msg)]
    meta = _hostile_meta(rng, kind) if rng.random() < 0.5 else _random_json(rng)
    try:
        frames[2] = json.dumps(meta).encode() if isinstance(meta, dict) else frames[2]
    except (ValueError, RecursionError):
        pass
    if rng.random() < 0.5:
        return frames                                         # hostile but well-formed
    how = rng.randrange(8)
    if how == 0:                                              # flip bytes anywhere
        i = rng.randrange(len(frames))
        if frames[i]:
            b = bytearray(frames[i])
            for _ in range(rng.randrange(1, 5)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            frames[i] = bytes(b)
    elif how == 1:                                            # truncate a frame
        i = rng.randrange(len(frames))
        frames[i] = frames[i][:rng.randrange(len(frames[i]) + 1)]
    elif how == 2:                                            # drop or add frames
        frames = frames[:rng.randrange(len(frames))] or [b""]
    elif how == 3:
        frames = frames + [bytes(rng.randrange(256) for _ in range(rng.randrange(64)))]
    elif how == 4:                                            # deep or broken JSON
        frames[2] = rng.choice([b"[" * 5000, b'{"a":' * 3000, b"{\xff}", b'{"role": "wor',
                                b"1e99999", b'{"rank": 1e400}', b'"' * 10])
    elif how == 5:                                            # random garbage message
        frames = [bytes(rng.randrange(256) for _ in range(rng.randrange(80)))
                  for _ in range(rng.randrange(1, 6))]
    elif how == 6:                                            # key table lies
        frames[1] = bytes(rng.randrange(256) for _ in range(P.KEY_RECORD.itemsize
                                                            * rng.randrange(1, 4)))
    else:                                                     # header lies about counts
        head = bytearray(frames[0])
        head[-12:] = bytes(rng.randrange(256) for _ in range(12))
        frames[0] = bytes(head)
    return frames


def test_decoding_any_bytes_gives_a_message_or_a_protocol_error():
    rng = random.Random(20240)
    outcomes = {"ok": 0, "refused": 0}
    for _ in range(3000):
        frames = fuzz_message(rng)
        try:
            P.receive(frames, max_bytes=1 << 20)
            outcomes["ok"] += 1
        except P.ProtocolError:
            outcomes["refused"] += 1
    assert outcomes["ok"] > 100 and outcomes["refused"] > 1000, outcomes


STEPS = 300
JOB_ENV = {"SSDSGD_ALGORITHM": "ssgd"}
MESSAGES = 1500


@pytest.mark.system
def test_a_live_job_survives_fuzzed_messages(tmp_path, tmp_path_factory):
    reference = undisturbed_weights(tmp_path_factory, STEPS, JOB_ENV)
    job = LiveJob(tmp_path, steps=STEPS, env=JOB_ENV)
    try:
        addresses = [job.address("scheduler"), job.address("server 0")]
        guard = Guard(job_keys(job, "worker 0"), print)   # an insider: a worker's key
        deadline = time.monotonic() + 120
        while "job started" not in job.text:   # REGISTER after the workers' are refused
            assert time.monotonic() < deadline and job.proc.poll() is None, job.text[-3000:]
            time.sleep(0.05)
        rng = random.Random(12)
        socks = [dealer(a, lambda s, p=peer: guard.client(s, p))
                 for a, peer in zip(addresses, ("scheduler", "server 0")) for _ in range(3)]
        sent, answered, until = 0, 0, time.monotonic() + 60
        while sent < MESSAGES and time.monotonic() < until and job.proc.poll() is None:
            sock = rng.choice(socks)
            try:
                sock.send_multipart(fuzz_message(rng), flags=zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                time.sleep(0.01)
            for s in socks:
                while s.poll(0):
                    s.recv_multipart()
                    answered += 1
            if sent % 50 == 0:
                time.sleep(0.01)       # a stream during the job, not one burst
        print(f"fuzz: {sent} messages sent, {answered} answers read")
        assert sent >= 200, f"only {sent} messages sent before the job ended"
        assert job.wait() == 0, job.text[-4000:]
    finally:
        job.kill()
    out = job.text
    assert "Traceback" not in out and "internal error" not in out, out[-4000:]
    for node in ("[scheduler]", "[server 0]"):       # each started once, never again
        assert sum(line.startswith(node) and "listening on" in line
                   for line in job.lines) == 1, node
        assert any(line.startswith(node) and "rejected a message from a peer" in line
                   for line in job.lines), f"{node} saw none of the fuzz:\n{out[-3000:]}"
    assert answered > 0
    final = np.load(tmp_path / "final-rank0.npz")
    for k in reference:
        np.testing.assert_array_equal(final[k], reference[k])
