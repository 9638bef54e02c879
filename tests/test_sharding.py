"""Key placement: balanced by bytes, big arrays sliced over every server, deterministic."""
from ssdsgd.kvstore.sharding import Placement, split_evenly


def test_split_evenly_covers_every_element_once():
    pieces = split_evenly(10, 3)
    assert pieces == [(0, 4), (4, 3), (7, 3)]
    assert sum(n for _, n in pieces) == 10


def test_small_keys_balance_by_bytes():
    p = Placement(2, bigarray_bound=1000)
    p.place(0, 800)
    p.place(1, 100)
    p.place(2, 100)
    p.place(3, 500)
    assert [p[k][0].server for k in range(4)] == [0, 1, 1, 1]
    assert p.load == [3200, 2800]


def test_big_arrays_are_split_across_all_servers():
    p = Placement(3, bigarray_bound=100)
    slices = p.place(0, 1001)
    assert [s.server for s in slices] == [0, 1, 2]
    assert [(s.offset, s.count) for s in slices] == [(0, 334), (334, 334), (668, 333)]


def test_one_server_keeps_big_arrays_whole():
    p = Placement(1, bigarray_bound=10)
    assert len(p.place(0, 1000)) == 1


def test_same_order_same_placement():
    sizes = [5, 300, 7, 2000, 40, 40, 900]
    a, b = Placement(3, 1000), Placement(3, 1000)
    for k, n in enumerate(sizes):
        a.place(k, n)
        b.place(k, n)
    assert a.slices == b.slices
