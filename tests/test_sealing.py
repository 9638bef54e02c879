"""AES-256-GCM on every frame (security mode aesgcm, ssdsgd/kvstore/sealing.py): what
one connection's channel lets through, and how a real port's handshake gives each
connection its own keys (real ZeroMQ sockets, the real ZAP handler, in process)."""
import contextlib

import numpy as np
import pytest
import zmq

from ssdsgd.kvstore import plain_handshake as PH, protocol as P, sealing
from ssdsgd.kvstore.security import Guard, NodeKeys

A, B = b"a" * 32, b"b" * 32


def _pair():
    return sealing.Channel(A, B), sealing.Channel(B, A)


@contextlib.contextmanager
def _inproc(name):
    """A real PUSH -> PULL pair over inproc://``name``, closed on the way out."""
    ctx = zmq.Context.instance()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    try:
        pull.bind(f"inproc://{name}")
        push.connect(f"inproc://{name}")
        yield push, pull
    finally:
        push.close(0)
        pull.close(0)


def test_a_message_opens_as_it_was_sent_whatever_its_buffers():
    out, into = _pair()
    weights = np.arange(12, dtype=np.float32).reshape(3, 4)
    frames = P.encode(P.Message(P.Kind.PUSH, sender=1, req=7,
                                records=P.make_records([(0, 3, 0, 12, np.float32, 1)]),
                                tensors=[[weights]]))
    sealed = out.seal(frames)
    assert len(sealed) == len(frames) + 1 and len(sealed[0]) == sealing.COUNTER.size
    assert all(len(s) == len(sealing._buffer(f)) + sealing.TAG
               for s, f in zip(sealed[1:], frames))
    assert bytes(weights.data) not in b"".join(bytes(s) for s in sealed)    # encrypted
    msg = P.decode(into.open(sealed))
    assert msg.kind == P.Kind.PUSH and msg.req == 7
    assert np.array_equal(msg.tensors[0][0].reshape(3, 4), weights)


