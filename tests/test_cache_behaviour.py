"""Caches in use with mlx-lm (``turboquant.cache``, ``turboquant.prompt_cache``,
``turboquant.attention``): max_kv_size, trimming, sliding layers, codes attention across
threads and model depths, grouped-query masks, deep copies, conversion options, Bit-Axon's
ring."""
import copy
import threading
import warnings

import mlx.core as mx
import pytest

import turboquant as tq
from turboquant.cache import FIT_TOKENS
from turboquant.suite import CONFIGS

from mlx_lm.models import cache as mlx_cache

from turboquant.models import run_in_chunks, tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)


def toks(n, seed=0):
    return mx.random.randint(1, 256, (1, n), key=mx.random.key(seed))


# max_kv_size is honoured for models with make_cache (llama)
def test_max_kv_size_bounds_every_layer(llama):
    cache = tq.make_prompt_cache(llama, max_kv_size=64)
    assert all(isinstance(c, tq.TurboQuantRotatingKVCache) and c.max_size == 64 for c in cache)
    run_in_chunks(llama, toks(299), cache, [200] + [1] * 99)
    assert all(c.size() == 64 for c in cache)
    unbounded = tq.make_prompt_cache(llama)
    run_in_chunks(llama, toks(299), unbounded, [200] + [1] * 99)
    assert cache[0].nbytes < unbounded[0].nbytes / 3
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="max_kv_size"):
            tq.make_prompt_cache(llama, max_kv_size=bad)


def test_max_kv_size_keeps_a_smaller_sliding_window():
    gemma = tiny_model("gemma3", num_layers=6, sliding_window=16)
    cache = tq.make_prompt_cache(gemma, max_kv_size=64)
    assert sorted({c.max_size for c in cache}) == [16, 64]


# trim is exact or refused
def test_trim_with_fp_window_is_refused_not_inexact(llama):
    cache = tq.make_prompt_cache(llama, fp_window=8)
    run_in_chunks(llama, toks(40), cache, [40])
    assert not mlx_cache.can_trim_prompt_cache(cache)
    assert mlx_cache.trim_prompt_cache(cache, 3) == 0 and cache[0].offset == 40
    with pytest.raises(ValueError, match="cannot be trimmed exactly"):
        cache[0].trim(3)
    plain = tq.make_prompt_cache(llama)
    run_in_chunks(llama, toks(40), plain, [40])
    for c in (plain[0], tq.TurboQuantRotatingKVCache(8, tq.Identity(16))):
        with pytest.raises(ValueError, match="n must be an int >= 0"):
            c.trim(-1)


def test_trim_without_fp_window_equals_a_cache_that_never_saw_the_tokens(llama):
    t = toks(50)
    a, b = tq.make_prompt_cache(llama, sink_tokens=2), tq.make_prompt_cache(llama, sink_tokens=2)
    run_in_chunks(llama, t, a, [50])
    assert mlx_cache.trim_prompt_cache(a, 10) == 10
    run_in_chunks(llama, t[:, :40], b, [40])
    nxt = toks(1, seed=9)
    assert mx.array_equal(llama(nxt, cache=a), llama(nxt, cache=b)).item()


def test_codes_attention_refuses_a_cache_of_another_depth(llama):
    six = tiny_model("llama", num_layers=6, hidden_size=64, num_heads=4, num_kv_heads=2)
    cache = tq.make_prompt_cache(llama)
    with tq.codes_attention(six), pytest.raises(ValueError, match="made for 2 layers, the model has 6"):
        six(toks(5), cache=cache)
    with pytest.raises(ValueError, match="2 layers, the model has 6"):
        tq.to_turboquant([mlx_cache.KVCache(), mlx_cache.KVCache()], model=six)


