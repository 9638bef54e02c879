"""ssdsgd.kvstore.compression (the codecs of ssdsgd/kvstore/codecs/) against MXNet 1.9.1's
own 2bit quantizer, bit for bit.

Two ways to MXNet's code: its GradientCompression object called directly
(ssdsgd.testing.mxnet_compression: packed bytes and residuals), and the public API, a
'device' kvstore with set_gradient_compression on a CPU context (how it reads the
threshold and what a push of a compressed gradient sums to).
"""
import mxnet as mx
import numpy as np
import pytest

from ssdsgd.kvstore.codecs.twobit import (MAX_SUMMED, Packed2bit, dequantize_2bit,
                                          mxnet_stof, quantize_2bit, strtof, sum_2bit,
                                          summable)
from ssdsgd.kvstore.compression import (Compression, CompressionError, Residuals, decode,
                                        parse_setting, payload_nbytes)
from ssdsgd.testing import mxnet_compression

needs_symbols = pytest.mark.skipif(not mxnet_compression.available(),
                                   reason="libmxnet does not export GradientCompression")
THRESHOLDS = [0.5, 0.05, 1 / 3, 0.0123456789, 2.75]
SIZES = [1, 3, 15, 16, 17, 33, 1000, 100_003]


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def grads(size, threshold, steps, seed=0):
    """Gradients around the threshold (so every code occurs), with exact hits and specials."""
    rs = np.random.RandomState(seed)
    t = np.float32(threshold)
    out = [(rs.randn(size) * threshold * 1.5).astype(np.float32) for _ in range(steps)]
    special = np.array([t, -t, np.nextafter(t, 0), -np.nextafter(t, 0), 0.0, -0.0,
                        np.nextafter(t, np.inf), np.inf, -np.inf, np.nan], np.float32)
    out[0][:min(size, special.size)] = special[:size]
    return out


