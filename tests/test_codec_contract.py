"""The codec contract, checked for every registered codec (``tests/conftest.py``): round
trips keep shape and dtype, ``from_config(config())`` rebuilds the codec bit for bit, the
bit accounting matches the bytes of a code, and bad input raises clear errors."""
import math

import mlx.core as mx
import pytest

from turboquant.codecs import from_config

from conftest import CODEC_EXAMPLES, registered_codecs

D = 64


def make(factory, x=None):
    codec = factory(D)
    if hasattr(codec, "fit") and not codec.fitted:
        codec.fit(mx.random.normal((1, 2, 16, D), key=mx.random.key(9)) if x is None else x)
    return codec


def test_every_registered_codec_has_an_example():
    assert set(registered_codecs()) == set(CODEC_EXAMPLES)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_round_trip_keeps_shape_and_dtype(any_codec, dtype):
    _, factory = any_codec
    codec = make(factory)
    x = mx.random.normal((1, 2, 7, D), key=mx.random.key(0)).astype(dtype)
    code = codec.encode(x)
    out = codec.decode(code)
    assert out.shape == x.shape and out.dtype == dtype and mx.all(mx.isfinite(out)).item()
    assert code.shape == (1, 2, 7)
    # the error is a fraction of the signal (QJL's unbiased one-bit sketch: about π/2 of it)
    err = mx.sum((out.astype(mx.float32) - x.astype(mx.float32)) ** 2) / mx.sum(x.astype(mx.float32) ** 2)
    assert err.item() < (2.0 if codec.name == "qjl" else 0.5)


def test_config_rebuilds_bit_for_bit(any_codec):
    _, factory = any_codec
    codec = make(factory)
    again = from_config(codec.config())
    assert again == codec and hash(again) == hash(codec)
    x = mx.random.normal((1, 2, 9, D), key=mx.random.key(1))
    a, b = codec.encode(x), again.encode(x)
    assert a.arrays.keys() == b.arrays.keys()
    assert all(mx.array_equal(a[n], b[n]).item() for n in a.arrays)
    assert mx.array_equal(codec.decode(a), again.decode(b)).item()


def test_bit_accounting_matches_the_bytes(any_codec):
    _, factory = any_codec
    codec = make(factory)
    code = codec.encode(mx.random.normal((3, 2, 5, D), key=mx.random.key(2)))
    assert code.nbytes == 30 * codec.nbytes_per_vector == codec.code_nbytes(30)
    # bits per coordinate = payload + side information; the bytes round up to whole bytes
    assert codec.payload_bits <= codec.bits_per_coordinate
    stored = 8 * codec.nbytes_per_vector / D
    assert codec.bits_per_coordinate <= stored + 1e-9
    assert stored - codec.bits_per_coordinate < 8 * max(1, len(code.arrays)) / D


def test_bad_input_is_refused_clearly(any_codec):
    _, factory = any_codec
    codec = make(factory)
    with pytest.raises(ValueError, match=str(D)):
        codec.encode(mx.zeros((2, D + 1)))
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.encode(mx.full((1, 2, 3, D), float("nan")))
    with pytest.raises(TypeError):
        codec.encode([[0.0] * D])
    with pytest.raises(TypeError):
        codec.encode(mx.zeros((2, D), mx.int32))
    with pytest.raises(TypeError):
        codec.decode("not a code")
    other = make(CODEC_EXAMPLES["identity"] if codec.name != "identity" else CODEC_EXAMPLES["turboquant_mse"])
    with pytest.raises(ValueError, match="made by"):
        codec.decode(other.encode(mx.zeros((1, D))))


def test_zero_vectors_stay_finite(any_codec):
    name, factory = any_codec
    codec = make(factory)
    out = codec.decode(codec.encode(mx.zeros((1, 2, 3, D))))
    assert mx.all(mx.isfinite(out)).item()
    if name not in ("centered", "transform"):        # codecs with a mean return it there
        assert math.isclose(mx.abs(out).max().item(), 0.0, abs_tol=1e-6)
