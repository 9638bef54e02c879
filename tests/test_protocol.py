"""The wire format: round trips, and every malformed field rejected with its reason."""
import json

import numpy as np
import pytest

from ssdsgd.kvstore import protocol as P
from ssdsgd.kvstore import fragments as F


def _push(arrays=None):
    arrays = arrays if arrays is not None else [np.arange(6, dtype=np.float32),
                                                np.ones(3, np.float64)]
    recs = P.make_records((k, 7, 0, a.size, a.dtype, 1) for k, a in enumerate(arrays))
    return P.Message(P.Kind.PUSH, flags=P.Flag.PULL, sender=1, step=7, req=42, records=recs,
                     tensors=[[a] for a in arrays], meta={"lr": 0.1})


def test_round_trip_keeps_every_field_and_tensor():
    frames = P.encode(_push())
    msg = P.decode(frames)
    assert (msg.kind, msg.flags, msg.sender, msg.step, msg.req) == (P.Kind.PUSH, P.Flag.PULL, 1, 7, 42)
    assert msg.meta == {"lr": 0.1}
    np.testing.assert_array_equal(msg.tensors[0][0], np.arange(6, dtype=np.float32))
    assert msg.tensors[1][0].dtype == np.float64 and msg.tensors[1][0].sum() == 3


def test_tensors_are_raw_frames_not_json():
    frames = P.encode(_push([np.full(1000, 3.5, np.float32)]))
    assert len(frames) == 4
    assert bytes(frames[3]) == np.full(1000, 3.5, np.float32).tobytes()
    assert len(frames[2]) < 100  # only the scalar meta is JSON


def _corrupt(frames, i, data):
    frames = [bytes(f) for f in frames]
    frames[i] = data
    return frames


@pytest.mark.parametrize("mutate, reason", [
    (lambda f: f[:2], "at least 3 frames"),
    (lambda f: _corrupt(f, 0, b"XXXX" + bytes(f[0])[4:]), "bad magic"),
    (lambda f: _corrupt(f, 0, bytes(f[0])[:4] + bytes([P.VERSION + 1]) + bytes(f[0])[5:]),
     f"protocol version {P.VERSION + 1}, this node speaks {P.VERSION}"),
    (lambda f: _corrupt(f, 0, bytes(f[0])[:5] + b"\xee" + bytes(f[0])[6:]), "unknown message kind"),
    (lambda f: _corrupt(f, 0, bytes(f[0])[:-3]), "header is"),
    (lambda f: f[:-1], "data frames"),
    (lambda f: _corrupt(f, 1, bytes(f[1])[:-1]), "key table is"),
    (lambda f: _corrupt(f, 2, b"{not json"), "not UTF-8 JSON"),
    (lambda f: _corrupt(f, 2, b"[1, 2]"), "JSON object"),
    (lambda f: _corrupt(f, 3, bytes(f[3])[:-4]), "its tensors need bytes"),
])
def test_malformed_messages_are_rejected_with_the_reason(mutate, reason):
    frames = mutate(P.encode(_push()))
    with pytest.raises(P.ProtocolError, match=reason):
        P.decode(frames)


def test_bad_key_table_values_are_rejected():
    frames = [bytes(f) for f in P.encode(_push())]
    table = np.frombuffer(frames[1], P.KEY_RECORD).copy()
    nbytes = int(table[0]["nbytes"])
    for fields, reason in [({"dtype": 99}, "unknown dtype"), ({"count": -1}, "negative"),
                           ({"ntensors": 9}, "more than 8 tensors"),
                           # the record's byte length says 2 tensors as well
                           ({"ntensors": 2, "nbytes": 2 * nbytes}, "claim the same bytes"),
                           ({"ntensors": 2}, "the record says"),
                           ({"nbytes": nbytes + 4}, "the record says"),
                           ({"encoding": 9}, "unknown encoding"),
                           ({"boff": 1 << 20}, "its tensors need bytes"),
                           ({"frame": 5}, "data frame 5 does not exist")]:
        bad = table.copy()
        for field, value in fields.items():
            bad[0][field] = value
        with pytest.raises(P.ProtocolError, match=reason):
            P.decode([frames[0], bad.tobytes()] + frames[2:])


