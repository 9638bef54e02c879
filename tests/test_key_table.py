"""MXNet's key conventions (ssdsgd/key_table.py): one key type per store, string keys
numbered in init order from 0, clear MXNetErrors for keys a store cannot use."""
import mxnet as mx
import pytest

from ssdsgd.key_table import KeyTable


def test_string_keys_are_numbered_in_first_init_order_and_keep_their_number():
    table = KeyTable()
    assert [table.number(k, new=True) for k in ["b", "a", "b", "c"]] == [0, 1, 0, 2]
    assert table.number("a") == 1


def test_integer_keys_are_their_own_numbers():
    table = KeyTable()
    assert table.number(7, new=True) == 7 and table.number(3) == 3


@pytest.mark.parametrize("first, second", [(3, "a"), ("a", 3)])
def test_one_key_type_per_store(first, second):
    table = KeyTable()
    table.number(first, new=True)
    with pytest.raises(mx.MXNetError, match="MXNet allows one key type per store"):
        table.number(second, new=True)


def test_a_string_key_never_initialized_is_named():
    table = KeyTable()
    table.number("w", new=True)
    with pytest.raises(mx.MXNetError, match="key 'x' was never initialized"):
        table.number("x")


@pytest.mark.parametrize("key", [True, 1.5, None, (1,)])
def test_what_is_not_a_key_is_refused(key):
    with pytest.raises(mx.MXNetError, match="a key is an int or a str"):
        KeyTable().number(key, new=True)
