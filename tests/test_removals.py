"""The step a dead worker leaves the job from (ssdsgd/kvstore/removals.py), in process:
every server is asked, the smallest answer wins, and only answers to a question count."""
import pytest

from ssdsgd.kvstore.removals import RemovalError, Removals


def test_the_smallest_answer_decides_once_every_server_has_answered():
    r = Removals()
    r.begin(2, [b"s0", b"s1", b"s2"])
    assert r.answer(b"s1", {"removed": 2, "next_step": 9}) is None
    assert r.answer(b"s0", {"removed": 2, "next_step": 7}) is None
    assert r.answer(b"s2", {"removed": 2, "next_step": 8}) == {"removed": 2, "from_step": 7}


def test_two_removals_are_decided_apart():
    r = Removals()
    r.begin(1, [b"s0", b"s1"])
    r.begin(3, [b"s0", b"s1"])
    assert r.answer(b"s0", {"removed": 3, "next_step": 4}) is None
    assert r.answer(b"s0", {"removed": 1, "next_step": 6}) is None
    assert r.answer(b"s1", {"removed": 1, "next_step": 5}) == {"removed": 1, "from_step": 5}
    assert r.answer(b"s1", {"removed": 3, "next_step": 4}) == {"removed": 3, "from_step": 4}


@pytest.mark.parametrize("server, meta", [
    (b"s0", {"removed": 5, "next_step": 1}),      # no such removal
    (b"sX", {"removed": 1, "next_step": 1}),      # a server that was not asked
    (b"s0", {"removed": 1}),                      # no step
])
def test_an_answer_to_no_question_is_refused(server, meta):
    r = Removals()
    r.begin(1, [b"s0", b"s1"])
    with pytest.raises(RemovalError, match="not an answer to a removal"):
        r.answer(server, meta)


def test_a_server_answers_once():
    r = Removals()
    r.begin(1, [b"s0", b"s1"])
    r.answer(b"s0", {"removed": 1, "next_step": 3})
    with pytest.raises(RemovalError):
        r.answer(b"s0", {"removed": 1, "next_step": 2})     # a second, smaller answer
    assert r.answer(b"s1", {"removed": 1, "next_step": 4}) == {"removed": 1, "from_step": 3}
