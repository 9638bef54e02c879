"""Checks of the values a peer sends: each a (predicate, what it must be) pair.

A node trusts no peer, so every field of every message is type-checked before use. The
transport checks its own messages' fields (``kvstore/kinds.py``) and each policy the fields
of its own events (``sync/events.py``), with the same checks from here: a leaf that every
layer may import. ``check_fields`` is the one loop that applies a table of them.
"""
import math
import re

MAX_RANK = 1 << 20
MAX_STEP = 1 << 62


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v):
    """A finite int or float (not a bool, not NaN or infinite)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def int_in(lo, hi):
    return lambda v: is_int(v) and lo <= v <= hi


def text(limit=None):
    return lambda v: isinstance(v, str) and (limit is None or len(v) <= limit)


def optional(check):
    return lambda v: v is None or check(v)


def one_of(*names):
    return (lambda v: isinstance(v, str) and v in names,
            " or ".join(repr(n) for n in names))


def is_address(v):
    return isinstance(v, list) and len(v) == 2 and text(255)(v[0]) and int_in(1, 65535)(v[1])


_HEX_ID = re.compile(r"[0-9a-f]{8,64}\Z")
RANK = (int_in(-1, MAX_RANK), "an integer from -1 to 2^20")
WORKER = (int_in(0, MAX_RANK), "a worker rank")
COUNT = (int_in(1, MAX_RANK), "an integer from 1 to 2^20")
STEP = (int_in(0, MAX_STEP), "a step")
ID = (lambda v: isinstance(v, str) and bool(_HEX_ID.match(v)), "8 to 64 lowercase hex digits")
STR = (text(), "a string")
OBJ = (lambda v: isinstance(v, dict), "a JSON object")
BOOL = (lambda v: isinstance(v, bool), "true or false")
RANKS = (lambda v: isinstance(v, list) and 1 <= len(v) <= MAX_RANK
         and all(int_in(0, MAX_RANK)(r) for r in v) and v == sorted(set(v)),
         "a non-empty increasing list of worker ranks")


def short(value, limit=60):
    shown = repr(value)
    return shown if len(shown) <= limit else shown[:limit] + "..."


def check_fields(what, fields, values, error, noun="field"):
    """Every field of ``values`` is one ``fields`` lists, of the type it must be; each
    required one is there. ``fields``: {name: ((check, what it must be), required)};
    ``error``: the exception class raised, with ``what`` (the message's name) first."""
    for name in values:
        if name not in fields:
            expected = f"expected {', '.join(fields)}" if fields else "it carries none"
            raise error(f"{what}: unexpected {noun} {short(name)} ({expected})")
    for name, ((check, must), required) in fields.items():
        if name not in values:
            if required:
                raise error(f"{what}: {noun} {name!r} is missing")
        elif not check(values[name]):
            raise error(f"{what}: {noun} {name!r} must be {must}, got "
                        f"{short(values[name])}")


# a REPLY's ``policy`` fields ``joins`` and ``leaves``: every join and departure its
# server decided, [[rank, from_step]] (docs/spec/membership.md rule 6; read by the
# worker's transport and its policy checks)
CHANGES = (lambda v: isinstance(v, list) and len(v) <= MAX_RANK and all(
    isinstance(j, list) and len(j) == 2 and int_in(0, MAX_RANK)(j[0])
    and int_in(0, MAX_STEP)(j[1]) for j in v), "a list of [worker rank, step]")
