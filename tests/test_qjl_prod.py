"""QJL and TurboQuant_prod: unbiasedness over the draw of S, variance, D_prod."""
import math

import mlx.core as mx
import numpy as np
import pytest

from turboquant import QJL, TurboQuantMSE, TurboQuantProd, from_config
from turboquant.estimators import bias_summary, estimates_over_seeds
from turboquant.sphere import sample_sphere

D = 128


def estimates(make, n_seeds=200, per_seed=50):
    return estimates_over_seeds(make, D, n_seeds, per_seed)


@pytest.mark.parametrize("make", [
    lambda s: QJL(D, seed=s), lambda s: QJL(D, orthogonal=True, seed=s),
    *[(lambda b: lambda s: TurboQuantProd(D, b, seed=s))(b) for b in (1, 2, 3, 4)]],
    ids=["qjl", "qjl-orth", "prod1", "prod2", "prod3", "prod4"])
def test_unbiased_over_the_draw_of_s(make):
    r = bias_summary(*estimates(make))
    assert abs(r["z"]) < 3
    # no multiplicative bias either: regression slope 1 within 3 standard errors
    assert abs(r["slope"] - 1) < 3 * r["slope_se"]


def test_mse_quantizer_is_biased_with_slope_2_over_pi_at_one_bit():
    for bits in (1, 2, 3):
        r = bias_summary(*estimates(lambda s: TurboQuantMSE(D, bits, seed=s), 100, 100))
        expected = TurboQuantMSE(D, bits).inner_product_slope       # 1 − D·C(f, b)
        assert r["slope"] == pytest.approx(expected, abs=3 * r["slope_se"] + 2e-3)
        assert abs(r["slope"] - 1) > 10 * r["slope_se"]              # visibly biased
    assert TurboQuantMSE(D, 1).inner_product_slope == pytest.approx(2 / math.pi, abs=0.003)


@pytest.mark.parametrize("inner", [0.0, 0.5, 0.9])
def test_qjl_variance_matches_formula(inner):
    # one (q, k) pair, many sketches: Var = (π/2 ‖q‖²‖k‖² − ⟨q,k⟩²)/m
    k = np.zeros(D); k[0] = 1.0
    q = np.zeros(D); q[0], q[1] = inner, math.sqrt(1 - inner**2)
    q *= 2.0  # ‖q‖ = 2
    kk, qq = mx.array(k[None], dtype=mx.float32), mx.array(q[None, None], dtype=mx.float32)
    m = 64
    est = np.array([QJL(D, m=m, seed=s).inner(qq, QJL(D, m=m, seed=s).encode(kk)).item() for s in range(3000)])
    expected = QJL.variance(4.0, 1.0, 2 * inner, m)
    assert est.var() == pytest.approx(expected, rel=0.1)
    assert est.mean() == pytest.approx(2 * inner, abs=4 * math.sqrt(expected / len(est)))


def test_orthogonal_constant():
    # unit rows: c = 1/(m E|s_1|) with E|s_1| ≈ sqrt(2/(πD)), so m·c/sqrt(D) → sqrt(π/2)
    assert QJL.constant(4096, 1, True) / math.sqrt(4096) == pytest.approx(math.sqrt(math.pi / 2), rel=1e-3)
    s = np.array(QJL(16, m=40, orthogonal=True).S)
    assert np.allclose(np.linalg.norm(s, axis=1), 1, atol=1e-6)
    assert np.allclose(s[:16] @ s[:16].T, np.eye(16), atol=1e-5)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_prod_inner_product_error(bits):
    x = mx.array(sample_sphere(20000, D, 5), dtype=mx.float32)
    y = sample_sphere(20000, D, 6)
    codec = TurboQuantProd(D, bits, seed=3)
    err = np.sum(y * (np.array(x) - np.array(codec.decode(codec.encode(x)))), 1)
    measured = np.mean(err**2)
    assert measured == pytest.approx(codec.expected_inner_error(), rel=0.1)
    assert measured >= 4.0**-bits / D
    paper = {1: 1.57, 2: 0.56, 3: 0.18, 4: 0.047}[bits] / D
    # b ≤ 3 agrees with the paper's rounded values; b = 4 is π/2·0.034/D, not π/2·0.03/D
    if bits < 4:
        assert measured == pytest.approx(paper, rel=0.1)
    else:
        assert measured / paper == pytest.approx(0.0340 / 0.03, rel=0.1)


def test_inner_matches_decode_then_dot():
    codec = TurboQuantProd(64, 3, seed=1)
    k = mx.random.normal((2, 10, 64), key=mx.random.key(0))
    q = mx.random.normal((2, 3, 64), key=mx.random.key(1))
    code = codec.encode(k)
    direct = codec.inner(q, code)
    via_decode = q @ mx.swapaxes(codec.decode(code), -1, -2)
    assert direct.shape == (2, 3, 10)
    assert mx.allclose(direct, via_decode, atol=1e-4).item()


def test_bits_config_and_errors():
    assert TurboQuantProd(128, 3).bits_per_coordinate == 3 + 32 / 128
    assert TurboQuantProd(128, 1).bits_per_coordinate == 1 + 16 / 128
    assert QJL(64, m=128).bits_per_coordinate == (128 + 16) / 64
    for c in (QJL(64, m=96, orthogonal=True, seed=4), TurboQuantProd(80, 3, seed=2)):
        x = mx.random.normal((7, c.dim))
        assert mx.array_equal(c.decode(c.encode(x)), from_config(c.config()).decode(from_config(c.config()).encode(x))).item()
    z = TurboQuantProd(64, 2).decode(TurboQuantProd(64, 2).encode(mx.zeros((1, 64))))
    assert mx.all(z == 0).item()
    with pytest.raises(ValueError, match="bits"):
        TurboQuantProd(64, 0)
    with pytest.raises(ValueError, match="m"):
        QJL(64, m=0)
    with pytest.raises(ValueError, match="NaN"):
        QJL(64).encode(mx.full((1, 64), float("nan")))
