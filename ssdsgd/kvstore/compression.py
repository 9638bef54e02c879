"""Compressed pushes with error feedback (docs/spec/compression.md): the names the rest of
ssdsgd uses. The codecs themselves, one module each, and their registry are
``ssdsgd/kvstore/codecs/``.

A worker keeps a residual per key: what compression has not sent yet. Each push adds the
fresh gradient to it, sends a coarse version of the sum and keeps the rest for the next
push (``Residuals``). Servers decode every worker's push and sum the decoded values in rank
order. Pulls are never compressed.

    spec = Compression.from_params({'type': '2bit', 'threshold': 0.5})   # a codecs.TwoBit
    payloads = spec.residuals().encode(key, grad, slices)     # worker: one per slice
    values = spec.decode(payload, count)                      # server: float32 to add
"""
from .codecs import AUTO, CompressionError, Residuals, from_params, parse_setting
from .codecs.cost import measure as measure_codecs

__all__ = ["AUTO", "Compression", "CompressionError", "Residuals", "decode",
           "measure_codecs", "parse_setting", "payload_nbytes"]


class Compression:
    """``Compression.from_params(params)``: kv.set_gradient_compression's dict, checked,
    as its codec's settings (a ``codecs.Codec``: ``type``, its parameters, ``params()``,
    ``residuals()``, ``decode``, ``receive``); None or {} -> None."""
    from_params = staticmethod(from_params)


def decode(spec, payload, count):
    """What a server adds up for one push: ``count`` float32 values."""
    return spec.decode(payload, count)


def payload_nbytes(spec, count):
    """Bytes of a push of ``count`` elements (None if they depend on the data)."""
    return spec.payload_nbytes(count)
