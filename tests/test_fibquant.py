"""FibQuant: the acceptance numbers of Chapter 6, construction, cache and interface."""
import math

import mlx.core as mx
import numpy as np
import pytest

from turboquant.codecs import mse
from turboquant import FibQuant, TurboQuantMSE
from turboquant.codecs import fibquant as fq
from turboquant.sphere import unit_vectors

D = 64


@pytest.fixture(scope="module")
def x():
    return unit_vectors(20000, D, 1)




def test_two_bits_k2_beats_scalar(x):
    fib = FibQuant(D, k=2, n_codewords=16)
    assert mse(fib, x) <= 0.106
    assert mse(TurboQuantMSE(D, 2), x) == pytest.approx(0.1145, rel=0.01)
    # the spiral alone is worse than scalar, refinement is what wins
    assert fib.codebook.init_mse * D / 2 == pytest.approx(0.1227, rel=0.02)


# the block size chosen per integer rate (k = 2 only ties scalar at one bit)
@pytest.mark.parametrize("bits, k", [(1, 8), (2, 2), (3, 2), (4, 2)])
def test_strictly_below_scalar_at_every_integer_rate(x, bits, k):
    fib = FibQuant(D, k=k, bits=bits)
    assert fib.rate == bits
    assert mse(fib, x) < 0.98 * TurboQuantMSE(D, bits).expected_mse


def test_fractional_rates_fall_between_neighbours(x):
    m = {b: mse(FibQuant(D, 2, bits=b), x) for b in (2, 2.5, 3)}
    assert m[2] > m[2.5] > m[3]
    assert FibQuant(D, 2, bits=2.5).n_codewords == 32


@pytest.mark.parametrize("k, n, rate", [(8, 16, 0.5), (16, 16, 0.25), (32, 16, 0.125), (64, 16, 1 / 16)])
def test_sub_one_bit_rates_beat_the_zero_rate_codec(x, k, n, rate):
    fib = FibQuant(D, k=k, n_codewords=n)
    assert fib.rate == pytest.approx(rate)
    m = mse(fib, x)
    assert m < 1.0                                   # decoding to zero costs exactly 1
    assert m == pytest.approx(fib.expected_mse, rel=0.03)


def test_companded_radii_and_directions():
    r = fq.companded_radii(64, 2, 16)
    assert np.all(np.diff(r) > 0) and r[-1] < 1
    # k = 2 closed form: r_n = sqrt(1 − (1 − q_n)^(4/D))
    q = (np.arange(1, 17) - 0.5) / 16
    assert np.allclose(r, np.sqrt(1 - (1 - q) ** (4 / 64)))
    assert np.all(fq.companded_radii(8, 8, 5) == 1)
    for k in (2, 3, 4, 8):
        d = fq.directions(k, 50)
        assert d.shape == (50, k) and np.allclose(np.linalg.norm(d, axis=1), 1)
    phi = fq.generalized_golden(2)
    assert phi ** 3 == pytest.approx(phi + 1)
    assert fq.generalized_golden(1) == pytest.approx((1 + math.sqrt(5)) / 2)


def test_refinement_never_worse_than_its_initialization():
    for k, n in ((2, 8), (4, 16), (16, 8)):
        cb = fq.fibquant_codebook(D, k, n, use_disk=False)
        assert cb.mse <= cb.init_mse
        assert cb.start_label == ("spiral (unrefined)" if cb.start < 0 else "Lloyd from the spiral" if cb.start == 0
                                  else f"Lloyd from k-means++ seed {cb.start}")
    labels = {fq.VectorCodebook(np.zeros((1, 2)), 0.0, 0.0, 8, 0, s).start_label for s in (-1, 0, 2)}
    assert labels == {"spiral (unrefined)", "Lloyd from the spiral", "Lloyd from k-means++ seed 2"}


def test_codebook_is_deterministic_and_disk_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TURBOQUANT_CACHE", str(tmp_path))
    fq.clear_memory_cache()
    a = fq.fibquant_codebook(32, 2, 8, seed=3)
    files = list((tmp_path / "fibquant").glob("*.npz"))
    assert len(files) == 1
    fq.clear_memory_cache()
    b = fq.fibquant_codebook(32, 2, 8, seed=3)               # from disk
    c = fq.fibquant_codebook(32, 2, 8, seed=3, use_disk=False)  # rebuilt
    assert np.array_equal(a.codewords, b.codewords) and np.array_equal(a.codewords, c.codewords)
    assert not np.array_equal(a.codewords, fq.fibquant_codebook(32, 2, 8, seed=4, use_disk=False).codewords)
    # a corrupt cache file is rebuilt, not trusted
    files[0].write_bytes(b"not a numpy file")
    fq.clear_memory_cache()
    d = fq.fibquant_codebook(32, 2, 8, seed=3)
    assert np.array_equal(d.codewords, a.codewords)
    fq.clear_memory_cache()


@pytest.mark.parametrize("kwargs, match", [
    (dict(dim=64, k=3, n_codewords=16), "divide"), (dict(dim=64, k=2, n_codewords=1), "n_codewords"),
    (dict(dim=64, k=2), "exactly one"), (dict(dim=64, k=2, n_codewords=4, bits=1), "exactly one"),
    (dict(dim=64, k=3, bits=1.3), "whole number"), (dict(dim=64, k=2, bits=-1), "bits"),
])
def test_bad_configuration(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FibQuant(**kwargs)


def test_long_inputs_are_chunked_not_materialized():
    c = FibQuant(64, k=2, n_codewords=256)
    x = mx.random.normal((40000, 64), key=mx.random.key(1))  # 1.28M blocks x 256 codewords
    y = c.rotation.apply(x / mx.linalg.norm(x, axis=-1, keepdims=True))
    idx = c.quantize_rotated(y)
    assert idx.shape == (40000, 32)
    # chunk boundaries change nothing: spot rows across the chunks against brute force
    rows = np.r_[0:50, 16000:16050, 39950:40000]
    blocks = np.array(y)[rows].reshape(-1, 2).astype(np.float64)
    d = ((blocks[:, None, :] - np.array(c.codewords, dtype=np.float64)[None]) ** 2).sum(-1)
    best = d.min(-1)
    got = d[np.arange(len(d)), np.array(idx)[rows].reshape(-1)]
    assert np.all(got <= best + 1e-6)
