"""TurboQuant_mse: the measured acceptance numbers of Chapter 3, and the interface rules."""
import mlx.core as mx
import numpy as np
import pytest

from turboquant import TurboQuantMSE, from_config
from turboquant.codecs import mse
from turboquant.sphere import unit_vectors

PAPER_D128 = {1: 0.3609, 2: 0.1160, 3: 0.0340, 4: 0.0093}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("rotation", ["hadamard", "haar"])
def test_distortion_d128_matches_paper(bits, rotation):
    x = unit_vectors(20000, 128, seed=11)
    measured = mse(TurboQuantMSE(128, bits, rotation=rotation, seed=5), x)
    assert measured == pytest.approx(PAPER_D128[bits], rel=0.03)
    assert 4.0 ** -bits <= measured <= np.sqrt(3) * np.pi / 2 * 4.0 ** -bits


@pytest.mark.parametrize("dim", [64, 80])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_distortion_matches_d_times_c(dim, bits):
    codec = TurboQuantMSE(dim, bits, seed=1)
    measured = mse(codec, unit_vectors(20000, dim, seed=2))
    assert measured == pytest.approx(codec.expected_mse, rel=0.03)
    assert 4.0 ** -bits <= measured <= np.sqrt(3) * np.pi / 2 * 4.0 ** -bits


def test_norm_is_restored_and_zero_vector_decodes_to_zero():
    codec = TurboQuantMSE(64, 4)
    x = unit_vectors(100, 64) * mx.linspace(0.01, 50, 100)[:, None]
    x = mx.concatenate([x, mx.zeros((1, 64))])
    xh = codec.decode(codec.encode(x))
    assert mx.all(xh[-1] == 0).item()
    # the codec is scale-equivariant: relative squared error averages D·C(f, b) at any norm
    rel2 = mx.sum((x[:-1] - xh[:-1]) ** 2, axis=-1) / mx.sum(x[:-1] ** 2, axis=-1)
    assert mx.mean(rel2).item() == pytest.approx(codec.expected_mse, rel=0.2)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_dtypes_and_shapes(dtype):
    codec = TurboQuantMSE(96, 3)
    x = mx.random.normal((2, 3, 5, 96), key=mx.random.key(0)).astype(dtype)
    code = codec.encode(x)
    xh = codec.decode(code)
    assert xh.shape == x.shape and xh.dtype == dtype
    assert code["idx"].shape == (2, 3, 5, 36) and code["norm"].dtype == mx.float16
    assert code.nbytes == 30 * codec.nbytes_per_vector


def test_bits_per_coordinate_and_bytes():
    codec = TurboQuantMSE(128, 3)
    assert codec.bits_per_coordinate == 3 + 16 / 128
    assert codec.nbytes_per_vector == 128 * 3 // 8 + 2


def test_config_rebuilds_bit_for_bit():
    x = mx.random.normal((64, 80), key=mx.random.key(3))
    a = TurboQuantMSE(80, 3, rotation="haar", seed=9)
    b = from_config(a.config())
    assert a == b
    assert mx.array_equal(a.encode(x)["idx"], b.encode(x)["idx"]).item()
    assert mx.array_equal(a.decode(a.encode(x)), b.decode(b.encode(x))).item()
    c = TurboQuantMSE(80, 3, rotation="haar", seed=10)
    assert not mx.array_equal(a.encode(x)["idx"], c.encode(x)["idx"]).item()


def test_code_from_another_codec_is_refused():
    x = mx.random.normal((4, 64))
    with pytest.raises(ValueError, match="made by"):
        TurboQuantMSE(64, 3).decode(TurboQuantMSE(64, 4).encode(x))


@pytest.mark.parametrize("kwargs, match", [
    (dict(dim=64, bits=0), "bits"), (dict(dim=64, bits=9), "bits"), (dict(dim=64, bits=2.0), "bits"),
    (dict(dim=72, bits=2), "72"), (dict(dim=2, bits=2), "dim"), (dict(dim=64, bits=2, law="uniform"), "law"),
])
def test_bad_configuration(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TurboQuantMSE(**kwargs)


def test_bad_input():
    codec = TurboQuantMSE(64, 2)
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.encode(mx.array([[float("nan")] * 64]))
    with pytest.raises(ValueError, match="NaN or Inf"):
        codec.encode(mx.array([[float("inf")] + [0.0] * 63]))
    with pytest.raises(ValueError, match="65"):
        codec.encode(mx.zeros((3, 65)))
    with pytest.raises(TypeError):
        codec.encode(np.zeros((3, 64), np.float32))
    with pytest.raises(TypeError):
        codec.encode(mx.zeros((3, 64), dtype=mx.int32))
    with pytest.raises(ValueError, match="fp16"):
        codec.encode(mx.full((1, 64), 1e4))


def test_time_call_reports_the_median_of_evaluated_calls(monkeypatch):
    """The timing helper's contract with a fake clock: warm-up runs are not timed, each
    timed run is evaluated (mx.eval) inside its interval, and the median is returned."""
    import turboquant.bench as bench
    ticks = iter([0.0, 5.0, 10.0, 11.0, 20.0, 23.0])          # intervals 5, 1, 3 → median 3
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(ticks))
    calls = []
    assert bench.time_call(lambda v: calls.append(v) or v * 2, mx.ones(2), repeats=3, warmup=1) == 3.0
    assert len(calls) == 4
    seen = []
    monkeypatch.setattr(bench.mx, "eval", lambda *a: seen.append(a))
    ticks2 = iter(range(100))
    monkeypatch.setattr(bench.time, "perf_counter", lambda: float(next(ticks2)))
    x = mx.random.normal((4, 128))
    codec = TurboQuantMSE(128, 4)
    from turboquant import kernels
    with kernels.use(None):                  # the CPU kernels evaluate their inputs themselves
        bench.encode_decode_seconds(codec, x, repeats=1)
    assert len(seen) == 2 and seen[-1][0].shape == x.shape       # the decoded array is evaluated
