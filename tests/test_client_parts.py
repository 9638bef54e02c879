"""The worker client's parts that need no sockets, in process: splitting a request over
the servers, the key table, the futures of requests in flight (a reply decoded from real
frames), and push_then's outbox."""
import numpy as np
import pytest

from ssdsgd.kvstore import protocol as P
from ssdsgd.kvstore.client import PushOutbox
from ssdsgd.kvstore.key_tables import KeyTable
from ssdsgd.kvstore.requests import Gather, Requests, ServerError
from ssdsgd.kvstore.scheduler import JobAborted
from ssdsgd.kvstore.splitting import Coded, split

F32 = np.float32


def _table():
    table = KeyTable(num_servers=2, bigarray_bound=10)
    table.add(0, 4, F32)        # small: whole on server 0
    table.add(1, 20, F32)       # big: one slice per server
    return table


def test_a_request_is_split_into_each_servers_slices():
    table = _table()
    big = np.arange(20, dtype=F32)
    messages = split(table.placement, [(0, 3, np.ones(4, F32), F32), (1, 3, big, F32)], None)
    assert sorted(messages) == [0, 1]
    (recs0, tens0, bytes0), = messages[0]
    assert [r[:4] for r in recs0] == [(0, 3, 0, 4), (1, 3, 0, 10)] and bytes0 == 56
    np.testing.assert_array_equal(tens0[1][0], big[:10])
    (recs1, tens1, _), = messages[1]
    assert [r[:4] for r in recs1] == [(1, 3, 10, 10)]
    np.testing.assert_array_equal(tens1[0][0], big[10:])
    # a compressed gradient: one payload per slice, its encoding in the record
    coded = Coded("2bit", [np.zeros(3, np.uint8), np.ones(3, np.uint8)])
    messages = split(table.placement, [(1, 0, coded, F32)], None)
    assert messages[1][0][0] == [(1, 0, 10, 10, F32, 1, "2bit")]
    assert messages[1][0][1][0][0] is coded.payloads[1]
    # a pull carries no tensors; small chunks cut a server's part into messages
    messages = split(table.placement, [(0, -1, None, F32), (1, -1, None, F32)], 40)
    assert [len(messages[s]) for s in (0, 1)] == [2, 1]
    assert messages[0][0][1] == [[]]


def test_the_key_table_knows_every_key_it_placed_and_no_other():
    table = _table()
    with pytest.raises(KeyError, match="key 7 was never initialized"):
        table[7]
    table[0].pushes += 1
    assert table[0].pushes == 1 and table[1].pushes == 0
    assert table.shapes([(1, 0, None, np.float64)]) == ({1: 20}, {1: np.dtype(np.float64)})
    assert table.shapes() == ({0: 4, 1: 20}, {0: np.dtype(F32), 1: np.dtype(F32)})


def _reply(req, key, offset, values, kind=P.Kind.REPLY, meta=None):
    msg = P.Message(kind, sender=0, req=req, meta=meta,
                    records=P.make_records([(key, 5, offset, len(values), F32, 1)]),
                    tensors=[[np.asarray(values, F32)]])
    return P.decode(P.encode(msg))


def test_replies_reach_their_futures_and_are_put_back_together_per_key():
    requests = Requests({"time_blocked": 0.0})
    first, second = requests.expect(1), requests.expect(2)
    requests.deliver(_reply(2, 1, 10, range(10, 20)), server=1)
    requests.deliver(_reply(1, 1, 0, range(10)), server=0)
    out = Gather(requests, [first, second], {1: 20}, {1: np.dtype(F32)}).wait()
    np.testing.assert_array_equal(out[1].value, np.arange(20, dtype=F32))
    assert out[1].version == 5
    # a refusal fails its request; a refusal of a message that wanted no reply, the job
    third = requests.expect(3)
    requests.deliver(_reply(3, 1, 0, [], kind=P.Kind.ERROR, meta={"error": "no"}), server=0)
    with pytest.raises(ServerError, match="server 0: no"):
        third.result(0)
    with pytest.raises(JobAborted, match="refused a message of this worker: no"):
        requests.deliver(_reply(9, 1, 0, [], kind=P.Kind.ERROR, meta={"error": "no"}), 0)
    # a reply with a key this worker never placed is refused
    fourth = requests.expect(4)
    requests.deliver(_reply(4, 8, 0, [1.0]), server=0)
    with pytest.raises(ServerError, match="key 8, which this worker never initialized"):
        Gather(requests, [fourth], {1: 20}, {1: np.dtype(F32)}).wait()


