"""Issue 28, part 1: a relayed piece is checked end to end (docs/spec/pull_relay.md).

With ``sync.pull_relay: chain`` a worker gets most replies through another worker, which
holds a real key of the job: its connection proves who it is, not that it passed the
bytes on unchanged. Before, a worker that negated the weights it relayed made the next
one diverge to NaN with nothing naming the cause. Now the server sends every such worker
the digests of the pieces on its own connection (DIGEST), and a piece that does not match
ends the job, naming the worker that passed it on.

In process: the digests bind each piece's bytes, index, count and frame sizes; a piece
altered, replayed from another reply, or sent with another chain is named; pieces that
come before the digests wait, bounded. Live: three workers, worker 1 alters every piece it
relays (``SSDSGD_TAMPER_RELAY``, test only); worker 2 names it and the job stops.
"""
import re
import time

import numpy as np
import pytest

from jobs import launch
from ssdsgd.kvstore import fragments as F
from ssdsgd.kvstore import piece_digests as D
from ssdsgd.kvstore import protocol as P

F32 = np.float32


def _reply(step=9):
    """Server 0's reply of three keys (2.8 MB), as its frames."""
    recs = P.make_records([(3, step, 0, 5, F32, 1), (4, step, 0, 400_000, F32, 1),
                           (5, step, 0, 300_000, F32, 1)])
    return P.encode(P.Message(P.Kind.REPLY, sender=0, req=0, records=recs, meta={"lr": 0.5},
                              tensors=[[np.arange(5, dtype=F32)],
                                       [np.full(400_000, step, F32)], [np.ones(300_000, F32)]]))


def _relayed(frames, altered=None):
    """The pieces worker 2 receives from worker 1 (chain 1 -> 2; ``altered(i, piece)``
    may change piece i on the way), decoded, with the server's DIGEST for worker 2."""
    pieces = F.fragments(frames, 11, 0, {"relay": [[2, 12]]}, size=1 << 20)
    digest = P.decode(P.encode(P.Message(P.Kind.DIGEST, sender=0, req=12,
                                         meta={"digests": D.of_pieces(pieces),
                                               "from": 1})))
    P.check_meta(digest.kind, digest.meta)
    out = []
    for i, p in enumerate(pieces):
        passed = F.forward(p, 12, {"of": len(pieces), **({"sizes": P.decode(p).meta["sizes"]}
                                                          if i == 0 else {})})
        passed = altered(i, passed) if altered else passed
        msg = P.decode(passed)
        P.check_meta(msg.kind, msg.meta)
        out.append((passed, msg))
    return out, digest


def _check(pieces, digest, digests_first):
    """Worker 2's check of the pieces: the error of the first that fails, else None."""
    check = D.Expected(0, F.reply_bound(P.make_records([(k, 0, 0, n, F32, 0) for k, n in (
        (3, 5), (4, 400_000), (5, 300_000))])), [3, 4, 5])
    ready = check.given(digest) if digests_first else []
    for frames, msg in pieces:
        ready += check.hold(frames, msg, 1)
    if not digests_first:
        assert ready == [], "a piece was taken before the server's digests came"
        ready = check.given(digest)
    for frames, msg, relayer in ready:
        error = check.mismatch(msg, frames[3:], relayer)
        if error:
            return error
    assert check.done
    return None


def _flip_last_byte(i, frames, which=1):
    if i != which:
        return frames
    last = bytearray(P.frame_buffer(frames[-1]))
    last[-1] ^= 0x80
    return frames[:-1] + [bytes(last)]


@pytest.mark.parametrize("digests_first", [True, False], ids=["digests first", "pieces first"])
def test_relayed_pieces_are_taken_only_as_the_server_sent_them(digests_first):
    frames = _reply()
    pieces, digest = _relayed(frames)
    assert len(pieces) == 3
    assert _check(pieces, digest, digests_first) is None
    altered, _ = _relayed(frames, _flip_last_byte)
    error = _check(altered, digest, digests_first)
    assert error == ("piece 1 of server 0's reply (keys 3, 4, 5) relayed by worker 1 does "
                     "not match server 0's digest: it was altered after the server sent it; "
                     "stopping the job")


def test_a_piece_of_another_reply_or_with_other_sizes_or_chain_is_refused():
    frames = _reply(step=9)
    _, digest = _relayed(frames)
    # a piece of the same keys' reply at another step (the same index, count and sizes)
    replayed, _ = _relayed(_reply(step=8))
    assert "piece 0 of server 0's reply (keys 3, 4, 5) relayed by worker 1 does not match" \
        in _check(replayed, digest, True)

    def sizes(i, passed):       # the first piece announces other frame sizes
        if i:
            return passed
        meta = P.decode(passed).meta
        return F.forward(passed, 12, dict(meta, sizes=meta["sizes"][:-2] +
                                          [meta["sizes"][-2] + 4, meta["sizes"][-1] - 4]))
    assert "does not match server 0's digest" in _check(_relayed(frames, sizes)[0], digest,
                                                        True)

    def chain(i, passed):      # worker 1 sends worker 2's piece on with a chain of its own
        return F.forward(passed, 12, dict(P.decode(passed).meta, relay=[[0, 7]]))
    assert "names the chain [[0, 7]], server 0's is None" in _check(
        _relayed(frames, chain)[0], digest, True)


