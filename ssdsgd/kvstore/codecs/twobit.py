"""``2bit``: MXNet 1.9.1's scheme, bit for bit (src/kvstore/gradient_compression-inl.h).

    residual += grad
    residual >= t  -> send +t, residual -= t   (code 0b11)
    residual <= -t -> send -t, residual += t   (code 0b10)
    otherwise      -> send 0                   (code 0b00)

Four codes per byte, the first element in the two most significant bits; 16 elements per
32-bit word, the last word zero-padded: ``4 * ceil(n / 16)`` bytes for n elements. Like
``dist_sync``, every key is compressed whatever its size. MXNet's worker reads the
threshold with dmlc's float parser (``mxnet_stof``); its servers receive it printed with
six decimals (``std::to_string``) and decode with that value (``server_threshold``).
A server keeps the pushes packed (``Packed2bit``) and, where that is exact, sums a step's
pushes by counting codes (``sum_2bit``). tests/test_compression.py checks all of this
against MXNet's own code.
"""
import dataclasses
import fractions
import functools
import math
from typing import ClassVar

import numpy as np

from .base import CHUNK, Codec, CompressionError, Packed

DEFAULT_THRESHOLD = 0.5          # MXNet's GradientCompressionParam default
_PACK = np.uint32(0x40100401)    # moves codes at bits 0, 8, 16, 24 to 30, 28, 26, 24


def mxnet_stof(text):
    """A float parameter as MXNet 1.9.1 reads it: dmlc-core's ``dmlc::stof``
    (include/dmlc/strtonum.h, ParseFloat<float, true>), replayed in float32 arithmetic.
    It is not correctly rounded (about one value in ten lands one ulp off), and a job
    moved from dist_sync must quantize with the same threshold. Raises ValueError."""
    f32, s, p = np.float32, str(text), 0
    while p < len(s) and s[p] in " \t\n\v\f\r":
        p += 1
    start, negative = p, s[p:p + 1] == "-"
    p += s[p:p + 1] in "+-" and 1
    predec = 0
    while p < len(s) and s[p].isdigit() and s[p].isascii():
        predec = (predec * 10 + int(s[p])) % 2 ** 64
        p += 1
    digits = p > start + (s[start:start + 1] in "+-")
    value = f32(np.uint64(predec))
    if s[p:p + 1] == ".":
        p += 1
        val2 = pow10 = cnt = 0
        pow10 = 1
        while p < len(s) and s[p].isdigit() and s[p].isascii():
            if cnt < 19:
                val2, pow10 = val2 * 10 + int(s[p]), pow10 * 10
            p, cnt, digits = p + 1, cnt + 1, True
        value = f32(value + f32(np.float64(np.uint64(val2)) / np.float64(np.uint64(pow10))))
    if not digits:
        raise ValueError(f"{text!r} is not a number")
    if s[p:p + 1] in ("e", "E"):
        p += 1
        frac = s[p:p + 1] == "-"
        p += s[p:p + 1] in "+-" and 1
        expon = 0
        while p < len(s) and s[p].isdigit() and s[p].isascii():
            expon, p = (expon * 10 + int(s[p])) % 2 ** 32, p + 1
        if expon > 38 or (expon == 38 and ((not frac and value > f32(3.402823466))
                                           or (frac and value < f32(1.175494351)))):
            raise ValueError(f"{text!r} is out of the float32 range")
        scale = f32(1)
        while expon >= 8:
            scale, expon = f32(scale * f32(1e8)), expon - 8
        while expon > 0:
            scale, expon = f32(scale * f32(10)), expon - 1
        value = f32(value / scale) if frac else f32(value * scale)
    p += s[p:p + 1] in ("f", "F") and 1
    if p < len(s):
        raise ValueError(f"{text!r}: trailing characters {s[p:]!r}")
    return -value if negative else value


def strtof(text):
    """Correctly rounded decimal -> float32 (C's strtof; what std::stof does)."""
    exact = fractions.Fraction(text)
    near = np.float32(float(exact))      # within one ulp: float() rounds once to double
    best = min((near, np.nextafter(near, np.float32(-np.inf)),
                np.nextafter(near, np.float32(np.inf))),
               key=lambda c: (abs(fractions.Fraction(float(c)) - exact),
                              int(np.float32(c).view(np.uint32)) & 1))
    return np.float32(best)


