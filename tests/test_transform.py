"""Transform coding fitted on calibration vectors (``turboquant.codecs.transform``)."""
import math

import mlx.core as mx
import numpy as np
import pytest

from turboquant.codecs import TurboQuantMSE, from_config
from turboquant.codecs.transform import (TransformCoder, allocate_bits, gaussian_distortion, lloyd_1d,
                                         reverse_water_filling)

D = 32


def anisotropic(heads=2, n=3000, seed=0, d=D):
    """Correlated vectors whose variances fall off geometrically (like real keys)."""
    rng = np.random.default_rng(seed)
    out = []
    for h in range(heads):
        basis = np.linalg.qr(rng.standard_normal((d, d)))[0]
        scale = np.exp(-np.arange(d) / 6.0)
        out.append(rng.standard_normal((n, d)) * scale @ basis.T + rng.standard_normal(d))
    return np.stack(out)


def rel_mse(codec, x):
    xm = mx.array(x.astype(np.float32))[None]
    y = codec.decode(codec.encode(xm))
    return (mx.sum((y - xm) ** 2) / mx.sum((xm - mx.mean(xm, axis=2, keepdims=True)) ** 2)).item()


def test_allocation_follows_the_variances_and_spends_every_bit():
    lam = [16.0, 4.0, 1.0, 0.25]
    b = allocate_bits(lam, 10)
    assert sum(b) == 10 and b == sorted(b, reverse=True) and b[0] > b[-1]
    # a 4× larger variance is worth one more bit (6 dB per bit): the gaps are one bit
    assert [x - y for x, y in zip(b, b[1:])] == [1, 1, 1]
    assert allocate_bits([1.0] * 4, 8) == [2, 2, 2, 2]
    with pytest.raises(ValueError, match="cannot give"):
        allocate_bits([1.0], 9)
    z = allocate_bits([0.0, 0.0, 1.0], 17)          # zero variances: bits left over go there last
    assert sum(z) == 17 and max(z) == 8 and z[2] == 8
    assert sorted(allocate_bits([0.0, 0.0], 10)) == [2, 8]
    assert gaussian_distortion(0) == 1.0 and math.isclose(gaussian_distortion(1), 1 - 2 / math.pi, rel_tol=1e-6)


def test_lloyd_on_gaussian_samples_finds_the_lloyd_max_levels():
    x = np.random.default_rng(1).standard_normal(200_000)
    levels = lloyd_1d(x, 4)
    assert np.allclose(levels, [-1.510, -0.4528, 0.4528, 1.510], atol=0.02)


def test_transform_coding_beats_the_random_rotation_on_anisotropic_data():
    x = anisotropic()
    codec = TransformCoder.calibrate(x[:, :2000], 4.0)
    held = x[:, 2000:]
    ours = rel_mse(codec, held)
    tq = TurboQuantMSE(D, 4)
    theirs = rel_mse(tq, held)
    assert codec.bits_per_coordinate == 4.0 < tq.bits_per_coordinate
    assert ours < theirs / 4, (ours, theirs)
    # the KLT is orthogonal (no metric): T⁻¹ = Tᵀ
    assert mx.allclose(mx.matmul(codec.inverse, codec.transform), mx.eye(D)[None], atol=1e-5).item()


def test_fractional_rates_and_outliers_are_counted_exactly():
    x = anisotropic()
    for bits, outliers in ((3.25, 0), (2.25, 1), (4.0, 2)):
        c = TransformCoder.calibrate(x, bits, outliers=outliers)
        assert c.bits_per_coordinate == round(bits * D) / D
        assert sum(c.alloc) + 24 * outliers == round(bits * D)
        code = c.encode(mx.array(x[:, :5].astype(np.float32))[None])
        assert code.nbytes == 2 * 5 * c.nbytes_per_vector
        assert 8 * c.nbytes_per_vector - c.bits_per_coordinate * D < 8 + 1e-9
    u = TransformCoder.calibrate(x, 3, outliers=1, transform="channels", uniform=True)
    assert set(u.alloc) == {3} and u.bits_per_coordinate == 3 + 24 / D


def test_outliers_pay_for_themselves_on_spiky_data_only():
    """On Gaussian data the 24 bits of an exact entry are better spent on levels; with
    rare large entries (as real keys and values have) the exact entry wins."""
    x = anisotropic()
    plain = TransformCoder.calibrate(x[:, :2000], 3.0)
    with_outlier = TransformCoder.calibrate(x[:, :2000], 3.0, outliers=1)
    assert rel_mse(with_outlier, x[:, 2000:]) > rel_mse(plain, x[:, 2000:])
    rng = np.random.default_rng(5)                      # heavy tails: Student t, 3 degrees of freedom
    x = np.stack([rng.standard_t(3, (3000, D)) * np.exp(-np.arange(D) / 6.0)
                  @ np.linalg.qr(rng.standard_normal((D, D)))[0].T for _ in range(2)])
    plain = TransformCoder.calibrate(x[:, :2000], 3.0)
    with_outlier = TransformCoder.calibrate(x[:, :2000], 3.0, outliers=1)
    assert rel_mse(with_outlier, x[:, 2000:]) < rel_mse(plain, x[:, 2000:])