def test_pieces_held_for_the_digests_are_bounded():
    pieces, digest = _relayed(_reply())
    check = D.Expected(0, 1 << 18, [3, 4, 5])
    frames, msg = pieces[0]
    check.hold(frames, msg, 1)
    with pytest.raises(P.ProtocolError, match=r"worker 1 passed on \d+ bytes in 2 pieces of "
                       r"server 0's reply before the server's digests came"):
        check.hold(*pieces[1], 1)
    check.given(digest)
    with pytest.raises(P.ProtocolError, match="sent the digests of its reply to request 12 "
                                              "twice"):
        check.given(digest)


class _Clock:
    """Seconds that pass when the test says so."""
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_pieces_that_stop_coming_name_the_worker_that_should_pass_them_on():
    pieces, digest = _relayed(_reply())
    clock = _Clock()
    check = D.Expected(0, 1 << 22, [3, 4, 5], clock=clock)
    clock.now += 1000          # before the digests nobody is named: the server is not done
    assert check.overdue(30) is None
    check.given(digest)
    clock.now += 29.9
    assert check.overdue(30) is None
    frames, msg = pieces[0]
    assert check.mismatch(msg, frames[3:], 1) is None
    clock.now += 29.9          # a piece came: the wait starts again
    assert check.overdue(30) is None
    clock.now += 0.2
    assert check.overdue(30) == (
        "worker 1 stopped passing on server 0's reply (keys 3, 4, 5): 1 of its 3 pieces "
        "came, none in the 30 s since server 0's digests or the last piece "
        "(cluster.heartbeat_timeout + interval); stopping the job")
    for frames, msg in pieces[1:]:
        assert check.mismatch(msg, frames[3:], 1) is None
    clock.now += 1000          # a reply that is complete is never overdue
    assert check.done and check.overdue(30) is None


@pytest.mark.parametrize("meta,ok", [
    ({"digests": ["ab" * 32], "from": 0}, True),
    ({"digests": ["ab" * 32], "relay": [[2, 5]], "from": 1}, True),
    ({"digests": [], "from": 0}, False),
    ({"digests": ["AB" * 32], "from": 0}, False),
    ({"digests": ["ab" * 31], "from": 0}, False),
    ({"digests": "ab" * 32, "from": 0}, False),
    ({"from": 0}, False),
    ({"digests": ["ab" * 32]}, False),
    ({"digests": ["ab" * 32], "from": -1}, False),
    ({"digests": ["ab" * 32], "from": "1"}, False)])
def test_a_digest_message_is_type_checked(meta, ok):
    if ok:
        P.check_meta(P.Kind.DIGEST, meta)
    else:
        with pytest.raises(P.ProtocolError, match="digests|from"):
            P.check_meta(P.Kind.DIGEST, meta)


def _a_faulty_relay_is_named_and_stops_the_job(tmp_path, fault, said, cause, **env):
    """Chain 0 -> 1 -> 2 at every step of ssgd, worker 1 relaying with ``fault`` (a
    test-only setting, ``said`` its line): worker 2 names worker 1 (``cause``, a regex),
    tells the scheduler, and every node and the launcher say why the job ended, before
    worker 2 trained on anything but the server's weights."""
    started = time.monotonic()
    res = launch(3, 1, ["--out", tmp_path, "--steps", "200"], timeout=120,
                 env={"SSDSGD_ALGORITHM": "ssgd", "SSDSGD_PULL_RELAY": "chain",
                      f"SSDSGD_{fault}": "1", **env})
    assert res.returncode != 0
    err = res.stderr
    assert said in err, err[-3000:]
    named = [line for line in err.splitlines() if re.search(cause, line)]
    assert any(line.startswith("[worker 2] ssdsgd worker 2: ") for line in named), err[-3000:]
    for node in ("[scheduler]", "[server 0]", "[worker 0]", "[launcher] the scheduler "
                 "aborted the job: worker 2 (pid"):
        assert any(line.startswith(node) for line in named), (node, err[-3000:])
    assert not (tmp_path / "final-rank2.npz").exists()
    assert "Traceback" not in err
    assert time.monotonic() - started < 60


@pytest.mark.system
def test_a_worker_that_alters_what_it_relays_is_named_and_the_job_stops(tmp_path):
    """Worker 1 flips bits in every piece it passes on: worker 2 refuses the first."""
    _a_faulty_relay_is_named_and_stops_the_job(
        tmp_path, "TAMPER_RELAY", "SSDSGD_TAMPER_RELAY=1: this worker alters every piece it "
        "relays", r"piece \d+ of server 0's reply \(keys? [\d, .()a-z]+\) relayed by worker 1 "
        r"does not match server 0's digest")


@pytest.mark.system
def test_a_worker_that_drops_what_it_relays_is_named_and_the_job_stops(tmp_path):
    """Worker 1 passes nothing on: worker 2 names it once cluster.heartbeat_timeout +
    interval (here 4.5 s) passed with no piece after the server's digests (before: the job
    waited until the stall watch, 300 s by default, named worker 2, the victim)."""
    _a_faulty_relay_is_named_and_stops_the_job(
        tmp_path, "DROP_RELAY", "SSDSGD_DROP_RELAY=1: this worker passes on nothing it "
        "should relay", r"worker 1 stopped passing on server 0's reply \(keys? [\d, .()a-z]+\): "
        r"0 of its \d+ pieces came, none in the 4.5 s since server 0's digests",
        SSDSGD_HEARTBEAT_TIMEOUT="4", SSDSGD_HEARTBEAT_INTERVAL="0.5")
