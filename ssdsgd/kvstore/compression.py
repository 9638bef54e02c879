"""Compressed pushes with error feedback (docs/spec/compression.md).

A worker keeps a residual per key: what compression has not sent yet. Each push adds the
fresh gradient to it, sends a coarse version of the sum and keeps the rest for the next
push. Servers decode every worker's push and sum the decoded values in rank order. Pulls
are never compressed. Everything here is vectorized numpy on flat float32 arrays.

``2bit`` is MXNet 1.9.1's scheme, bit for bit (src/kvstore/gradient_compression-inl.h):
    residual += grad
    residual >= t  -> send +t, residual -= t   (code 0b11)
    residual <= -t -> send -t, residual += t   (code 0b10)
    otherwise      -> send 0                   (code 0b00)
Four codes per byte, the first element in the two most significant bits; 16 elements per
32-bit word, the last word zero-padded: ``4 * ceil(n / 16)`` bytes for n elements. Like
``dist_sync``, every key is compressed whatever its size. MXNet's worker reads the
threshold with dmlc's float parser (``mxnet_stof``); its servers receive it printed with
six decimals (``std::to_string``) and decode with that value (``server_threshold``).
tests/test_compression.py checks all of this against MXNet's own code.

``topk`` (ssdsgd's second scheme, chosen by measurement: docs/spec/compression.md) sends
the elements of residual + grad with the largest magnitude, about ``ratio`` of each key,
as (uint32 index, float32 value) pairs, and zeroes them in the residual. The selection
threshold is exact for keys of up to SAMPLE elements and estimated from a strided sample
for bigger ones, so it costs O(n) and is the same on every run.
"""
import dataclasses
import difflib
import fractions
import functools
import math

import numpy as np

TYPES = ("2bit", "topk")
DEFAULT_THRESHOLD = 0.5          # MXNet's GradientCompressionParam default
DEFAULT_RATIO = 0.1              # topk: see docs/spec/compression.md for the measurement
SAMPLE = 1 << 16                 # topk: sample size for the selection threshold
_PACK = np.uint32(0x40100401)    # moves codes at bits 0, 8, 16, 24 to 30, 28, 26, 24
CHUNK = 1 << 16                  # elements per vectorized pass (a multiple of 16)


class CompressionError(ValueError):
    """Compression parameters or data that cannot be used; the message says why."""


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


PARAMS = {"2bit": ("threshold",), "topk": ("ratio",)}


@dataclasses.dataclass(frozen=True)
class Compression:
    """One job's compression settings; build with ``from_params``."""
    type: str
    threshold: float = None   # 2bit: the float32 value the worker quantizes with
    ratio: float = None       # topk: the fraction of each key's elements a push carries

    @classmethod
    def from_params(cls, params):
        """Validate ``kv.set_gradient_compression``'s dict; None or {} -> None (off)."""
        if params is None or params == {}:
            return None
        if not isinstance(params, dict):
            raise CompressionError(f"compression params must be a dict like "
                                   f"{{'type': '2bit', 'threshold': 0.5}}, got {params!r}")
        kind = params.get("type")
        if kind not in TYPES:
            raise CompressionError(f"compression type must be one of {', '.join(TYPES)}; "
                                   f"got {kind!r}")
        allowed = ("type",) + PARAMS[kind]
        unknown = sorted(set(params) - set(allowed))
        if unknown:
            hint = difflib.get_close_matches(unknown[0], allowed, n=1)
            raise CompressionError(f"unknown {kind} compression parameter {unknown[0]!r}"
                                   + (f"; did you mean {hint[0]!r}?" if hint else
                                      f"; {kind} takes {', '.join(allowed)}"))
        if kind == "topk":
            ratio = _number(params.get("ratio", DEFAULT_RATIO), "ratio")
            if not 0 < ratio <= 1:
                raise CompressionError(f"ratio must be in (0, 1] for topk compression, got "
                                       f"{params.get('ratio')!r}")
            return cls(kind, ratio=ratio)
        threshold = _threshold(params.get("threshold", DEFAULT_THRESHOLD))
        if not threshold > 0:
            raise CompressionError(f"threshold must be > 0 for 2bit compression, got "
                                   f"{params.get('threshold')!r}")
        spec = cls(kind, threshold=float(threshold))
        if not spec.server_threshold > 0:
            raise CompressionError(f"threshold {params['threshold']!r} is below 5e-7: "
                                   f"MXNet's servers round it to 6 decimals, i.e. to 0")
        return spec

    def params(self):
        """The dict form (what ``from_params`` accepts back; scalars only, for the wire)."""
        return {"type": self.type, **{name: getattr(self, name) for name in PARAMS[self.type]}}

    @functools.cached_property
    def server_threshold(self):
        """The value servers decode +-t with: MXNet sends it as std::to_string(float)."""
        return float(strtof("%f" % self.threshold))

    def residuals(self):
        """A worker's error-feedback state for this scheme."""
        return Residuals(self)

    def decode(self, payload, count):
        """What a server adds up for one push: ``count`` float32 values."""
        return decode(self, payload, count)

    def receive(self, payload, count):
        """A server's checked push: 2bit stays packed (a ``Packed2bit``, summed by
        ``sum_2bit`` with its step's other pushes), topk is decoded."""
        if self.type == "2bit":
            return Packed2bit(check_2bit(payload, count), count, self.server_threshold)
        return self.decode(payload, count)


