"""What every push codec shares (docs/spec/compression.md): the ``Codec`` interface a codec
module fills in, the error all of them raise, and ``Residuals``, the worker's
error-feedback memory, which is the same for every codec.

A codec is a frozen dataclass of its settings (its fields are the parameters of
``kv.set_gradient_compression``'s dict besides ``type``) that declares, as class
attributes, its name, its wire code and its defaults, and implements: ``parse`` (a
checked params dict -> its settings), ``length_error`` (the byte-length rule the
protocol checks a record against), ``encode`` (residual += grad; the payloads of the
key's slices; what was not sent stays in the residual), ``decode`` (what a server adds up)
and, if it can sum pushes without decoding them, ``receive`` returning a ``Packed``.
"""
import dataclasses
import math
from typing import ClassVar

import numpy as np

CHUNK = 1 << 16                  # elements per vectorized pass (a multiple of 16)


class CompressionError(ValueError):
    """Compression parameters or data that cannot be used; the message says why."""


def number(value, what):
    """A float parameter given as a number or a string; finite, else CompressionError."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str, np.floating)):
        raise CompressionError(f"{what} must be a number, got {value!r}")
    try:
        result = float(value)
    except ValueError:
        raise CompressionError(f"{what} must be a number, got {value!r}") from None
    if not math.isfinite(result):
        raise CompressionError(f"{what}={value!r} is not finite")
    return result


class Codec:
    """One job's compression settings, of one codec (subclasses are frozen dataclasses)."""
    type: ClassVar[str]           # the name in ``{'type': ...}`` and ``sync.compression``
    code: ClassVar[int]           # the key record's ``encoding`` byte (0 is raw)
    PARAMS: ClassVar[tuple]       # its parameters; the first is ``sync.compression``'s NAME:X

    @classmethod
    def parse(cls, params):
        """The settings of a params dict whose keys were checked: CompressionError if a
        value cannot be used."""
        raise NotImplementedError

    @classmethod
    def length_error(cls, count, nbytes):
        """None if ``nbytes`` can code ``count`` float32 values, else what is wrong."""
        raise NotImplementedError

    def payload_nbytes(self, count):
        """Bytes of a push of ``count`` elements, or None if they depend on the data."""
        return None

    def encode(self, grad, residual, slices):
        """residual += grad (flat float32, the whole key); one uint8 payload per slice
        [(offset, count), ...]; what was not sent stays in ``residual``."""
        raise NotImplementedError

    def decode(self, payload, count):
        """What a server adds up for one push: ``count`` float32 values."""
        raise NotImplementedError

    def receive(self, payload, count):
        """A server's checked push: decoded values, or a ``Packed`` summed later."""
        return self.decode(payload, count)

    def params(self):
        """The dict form (what ``from_params`` accepts back; scalars only, for the wire)."""
        return {"type": self.type,
                **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}

    def residuals(self):
        """A worker's error-feedback state for this codec."""
        return Residuals(self)


class Packed:
    """A push a server keeps coded until its step is summed."""

    def decode(self):
        raise NotImplementedError

    @staticmethod
    def sum_into(parts, out):
        """out[:] = the sum of ``parts`` (all of this class, one key slice, rank order),
        bit for bit what adding their decoded values would give; False (out untouched)
        if that cannot be promised."""
        return False


class Residuals:
    """A worker's error-feedback memory: one float32 residual per key, whole-key sized."""

    def __init__(self, spec):
        self.spec = spec
        self._residual = {}

    def encode(self, key, grad, slices=None):
        """Compress ``grad`` (flat float32, the whole key) for its server slices
        [(offset, count), ...] (default: one slice, the whole key); one uint8 payload
        per slice. The result equals compressing the whole key at once."""
        grad = np.asarray(grad)
        if grad.dtype != np.float32:
            raise CompressionError(f"key {key}: gradient compression needs float32 "
                                   f"gradients (as in MXNet), got {grad.dtype}")
        grad = grad.reshape(-1)
        residual = self._residual.get(key)
        if residual is None:
            residual = self._residual[key] = np.zeros(grad.size, np.float32)
        elif residual.size != grad.size:
            raise CompressionError(f"key {key}: gradient of {grad.size} elements, earlier "
                                   f"pushes had {residual.size}")
        return self.spec.encode(grad, residual, slices or [(0, grad.size)])

    def residual(self, key):
        """The key's residual (a view; None before its first push)."""
        return self._residual.get(key)

    def state(self):
        """Every key's residual, copied (a worker checkpoint)."""
        return {key: r.copy() for key, r in self._residual.items()}

    def load(self, state):
        """Continue from ``state()``."""
        self._residual = {key: np.array(r, np.float32).reshape(-1) for key, r in state.items()}
