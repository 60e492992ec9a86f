"""Bit-Axon's SWA layer: exactness under any split, the quantized ring, the plan's API and memory."""
import mlx.core as mx
import pytest

from turboquant import memory
from turboquant.attention import cosine_similarity
from turboquant.demos import upstream_trimmed_prefill
from turboquant.bitaxon import (BIT_AXON, SMALL, ExactSWACache, QuantizedSWACache, SWAConfig, SWAttention, TurboQuant,
                                full_sequence_attention)
from turboquant.models import run_in_chunks
from turboquant.codecs import Centered, FibQuant, Identity, OutlierSplit, PolarQuant, TurboQuantMSE, TurboQuantProd


@pytest.fixture(scope="module")
def layer():
    mx.random.seed(0)
    layer = SWAttention(SMALL)
    mx.eval(layer.parameters())
    return layer


def run(layer, cache, x, splits):
    return run_in_chunks(layer, x, cache, splits)


SPLITS = [[300], [100, 100, 100], [70] + [1] * 30 + [200], [200] + [1] * 100, [5] * 60, [64, 64, 64, 108]]


@pytest.mark.parametrize("splits", SPLITS, ids=lambda s: f"{len(s)}parts")
def test_any_split_equals_full_sequence_attention(layer, splits):
    x = mx.random.normal((2, 300, 256), key=mx.random.key(1))
    ref = full_sequence_attention(layer, x)
    for cache in (ExactSWACache(SMALL.window), QuantizedSWACache(SMALL.window, Identity(64))):
        out = run(layer, cache, x, splits)
        assert not mx.any(mx.isnan(out)).item()
        assert mx.abs(out - ref).max().item() < 1e-5


def test_upstream_defect_is_real(layer):
    # trimming before attention (the upstream order, demos.upstream_trimmed_prefill) gives
    # NaN rows for a prefill longer than the window; our layer does not
    x = mx.random.normal((1, 100, 256), key=mx.random.key(2))
    bad = upstream_trimmed_prefill(layer, x)
    assert mx.any(mx.isnan(bad[0, : 100 - SMALL.window])).item()
    assert not mx.any(mx.isnan(bad[0, 100 - SMALL.window:])).item()
    assert mx.all(mx.isfinite(layer(x, cache=None))).item()


@pytest.mark.parametrize("make", [lambda d: TurboQuantMSE(d, 4), lambda d: TurboQuantMSE(d, 2),
                                  lambda d: FibQuant(d, 2, 32), lambda d: PolarQuant(d, rotation="haar"),
                                  lambda d: TurboQuantProd(d, 3)])
def test_head_size_80_works_with_every_codec(make):
    cfg = SWAConfig(hidden=160, n_heads=2, head_dim=80, window=32, chunk=8)
    mx.random.seed(1)
    layer = SWAttention(cfg)
    x = mx.random.normal((1, 90, 160), key=mx.random.key(3))
    ref = full_sequence_attention(layer, x)
    out = run(layer, QuantizedSWACache(32, make(80)), x, [50] + [1] * 40)
    assert mx.mean(cosine_similarity(out, ref)).item() > 0.8


def test_compress_decompress_keeps_shape_dtype_window_offset(layer):
    x = mx.random.normal((1, 150, 256), key=mx.random.key(4))
    kv = ExactSWACache(SMALL.window)
    run(layer, kv, x, [150])
    for tq in (TurboQuant(payload_bits=4), TurboQuant(payload_bits=2.5), TurboQuant(codec=lambda d: PolarQuant(d))):
        q = tq.compress(kv)
        d = tq.decompress(q)
        assert d.k.shape == kv.k.shape and d.k.dtype == kv.k.dtype
        assert d.window_size == kv.window_size and d.offset == kv.offset == 150
        assert mx.mean(cosine_similarity(d.k, kv.k)).item() > 0.95
    # continuing from a compressed cache matches continuing from the original
    nxt = mx.random.normal((1, 1, 256), key=mx.random.key(5))
    a = layer(nxt, cache=kv)
    b = layer(nxt, cache=TurboQuant(codec=lambda d: Identity(d)).compress(KVCache_like(layer, x)))
    assert mx.abs(a - b).max().item() < 1e-5
    with pytest.raises(ValueError):
        TurboQuant(payload_bits=4).compress(ExactSWACache(8))
    with pytest.raises(TypeError):
        TurboQuant(payload_bits=4).decompress(kv)
    with pytest.raises(ValueError, match="whole number"):
        TurboQuant(payload_bits=2.3).codec(80)


def KVCache_like(layer, x):
    kv = ExactSWACache(SMALL.window)
    run(layer, kv, x, [150])
    return kv


def test_real_geometry_memory():
    # one layer's ring at W = 4096, 32 heads of 80, measured; eight layers by the formula and by 8 x measured
    g = memory.PRESETS["bit-axon"]
    fp16 = memory.kv_cache_bytes(g, 65536)
    assert round(fp16 / 1e6, 1) == 335.5
    rows = {}
    for name, codec in (("4", TurboQuantMSE(80, 4)), ("3", TurboQuantMSE(80, 3)), ("2", TurboQuantMSE(80, 2)),
                        ("2.5", FibQuant(80, 2, 32))):
        c = QuantizedSWACache(BIT_AXON.window, codec)
        x = mx.random.normal((1, 32, BIT_AXON.window + 7, 80), key=mx.random.key(0))
        c.update_and_fetch(x, x)
        rows[name] = 8 * c.nbytes
        formula = memory.kv_cache_bytes(g, 65536, bits=codec.bits_per_coordinate)
        assert abs(rows[name] / formula - 1) < 0.01
    assert rows["4"] <= 88.1e6 and rows["2"] < rows["2.5"] < rows["3"] < rows["4"]