@needs_symbols
@pytest.mark.parametrize("threshold", THRESHOLDS)
@pytest.mark.parametrize("size", SIZES)
def test_quantize_equals_mxnet_bit_for_bit_over_steps(size, threshold):
    ref = mxnet_compression.MXNet2Bit(threshold)
    spec = Compression.from_params({"type": "2bit", "threshold": threshold})
    ours = np.zeros(size, np.float32)
    theirs = np.zeros(size, np.float32)
    for step, g in enumerate(grads(size, threshold, steps=4)):
        packed = quantize_2bit(g, ours, spec.threshold)
        ref_packed, theirs = ref.quantize(g, theirs)
        np.testing.assert_array_equal(packed, ref_packed, err_msg=f"step {step}")
        np.testing.assert_array_equal(bits(ours), bits(theirs), err_msg=f"step {step}")
        assert packed.size == payload_nbytes(spec, size) == 4 * -(-size // 16)


@needs_symbols
@pytest.mark.parametrize("threshold", THRESHOLDS)
@pytest.mark.parametrize("size", [1, 5, 16, 21, 4096 + 7])
def test_dequantize_equals_mxnet_for_every_code(size, threshold):
    """Random bytes, so the unused code 0b01 and the padding are covered too."""
    packed = np.random.RandomState(size).randint(0, 256, 4 * -(-size // 16)).astype(np.uint8)
    t = float(np.float32(threshold))
    expected = mxnet_compression.MXNet2Bit(threshold).dequantize(packed, size)
    got = dequantize_2bit(packed, size, t)
    np.testing.assert_array_equal(bits(got), bits(expected))


def test_bit_layout_is_mxnets():
    """Element 0 in the top two bits of byte 0; +t is 0b11, -t 0b10 (gradient_compression-inl.h)."""
    g = np.array([1, -1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, -1], np.float32)
    packed = quantize_2bit(g, np.zeros(g.size, np.float32), 0.5)
    assert packed.tolist() == [0b11100000, 0b00000011, 0, 0, 0b10000000, 0, 0, 0]


@pytest.mark.parametrize("threshold", [0.5, 0.0123456789])
def test_device_kvstore_pushes_sum_to_what_a_server_decodes(threshold):
    """MXNet's public API: a 'device' kvstore on one CPU context quantizes each push with
    its residual and keeps the dequantized value. Its threshold parse (float32 of
    str(threshold)) decides where +t starts: exactly at spec.threshold."""
    spec = Compression.from_params({"type": "2bit", "threshold": threshold})
    t = np.float32(spec.threshold)
    kv = mx.kv.create("device")
    kv.set_gradient_compression({"type": "2bit", "threshold": threshold})
    size = 37
    kv.init(0, mx.nd.zeros(size))
    ours = Residuals(spec)
    gs = grads(size, threshold, steps=5, seed=3)
    gs[0][:4] = [t, np.nextafter(t, 0), -t, -np.nextafter(t, 0)]
    gs[0][4:10] = 0
    for step, g in enumerate(gs):
        kv.push(0, mx.nd.array(g))
        out = mx.nd.zeros(size)
        kv.pull(0, out=out)
        (packed,) = ours.encode(0, g)
        # the device kvstore decodes with the worker's threshold (no trip through a server)
        mine = dequantize_2bit(packed, size, float(t))
        np.testing.assert_array_equal(bits(out.asnumpy()), bits(mine), err_msg=f"step {step}")
    assert float(out.asnumpy()[0]) != 0   # the test did exercise +-t


def _mxnet_worker_threshold_boundary(threshold):
    """What a 'device' kvstore with this threshold makes of [t, t - 1 ulp], t = ours."""
    t = np.float32(Compression.from_params({"type": "2bit", "threshold": threshold}).threshold)
    kv = mx.kv.create("device")
    kv.set_gradient_compression({"type": "2bit", "threshold": threshold})
    kv.init(0, mx.nd.zeros(2))
    kv.push(0, mx.nd.array(np.array([t, np.nextafter(t, np.float32(0))], np.float32)))
    out = mx.nd.zeros(2)
    kv.pull(0, out=out)
    return t, out.asnumpy()


def test_threshold_is_parsed_like_mxnet():
    """MXNet parses str(threshold) with dmlc::stof, which is one ulp off for about one
    value in ten; its quantizer must then start +t at exactly our float32."""
    rs = np.random.RandomState(1)
    values = list(10 ** rs.uniform(-6, 2, 150)) + [7.353780987411301, 1.4691674033346,
                                                    4.335194845029251e-06, 0.1, 1 / 3, 3]
    for v in values + [str(v) for v in values[:10]] + ["0.25", "1e-3", "+2.5E+1"]:
        t, out = _mxnet_worker_threshold_boundary(v)
        assert out[0] == t and out[1] == 0, (v, t, out)
    # and the replay is not just correct rounding: that differs for these
    assert mxnet_stof("7.353780987411301") != strtof("7.353780987411301")


def test_slices_equal_the_whole_key():
    spec = Compression.from_params({"type": "2bit", "threshold": 0.3})
    whole, sliced = Residuals(spec), Residuals(spec)
    size, slices = 1001, [(0, 334), (334, 333), (667, 334)]
    for g in grads(size, 0.3, steps=3):
        (packed,) = whole.encode(7, g)
        parts = sliced.encode(7, g, slices)
        expected = decode(spec, packed, size)
        got = np.concatenate([decode(spec, p, n) for p, (_, n) in zip(parts, slices)])
        np.testing.assert_array_equal(bits(got), bits(expected))
        np.testing.assert_array_equal(bits(whole.residual(7)), bits(sliced.residual(7)))


def test_server_threshold_is_printed_with_six_decimals_like_mxnet():
    """MXNet sends the threshold to its servers as std::to_string(float)."""
    spec = Compression.from_params({"type": "2bit", "threshold": 1 / 3})
    assert spec.threshold == float(np.float32(1 / 3))
    assert spec.server_threshold == float(np.float32(0.333333))
    assert Compression.from_params({"type": "2bit", "threshold": 0.5}).server_threshold == 0.5
    # what a server adds up is the rounded value
    assert decode(spec, np.array([0xC0, 0, 0, 0], np.uint8), 1)[0] == np.float32(0.333333)


def test_residual_keeps_what_was_not_sent():
    spec = Compression.from_params({"type": "2bit", "threshold": 1.0})
    res = Residuals(spec)
    sent = np.zeros(4, np.float32)
    for g in ([0.6, -0.6, 2.5, 0.0], [0.6, -0.6, 0.0, 0.0]):
        (packed,) = res.encode(0, np.array(g, np.float32))
        sent += decode(spec, packed, 4)
    np.testing.assert_array_equal(sent, [1, -1, 2, 0])   # 2.5 goes out one t per push
    np.testing.assert_allclose(res.residual(0), [0.2, -0.2, 0.5, 0], rtol=1e-6)


@pytest.mark.parametrize("params,match", [
    ({"type": "4bit"}, "one of 2bit"),
    ({"threshold": 0.5}, "one of 2bit"),
    ({"type": "2bit", "threshold": 0}, "> 0"),
    ({"type": "2bit", "threshold": -1}, "> 0"),
    ({"type": "2bit", "threshold": "abc"}, "must be a number"),
    ({"type": "2bit", "threshold": True}, "must be a number"),
    ({"type": "2bit", "threshold": 1e39}, "float32 range"),
    ({"type": "2bit", "threshold": "inf"}, "not a number"),
    ({"type": "2bit", "threshold": "0.5x"}, "trailing"),
    ({"type": "2bit", "threshold": 1e-7}, "round it to 6 decimals"),
    ({"type": "2bit", "threshhold": 0.1}, "did you mean 'threshold'"),
    ({"type": "2bit", "ratio": 0.1}, "2bit takes type, threshold"),
    ({"type": "topk", "threshold": 0.1}, "topk takes type, ratio"),
    ({"type": "topk", "ratio": 0}, r"in \(0, 1\]"),
    ({"type": "topk", "ratio": 1.5}, r"in \(0, 1\]"),
    ({"type": "topk", "ratio": "nan"}, "not finite"),
    (["2bit"], "must be a dict"),
])
def test_bad_params_name_the_cause(params, match):
    with pytest.raises(CompressionError, match=match):
        Compression.from_params(params)


SETTING_PROBES = ["none", "2bit", "2bit:0.5", "2bit:0.0123456789", "2bit:0", "2bit:-1",
                  "2bit:1e-7", "2bit:abc", "2bit:1e39", "topk", "topk:0.05", "topk:1",
                  "topk:0", "topk:1.5", "3bit", "none:1", "2bit:", "topk:nan"]


@pytest.mark.parametrize("text", SETTING_PROBES)
def test_sync_compression_text_is_read_alike_by_the_settings_row_and_the_codec(text):
    from ssdsgd import settings as S
    try:
        S.BY_NAME["compression"].check(text)
        row = True
    except S.SettingError:
        row = False
    try:
        params = parse_setting(text)
        codec = True
    except CompressionError:
        codec = False
    assert row == codec, (text, row, codec)
    if codec and params is not None:
        assert Compression.from_params(params).type == text.split(":")[0]


def test_sync_compression_in_a_config():
    from ssdsgd.config import ConfigError, parse_config
    base = {"model": {"name": "digits_mlp"}, "data": {"dataset": "digits"}}
    cfg = parse_config(dict(base, sync={"compression": "topk:0.05"}))
    assert parse_setting(cfg.sync.compression) == {"type": "topk", "ratio": "0.05"}
    assert parse_config(base).sync.compression == "none"
    with pytest.raises(ConfigError, match=r"^sync.compression: expected a topk ratio"):
        parse_config(dict(base, sync={"compression": "topk:2"}))


def test_params_defaults_and_round_trip():
    assert Compression.from_params(None) is None and Compression.from_params({}) is None
    spec = Compression.from_params({"type": "2bit"})
    assert spec.threshold == 0.5                       # MXNet's default
    assert Compression.from_params({"type": "2bit", "threshold": "0.25"}).threshold == 0.25
    assert Compression.from_params(spec.params()) == spec
    topk = Compression.from_params({"type": "topk"})
    assert topk.ratio == 0.1 and Compression.from_params(topk.params()) == topk


def test_bad_data_is_refused():
    spec = Compression.from_params({"type": "2bit"})
    res = Residuals(spec)
    with pytest.raises(CompressionError, match="float32"):
        res.encode(0, np.zeros(4, np.float16))
    res.encode(0, np.zeros(4, np.float32))
    with pytest.raises(CompressionError, match="earlier pushes had 4"):
        res.encode(0, np.zeros(5, np.float32))
    with pytest.raises(CompressionError, match="is 4 bytes, got 8"):
        decode(spec, np.zeros(8, np.uint8), 16)


@pytest.mark.parametrize("threshold", [0.5, 2.75, 0.25])
@pytest.mark.parametrize("parts", [1, 2, 4, 7, MAX_SUMMED])
@pytest.mark.parametrize("size", [1, 17, 100_003])
def test_counting_sum_equals_decoding_and_adding_in_rank_order(threshold, parts, size):
    """The server sums a step's 2bit pushes by counting codes; where ``summable`` says so
    this is bit for bit what decoding each push and adding them in rank order gives."""
    spec = Compression.from_params({"type": "2bit", "threshold": threshold})
    t = spec.server_threshold
    assert summable(t, parts)
    packs = [spec.receive(quantize_2bit(g, np.zeros(size, np.float32), spec.threshold), size)
             for g in (grads(size, threshold, 1, seed=s)[0] for s in range(parts))]
    assert all(isinstance(p, Packed2bit) for p in packs)
    expected = packs[0].decode()
    for p in packs[1:]:
        expected = expected + p.decode()
    out = np.full(size, np.nan, np.float32)
    sum_2bit(packs, out)
    np.testing.assert_array_equal(bits(out), bits(expected))
    assert np.abs(out).max() > 0


def test_counting_sum_is_refused_where_order_could_round():
    """t = 0.1: 3t is not a float32, so a sum's last bit could depend on the order; the
    server then decodes and adds in rank order (``summable`` is False)."""
    assert not summable(0.1, 3)
    assert summable(0.1, 2)                 # 2t is t with the exponent raised
    assert not summable(0.5, MAX_SUMMED + 1)  # a lane of the counter would carry


# --- topk ------------------------------------------------------------------------------

TOPK = Compression.from_params({"type": "topk", "ratio": 0.1})


def test_topk_sends_the_largest_and_keeps_the_rest():
    rs = np.random.RandomState(0)
    res = TOPK.residuals()
    before = np.zeros(1000, np.float32)
    for step in range(3):
        g = rs.randn(1000).astype(np.float32)
        p = before + g
        (payload,) = res.encode(0, g)
        sent = decode(TOPK, payload, 1000)
        chosen = sent != 0
        assert chosen.sum() == 100                       # exact top-k below SAMPLE elements
        assert np.abs(p[chosen]).min() >= np.abs(p[~chosen]).max()
        np.testing.assert_array_equal(sent[chosen], p[chosen])
        np.testing.assert_array_equal(res.residual(0), np.where(chosen, 0, p))
        assert payload.nbytes == 8 * 100
        before = res.residual(0).copy()


def test_topk_of_a_big_key_samples_its_threshold():
    n = 40 * (1 << 16) + 5
    g = np.random.RandomState(1).randn(n).astype(np.float32)
    (payload,) = TOPK.residuals().encode(0, g)
    assert 0.09 * n < payload.nbytes / 8 < 0.11 * n


def test_topk_slices_equal_the_whole_key():
    whole, sliced = TOPK.residuals(), TOPK.residuals()
    size, slices = 3001, [(0, 1000), (1000, 1001), (2001, 1000)]
    for g in grads(size, 1.0, steps=3):
        g = np.nan_to_num(g, nan=0.0, posinf=5.0, neginf=-5.0)
        (payload,) = whole.encode(3, g)
        parts = sliced.encode(3, g, slices)
        got = np.concatenate([decode(TOPK, p, n) for p, (_, n) in zip(parts, slices)])
        np.testing.assert_array_equal(bits(got), bits(decode(TOPK, payload, size)))
        np.testing.assert_array_equal(bits(whole.residual(3)), bits(sliced.residual(3)))


def test_topk_of_zeros_sends_nothing():
    (payload,) = TOPK.residuals().encode(0, np.zeros(50, np.float32))
    assert payload.size == 0
    assert not decode(TOPK, payload, 50).any()


@pytest.mark.parametrize("index,values,count,match", [
    ([0, 1, 2], [], 10, "multiple of 8"),
    ([3, 1], [1.0, 2.0], 10, "increase strictly"),
    ([1, 1], [1.0, 2.0], 10, "increase strictly"),
    ([0, 10], [1.0, 2.0], 10, "< 10"),
    ([0, 1, 2], [1.0, 2.0, 3.0], 2, "carries 3 entries"),
])
def test_bad_topk_data_is_refused(index, values, count, match):
    payload = np.concatenate([np.array(index, "<u4").view(np.uint8),
                              np.array(values, "<f4").view(np.uint8)])
    with pytest.raises(CompressionError, match=match):
        decode(TOPK, payload, count)