def test_a_failure_reaches_every_waiting_future_and_every_later_request():
    requests = Requests({})
    waiting, barrier = requests.expect(1), requests.expect_control(P.Kind.BARRIER)
    requests.fail(JobAborted("the job was aborted: x"))
    for fut in (waiting, barrier):
        with pytest.raises(JobAborted, match="aborted: x"):
            fut.result(0)
    with pytest.raises(JobAborted, match="aborted: x"):
        requests.check_open()
    ended = Requests({})
    ended.end(JobAborted("over"))
    with pytest.raises(JobAborted, match="I/O thread has stopped"):
        ended.check_open()


def test_queued_scheduler_replies_go_to_their_requests_in_order_and_all_fail_together():
    """CHUNK: a worker keeps requests in flight (data/dynamic.py), the scheduler answers
    them in order; any other kind waits for one reply, a new request replacing the old."""
    requests = Requests({})
    first = requests.expect_control(P.Kind.CHUNK, queued=True)
    second = requests.expect_control(P.Kind.CHUNK, queued=True)
    assert requests.take_control(P.Kind.CHUNK) is first
    assert requests.take_control(P.Kind.CHUNK) is second
    assert requests.take_control(P.Kind.CHUNK) is None
    requests.expect_control(P.Kind.BARRIER)
    barrier = requests.expect_control(P.Kind.BARRIER)
    assert requests.take_control(P.Kind.BARRIER) is barrier
    assert requests.take_control(P.Kind.BARRIER) is None
    waiting = [requests.expect_control(P.Kind.CHUNK, queued=True) for _ in range(2)]
    requests.fail(JobAborted("the job was aborted: y"))
    for fut in waiting:
        with pytest.raises(JobAborted, match="aborted: y"):
            fut.result(0)


def test_the_outbox_sends_a_key_twice_in_two_requests_and_answers_every_caller():
    requests, sent, answers = Requests({}), [], []

    def send(entries):
        sent.append([e[0] for e in entries])
        fut = requests.expect(len(sent))
        fut.set_result(_reply(len(sent), entries[0][0], 0, [float(len(sent))] * 4))
        return Gather(requests, [fut], {k: 4 for k in (0, 1)}, {k: np.dtype(F32) for k in (0, 1)})

    outbox = PushOutbox(requests.lock, send)
    assert outbox.add([(0, 0, None, F32)], lambda r, e: answers.append(("a", r, e)))
    assert not outbox.add([(1, 0, None, F32)], lambda r, e: answers.append(("b", r, e)))
    outbox.add([(0, 1, None, F32)], lambda r, e: answers.append(("c", r, e)))
    outbox.flush()
    assert sent == [[0, 1], [0]]
    assert [(name, r[0].value[0], e) for name, r, e in answers] == \
        [("a", 1.0, None), ("b", 1.0, None), ("c", 2.0, None)]
    outbox.add([(1, 1, None, F32)], lambda r, e: answers.append(("d", r, e)))
    outbox.fail(JobAborted("over"))
    assert answers[-1][0] == "d" and answers[-1][1] is None and str(answers[-1][2]) == "over"


def test_a_turn_of_the_io_thread_sends_at_most_send_per_turn_messages():
    """The bound that keeps a full send queue from holding the I/O thread away from its
    heartbeats and replies (test_client_send_flood runs it live): one turn sends
    SEND_PER_TURN of a longer queue, in order, over a real socket, and says some are left;
    the close (no limit) sends the rest."""
    import queue

    import zmq

    from ssdsgd.kvstore import io_thread
    ctx = zmq.Context.instance()
    into, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    into.bind("inproc://send-per-turn")
    out.connect("inproc://send-per-turn")
    thread = io_thread.IOThread.__new__(io_thread.IOThread)    # its queue and counters only
    thread._commands, thread.stats = queue.SimpleQueue(), {"messages_sent": 0,
                                                           "bytes_sent": 0}
    thread._sockets = [out]
    total = 3 * io_thread.SEND_PER_TURN + 5
    for i in range(total):
        thread._commands.put((0, [str(i).encode()]))
    try:
        assert thread._send_queued(None, io_thread.SEND_PER_TURN) is True
        got = [into.recv() for _ in range(thread.stats["messages_sent"])]
        assert got == [str(i).encode() for i in range(io_thread.SEND_PER_TURN)]
        assert thread._send_queued(None, None) is False
        assert thread.stats["messages_sent"] == total
    finally:
        into.close(linger=0)
        out.close(linger=0)