def _threshold(value):
    """``threshold`` as MXNet's worker gets it: str(value) through dmlc::stof."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str, np.floating)):
        raise CompressionError(f"threshold must be a number, got {value!r}")
    try:
        parsed = mxnet_stof(value)
    except ValueError as e:
        raise CompressionError(f"threshold must be a number: {e}") from None
    if not math.isfinite(parsed):
        raise CompressionError(f"threshold={value!r} is not a finite float32")
    return parsed


@dataclasses.dataclass(frozen=True)
class TwoBit(Codec):
    """2bit settings: ``threshold``, the float32 value the worker quantizes with."""
    type: ClassVar[str] = "2bit"
    code: ClassVar[int] = 1
    PARAMS: ClassVar[tuple] = ("threshold",)
    threshold: float = DEFAULT_THRESHOLD

    @classmethod
    def parse(cls, params):
        threshold = _threshold(params.get("threshold", DEFAULT_THRESHOLD))
        if not threshold > 0:
            raise CompressionError(f"threshold must be > 0 for 2bit compression, got "
                                   f"{params.get('threshold')!r}")
        spec = cls(threshold=float(threshold))
        if not spec.server_threshold > 0:
            raise CompressionError(f"threshold {params['threshold']!r} is below 5e-7: "
                                   f"MXNet's servers round it to 6 decimals, i.e. to 0")
        return spec

    @functools.cached_property
    def server_threshold(self):
        """The value servers decode +-t with: MXNet sends it as std::to_string(float)."""
        return float(strtof("%f" % self.threshold))

    @classmethod
    def length_error(cls, count, nbytes):
        want = 4 * (-(-count // 16))
        return None if nbytes == want else \
            f"2bit data for {count} values is {want} bytes, got {nbytes}"

    def payload_nbytes(self, count):
        return 4 * (-(-count // 16))

    def encode(self, grad, residual, slices):
        return [quantize_2bit(grad[o:o + n], residual[o:o + n], self.threshold)
                for o, n in slices]

    def decode(self, payload, count):
        return dequantize_2bit(payload, count, self.server_threshold)

    def receive(self, payload, count):
        """Kept packed (a ``Packed2bit``), summed by ``sum_2bit`` with its step's others."""
        return Packed2bit(check_2bit(payload, count), count, self.server_threshold)