@pytest.mark.slow
def test_long_run_constant_memory_and_within_codec_error(layer):
    """4,096 decode steps (many wraps of the window) compared step by step with the exact
    ring, then chunks of 1,024 tokens up to offset 65,536: memory never grows and the output
    stays within the codec's error. (65,536 single steps of the one ring of codes both SWA
    caches share: tests/test_cache.py.)"""
    ref, q = ExactSWACache(SMALL.window), QuantizedSWACache(SMALL.window, TurboQuantMSE(64, 4))
    sizes, cos = set(), []
    for i in range(4096):
        if i % 1024 == 0:
            xs = mx.random.normal((1, 1024, 256), key=mx.random.key(7 + i))
        x = xs[:, i % 1024: i % 1024 + 1]
        cos.append(cosine_similarity(layer(x, cache=ref), layer(x, cache=q)).reshape(-1))
        if i % 256 == 255:
            mx.eval(cos, ref.k, q.ring.state[:2])
        if i + 1 in (SMALL.window, 4096):
            sizes.add(q.nbytes)
    for i in range(4096, 65536, 1024):
        xs = mx.random.normal((1, 1024, 256), key=mx.random.key(7 + i))
        cos.append(cosine_similarity(layer(xs, cache=ref), layer(xs, cache=q)).reshape(-1))
        mx.eval(cos, ref.k, q.ring.state[:2])
    sizes.add(q.nbytes)
    c = mx.concatenate(cos)
    assert len(sizes) == 1 and q.offset == 65536
    assert mx.mean(c).item() > 0.99 and mx.min(c).item() > 0.95


def test_bits_means_one_thing_payload_bits_is_named_so():
    with pytest.raises(TypeError, match="payload_bits"):
        TurboQuant(bits=4)
    codec = TurboQuant(payload_bits=4).codec(80)
    assert codec.payload_bits == 4 and codec.bits_per_coordinate == 4 + 16 / 80


@pytest.mark.parametrize("make", [lambda d: Centered(TurboQuantMSE(d, 4)),
                                  lambda d: OutlierSplit(d, n_outliers=16, outlier_bits=4, bits=3, rotation="haar")])
def test_the_ring_fits_codecs_that_learn(layer, make):
    x = mx.random.normal((1, 100, 256), key=mx.random.key(4))
    cache = QuantizedSWACache(SMALL.window, make(SMALL.head_dim))
    out = layer(x, cache=cache)
    ref = full_sequence_attention(layer, x)
    assert cache.key_codec.fitted and mx.mean(cosine_similarity(out, ref)).item() > 0.95


@pytest.mark.parametrize("field, value", [("window", 2.5), ("window", float("nan")), ("window", 0), ("chunk", -4),
                                          ("n_layers", True), ("head_dim", 0)])
def test_config_refuses_sizes_that_are_not_positive_ints(field, value):
    """Issue #26.11: window=nan used to give all-NaN outputs."""
    args = dict(hidden=256, n_heads=4, head_dim=64, window=64, chunk=16, n_layers=1)
    args[field] = value
    with pytest.raises(ValueError, match=field):
        SWAConfig(**args)


def test_window_attention_refuses_a_zero_window_or_chunk():
    from turboquant.bitaxon import window_attention
    q = mx.zeros((1, 1, 2, 8))
    for kw in (dict(window=0, chunk=4), dict(window=4, chunk=0)):
        with pytest.raises(ValueError, match="window|chunk"):
            window_attention(q, q, q, None, scale=1.0, **kw)


def test_both_cache_faces_take_the_same_window_sizes():
    import numpy as np
    assert ExactSWACache(np.int64(4)).window_size == 4
    assert QuantizedSWACache(np.int64(4), TurboQuantMSE(64, 4)).ring.max_size == 4
    for bad in (True, 2.5, 0):
        for make in (lambda w: ExactSWACache(w), lambda w: QuantizedSWACache(w, TurboQuantMSE(64, 4))):
            with pytest.raises(ValueError, match="window_size"):
                make(bad)


def test_the_exact_cache_masks_what_it_returns():
    """ExactSWACache speaks mlx-lm's make_mask: the next N queries over the keys
    update_and_fetch returns (the held window, then the new ones), by the window rule."""
    from turboquant.attention import positions_mask
    c = ExactSWACache(4)
    x = mx.random.normal((1, 2, 6, 8), key=mx.random.key(0))
    c.update_and_fetch(x, x)
    mask = c.make_mask(2)
    k, _ = c.update_and_fetch(x[:, :, :2], x[:, :, :2])
    assert mask.shape == (2, k.shape[2]) == (2, 6)
    assert mx.array_equal(mask, positions_mask(mx.arange(6, 8), mx.arange(2, 8), 4)).item()
    assert mask[0].tolist() == [False, True, True, True, True, False]
