"""cluster.server_replicas: 1 as chain replication (kvstore/chain.py): a push's copy for
the backup carries no tensors, the owner hands the backup each update's sum (SUM, server
to server) and answers no reply of an update before the backup acknowledged it, and the
backup applies the owner's sum where its policy would have summed the pushes. In
process, on real sockets, with a real server; the kill-a-server jobs are in
tests/test_replicas.py."""
import dataclasses
from types import SimpleNamespace

import mxnet as mx
import numpy as np
import pytest
import zmq

from ssdsgd.kvstore import protocol as P
from ssdsgd.mxglue.optimizer_spec import describe

F32 = np.float32


def backup_job(**settings):
    from test_server_in_process import InProcessJob
    return InProcessJob(num_servers=2, **settings)


def copy_init(job, values):
    """Both workers' INIT copies (server 0 backs up server 1's keys)."""
    from test_server_in_process import SIZES, records
    w0, w1 = job.workers
    job.send(w0, P.Message(P.Kind.INIT, sender=0, flags=P.Flag.BACKUP, records=records(SIZES),
                           tensors=[[values[k]] for k in SIZES]))
    job.send(w1, P.Message(P.Kind.INIT, sender=1, flags=P.Flag.BACKUP,
                           records=records(SIZES, ntensors=0), tensors=[[] for _ in SIZES]))
    assert job.replies(w0) == [] and job.replies(w1) == []      # held, as copies' are


def tensorless_push(job, rank, step, flags=P.Flag.PULL):
    """Worker ``rank``'s copy of its push of ``step``, as a worker makes it."""
    from test_server_in_process import SIZES, records
    from ssdsgd.kvstore.replica_map import ReplicaMap, backup_copies
    msg = P.Message(P.Kind.PUSH, sender=rank, flags=flags, step=step, req=next(job.reqs),
                    records=records(SIZES, step=step),
                    tensors=[[np.zeros(n, F32)] for n in SIZES.values()])
    (copy,) = backup_copies(ReplicaMap(2, 1), [(1, msg, P.encode(msg))])[1]
    assert copy[0] == 0
    job.workers[rank].send_multipart(copy[1])
    job.deliver()
    return msg.req


def sum_message(step, sums, sender=1, req=7, **change):
    from test_server_in_process import SIZES
    rows = [(k, step, 0, SIZES[k], F32, 1) for k in SIZES]
    msg = P.Message(P.Kind.SUM, sender=sender, req=req, step=step,
                    records=P.make_records(rows), tensors=[[sums[k]] for k in SIZES])
    for name, value in change.items():
        setattr(msg, name, value)
    return msg


def test_a_push_copy_carries_no_tensors():
    """The worker's copy of a push for the key's backup: the same header (request id,
    step, flags with BACKUP) and records, no data frame, whatever the push's size;
    INIT and PULL copies are the request's own frames (INIT's values are sent once)."""
    from ssdsgd.kvstore.replica_map import ReplicaMap, backup_copies
    big = np.ones(1 << 20, F32)                      # 4 MiB
    recs = P.make_records([(3, 5, 0, big.size, F32, 1)])
    push = P.Message(P.Kind.PUSH, sender=1, flags=P.Flag.PULL, step=5, req=41, records=recs,
                     tensors=[[big]], meta={"policy": {"latest": True}})
    frames = P.encode(push)
    (backup, copy), = backup_copies(ReplicaMap(2, 1), [(0, push, frames)])[0]
    assert backup == 1
    sent = sum(P.frame_buffer(f).nbytes for f in frames)
    copied = sum(P.frame_buffer(f).nbytes for f in copy)
    assert sent > big.nbytes and copied < 1024, (sent, copied)
    assert len(copy) == 3                           # header, records, meta: no data frame
    got = P.decode(copy)
    assert (got.kind, got.req, got.step, got.sender) == (P.Kind.PUSH, 41, 5, 1)
    assert got.flags == P.Flag.PULL | P.Flag.BACKUP and got.meta == push.meta
    assert got.records["key"].tolist() == [3] and got.records["ntensors"].tolist() == [0]
    assert got.records["count"].tolist() == [big.size] and got.tensors == [[]]
    # a pull's copy is its own frames, reflagged; without replicas there is no copy
    pull = P.Message(P.Kind.PULL, sender=1, req=42, records=P.make_records(
        [(3, 5, 0, big.size, F32, 0)]), tensors=[[]])
    (_, pull_copy), = backup_copies(ReplicaMap(2, 1), [(0, pull, P.encode(pull))])[0]
    assert P.decode(pull_copy).flags == P.Flag.BACKUP
    assert backup_copies(ReplicaMap(2, 0), [(0, push, frames)]) == {}