# fp_window / sink_tokens on sliding-window layers
def test_fp_window_on_sliding_layers_warns_with_the_rule():
    gemma = tiny_model("gemma3", num_layers=6, sliding_window=16)
    with pytest.warns(UserWarning, match="plain \\(global\\) layers only"):
        cache = tq.make_prompt_cache(gemma, fp_window=8, sink_tokens=2)
    plain = [c for c in cache if not isinstance(c, tq.TurboQuantRotatingKVCache)]
    assert plain and all(c.fp_window == 8 and c.sink_tokens == 2 for c in plain)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                     # callers that build many caches opt out
        tq.make_prompt_cache(gemma, fp_window=8, sink_tokens=2, warn_rotating=False)
        CONFIGS["budget K4/V4"].make_cache(gemma)()


# codes_attention from overlapping threads restores mlx-lm
def test_codes_attention_in_overlapping_threads_restores_mlx_lm(llama):
    import mlx_lm.models.llama as arch
    original = arch.scaled_dot_product_attention
    entered, release = [threading.Event() for _ in range(2)], [threading.Event() for _ in range(2)]

    def worker(i):
        with tq.codes_attention(llama):
            entered[i].set()
            release[i].wait(10)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for e in entered:
        e.wait(10)
    release[0].set()                                     # the first to enter exits first
    threads[0].join(10)
    assert arch.scaled_dot_product_attention is not original      # still in use by thread 2
    release[1].set()
    threads[1].join(10)
    assert arch.scaled_dot_product_attention is original
    a, b = tq.codes_attention(llama), tq.codes_attention(llama)
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)                          # non-nested exit in one thread
    b.__exit__(None, None, None)
    assert arch.scaled_dot_product_attention is original
    from turboquant.cache import codes_mode
    assert codes_mode.get() == 0


# per-query-head masks under grouped-query attention
def test_per_head_mask_with_gqa_equals_the_reference():
    from turboquant.attention import attention_from_codes, reference_attention
    from turboquant.cache import returning_codes
    B, Hk, R, Tq, T, D = 1, 2, 3, 2, 20, 16
    k = mx.random.normal((B, Hk, T, D), key=mx.random.key(0))
    v = mx.random.normal((B, Hk, T, D), key=mx.random.key(1))
    q = mx.random.normal((B, Hk * R, Tq, D), key=mx.random.key(2))
    mask = mx.random.uniform(shape=(B, Hk * R, Tq, T), key=mx.random.key(3)) > 0.3   # differs per head
    c = tq.TurboQuantKVCache(tq.Identity(D))
    kd, vd = c.update_and_fetch(k, v)
    with returning_codes():
        kv, vv = c.update_and_fetch(k[:, :, :0], v[:, :, :0])
    ref = reference_attention(q, kd, vd, mask=mask)
    assert mx.abs(attention_from_codes(q, kv, vv, mask=mask) - ref).max().item() < 1e-5


# deep copies
@pytest.mark.parametrize("kind", ["plain", "rotating", "window"])
def test_caches_deep_copy_independently(llama, kind):
    make = {"plain": lambda: tq.make_prompt_cache(llama, sink_tokens=1),
            "rotating": lambda: tq.make_prompt_cache(llama, max_kv_size=16),
            "window": lambda: tq.make_prompt_cache(llama, fp_window=4)}[kind]
    cache = make()
    run_in_chunks(llama, toks(20), cache, [12] + [1] * 8)
    twin = copy.deepcopy(cache)
    nxt = toks(1, seed=4)
    assert mx.array_equal(llama(nxt, cache=cache), llama(nxt, cache=twin)).item()
    run_in_chunks(llama, toks(5, seed=5), cache, [1] * 5)          # the original moves on …
    fresh = make()
    run_in_chunks(llama, toks(20), fresh, [12] + [1] * 8)
    run_in_chunks(llama, nxt, fresh, [1])
    nxt2 = toks(1, seed=6)
    assert mx.array_equal(llama(nxt2, cache=twin), llama(nxt2, cache=fresh)).item()   # … the copy did not