def test_big_tensors_get_frames_of_their_own_small_ones_share_one():
    big = np.arange(P.PACK_BELOW // 4 + 1, dtype=np.float32)
    small = [np.full(3, i, np.float32) for i in range(5)]
    frames = P.encode(_push([big] + small))
    assert len(frames) == 3 + 2
    assert frames[3].base is not None or frames[3].ctypes.data == big.ctypes.data  # a view
    msg = P.decode(frames)
    np.testing.assert_array_equal(msg.tensors[0][0], big)
    for i in range(5):
        np.testing.assert_array_equal(msg.tensors[1 + i][0], small[i])


def test_size_limit_is_enforced():
    frames = P.encode(_push([np.zeros(1000, np.float32)]))
    with pytest.raises(P.ProtocolError, match="limit is 100"):
        P.decode(frames, max_bytes=100)


def test_unsendable_dtype_is_named():
    with pytest.raises(P.ProtocolError, match="complex"):
        P.make_records([(0, 0, 0, 1, np.complex64, 1)])


def test_meta_is_plain_json():
    frames = P.encode(P.Message(P.Kind.REGISTER, meta={"role": "worker", "port": 5}))
    assert json.loads(bytes(frames[2])) == {"role": "worker", "port": 5}


def _compressed_push(encoding, payload, count, dtype=np.float32):
    recs = P.make_records([(0, 3, 0, count, dtype, 1, encoding)])
    return P.Message(P.Kind.PUSH, sender=0, step=3, records=recs, tensors=[[payload]])


@pytest.mark.parametrize("encoding,count,nbytes", [("2bit", 17, 8), ("2bit", 16, 4),
                                                   ("topk", 10, 0), ("topk", 10, 80)])
def test_compressed_gradients_travel_as_bytes(encoding, count, nbytes):
    payload = np.arange(nbytes, dtype=np.uint8)
    msg = P.decode(P.encode(_compressed_push(encoding, payload, count)))
    assert P.ENCODINGS[int(msg.records[0]["encoding"])] == encoding
    assert int(msg.records[0]["count"]) == count
    np.testing.assert_array_equal(msg.tensors[0][0], payload)


@pytest.mark.parametrize("encoding,count,nbytes,dtype,reason", [
    ("2bit", 17, 4, np.float32, "2bit data for 17 values is 8 bytes"),
    ("topk", 10, 12, np.float32, "multiple of 8 bytes up to 80"),
    ("topk", 10, 88, np.float32, "multiple of 8 bytes up to 80"),
    ("2bit", 16, 4, np.float16, "one tensor of float32 values"),
])
def test_compressed_gradients_of_the_wrong_size_are_rejected(encoding, count, nbytes, dtype,
                                                             reason):
    frames = P.encode(_compressed_push(encoding, np.zeros(nbytes, np.uint8), count, dtype))
    with pytest.raises(P.ProtocolError, match=reason):
        P.decode(frames)


def test_a_compressed_record_takes_one_byte_tensor():
    with pytest.raises(P.ProtocolError, match="one uint8 tensor"):
        P.encode(_compressed_push("2bit", np.zeros(1, np.float32), 16))


@pytest.mark.parametrize("relay,ok", [
    ([[1, 7], [2, 8]], True), ([], True),
    ([[1]], False), ([["1", 7]], False), ([[1, 0]], False), ([[-1, 7]], False),
    ([[1, 1 << 32]], False), ("1,7", False), ([[1, 7.0]], False), ([[True, 7]], False)])
def test_a_pieces_relay_chain_is_type_checked(relay, ok):
    """sync.pull_relay: chain (docs/spec/pull_relay.md): [[worker rank, request id], ...]."""
    if ok:
        P.check_meta(P.Kind.FRAGMENT, {"of": 2, "relay": relay})
    else:
        with pytest.raises(P.ProtocolError, match="relay"):
            P.check_meta(P.Kind.FRAGMENT, {"of": 2, "relay": relay})
    with pytest.raises(P.ProtocolError, match="unexpected meta field 'relay'"):
        P.check_meta(P.Kind.REPLY, {"relay": relay})


def _relayed_reply():
    values = [np.arange(5, dtype=np.float32), np.arange(400_000, dtype=np.float32),
              np.ones(300_000, np.float32)]
    recs = P.make_records([(3, 9, 0, 5, np.float32, 1), (4, 9, 0, 400_000, np.float32, 1),
                           (5, 9, 0, 150_000, np.float32, 2)])
    frames = P.encode(P.Message(P.Kind.REPLY, sender=1, req=0, records=recs,
                                tensors=[[values[0]], [values[1]],
                                         [values[2][:150_000], values[2][150_000:]]],
                                meta={"lr": 0.5}))
    return values, frames


def test_a_relayed_reply_travels_in_pieces_and_is_rebuilt():
    values, frames = _relayed_reply()
    pieces = F.fragments(frames, 11, 1, {"relay": [[2, 12], [3, 13]]}, size=1 << 20)
    assert len(pieces) == 3              # 2.8 MB of data in pieces of at most 1 MB, no copy
    assert any(np.shares_memory(np.asarray(p[3]), frames[3]) for p in pieces)
    # by default about 1/8 of the reply a piece (at least 128 KB, at most 2 MB)
    assert len(F.fragments(frames, 11, 1)) == 8
    assert len(F.fragments(frames[:3] + [frames[3][:1000]], 11, 1)) == 1
    # worker 1 passes each piece on to worker 2 as it arrives: request id and chain change
    passed = []
    for p in pieces:
        meta = P.decode(p).meta
        passed.append(F.forward(p, 12, dict(meta, relay=meta["relay"][1:])))
    assert all(a[3:] == b[3:] for a, b in zip(passed, pieces))
    rebuilt = None
    for frames_ in passed:
        msg = P.decode(frames_)
        P.check_meta(msg.kind, msg.meta)
        assert (msg.kind, msg.req, msg.sender, msg.meta["relay"]) == \
            (P.Kind.FRAGMENT, 12, 1, [[3, 13]])
        if msg.step == 0:
            part = F.Reassembly(msg, 10 << 20)
        rebuilt = part.add(msg, frames_[3:])
    reply = P.decode(rebuilt)
    assert (reply.kind, reply.sender, reply.meta) == (P.Kind.REPLY, 1, {"lr": 0.5})
    np.testing.assert_array_equal(reply.tensors[1][0], values[1])
    np.testing.assert_array_equal(np.concatenate(reply.tensors[2]), values[2])


@pytest.mark.parametrize("fault,error", [
    ("order", "fragment 1 of 3 arrived; expected 0"),
    ("missing first", "fragment 1 of a reply arrived before its first"),
    ("too big", "exceeds the limit"),
    ("more bytes", "more than the .* bytes the first announced"),
    ("fewer bytes", "carried .* of the .* bytes the first announced")])
def test_bad_pieces_of_a_relayed_reply_are_named(fault, error):
    _, frames = _relayed_reply()
    pieces = [F.fragments(frames, 11, 1, size=1 << 20)[i] for i in range(3)]
    msgs = [P.decode(p) for p in pieces]
    with pytest.raises(P.ProtocolError, match=error):
        if fault == "missing first":
            F.Reassembly(msgs[1], 10 << 20)
        part = F.Reassembly(msgs[0], (1 << 20) if fault == "too big" else 10 << 20)
        if fault == "order":
            part.add(msgs[1], pieces[1][3:])
        part.add(msgs[0], pieces[0][3:] + (pieces[1][3:] if fault == "more bytes" else []))
        part.add(msgs[1], pieces[1][3:])
        part.add(msgs[2], pieces[2][3:-1] if fault == "fewer bytes" else pieces[2][3:])