def test_the_backup_applies_the_owners_sum_bit_for_bit_once_it_came():
    """Tensorless push copies wait for the owner's SUM; it is acknowledged with its
    request id, the copies are taken, and the backup's weights are MXNet's SGD of the
    owner's sum -- what the owner computed from the pushes. The replies are held until
    the owner dies, as before."""
    from test_server_in_process import SIZES
    job = backup_job(SSDSGD_SERVER_REPLICAS=1)
    try:
        rng = np.random.default_rng(3)
        values = {k: rng.standard_normal(n).astype(F32) for k, n in SIZES.items()}
        copy_init(job, values)
        opt = dict(learning_rate=0.1, momentum=0.9, wd=1e-4)
        job.send(job.workers[0], P.Message(P.Kind.COMMAND, sender=0, meta={
            "command": "optimizer", "optimizer": describe(mx.optimizer.create("sgd", **opt))}))
        assert [m.kind for m in job.replies(job.workers[0])] == [P.Kind.ACK]
        updater = mx.optimizer.get_updater(mx.optimizer.create("sgd", **opt))
        expected = {k: mx.nd.array(v) for k, v in values.items()}
        owner = job.stranger                           # plays server 1 (open mode)
        for step in range(2):
            for rank in (0, 1):
                tensorless_push(job, rank, step)
            assert job.replies(job.workers[0]) == [] and job.server.chain_in.queued
            assert all(s.version == step for s in job.server.weights.shards.values())
            sums = {k: rng.standard_normal(n).astype(F32) for k, n in SIZES.items()}
            job.send(owner, sum_message(step, sums, req=100 + step))
            (ack,) = job.replies(owner)
            assert (ack.kind, ack.req, ack.sender) == (P.Kind.ACK, 100 + step, 0)
            for k in SIZES:
                updater(k, mx.nd.array(sums[k]), expected[k])
                shard = job.server.weights.shards[k]
                assert shard.version == step + 1
                np.testing.assert_array_equal(shard.weight.asnumpy(), expected[k].asnumpy())
            assert not any(job.server.chain_in.queued.values())
            assert job.server.chain_in.sums == {}
        assert job.replies(job.workers[0]) == [] and len(job.server.backup.held) >= 2
        job.server.on_scheduler(P.Message(P.Kind.PROMOTE, meta={"dead": 1, "owner": 0}))
        got = job.replies(job.workers[1])
        assert [m.kind for m in got][-1] == P.Kind.TAKEOVER
        last = [m for m in got if m.kind == P.Kind.REPLY][-1]
        for k, arrays in zip(last.records["key"].tolist(), last.tensors):
            np.testing.assert_array_equal(arrays[0], expected[k].asnumpy())
    finally:
        job.close()