def test_bit_axon_ring_deep_copies_independently():
    from turboquant.bitaxon import QuantizedSWACache
    ring = QuantizedSWACache(8, tq.TurboQuantMSE(64, 4))
    x = mx.random.normal((1, 2, 5, 64), key=mx.random.key(0))
    ring.update_and_fetch(x, x)
    twin = copy.deepcopy(ring)
    y = mx.random.normal((1, 2, 6, 64), key=mx.random.key(1))
    ring.update_and_fetch(y, y)                            # wraps the ring: overwrites slots
    assert twin.offset == 5 and ring.offset == 11
    fresh = QuantizedSWACache(8, tq.TurboQuantMSE(64, 4))
    fresh.update_and_fetch(x, x)
    a, b = twin.codes()[0].buffer.fields, fresh.codes()[0].buffer.fields
    assert all(mx.array_equal(a[n], b[n]).item() for n in b)


def test_to_turboquant_takes_the_options_of_make_prompt_cache(llama):
    t = toks(30)
    ref = [mlx_cache.KVCache() for _ in llama.layers]
    run_in_chunks(llama, t, ref, [30])
    keys = ref[0].state[0][..., :30, :]
    conv = tq.to_turboquant(ref, bits=4.25, model=llama, turned_mean=False)   # the centred rule
    kept = tq.to_turboquant(ref, sink_tokens=2, fp_window=3)
    direct = tq.make_prompt_cache(llama, bits=4.25, turned_mean=False)   # the mean after RoPE
    run_in_chunks(llama, t, direct, [30])
    assert conv[0].sink_tokens == direct[0].sink_tokens == 1 + FIT_TOKENS       # the sink, the fit tokens
    assert conv[0].key_codec.name == direct[0].key_codec.name == "centered"
    held = conv[0].sink_keys.shape[2]
    assert held == min(30, 1 + FIT_TOKENS) and mx.array_equal(conv[0].sink_keys, keys[..., :held, :]).item()
    nxt = toks(1, seed=3)
    exact = llama(nxt, cache=ref)
    from turboquant.attention import cosine_similarity
    assert cosine_similarity(llama(nxt, cache=conv), exact).min().item() > 0.99
    assert kept[0].sink_tokens == 2 and kept[0].fp_window == 3 and kept[0].sink_keys.shape[2] == 2
    assert mx.array_equal(kept[0].recent_keys, keys[..., -3:, :]).item()


def test_bit_axon_ring_does_not_share_a_learning_codec():
    from turboquant.bitaxon import QuantizedSWACache
    ring = QuantizedSWACache(8, tq.Centered(tq.TurboQuantMSE(64, 4)))
    k = mx.random.normal((1, 2, 5, 64), key=mx.random.key(0)) + 3
    v = mx.random.normal((1, 2, 5, 64), key=mx.random.key(1)) - 3
    ring.update_and_fetch(k, v)
    assert ring.key_codec is not ring.value_codec
    assert mx.mean(ring.key_codec.mean).item() > 2 and mx.mean(ring.value_codec.mean).item() < -2


def test_mlx_affine_nominal_bits_count_its_float32_scales():
    """mlx-lm's QuantizedKVCache keeps scales and biases in the keys' dtype: with float32 keys
    its bytes are 4 + 2·32/64 = 5 bits per coordinate, what the suite's row (and the frontier
    plot) must say, and a run recorded with the old 4.5 is plotted at 5.0 — not at measured
    bits that hold mlx-lm's allocation steps (Gemma's 513-token windows: 768 slots)."""
    from turboquant.memory import measured_bits
    from turboquant.suite import frontier_rows
    cfg = CONFIGS["mlx-lm affine 4"]
    model = tiny_model("llama", num_layers=1, hidden_size=128, num_heads=2, num_kv_heads=1)   # D = 64
    cache = cfg.make_cache(model)()
    run_in_chunks(model, mx.random.randint(1, 200, (1, 256), key=mx.random.key(0)), cache, [256])
    assert measured_bits(model, cache) == pytest.approx(cfg.bits(64)) == 5.0
    old = {"results": {"mlx-lm affine 4": {"family": "mlx-lm affine", "bits": 4.5,
                                           "measured_bits": 5.0 * 768 / 513, "ppl": 1.0,
                                           "ppl_increase": 0.0}}}
    assert frontier_rows(old)[0][2] == 5.0