def test_big_frames_reuse_a_buffer_only_once_zeromq_has_sent_it():
    """Big frames are sealed into kept buffers (no fresh pages per frame); a buffer still
    held by a message ZeroMQ has not released is never written again: two big messages
    queued unread on a real inproc pair both open as they were sent, and once read and
    released the next one reuses a buffer."""
    out, into = _pair()
    with _inproc("sealing-big") as (push, pull):
        big = [np.full(sealing.REUSED_FROM // 4 + 5, v, dtype=np.float32) for v in (1, 2, 3)]
        for a in big[:2]:           # both queued: the second cannot take the first's buffer
            push.send_multipart(out.seal([b"head", a]), copy=False)
        kept = [bytes(s[0][:16]) for s in out._buffers.kept]
        assert len(kept) == 2
        for a in big[:2]:
            got = into.open(pull.recv_multipart(copy=False))
            assert got[0].bytes == b"head"
            assert np.array_equal(np.frombuffer(got[1].buffer, dtype=np.float32), a)
            del got
        for _, tracker in out._buffers.kept:    # released: ZeroMQ says so (bounded)
            tracker.wait(5)
        first = out._buffers.kept[0][0]
        push.send_multipart(out.seal([b"head", big[2]]), copy=False)
        assert len(out._buffers.kept) == 2
        assert any(s[0] is first for s in out._buffers.kept)
        got = into.open(pull.recv_multipart(copy=False))
        assert np.array_equal(np.frombuffer(got[1].buffer, dtype=np.float32), big[2])


def test_kept_buffers_are_bounded_in_number_and_bytes(monkeypatch):
    """Frames in flight beyond the bounds are sealed into fresh buffers, not kept: a
    connection holds at most KEPT buffers of at most KEPT_BYTES together."""
    monkeypatch.setattr(sealing, "KEPT_BYTES", 3 * sealing.REUSED_FROM)
    out, into = _pair()
    with _inproc("sealing-bounds") as (push, pull):
        big = [np.full(sealing.REUSED_FROM // 4, v, dtype=np.float32) for v in range(6)]
        for a in big:               # all queued unread: every buffer is in flight
            push.send_multipart(out.seal([a]), copy=False)
        kept = out._buffers.kept
        assert len(kept) == 2 and sum(len(b) for b, _ in kept) <= sealing.KEPT_BYTES
        for a in big:               # the fresh ones and the kept ones all arrive intact
            got = into.open(pull.recv_multipart(copy=False))
            assert np.array_equal(np.frombuffer(got[0].buffer, dtype=np.float32), a)


@pytest.mark.parametrize("attack, says", [
    ("replay", "replayed or out of order"),
    ("reorder", "replayed or out of order"),
    ("flip", "does not open with this connection's key"),
    ("counter", "does not open with this connection's key"),
    ("cut", "does not open"),
    ("swap", "does not open"),
    ("short", "shorter than a sealed one"),
    ("no counter", "not a sealed message"),
    ("other key", "does not open"),
])
def test_a_frame_altered_replayed_reordered_or_cut_short_is_refused(attack, says):
    out, into = _pair()
    first, second = out.seal([b"one", b"two"]), out.seal([b"three"])
    if attack == "replay":
        into.open([bytes(f) for f in first])
        frames = first
    elif attack == "reorder":
        into.open(second)
        frames = first
    elif attack == "flip":
        frames = [first[0], bytearray(first[1]), first[2]]
        frames[1][1] ^= 1
    elif attack == "counter":        # a later counter: the nonce differs, the tag fails
        frames = [sealing.COUNTER.pack(7)] + first[1:]
    elif attack == "cut":            # the first frame of two, presented as the last
        frames = first[:2]
    elif attack == "swap":
        frames = [first[0], first[2], first[1]]
    elif attack == "short":
        frames = [first[0], b"x" * 10]
    elif attack == "no counter":
        frames = first[1:]
    else:                            # sealed by another connection
        frames = sealing.Channel(B, B).seal([b"one"])
    with pytest.raises(sealing.SealError, match=says):
        into.open(frames)


def test_a_gap_is_allowed_a_message_the_binder_dropped_is_not_a_fault():
    out, into = _pair()
    out.seal([b"dropped at the high-water mark"])
    assert bytes(into.open(out.seal([b"next"]))[0].buffer) == b"next"


def test_each_direction_and_each_handshake_has_its_own_keys():
    v = PH.verification_key(b"s" * 32, "server 0")
    user1, _ = PH.credentials(b"s" * 32, "worker 1", "server 0")
    user2, _ = PH.credentials(b"s" * 32, "worker 1", "server 0")
    k1, k2 = sealing.session_keys(v, user1.decode(), "server 0"), \
        sealing.session_keys(v, user2.decode(), "server 0")
    assert k1[0] != k1[1] and set(k1).isdisjoint(k2)
    assert sealing.session_keys(v, user1.decode(), "server 1") != k1     # bound to the binder


def test_two_connections_with_one_key_each_get_their_own_session_at_a_real_port():
    """A port bound with aesgcm keys: two DEALERs holding worker 1's key (its process,
    and e.g. ``--leave`` dialling as it) each pass the handshake, are told apart by
    their User-Id (``worker 1#nonce``; ``Guard.sender`` reads ``worker 1``), and each
    one's messages open with its own keys only."""
    keys = NodeKeys.generate_job(True, ["scheduler", "worker 1"], cipher="aesgcm")
    assert keys["scheduler"].mode == "aesgcm"
    ctx = zmq.Context()
    guard = Guard(keys["scheduler"], print)
    router = ctx.socket(zmq.ROUTER)
    guard.server(ctx, router)
    sealing.use(router, guard.binder_channels())
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealers = []
    try:
        for text in (b"first", b"second"):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            channel = Guard(keys["worker 1"], print).client(d, "scheduler")
            d.connect(f"tcp://127.0.0.1:{port}")
            d.send_multipart(channel.seal([text]))
            dealers.append((d, channel))
        got = {}
        for _ in dealers:
            assert router.poll(10_000)
            frames = sealing.of(router).open(router.recv_multipart(copy=False))
            assert guard.sender(frames[1]) == "worker 1"
            assert frames[1].get("User-Id").startswith("worker 1#")
            got[frames[1].bytes] = frames[0].bytes
            router.send_multipart([frames[0].bytes] + sealing.of(router).seal(
                frames[0].bytes, [b"back to " + frames[1].bytes]))
        assert set(got) == {b"first", b"second"} and len(set(got.values())) == 2
        for (d, channel), text in zip(dealers, (b"first", b"second")):
            assert d.poll(10_000)
            assert channel.open(d.recv_multipart(copy=False))[0].bytes == b"back to " + text
        # a frame one connection sealed does not open on the other's session
        d0, c0 = dealers[0]
        d1, _ = dealers[1]
        d1.send_multipart(c0.seal([b"spliced"]))
        assert router.poll(10_000)
        with pytest.raises(sealing.SealError):
            sealing.of(router).open(router.recv_multipart(copy=False))
    finally:
        for d, _ in dealers:
            d.close(0)
        router.close(0)
        guard.close()
        ctx.term()


def test_a_gone_peers_kept_buffers_are_released_and_its_channel_still_seals():
    """A binder's channel per connection keeps up to KEPT_BYTES of big-frame buffers; a
    worker that leaves or was removed needs none, so the server releases its channel
    (``release``): nothing is kept for it, then or later, and a reply to it is still
    sealed (into a fresh buffer) and opens."""
    channels = sealing.BinderChannels({})
    into = sealing.Channel(B, A)
    channels.by_id[b"w1"] = sealing.Channel(A, B)
    with _inproc("sealing-release") as (push, pull):
        big = np.full(sealing.REUSED_FROM // 4 + 5, 7, dtype=np.float32)
        push.send_multipart(channels.seal(b"w1", [big]), copy=False)
        assert len(channels.by_id[b"w1"]._buffers.kept) == 1
        channels.release(b"w1")
        channels.release(b"never connected")        # nothing to release: no error
        assert channels.by_id[b"w1"]._buffers.kept == []
        got = into.open(pull.recv_multipart(copy=False))     # the one in flight arrives
        assert np.array_equal(np.frombuffer(got[0].buffer, dtype=np.float32), big)
        push.send_multipart(channels.seal(b"w1", [big]), copy=False)
        assert channels.by_id[b"w1"]._buffers.kept == []     # nor from now on
        got = into.open(pull.recv_multipart(copy=False))
        assert np.array_equal(np.frombuffer(got[0].buffer, dtype=np.float32), big)
    sealing.PLAIN_BINDER.release(b"w1")              # a binder that seals nothing