def parse_setting(text):
    """``sync.compression``'s text as kv.set_gradient_compression's dict: 'none' -> None,
    '2bit' or '2bit:T' (threshold T), 'topk' or 'topk:R' (ratio R); checked like the dict."""
    kind, sep, value = str(text).partition(":")
    if kind == "none" and not sep:
        return None
    if kind not in TYPES:
        raise CompressionError(f"expected none, 2bit[:threshold] or topk[:ratio], got {text!r}")
    params = {"type": kind}
    if sep:
        params[PARAMS[kind][0]] = value
    Compression.from_params(params)
    return params


def _number(value, what):
    if isinstance(value, bool) or not isinstance(value, (int, float, str, np.floating)):
        raise CompressionError(f"{what} must be a number, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise CompressionError(f"{what} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise CompressionError(f"{what}={value!r} is not finite")
    return number


# ---- 2bit --------------------------------------------------------------------------------

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
    if packed.size != 4 * (-(-count // 16)):
        raise CompressionError(f"2bit data for {count} elements is {4 * (-(-count // 16))} "
                               f"bytes, got {packed.size}")
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
class Packed2bit:
    """One push's checked 2bit codes, kept packed until its step is summed."""
    payload: np.ndarray
    count: int
    threshold: float

    def decode(self):
        return dequantize_2bit(self.payload, self.count, self.threshold)


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


# ---- topk --------------------------------------------------------------------------------

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


# ---- per-scheme dispatch -----------------------------------------------------------------

def decode(spec, payload, count):
    """What a server adds up for one push: ``count`` float32 values."""
    if spec.type == "topk":
        return scatter_topk(payload, count)
    return dequantize_2bit(payload, count, spec.server_threshold)


def payload_nbytes(spec, count):
    """Bytes of a push of ``count`` elements (fixed for 2bit; topk: None, data-dependent)."""
    return 4 * (-(-count // 16)) if spec.type == "2bit" else None


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
        slices = slices or [(0, grad.size)]
        if self.spec.type == "topk":
            return select_topk(grad, residual, self.spec.ratio, slices)
        return [quantize_2bit(grad[o:o + n], residual[o:o + n], self.spec.threshold)
                for o, n in slices]

    def residual(self, key):
        """The key's residual (a view; None before its first push)."""
        return self._residual.get(key)

    def state(self):
        """Every key's residual, copied (a worker checkpoint)."""
        return {key: r.copy() for key, r in self._residual.items()}

    def load(self, state):
        """Continue from ``state()``."""
        self._residual = {key: np.array(r, np.float32).reshape(-1) for key, r in state.items()}