def test_a_departure_that_completes_owned_and_backed_up_keys_at_once_applies_each_its_way():
    """Worker 1 leaves (on_worker_failure: continue) while step 0 waits for it on a server
    that owns a key and backs up others: the departure completes step 0 of every key at
    once. The owned key's update is its pushes' (their mean, as N workers'), the
    backed-up keys' the owner's sum. Before, one update of both kinds summed the copies'
    placeholders and the server died with a TypeError (a 2-server job with a dead
    worker, test_replicas::test_a_dead_worker_then_a_dead_server..., under load)."""
    from test_server_in_process import SIZES
    job = backup_job(SSDSGD_SERVER_REPLICAS=1)
    try:
        w0, w1 = job.workers
        own, n = 9, 5          # a key this server owns, declared first
        job.send(w0, P.Message(P.Kind.INIT, sender=0, records=P.make_records(
            [(own, 0, 0, n, F32, 1)]), tensors=[[np.zeros(n, F32)]]))
        job.send(w1, P.Message(P.Kind.INIT, sender=1, records=P.make_records(
            [(own, 0, 0, n, F32, 0)]), tensors=[[]]))
        assert [m.kind for m in job.replies(w0) + job.replies(w1)] == [P.Kind.REPLY] * 2
        copy_init(job, {k: np.zeros(m, F32) for k, m in SIZES.items()})
        job.send(w0, P.Message(P.Kind.PUSH, sender=0, flags=P.Flag.PULL, step=0,
                               records=P.make_records([(own, 0, 0, n, F32, 1)]),
                               tensors=[[np.full(n, 2.0, F32)]]))
        tensorless_push(job, 0, 0)
        sums = {k: np.full(m, 3.0, F32) for k, m in SIZES.items()}
        job.send(job.stranger, sum_message(0, sums, req=100))
        assert all(s.version == 0 for s in job.server.weights.shards.values())
        job.server.on_membership({"removed": 1, "from_step": 0})
        shards = job.server.weights.shards
        assert all(s.version == 1 for s in shards.values())
        # no optimizer: the store keeps the sum (MXNet's rule); worker 0's gradient is
        # the members' mean, counted as the job's 2 workers'
        np.testing.assert_array_equal(shards[own].weight_view(), np.full(n, 4.0, F32))
        for k in SIZES:        # the owner's sum, as it came (it scaled it already)
            np.testing.assert_array_equal(shards[k].weight_view(), sums[k])
    finally:
        job.close()


@pytest.mark.parametrize("forget", [False, True], ids=["remembered", "forgotten"])
def test_a_request_sent_again_after_the_takeover_is_taken_once(forget):
    """After the takeover a worker sends the new owner every request it kept: one whose
    copy was taken is skipped (the step is not pushed twice), one whose copy still
    waits for a sum that will never come replaces it and is aggregated as the owner's."""
    from test_server_in_process import SIZES, records
    job = backup_job(SSDSGD_SERVER_REPLICAS=1)
    try:
        values = {k: np.zeros(n, F32) for k, n in SIZES.items()}
        copy_init(job, values)
        owner = job.stranger
        reqs = {rank: [tensorless_push(job, rank, 0)] for rank in (0, 1)}
        job.send(owner, sum_message(0, {k: np.full(n, 3, F32) for k, n in SIZES.items()}))
        for rank in (0, 1):                # step 1: copies, but the owner dies first
            reqs[rank].append(tensorless_push(job, rank, 1))
        assert all(s.version == 1 for s in job.server.weights.shards.values())
        job.server.on_scheduler(P.Message(P.Kind.PROMOTE, meta={"dead": 1, "owner": 0}))
        for rank in (0, 1):
            job.replies(job.workers[rank])
        if forget:      # the remembered ids do not decide: the policy has those pushes
            job.server.chain_in.taken_set.clear()
        grads = {k: np.full(n, 0.5 * (rank + 1), F32) for rank in (0,) for k, n in SIZES.items()}
        for rank in (0, 1):                # both requests again, with their tensors
            for step, req in enumerate(reqs[rank]):
                job.send(job.workers[rank], P.Message(
                    P.Kind.PUSH, sender=rank, req=req, flags=P.Flag.PULL,
                    records=records(SIZES, step=step),
                    tensors=[[np.full(n, 0.5 * (rank + 1), F32)] for n in SIZES.values()]))
        del grads
        for rank in (0, 1):
            got = job.replies(job.workers[rank])
            assert [m.kind for m in got] == [P.Kind.REPLY], got
            assert got[0].req == reqs[rank][1]
        for k, shard in job.server.weights.shards.items():    # no optimizer: the sum
            assert shard.version == 2
            np.testing.assert_array_equal(shard.weight.asnumpy(), np.full(SIZES[k], 1.5, F32))
    finally:
        job.close()


