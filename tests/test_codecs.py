"""The codecs' registry (ssdsgd/kvstore/codecs/): every codec it holds is found by name
and by wire code, round-trips through its params and the wire, has its byte length
checked, and no module outside the codecs' package names a codec in a comparison."""
import ast
from pathlib import Path

import numpy as np
import pytest

from ssdsgd import settings as S
from ssdsgd.kvstore import codecs
from ssdsgd.kvstore import protocol as P
from ssdsgd.kvstore.compression import Compression, CompressionError, parse_setting

PKG = Path(__file__).resolve().parents[1] / "ssdsgd"
CODECS = [pytest.param(c, id=c.type) for c in codecs.CODECS]


def test_names_and_wire_codes_are_unique_and_the_protocols():
    assert len({c.type for c in codecs.CODECS}) == len({c.code for c in codecs.CODECS}) \
        == len(codecs.CODECS)
    assert all(0 < c.code < 256 for c in codecs.CODECS)        # a u1 field; 0 is raw
    assert P.ENCODINGS == {c.code: c.type for c in codecs.CODECS}


@pytest.mark.parametrize("codec", CODECS)
def test_every_codec_round_trips_its_params_and_its_setting(codec):
    spec = Compression.from_params({"type": codec.type})
    assert isinstance(spec, codec) and spec == codec()
    assert Compression.from_params(spec.params()) == spec
    assert parse_setting(codec.type) == {"type": codec.type}
    value = str(getattr(spec, codec.PARAMS[0]))
    assert parse_setting(f"{codec.type}:{value}") == {"type": codec.type,
                                                       codec.PARAMS[0]: value}


@pytest.mark.parametrize("codec", CODECS)
def test_every_codec_round_trips_a_push_over_the_wire(codec):
    spec = codec()
    rs = np.random.RandomState(0)
    grad = rs.randn(1000).astype(np.float32)
    residuals = spec.residuals()
    slices = [(0, 300), (300, 700)]
    payloads = residuals.encode(7, grad, slices)
    recs = P.make_records([(7, 0, o, n, np.float32, 1, codec.type) for o, n in slices])
    msg = P.decode(P.encode(P.Message(P.Kind.PUSH, sender=0, step=0, records=recs,
                                      tensors=[[p] for p in payloads])))
    assert [P.ENCODINGS[int(r["encoding"])] for r in msg.records] == [codec.type] * 2
    sent = np.concatenate([spec.decode(t[0], n) for t, (_, n) in zip(msg.tensors, slices)])
    assert sent.any()
    # error feedback: what was sent plus what stays is the gradient
    np.testing.assert_allclose(sent + residuals.residual(7), grad, rtol=0, atol=1e-6)
    received = [spec.receive(t[0], n) for t, (_, n) in zip(msg.tensors, slices)]
    decoded = [r.decode() if isinstance(r, codecs.Packed) else r for r in received]
    np.testing.assert_array_equal(np.concatenate(decoded), sent)


@pytest.mark.parametrize("codec", CODECS)
def test_a_wrong_byte_length_is_refused_by_the_protocol_and_the_codec(codec):
    spec, count = codec(), 40
    (payload,) = spec.residuals().encode(0, np.ones(count, np.float32))
    assert codec.length_error(count, payload.size) is None
    bad = np.zeros(payload.size + 4, np.uint8)
    assert codec.length_error(count, bad.size).startswith(f"{codec.type} data for {count}")
    recs = P.make_records([(0, 0, 0, count, np.float32, 1, codec.type)])
    frames = P.encode(P.Message(P.Kind.PUSH, sender=0, step=0, records=recs,
                                tensors=[[bad]]))
    with pytest.raises(P.ProtocolError, match=f"key 0: {codec.type} data for {count}"):
        P.decode(frames)
    with pytest.raises(CompressionError):
        spec.decode(bad, count)


@pytest.mark.parametrize("call", [lambda: Compression.from_params({"type": "zip"}),
                                  lambda: parse_setting("zip:3"),
                                  lambda: codecs.by_name("zip")])
def test_an_unknown_codec_is_refused_in_one_line_naming_it(call):
    with pytest.raises(CompressionError) as e:
        call()
    assert "zip" in str(e.value) and "\n" not in str(e.value)
    assert all(c.type in str(e.value) for c in codecs.CODECS)     # and the known ones


def test_the_settings_table_knows_every_codec_and_its_parameter():
    """settings.py is a leaf below the transport: its table of sync.compression's forms is
    checked against the registry here (tests/test_compression.py probes the values)."""
    assert {name: p for name, (p, _, _) in S.COMPRESSION_FORMS.items()} == \
        {c.type: c.PARAMS[0] for c in codecs.CODECS}
    wrong = S.BY_NAME["compression"].validate("zip")
    assert wrong == f"expected {codecs.setting_forms()}"


def _compared_names(path):
    names = {c.type for c in codecs.CODECS}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            consts = [n for n in ast.walk(node) if isinstance(n, ast.Constant)]
            found += [(path.name, node.lineno, c.value) for c in consts if c.value in names]
    return found


def test_no_module_outside_the_codecs_asks_which_codec_it_has():
    """Everything codec-specific is in its codec's module: nobody else says
    ``if type == '2bit'``."""
    outside = [p for p in PKG.rglob("*.py") if "codecs" not in p.relative_to(PKG).parts]
    assert [hit for p in outside for hit in _compared_names(p)] == []
