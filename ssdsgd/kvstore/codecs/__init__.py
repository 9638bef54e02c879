"""The push codecs' registry (docs/spec/compression.md): each codec is one module of this
package (``twobit.py``, ``topk.py``) that declares what it needs (``base.Codec``: its name,
wire code, byte-length rule, parameters, encode and decode). The rest of the transport
asks this registry -- the protocol for a record's encoding and length, the server for the
job's codec, ``Compression.from_params`` for the settings -- and never names a codec.

Adding a codec: a module with a ``base.Codec`` subclass, and its class in ``CODECS``.
"""
import difflib

from .base import Codec, CompressionError, Packed, Residuals
from .topk import TopK
from .twobit import TwoBit

CODECS = (TwoBit, TopK)
AUTO = "auto"           # not a codec: the job picks one (or none) at the end of its warm-up
BY_NAME = {c.type: c for c in CODECS}
ENCODINGS = {c.code: c.type for c in CODECS}     # a key record's encoding -> name; 0: raw
assert len(BY_NAME) == len(ENCODINGS) == len(CODECS) and 0 not in ENCODINGS

__all__ = ["AUTO", "BY_NAME", "CODECS", "Codec", "CompressionError", "ENCODINGS", "Packed",
           "Residuals", "by_name", "from_params", "parse_setting", "setting_forms"]


def by_name(name):
    """The codec called ``name``; CompressionError naming it and the known ones if none."""
    if name not in tuple(BY_NAME):
        raise CompressionError(f"compression type must be one of {', '.join(BY_NAME)}; "
                               f"got {name!r}")
    return BY_NAME[name]


def from_params(params):
    """``kv.set_gradient_compression``'s dict, checked, as its codec's settings (a
    ``Codec``); None or {} -> None (off)."""
    if params is None or params == {}:
        return None
    if not isinstance(params, dict):
        raise CompressionError(f"compression params must be a dict like "
                               f"{CODECS[0]().params()}, got {params!r}")
    codec = by_name(params.get("type"))
    allowed = ("type",) + codec.PARAMS
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        hint = difflib.get_close_matches(unknown[0], allowed, n=1)
        raise CompressionError(f"unknown {codec.type} compression parameter {unknown[0]!r}"
                               + (f"; did you mean {hint[0]!r}?" if hint else
                                  f"; {codec.type} takes {', '.join(allowed)}"))
    return codec.parse(params)


def setting_forms():
    """``sync.compression``'s forms, in words: 'none, auto, 2bit[:threshold] or
    topk[:ratio]'."""
    forms = ["none", AUTO] + [f"{c.type}[:{c.PARAMS[0]}]" for c in CODECS]
    return ", ".join(forms[:-1]) + " or " + forms[-1]


def parse_setting(text):
    """``sync.compression``'s text as kv.set_gradient_compression's dict: 'none' -> None,
    'NAME' or 'NAME:X' (X: the codec's first parameter, e.g. 2bit's threshold, topk's
    ratio); checked like the dict. 'auto' -> {'type': 'auto'} (the job chooses: the
    worker's stage machine, sync/auto.py)."""
    kind, sep, value = str(text).partition(":")
    if kind == "none" and not sep:
        return None
    if kind == AUTO and not sep:
        return {"type": AUTO}
    if kind not in BY_NAME:
        raise CompressionError(f"expected {setting_forms()}, got {text!r}")
    params = {"type": kind}
    if sep:
        params[BY_NAME[kind].PARAMS[0]] = value
    from_params(params)
    return params
