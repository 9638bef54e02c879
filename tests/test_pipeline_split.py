"""How the worker cuts a server's part of an exchange into messages (pipelining)."""
from ssdsgd.kvstore.client import PIECE_MIN, _cut

PIECES = 8     # SSDSGD_PIPELINE_PIECES as a slow link would set it


def _items(sizes):
    return [((key,), [None], nbytes) for key, nbytes in enumerate(sizes)]


def _bytes(chunks):
    return [c[2] for c in chunks]


def test_a_small_model_is_cut_into_pieces_the_server_can_answer_one_by_one():
    sizes = [17_000] * 65                      # ResNet-20-like: 1.1 MB in 65 keys
    chunks = _cut(_items(sizes), 4 << 20, PIECES)   # the default chunk is bigger than the part
    assert PIECES <= len(chunks) <= PIECES + 1        # greedy: the last piece is the rest
    assert sum(_bytes(chunks)) == sum(sizes)
    assert [r for c in chunks for r in c[0]] == [(k,) for k in range(65)]   # key order kept


def test_pieces_are_never_smaller_than_the_minimum():
    assert len(_cut(_items([PIECE_MIN // 2, PIECE_MIN // 2]), 4 << 20, PIECES)) == 1
    # each piece is filled until the next key would pass PIECE_MIN
    assert all(b > PIECE_MIN - 20_000 for b in _bytes(_cut(_items([20_000] * 40), 4 << 20, PIECES))[:-1])


def test_a_smaller_chunk_setting_still_wins_and_none_means_one_message():
    assert len(_cut(_items([100] * 10), 250, PIECES)) == 5
    assert len(_cut(_items([17_000] * 65), None)) == 1


def test_a_big_model_keeps_the_chunk_setting():
    chunks = _cut(_items([1 << 20] * 100), 4 << 20, PIECES)
    assert _bytes(chunks) == [4 << 20] * 25


def test_by_default_a_part_below_the_chunk_setting_is_one_message():
    """SSDSGD_PIPELINE_PIECES defaults to 1: at 10 Gbit/s 8 pieces cost ssgd 1.27x ->
    0.78-0.90x native (docs/benchmarks/small_steps.md)."""
    assert len(_cut(_items([17_000] * 65), 4 << 20)) == 1
    assert len(_cut(_items([1 << 20] * 100), 4 << 20)) == 25
