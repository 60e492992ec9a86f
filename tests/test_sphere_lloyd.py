import numpy as np
import pytest
from scipy import integrate

from turboquant import sphere
from turboquant.lloyd import BetaLaw, QuadratureLaw, beta_codebook, gaussian_codebook, lloyd_max


@pytest.mark.parametrize("dim", [3, 8, 64, 80, 128])
def test_coordinate_law_is_a_density_with_variance_1_over_d(dim):
    total = integrate.quad(lambda x: sphere.coordinate_pdf(x, dim), -1, 1)[0]
    var = integrate.quad(lambda x: x * x * sphere.coordinate_pdf(x, dim), -1, 1)[0]
    assert total == pytest.approx(1, abs=1e-8)
    assert var == pytest.approx(1 / dim, rel=1e-7)
    assert sphere.coordinate_moment(dim, 2) == pytest.approx(1 / dim)
    assert sphere.coordinate_moment(dim, 4) == pytest.approx(3 / (dim * (dim + 2)))


def test_samples_follow_the_coordinate_law():
    d = 16
    x = sphere.sample_sphere(40000, d, seed=3)[:, 0]
    for q in (-0.5, -0.2, 0.0, 0.1, 0.4):
        assert np.mean(x <= q) == pytest.approx(sphere.coordinate_cdf(q, d), abs=0.01)
    assert np.allclose(sphere.coordinate_ppf(sphere.coordinate_cdf(0.3, d), d), 0.3)


def test_block_law_integrates_to_one_and_samples_match():
    d, k = 10, 2
    total = integrate.dblquad(lambda y, x: sphere.block_pdf(np.array([x, y]), d, k),
                              -1, 1, lambda x: -np.sqrt(1 - x * x), lambda x: np.sqrt(1 - x * x))[0]
    assert total == pytest.approx(1, abs=1e-6)
    u = sphere.sample_block(50000, d, k, seed=1)
    w = sphere.sample_sphere(50000, d, seed=2)[:, :k]
    r2u, r2w = np.sum(u * u, 1), np.sum(w * w, 1)
    assert r2u.mean() == pytest.approx(k / d, rel=0.02) and r2w.mean() == pytest.approx(k / d, rel=0.02)
    assert np.quantile(r2u, 0.9) == pytest.approx(np.quantile(r2w, 0.9), rel=0.03)


@pytest.mark.parametrize("dim,k", [(64, 2), (64, 4), (16, 3)])
def test_block_radius_summary_matches_samples(dim, k):
    s = sphere.block_radius_summary(dim, k)
    r = np.linalg.norm(sphere.sample_block(200_000, dim, k, seed=3), axis=1)
    assert s["rms"] == pytest.approx(np.sqrt(np.mean(r**2)), rel=5e-3)
    assert s["median"] == pytest.approx(np.median(r), rel=5e-3)
    hist, edges = np.histogram(r, bins=200, range=(0, 0.6 if dim == 64 else 1))
    peak = edges[np.argmax(hist)]                      # the histogram's tallest bin: the mode
    assert abs(peak - s["mode"]) < 0.02
    assert s["mode"] < s["median"] < s["rms"]          # the three differ: say which one is meant
    with pytest.raises(ValueError, match="block size k"):
        sphere.block_radius_summary(dim, dim)


def test_gaussian_limit():
    x = np.linspace(-0.3, 0.3, 7)
    err = np.abs(sphere.coordinate_pdf(x, 4096) - sphere.gaussian_limit_pdf(x, 4096)).max()
    assert err < 0.01 * sphere.gaussian_limit_pdf(0, 4096)


@pytest.mark.parametrize("bits, expected", [(1, 0.3609), (2, 0.1160), (3, 0.0340), (4, 0.0093)])
def test_beta_codebook_distortion_d128(bits, expected):
    book = beta_codebook(128, bits)
    assert 128 * book.mse == pytest.approx(expected, rel=2e-3)
    assert 4.0 ** -bits <= 128 * book.mse <= np.sqrt(3) * np.pi / 2 * 4.0 ** -bits


def test_one_bit_codebook_is_plus_minus_mean_abs():
    # 1 bit: centroids ±E|X|, E|X| = Γ(D/2)/(√π Γ((D+1)/2))
    from scipy.special import gammaln
    d = 64
    book = beta_codebook(d, 1)
    e_abs = np.exp(gammaln(d / 2) - 0.5 * np.log(np.pi) - gammaln((d + 1) / 2))
    assert np.allclose(book.centroids, [-e_abs, e_abs])


@pytest.mark.parametrize("bits", [1, 3, 6, 8])
def test_lloyd_conditions_hold(bits):
    book = beta_codebook(80, bits)
    c, t = book.centroids, book.thresholds
    assert np.all(np.diff(c) > 0) and np.allclose(t, (c[:-1] + c[1:]) / 2)
    law = BetaLaw(80)
    e = np.concatenate([[-1], t, [1]])
    assert np.allclose(law.first_moment(e[:-1], e[1:]) / law.mass(e[:-1], e[1:]), c, atol=1e-10)


def test_gaussian_codebook_matches_known_values():
    # Max (1960): N(0,1) at 1 and 2 bits has MSE 0.3634 and 0.1175
    assert 64 * gaussian_codebook(64, 1).mse == pytest.approx(0.3634, abs=1e-4)
    assert 64 * gaussian_codebook(64, 2).mse == pytest.approx(0.1175, abs=1e-4)


def test_quadrature_law_agrees_with_closed_form():
    d = 20
    book = lloyd_max(QuadratureLaw(lambda x: sphere.coordinate_pdf(x, d), -1, 1), 4)
    assert np.allclose(book.centroids, beta_codebook(d, 2).centroids, atol=1e-7)


@pytest.mark.parametrize("bad", [0, 9, 2.5, True])
def test_bad_bits(bad):
    with pytest.raises(ValueError, match="bits"):
        beta_codebook(64, bad)