@pytest.mark.parametrize("change, why", [
    ({"sender": 0}, "a SUM in the name of server 0, whose keys this server does not back up"),
    ({"sender": 5}, "a SUM in the name of server 5"),
    ({"flags": P.Flag.PULL}, "a SUM carries no flags"),
    ({"meta": {"x": 1}}, "'x'"),
    ({"step": 0, "records": "stale"}, "already applied here"),
    ({"records": "two"}, "a SUM carries one uncompressed sum per key"),
    ({"records": "short"}, "does not match this server's"),
    ({"records": "none"}, "a SUM names no key"),
])
def test_a_malformed_or_forged_sum_is_refused_and_the_backup_keeps_serving(change, why):
    from test_server_in_process import SIZES, error_of
    job = backup_job(SSDSGD_SERVER_REPLICAS=1)
    try:
        copy_init(job, {k: np.zeros(n, F32) for k, n in SIZES.items()})
        for rank in (0, 1):
            tensorless_push(job, rank, 0)
        job.send(job.stranger, sum_message(0, {k: np.ones(n, F32) for k, n in SIZES.items()},
                                           req=1))
        job.replies(job.stranger)                      # its ACK: step 0 is applied
        sums = {k: np.ones(n, F32) for k, n in SIZES.items()}
        msg = sum_message(1, sums, req=2)
        kind = change.pop("records", None)
        for name, value in change.items():
            setattr(msg, name, value)
        if kind == "stale":
            msg.records["step"] = 0
        elif kind == "two":
            msg.records["ntensors"] = 2
            msg.tensors = [[sums[k], sums[k]] for k in SIZES]
        elif kind == "short":
            msg.records["count"] = [n - 1 for n in SIZES.values()]
            msg.tensors = [[sums[k][:-1]] for k in SIZES]
        elif kind == "none":
            msg.records, msg.tensors = P.make_records([]), []
        job.send(job.stranger, msg)
        req, error = error_of(job, job.stranger)
        assert why in error and req == 2, error
        assert all(s.version == 1 for s in job.server.weights.shards.values())
        assert set(job.server.chain_in.sums) == set()
        # the backup keeps serving: the right sum of step 1 is taken
        for rank in (0, 1):
            tensorless_push(job, rank, 1)
        job.send(job.stranger, sum_message(1, sums, req=3))
        assert [m.kind for m in job.replies(job.stranger)] == [P.Kind.ACK]
        assert all(s.version == 2 for s in job.server.weights.shards.values())
    finally:
        job.close()


def test_only_the_owners_connection_sends_sums_and_no_worker_does():
    from test_server_in_process import SIZES, error_of
    job = backup_job(SSDSGD_SERVER_REPLICAS=1)
    try:
        copy_init(job, {k: np.zeros(n, F32) for k, n in SIZES.items()})
        sums = {k: np.ones(n, F32) for k, n in SIZES.items()}
        job.send(job.workers[0], sum_message(0, sums))     # a worker cannot send sums
        assert error_of(job, job.workers[0])[1] == (
            "worker 0 sent a SUM; only the server whose keys this one backs up sends sums")
        assert job.server.chain_in.sums == {}
        job.send(job.stranger, sum_message(0, sums, req=1))     # the owner's connection
        assert [m.kind for m in job.replies(job.stranger)] == [P.Kind.ACK]
        other = job._dealer(job.router.getsockopt(zmq.LAST_ENDPOINT).decode(), b"\x01other")
        job.sockets.append(other)
        job.send(other, sum_message(1, sums, req=2))
        assert "on another connection than its first" in error_of(job, other)[1]
        job.send(job.stranger, sum_message(0, sums, req=3))     # the same step twice
        assert "the sum of step 0 came twice" in error_of(job, job.stranger)[1]
    finally:
        job.close()
    job = backup_job()        # server_replicas: 0: no SUM is taken, from anyone
    try:
        job.send(job.stranger, sum_message(0, {k: np.ones(n, F32) for k, n in SIZES.items()}))
        assert "this job copies no requests" in error_of(job, job.stranger)[1]
        assert job.server.chain_out is None and job.server.replies.gate is None
        assert job.server.weights.on_sum is None
    finally:
        job.close()


