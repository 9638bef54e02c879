"""MXNet's key conventions on ssdsgd's integer wire keys.

MXNet's stores take integer keys or string keys, never both in one store (KVStoreLocal:
"Mixed key types are not allowed"), and number string keys in the order of their first
``init``, from 0. Every worker inits its keys in the same order (MXNet requires it), so
every worker gets the same numbers without a message; and a Module, whose keys are its
parameter names in ``param_names`` order, gets the numbers its optimizer's ``idx2name``
uses, so lr and wd multipliers by name reach the right key on the servers.
"""
import numbers

from mxnet.base import MXNetError


class StoreKeyError(MXNetError):
    """A key the store cannot use: never initialized, of the other key type, not a key.
    An MXNetError, as MXNet's own stores raise for the same mistakes."""


class KeyTable:
    """The numbers of one store's keys. One per store, as in MXNet: two stores of a
    process share the servers, so a script that uses both must keep their keys apart,
    as with MXNet's own distributed stores."""

    def __init__(self):
        self.kind = None          # int or str, fixed by the first key
        self.numbers = {}         # str key -> its number

    def number(self, key, new=False):
        """The wire number of ``key``; ``new``: a string key first seen gets the next one
        (``init``), otherwise it must have been initialized."""
        kind = _kind(key)
        if self.kind is None:
            self.kind = kind
        elif kind is not self.kind:
            raise StoreKeyError(f"key {key!r}: this store's keys are {self.kind.__name__}s "
                            f"(MXNet allows one key type per store)")
        if kind is int:
            return int(key)
        if key not in self.numbers:
            if not new:
                raise StoreKeyError(f"key {key!r} was never initialized (kv.init)")
            self.numbers[key] = len(self.numbers)
        return self.numbers[key]


def _kind(key):
    if isinstance(key, str):
        return str
    if isinstance(key, numbers.Integral) and not isinstance(key, bool):
        return int
    raise StoreKeyError(f"a key is an int or a str, got {type(key).__name__} {key!r:.40}")
