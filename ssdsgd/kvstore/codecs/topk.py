"""``topk``: ssdsgd's second scheme, chosen by measurement (docs/spec/compression.md).

A push sends the elements of residual + grad with the largest magnitude, about ``ratio``
of each key, as (uint32 index, float32 value) pairs -- every index of a slice, then every
value -- and zeroes them in the residual. The selection threshold is exact for keys of up
to SAMPLE elements and estimated from a strided sample for bigger ones, so it costs O(n)
and is the same on every run.
"""
import dataclasses
import math
from typing import ClassVar

import numpy as np

from .base import CHUNK, Codec, CompressionError, number

DEFAULT_RATIO = 0.1              # see docs/spec/compression.md for the measurement
SAMPLE = 1 << 16                 # sample size for the selection threshold


@dataclasses.dataclass(frozen=True)
class TopK(Codec):
    """topk settings: ``ratio``, the fraction of each key's elements a push carries."""
    type: ClassVar[str] = "topk"
    code: ClassVar[int] = 2
    PARAMS: ClassVar[tuple] = ("ratio",)
    ratio: float = DEFAULT_RATIO

    @classmethod
    def parse(cls, params):
        ratio = number(params.get("ratio", DEFAULT_RATIO), "ratio")
        if not 0 < ratio <= 1:
            raise CompressionError(f"ratio must be in (0, 1] for topk compression, got "
                                   f"{params.get('ratio')!r}")
        return cls(ratio=ratio)

    @classmethod
    def length_error(cls, count, nbytes):
        if nbytes % 8 or nbytes > 8 * count:     # (uint32, float32) pairs, <= count
            return (f"topk data for {count} values is a multiple of 8 bytes up to "
                    f"{8 * count}, got {nbytes}")
        return None

    def encode(self, grad, residual, slices):
        return select_topk(grad, residual, self.ratio, slices)

    def decode(self, payload, count):
        return scatter_topk(payload, count)


def topk_threshold(grad, residual, ratio):
    """The smallest |residual + grad| a topk push sends: the ceil(ratio * m)-th largest of
    m magnitudes, all n when n <= SAMPLE, else every (n // SAMPLE)-th (a strided sample,
    so selection is O(n) and the same on every run; about ratio * n elements go out)."""
    stride = max(1, residual.size // SAMPLE)
    sample = np.abs(residual[::stride] + grad[::stride])
    k = min(sample.size, max(1, math.ceil(ratio * sample.size)))
    return np.partition(sample, sample.size - k)[sample.size - k]


def select_topk(grad, residual, ratio, slices):
    """residual += grad; per slice, the (uint32 index in the slice, float32 value) pairs of
    the key's largest |residual|, as index bytes then value bytes; those elements of the
    residual become 0 (sent exactly), the rest stay for later pushes."""
    threshold = topk_threshold(grad, residual, ratio)
    payloads = []
    for offset, count in slices:
        index, value = [], []
        for start in range(offset, offset + count, CHUNK):   # cache-sized passes
            stop = min(offset + count, start + CHUNK)
            r = residual[start:stop]
            np.add(r, grad[start:stop], out=r)
            magnitude = np.abs(r)
            chosen = magnitude >= threshold
            if threshold == 0:
                chosen &= magnitude > 0   # nothing to send for an all-zero residual
            at = np.flatnonzero(chosen)
            value.append(r[at])
            r[at] = 0
            index.append((at + (start - offset)).astype("<u4"))
        index = np.concatenate(index) if index else np.zeros(0, "<u4")
        value = np.concatenate(value) if value else np.zeros(0, "<f4")
        payloads.append(np.concatenate([index.view(np.uint8),
                                        value.astype("<f4").view(np.uint8)]))
    return payloads


def scatter_topk(payload, count):
    """Decode a topk payload into ``count`` float32 values (zero where nothing was sent)."""
    payload = np.asarray(payload)
    if payload.dtype != np.uint8 or payload.ndim != 1 or payload.size % 8:
        raise CompressionError(f"topk data must be flat bytes, a multiple of 8, got "
                               f"{payload.dtype}{payload.shape}")
    k = payload.size // 8
    if k > count:
        raise CompressionError(f"topk data for {count} elements carries {k} entries")
    index = payload[:4 * k].view("<u4")
    if k and (index[-1] >= count or (k > 1 and not (np.diff(index.astype(np.int64)) > 0).all())):
        raise CompressionError(f"topk indices must increase strictly and be < {count}")
    out = np.zeros(count, np.float32)
    out[index] = payload[4 * k:].view("<f4")
    return out