def test_a_sum_of_another_servers_key_holder_is_refused():
    """With the job's keys, a SUM comes only on a connection that proved server 1's key
    (the port admits servers for that, security.CONNECTS_TO)."""
    from ssdsgd.kvstore.chain import ChainBackup
    from ssdsgd.kvstore.replica_map import ReplicaMap
    from ssdsgd.kvstore.replies import RequestError
    from ssdsgd.kvstore.security import NodeKeys, claim_error
    keys = NodeKeys.generate_job(False, ["server 0", "server 1", "worker 0"])["server 0"]
    assert not keys.may_connect("server 1") and keys.may_connect("worker 0")   # replicas 0
    keys = dataclasses.replace(keys, replicas=True)
    assert keys.may_connect("server 1") and keys.may_connect("worker 0")
    guard = SimpleNamespace(wrong_claim=lambda frame, role, rank: claim_error(
        frame, role, rank))
    chain = ChainBackup(ReplicaMap(2, 1), print)
    weights = SimpleNamespace(shards={})
    msg = P.Message(P.Kind.SUM, sender=1, req=1, records=P.make_records(
        [(4, 0, 0, 3, F32, 1)]), tensors=[[np.ones(3, F32)]])
    with pytest.raises(RequestError, match="worker 1's key cannot act as server 1"):
        chain.check_sum(b"c", msg, "worker 1", guard, weights, 0, None, 1 << 20)
    assert chain.check_sum(b"c", msg, "server 1", guard, weights, 0, None, 1 << 20)
    with pytest.raises(RequestError, match="would exceed 8 bytes"):
        chain.check_sum(b"c", msg, "server 1", guard, weights, 0, None, 8)


def test_a_worker_keeps_a_push_until_a_reply_as_of_its_step_came():
    """kvstore/chain.KeptRequests: ssgd's push that pulls goes with its reply; ssd's
    pushes stay until a pull as of their step (or later) is answered; a pull with its
    reply; what is kept for a dead server is sent to its new owner, in order."""
    from ssdsgd.kvstore.chain import KeptRequests
    kept = KeptRequests()

    def msg(kind, req, step, flags=0):
        return P.Message(kind, req=req, flags=flags, records=P.make_records(
            [(k, step, 0, 4, F32, 0) for k in (1, 2)]), tensors=[[], []])
    kept.keep(1, msg(P.Kind.PUSH, 1, 0, P.Flag.PULL), ["f1"])
    kept.keep(1, msg(P.Kind.PUSH, 2, 1), ["f2"])
    kept.keep(1, msg(P.Kind.PUSH, 3, 2), ["f3"])
    kept.keep(0, msg(P.Kind.PUSH, 4, 2), ["f4"])
    kept.keep(1, msg(P.Kind.PULL, 5, 1), ["f5"])
    kept.answered(1)
    assert list(kept.entries) == [2, 3, 4, 5]
    kept.answered(5)                       # as of step 1: the push of step 1 is held
    assert list(kept.entries) == [3, 4]
    assert kept.again(1, 0) == [["f3"]] and kept.entries[3][0] == 0
    latest = msg(P.Kind.PULL, 6, -1)
    kept.keep(0, latest, ["f6"])
    kept.answered(6)                       # a latest pull says nothing of a step
    assert list(kept.entries) == [3, 4]


def test_a_sum_sent_before_its_owner_heard_of_a_death_is_dropped_quietly():
    """With 3 or more servers a live owner may send a sum after its backup heard that
    another server died (PROMOTE reaches the servers one by one): no replica is left,
    so the backup drops it without an ERROR that would stop the owner; any other
    connection's SUM is still refused."""
    from test_server_in_process import SIZES, error_of
    job = backup_job(SSDSGD_SERVER_REPLICAS=1)
    try:
        copy_init(job, {k: np.zeros(n, F32) for k, n in SIZES.items()})
        sums = {k: np.ones(n, F32) for k, n in SIZES.items()}
        job.send(job.stranger, sum_message(0, sums, req=1))
        assert [m.kind for m in job.replies(job.stranger)] == [P.Kind.ACK]
        job.server.on_scheduler(P.Message(P.Kind.PROMOTE, meta={"dead": 1, "owner": 0}))
        for sock in job.workers:
            assert [m.kind for m in job.replies(sock)][-1] == P.Kind.TAKEOVER
        job.send(job.stranger, sum_message(1, sums, req=2))
        assert job.replies(job.stranger) == []
        assert set(job.server.chain_in.sums) == {(k, 0) for k in SIZES}
        job.send(job.workers[1], sum_message(1, sums, req=3))
        assert "worker 1 sent a SUM" in error_of(job, job.workers[1])[1]
    finally:
        job.close()


