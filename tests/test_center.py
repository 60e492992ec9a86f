"""Centered: the per-head mean is exact for attention and shrinks what the codec must hold."""
import mlx.core as mx
import pytest

from turboquant.attention import reference_attention
from turboquant.codecs import Centered, OutlierSplit, TurboQuantMSE, from_config


def offset_keys(seed=0, B=1, H=3, T=256, D=64, offset=4.0):
    base = mx.random.normal((B, H, T, D), key=mx.random.key(seed))
    mu = offset * mx.random.normal((H, 1, D), key=mx.random.key(seed + 100))
    return base + mu


def test_mean_is_per_head_and_round_trip_rebuilds_bit_for_bit():
    x = offset_keys()
    c = Centered(TurboQuantMSE(64, 3)).fit(x)
    assert c.mean.shape == (3, 64)
    assert mx.allclose(c.mean, mx.mean(x[0], axis=1), atol=1e-5)
    again = from_config(c.config())
    assert again == c and mx.array_equal(again.mean, c.mean)
    assert mx.array_equal(again.decode(c.encode(x)), c.decode(c.encode(x)))
    assert c.bits_per_coordinate == TurboQuantMSE(64, 3).bits_per_coordinate
    assert c.side_nbytes == 3 * 64 * 4


def test_centering_lowers_the_error_on_offset_keys_and_changes_no_attention():
    x = offset_keys()
    plain = TurboQuantMSE(64, 3)
    cent = Centered(TurboQuantMSE(64, 3)).fit(x)
    err = lambda codec: mx.mean((codec.roundtrip(x) - x) ** 2).item()   # noqa: E731
    assert err(cent) < 0.5 * err(plain)
    # the exactness argument: attention with k − μ, v − μ plus μ equals attention with k, v
    q = mx.random.normal((1, 3, 5, 64), key=mx.random.key(9))
    mu = cent.broadcast_mean(4)
    a = reference_attention(q, x, x)
    b = reference_attention(q, x - mu, x - mu) + mu
    assert mx.abs(a - b).max().item() < 1e-4


def test_inner_outlier_split_is_fitted_on_centered_vectors():
    x = offset_keys(D=64)
    c = Centered(OutlierSplit(64, n_outliers=16, outlier_bits=3, bits=2)).fit(x)
    assert c.fitted and c.inner.fitted
    assert from_config(c.config()).inner.channels == c.inner.channels


def test_bad_input():
    c = Centered(TurboQuantMSE(64, 3))
    with pytest.raises(ValueError, match="no mean yet"):
        c.encode(offset_keys())
    c.fit(offset_keys())
    with pytest.raises(ValueError, match="fitted on 3 heads"):
        c.encode(offset_keys(H=2))
    with pytest.raises(ValueError, match="shape"):
        Centered(TurboQuantMSE(64, 3), mean=[[0.0] * 63])
    with pytest.raises(ValueError, match="finite"):
        Centered(TurboQuantMSE(64, 3), mean=[float("nan")] * 64)
    with pytest.raises(TypeError):
        Centered("turboquant")
    with pytest.raises(ValueError, match="NaN"):
        c.encode(mx.full((1, 3, 2, 64), float("nan")))


def test_cache_with_centered_keys_and_sinks_saves_trims_and_reloads(tmp_path):
    from turboquant.cache import TurboQuantKVCache
    from turboquant.prompt_cache import load_prompt_cache, save_prompt_cache
    k, v = offset_keys(seed=1, T=100), offset_keys(seed=2, T=100)
    c = TurboQuantKVCache(Centered(TurboQuantMSE(64, 3)), TurboQuantMSE(64, 2), sink_tokens=2, fit_tokens=3)
    c.update_and_fetch(k[:, :, :1], v[:, :, :1])          # the sink fills across updates
    kh, vh = c.update_and_fetch(k[:, :, 1:], v[:, :, 1:])
    # the 2 sinks and the 3 tokens the mean is fitted on stay exact
    assert c.sink_tokens == 5 and mx.array_equal(c.key_codec.mean, mx.mean(k[0, :, 2:5], axis=1))
    assert mx.array_equal(kh[:, :, :5], k[:, :, :5]) and mx.array_equal(vh[:, :, :5], v[:, :, :5])
    assert not mx.array_equal(kh[:, :, 5:6], k[:, :, 5:6])
    assert c.nbytes == c.code_nbytes(256) + 5 * 3 * 2 * 64 * 4       # codes (one 256 step) + exact tokens
    save_prompt_cache(tmp_path / "c.safetensors", [c])
    (d,) = load_prompt_cache(tmp_path / "c.safetensors")
    assert d.sink_tokens == 5 and d.fit_tokens == 3 and d.key_codec == c.key_codec
    k1, v1 = c.update_and_fetch(k[:, :, :1], v[:, :, :1])
    k2, v2 = d.update_and_fetch(k[:, :, :1], v[:, :, :1])
    assert mx.array_equal(k1, k2) and mx.array_equal(v1, v2)
    d.trim(d.offset - 1)                                      # back to one token: one sink left
    assert d.sink_keys.shape[2] == 1 and d.offset == 1
    with pytest.raises(ValueError, match="sink_tokens"):
        TurboQuantKVCache(TurboQuantMSE(64, 3), sink_tokens=-1)


def test_a_non_finite_mean_is_named_as_such():
    import pytest as _pytest
    from turboquant.codecs import Centered, TurboQuantMSE
    with _pytest.raises(ValueError, match="mean must be finite; it holds 8 NaN"):
        Centered(TurboQuantMSE(8, 4, rotation="haar"), mean=[float("nan")] * 8)