def test_the_query_metric_lowers_the_score_error():
    """Keys coded under E[qqᵀ] make smaller errors in q·k for queries from that law."""
    rng = np.random.default_rng(3)
    k = anisotropic(heads=1, n=4000, seed=3)
    qs = rng.standard_normal((4000, D)) * np.where(np.arange(D) % 5 == 0, 3.0, 0.2)
    metric = (qs.T @ qs / len(qs))[None]
    plain = TransformCoder.calibrate(k[:, :3000], 3.0)
    weighted = TransformCoder.calibrate(k[:, :3000], 3.0, metric=metric)
    held = mx.array(k[:, 3000:].astype(np.float32))
    q = mx.array(qs[:1000].astype(np.float32))

    def score_err(c):
        e = c.decode(c.encode(held)) - held                 # (1, N, D)
        return mx.mean((e[0] @ q.T) ** 2).item()
    assert score_err(weighted) < 0.8 * score_err(plain), (score_err(weighted), score_err(plain))


def test_heads_are_checked_and_the_config_rebuilds_the_codec():
    x = anisotropic(heads=2)
    c = TransformCoder.calibrate(x, 4.25, outliers=1)
    assert c.heads == 2 and c.side_nbytes > 0
    k = mx.array(x[:, :7].astype(np.float32))[None]            # (1, 2, 7, D)
    again = from_config(c.config())
    assert again == c and mx.array_equal(c.decode(c.encode(k)), again.decode(again.encode(k))).item()
    with pytest.raises(ValueError, match="fitted on 2 heads"):
        c.encode(mx.zeros((1, 3, 4, D)))
    with pytest.raises(ValueError, match="fitted on 2 heads"):
        c.encode(mx.zeros((5, D)))


@pytest.mark.parametrize("kwargs, message", [
    (dict(bits=9), "bits=9 leaves"),
    (dict(bits=4, transform="pca"), "transform must be one of"),
    (dict(bits=3.5, uniform=True), "integer number of bits"),
    (dict(bits=4, metric=np.zeros((1, D, D))), "metric must be"),
    (dict(bits=4, transform="channels", metric=np.eye(D)[None].repeat(2, 0)), "takes no metric"),
])
def test_bad_calibration_arguments_are_refused(kwargs, message):
    x = anisotropic(n=100)
    bits = kwargs.pop("bits")
    with pytest.raises(ValueError, match=message):
        TransformCoder.calibrate(x, bits, **kwargs)


def test_bad_calibration_data_is_refused():
    x = anisotropic(n=100)
    x[0, 5, 3] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        TransformCoder.calibrate(x, 4)
    with pytest.raises(ValueError, match=r"\(H, N ≥ 2, D\)"):
        TransformCoder.calibrate(np.zeros((10, D)), 4)


def test_bad_parameters_are_refused():
    c = TransformCoder.calibrate(anisotropic(heads=1, n=500), 3.0)
    cfg = c.config()
    with pytest.raises(ValueError, match="non-increasing"):
        from_config({**cfg, "alloc": list(reversed(cfg["alloc"]))})
    with pytest.raises(ValueError, match="transform must have shape"):
        from_config({**cfg, "transform": cfg["transform"][0]})
    bad = np.array(cfg["mean"])
    bad[0, 0] = np.inf
    with pytest.raises(ValueError, match="mean contains NaN or Inf"):
        from_config({**cfg, "mean": bad.tolist()})


def test_reverse_water_filling():
    theta, dist = reverse_water_filling([4.0, 1.0], 1.0)            # both above the water
    assert math.isclose(theta, 0.5, rel_tol=1e-9) and math.isclose(dist, 1.0, rel_tol=1e-9)
    theta, dist = reverse_water_filling([16.0, 0.01], 1.0)          # the small one gets no bits
    assert math.isclose(theta, 1.0, rel_tol=1e-9) and math.isclose(dist, 1.01, rel_tol=1e-9)
    _, flat = reverse_water_filling([2.0] * 8, 3.0)                 # equal variances: n λ 2^(−2R)
    assert math.isclose(flat, 8 * 2.0 * 2 ** -6, rel_tol=1e-9)
    with pytest.raises(ValueError, match="variances"):
        reverse_water_filling([1.0, -1.0], 2)
    _, wide = reverse_water_filling([1.0] * 256, 5.0)              # 1280 bits: no underflow
    assert math.isclose(wide, 256 * 2 ** -10, rel_tol=1e-9)


def test_outliers_beyond_fp16_are_refused():
    c = TransformCoder.calibrate(anisotropic(heads=1), 3.0, outliers=1)
    with pytest.raises(ValueError, match="beyond 16x the range this TransformCoder was fitted on"):
        c.encode(mx.full((1, 4, D), 1e6))                  # every coefficient far out: refused (#26.6)
    c = TransformCoder.calibrate(anisotropic(heads=1), 3.0, outliers=1, transform="channels")
    one = mx.zeros((1, 4, D)).at[..., 3].add(1e6)          # one far coefficient: an outlier, but not in fp16
    with pytest.raises(ValueError, match="fp16's range"):
        c.encode(one)
    x = mx.zeros((1, 4, D)).at[..., 3].add(1e3)            # one far coefficient within fp16: stored exactly
    assert mx.allclose(c.decode(c.encode(x))[..., 3], x[..., 3], rtol=1e-3).item()


def test_kind_is_checked():
    """Issue #26.11: TransformCoder(kind="foo") used to be accepted."""
    import pytest as _pytest
    good = TransformCoder.example(8)
    cfg = dict(good.config())
    for k in ("codec", "dim"):
        cfg.pop(k, None)
    cfg["kind"] = "foo"
    with _pytest.raises(ValueError, match="kind must be one of"):
        TransformCoder(8, **cfg)