@pytest.mark.system
@pytest.mark.parametrize("algorithm", ["ssgd", "ssd"])
def test_a_replicas_job_sends_each_push_once_and_ends_as_the_one_server_job(
        tmp_path, uninterrupted_digits, algorithm):
    """The whole job with server_replicas: 1 and no death: the workers' bytes sent are
    those of the job without replicas but for the copies' headers (active replication
    sent every push twice: about 2x), and the final weights are the 1-server job's."""
    import jobs
    from conftest import digits_job
    from test_e2e_configs import run_dir_of, sets
    from test_recovery import assert_same, final
    from test_replicas import REPLICAS
    reference = uninterrupted_digits(algorithm)
    root = tmp_path / "runs"
    p = jobs.run(["configs/digits.yaml", *digits_job(algorithm), *REPLICAS,
                  *sets(output__dir=root)], timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "sends the sums of its keys to server 1, their backup" in p.stdout + p.stderr
    run = run_dir_of(root)
    assert_same(run, final(reference))
    sent = {name: json_of(d / "summary.json")["bytes_sent"] for name, d in
            (("replicas", run), ("none", reference))}
    ratio = sent["replicas"] / sent["none"]
    print(f"{algorithm}: workers sent {sent['replicas']} bytes with a replica, "
          f"{sent['none']} without ({ratio:.3f}x)")
    assert 1.0 < ratio < 1.15, sent


def json_of(path):
    import json
    return json.loads(path.read_text())


@pytest.mark.system
@pytest.mark.parametrize("cipher", ["aesgcm", "curve"])
def test_a_killed_server_of_a_secure_job_is_replaced_as_if_uninterrupted(
        tmp_path, uninterrupted_digits, cipher):
    """--secure: the owner's connection to its backup passes the port's guard (a
    server's key, admitted because the job has replicas) and its frames are sealed
    (aesgcm) or CURVE-encrypted; a server SIGKILLed at a seeded step, its backup owns
    its keys, and the job ends bit for bit as the uninterrupted 1-server job."""
    from conftest import digits_job
    from test_recovery import assert_same, final
    from test_replicas import kill_a_server
    reference = final(uninterrupted_digits("ssd"))
    run, out, victim = kill_a_server(tmp_path / "runs", f"chain-secure-{cipher}",
                                     [*digits_job("ssd"), "--secure", "--cipher", cipher])
    assert f"sends the sums of its keys to server {1 - victim}, their backup" in out
    assert "refused a connection" not in out, out[-3000:]
    assert_same(run, reference)


@pytest.mark.parametrize("secure", [False, True], ids=["plain", "curve"])
def test_a_servers_key_opens_a_servers_port_only_in_a_job_with_replicas(secure):
    """Real handshakes: server 1's key at server 0's port is refused without replicas
    (test_security's rule) and admitted with them; a worker's still is, a scheduler's
    still is not."""
    from ssdsgd.kvstore.security import KeyFile, load_keys
    from test_security import _handshake
    names = ["scheduler", "server 0", "server 1", "worker 0"]
    kf = KeyFile(secure, names)
    try:
        keys = {n: load_keys(kf.files[n]) for n in names}
        port = dataclasses.replace(keys["server 0"], replicas=True)
        for peer, admitted in (("server 1", True), ("worker 0", True), ("scheduler", False)):
            ok, lines = _handshake(port, keys[peer], "server 0")
            assert ok == admitted, (peer, lines)
        assert not _handshake(keys["server 0"], keys["server 1"], "server 0")[0]
    finally:
        kf.remove()