def quantize_2bit(grad, residual, threshold):
    """residual += grad; return the packed codes (uint8, 4 * ceil(n/16) bytes) and leave
    in ``residual`` what was not sent. Both arrays flat float32; residual is updated."""
    n = residual.size
    out = np.empty(4 * (-(-n // 16)), np.uint8)
    t = np.float32(threshold)
    for start in range(0, n, CHUNK):     # passes over cache-sized pieces, not elements
        stop = min(n, start + CHUNK)
        out[start // 4:4 * (-(-stop // 16))] = _quantize_chunk(
            grad[start:stop], residual[start:stop], t)
    return out


def _quantize_chunk(grad, residual, t):
    n = residual.size
    np.add(residual, grad, out=residual)
    codes = np.zeros(-(-n // 16) * 16, np.uint8)
    pos = codes[:n].view(bool)
    np.greater_equal(residual, t, out=pos)
    neg = np.less_equal(residual, -t)
    # residual -= (+t, -t or 0): r - (-t) is exactly MXNet's r -= neg_threshold.
    sent = np.subtract(pos.view(np.int8), neg.view(np.int8)).astype(np.float32)
    sent *= t
    residual -= sent
    codes[:n] *= np.uint8(3)                        # 0b11 for +t
    codes[:n] += neg.view(np.uint8) << np.uint8(1)  # 0b10 for -t
    # 4 codes (one per byte of a little-endian uint32) -> one byte, first code on top.
    words = codes.view("<u4")
    return ((words * _PACK) >> np.uint32(24)).astype(np.uint8)


def _lut_2bit(threshold):
    """byte -> its 4 decoded float32 values, as one complex128 per byte (fast gather)."""
    t = np.float32(threshold)
    value = np.array([0, 0, -t, t], np.float32)
    byte = np.arange(256)
    table = np.stack([value[(byte >> s) & 3] for s in (6, 4, 2, 0)], axis=1)
    return np.ascontiguousarray(table, np.float32).view(np.complex128).reshape(256)


_LUTS = {}


def check_2bit(packed, count):
    """``packed`` as flat bytes, if it is the size of ``count`` elements' 2bit codes."""
    packed = np.asarray(packed)
    if packed.dtype != np.uint8 or packed.ndim != 1:
        raise CompressionError(f"2bit data must be flat bytes, got {packed.dtype}{packed.shape}")
    wrong = TwoBit.length_error(count, packed.size)
    if wrong:
        raise CompressionError(wrong)
    return packed


def dequantize_2bit(packed, count, threshold):
    """Decode ``count`` float32 values (+t, -t or 0) from MXNet's packed 2bit codes."""
    packed = check_2bit(packed, count)
    lut = _LUTS.get(threshold)
    if lut is None:
        lut = _LUTS[threshold] = _lut_2bit(threshold)
    out = np.empty(count, np.float32)
    for start in range(0, count, CHUNK):
        stop = min(count, start + CHUNK)
        out[start:stop] = lut[packed[start // 4:-(-stop // 4)]].view(np.float32)[:stop - start]
    return out


@dataclasses.dataclass(frozen=True)
class Packed2bit(Packed):
    """One push's checked 2bit codes, kept packed until its step is summed."""
    payload: np.ndarray
    count: int
    threshold: float

    def decode(self):
        return dequantize_2bit(self.payload, self.count, self.threshold)

    @staticmethod
    def sum_into(parts, out):
        """By counting (``sum_2bit``) where that is exact (``summable``)."""
        if not summable(parts[0].threshold, len(parts)):
            return False
        sum_2bit(parts, out)
        return True


#: lanes per uint32 counter word hold sums of (digit + 1) <= 2 * parts: at most 127 parts
MAX_SUMMED = 127


def _count_lut_2bit():
    """byte -> uint32 whose byte j is code j's digit + 1 (-t: 0, 0: 1, +t: 2), so that a
    little-endian word's bytes follow the elements' order."""
    digit1 = np.array([1, 1, 0, 2], np.uint32)   # codes 0b00, 0b01 (unused), 0b10, 0b11
    byte = np.arange(256)
    return sum(digit1[(byte >> (6 - 2 * j)) & 3] << np.uint32(8 * j)
               for j in range(4)).astype("<u4")


_COUNT_LUT = _count_lut_2bit()


@functools.lru_cache(maxsize=64)
def summable(threshold, parts):
    """Can ``parts`` pushes of +-t or 0 be summed by counting? Yes when every c * t,
    |c| <= parts, is a float32: then each partial sum of a rank-order addition is exact,
    and equals the count times t. (True for MXNet's default 0.5 and any power of two.)"""
    t = float(np.float32(threshold))
    return 0 < parts <= MAX_SUMMED and all(float(np.float32(c * t)) == c * t
                                           for c in range(1, parts + 1))


def sum_2bit(packs, out):
    """out[:] = the sum of ``packs`` (Packed2bit of one key slice) decoded, without
    decoding each: four codes per byte are counted in the four 8-bit lanes of a uint32
    word (one table lookup and one add per byte and push), then each count c becomes
    c * t. The caller checks ``summable``: then this equals adding
    the decoded pushes in any order, bit for bit."""
    first = packs[0]
    counts = np.zeros(first.payload.size, "<u4")
    for start in range(0, counts.size, CHUNK // 4):    # cache-sized passes
        stop = start + CHUNK // 4
        lanes = counts[start:stop]
        for p in packs:
            lanes += _COUNT_LUT[p.payload[start:stop]]
    t, n = np.float32(first.threshold), np.float32(len(packs))
    lanes = counts.view(np.uint8)
    for start in range(0, first.count, CHUNK):    # (lane - parts) * t: c * t, one rounding
        stop = min(first.count, start + CHUNK)
        part = out[start:stop]
        np.copyto(part, lanes[start:stop], casting="unsafe")
        part -= n
        part *= t
    return out
