"""Keys coded before RoPE (``turboquant.prerope``): exact round trip, the position-free mean it
exists for, refusals, and the suite's configurations."""
import copy
import types

import mlx.core as mx
import mlx.nn as nn
import pytest

import turboquant as tq
from turboquant.budget import codecs_for
from turboquant.cache_base import returning_codes
from turboquant.codecs.identity import Identity
from turboquant.memory import geometry_from_model
from turboquant.models import run_in_chunks, tiny_model
from turboquant.prerope import PreRopeCache, Rope, TurnedMeanCache, pre_rope, rope_of
from turboquant.suite import CONFIGS

from mlx_lm.models import cache as mlx_cache


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2)


def toks(n, seed=0):
    return mx.random.randint(1, 256, (1, n), key=mx.random.key(seed))


def test_rope_matches_the_models_and_inverts(llama):
    ropes = rope_of(llama)
    assert len(ropes) == 2 and ropes[0] == Rope(32, False, 10000.0, 1.0)
    x = mx.random.normal((1, 2, 9, 32), key=mx.random.key(1))
    assert mx.array_equal(ropes[0].apply(x, 7), llama.layers[0].self_attn.rope(x, offset=7))
    back = ropes[0].apply(ropes[0].apply(x, 7), 7, inverse=True)
    assert mx.max(mx.abs(back - x)).item() < 1e-5
    assert mx.max(mx.abs(ropes[0].apply(x, 7) - x)).item() > 0.1      # it does turn them


def test_exact_codecs_reproduce_the_fp32_model(llama):
    """With an exact codec the wrapper changes nothing but rounding: prefill, chunks and
    single decode steps (the offsets RoPE reads) agree with mlx-lm's cache."""
    x = toks(80)
    ref = run_in_chunks(llama, x, mlx_cache.make_prompt_cache(llama), [50, 20, 1, 1, 8])
    cache = pre_rope(llama, tq.make_prompt_cache(llama, key_codec=Identity(32), value_codec=Identity(32)))
    out = run_in_chunks(llama, x, cache, [50, 20, 1, 1, 8])
    assert mx.max(mx.abs(out - ref)).item() < 1e-4
    assert cache[0].offset == 80 and cache[0].size() == 80 and cache[0].nbytes == cache[0].inner.nbytes


def test_inside_codes_attention_it_decodes(llama):
    """These codes cannot be read without decoding: under ``codes_attention`` the cache returns
    decoded keys and values (the layer attends as for an exact cache) and the model's output is
    the one it gives outside, while the plain caches beside it still return codes."""
    x = toks(40, seed=1)
    make = lambda: pre_rope(llama, tq.make_prompt_cache(llama, bits=4.25, turned_mean=False))
    plain = run_in_chunks(llama, x, make(), [30, 1, 1, 8])
    with tq.codes_attention(llama):
        inside = run_in_chunks(llama, x, make(), [30, 1, 1, 8])
    assert mx.max(mx.abs(inside - plain)).item() < 1e-4
    with returning_codes():
        k, v = make()[0].update_and_fetch(mx.ones((1, 2, 3, 32)), mx.ones((1, 2, 3, 32)))
        assert isinstance(k, mx.array) and k.shape == (1, 2, 3, 32)
        assert not isinstance(tq.make_prompt_cache(llama, bits=4.25, turned_mean=False)[0].update_and_fetch(
            mx.ones((1, 2, 3, 32)), mx.ones((1, 2, 3, 32)))[0], mx.array)


def test_a_bias_before_rope_is_one_mean():
    """Keys that are one vector plus small noise before RoPE: after RoPE their mean turns with
    the position, so a centred cache fed them after RoPE keeps most of the vector to code; the
    same codecs before RoPE remove it exactly. The point of the lever, with a known answer."""
    D, T = 64, 256
    rope = Rope(D, False, 10000.0, 1.0)
    bias = 4 * mx.random.normal((1, 1, 1, D), key=mx.random.key(2))
    pre = bias + 0.1 * mx.random.normal((1, 1, T, D), key=mx.random.key(3))
    keys = rope.apply(pre, 0)
    values = mx.random.normal((1, 1, T, D), key=mx.random.key(4))

    def err(cache):
        k, _ = cache.update_and_fetch(keys, values)
        return (mx.sum((k - keys) ** 2) / mx.sum((keys - mx.mean(keys, axis=2, keepdims=True)) ** 2)).item()

    k, v = codecs_for(3, 3, True)                                    # centred 3-bit keys
    make = lambda: tq.TurboQuantKVCache(k(D), v(D))
    after, before = err(make()), err(PreRopeCache(make(), rope))
    assert before < after / 20, (before, after)


def test_refusals(llama):
    rope = rope_of(llama)[0]
    ring = tq.TurboQuantRotatingKVCache(16, Identity(32))
    with pytest.raises(TypeError, match="sliding-window"):
        PreRopeCache(ring, rope)
    with pytest.raises(TypeError, match="TurboQuantKVCache"):
        PreRopeCache(mlx_cache.KVCache(), rope)
    used = tq.TurboQuantKVCache(Identity(32))
    used.update_and_fetch(mx.zeros((1, 2, 3, 32)) + 1, mx.zeros((1, 2, 3, 32)) + 1)
    with pytest.raises(ValueError, match="empty"):
        PreRopeCache(used, rope)
    with pytest.raises(TypeError, match="Rope"):
        PreRopeCache(tq.TurboQuantKVCache(Identity(32)), "rope")
    with pytest.raises(ValueError, match="layers"):
        pre_rope(llama, tq.make_prompt_cache(llama)[:1])
    fake = types.SimpleNamespace(layers=[types.SimpleNamespace(self_attn=types.SimpleNamespace(
        rope=nn.ALiBi()))])
    with pytest.raises(ValueError, match="ALiBi"):
        rope_of(fake)
    with pytest.raises(TypeError, match="layers"):
        rope_of(object())


def test_suite_configurations(llama):
    name = "pre-RoPE budget K4/V4"
    cfg, plain = CONFIGS[name], CONFIGS["budget K4/V4"]
    assert cfg.pre_rope and not plain.pre_rope
    assert cfg.bits(64) == plain.bits(64) and cfg.sink_tokens == plain.sink_tokens
    assert cfg.fidelity_codecs() is None
    cache = cfg.make_cache(llama)()
    assert all(isinstance(c, PreRopeCache) for c in cache)
    assert cache[0].key_codec.config() == plain.make_cache(llama)()[0].key_codec.config()
    assert cfg.seeded(1, 32).pre_rope
    gemma = tiny_model("gemma3", num_layers=6, hidden_size=64)
    with pytest.raises(ValueError, match="does not allow: the model has sliding-window layers"):
        cfg.make_cache(gemma)                  # refused when the configuration is built, not later


def test_the_decode_benchmark_times_it_beside_codes(llama):
    from turboquant.bench import generation_tokens_per_second
    caches = {"codes": tq.make_prompt_cache(llama, bits=4.25),
              "before RoPE": pre_rope(llama, tq.make_prompt_cache(llama, bits=4.25, turned_mean=False))}
    out = generation_tokens_per_second(llama, caches, toks(64, seed=2)[0], new_tokens=2, chunk=32)
    assert set(out) == {"codes", "before RoPE"} and all(r["tokens_per_s"] > 0 for r in out.values())
    assert caches["before RoPE"][0].offset == 64 + 2 == caches["codes"][0].offset


def test_the_benchmark_adds_the_turned_mean_rows(monkeypatch, llama):
    """``bench generate --turned-mean`` times centred keys after RoPE and the turned mean beside
    the plain codes (a tiny model stands in for the named one)."""
    from turboquant import bench, models
    from turboquant.data import load_text
    monkeypatch.setattr(models, "load", lambda name: (llama, types.SimpleNamespace(
        encode=lambda text, **kw: [int(c) % 250 + 1 for c in text.encode()[:4000]])))
    monkeypatch.setattr(bench, "memory_bandwidth", lambda: 1.0)
    out = bench.generation_run("tiny", context=64, new_tokens=2, turned_mean=True)
    assert out["turned_mean"] and len(out["runs"]) == 4
    assert any("turned to each position" in name for name in out["runs"])
    assert all(r["tokens_per_s"] > 0 for r in out["runs"].values())


def test_centering_residual_has_the_known_answers():
    """Keys that are one vector before RoPE plus small noise: before RoPE the mean leaves only
    the noise (its share known); after RoPE it leaves most of the turning vector. Keys with no
    common part: both ways leave about everything."""
    from turboquant.prerope import centering_residual
    D, T = 64, 512
    rope = Rope(D, False, 10000.0, 1.0)
    bias = mx.random.normal((1, 1, 1, D), key=mx.random.key(5))
    noise = 0.1 * mx.random.normal((1, 1, T, D), key=mx.random.key(6))
    after, before = centering_residual(rope.apply(bias + noise, 0), rope)
    share = (mx.sum(noise[:, :, 17:] ** 2) / mx.sum((bias + noise)[:, :, 17:] ** 2)).item()
    assert before == pytest.approx(share, rel=0.2) and after > 0.3 > 20 * before
    a, b = centering_residual(rope.apply(noise, 0), rope)
    assert 0.9 < a < 1.2 and 0.9 < b < 1.2
    with pytest.raises(ValueError, match="shape"):
        centering_residual(mx.zeros((2, 1, 8, D)), rope)
    with pytest.raises(ValueError, match="fit"):
        centering_residual(mx.zeros((1, 1, 17, D)), rope, fit_tokens=16)


def test_trim_copy_and_mlx_lm_generation_continue_exactly(llama):
    """Trimming then continuing, a deep copy continuing, and mlx-lm's own generation loop all
    see the positions they should (exact codecs: the fp32 model's outputs)."""
    import copy
    from mlx_lm.generate import generate_step
    x = toks(60, seed=3)
    ref = run_in_chunks(llama, x, mlx_cache.make_prompt_cache(llama), [60])
    exact = lambda: pre_rope(llama, tq.make_prompt_cache(llama, key_codec=Identity(32), value_codec=Identity(32)))
    cache = exact()
    run_in_chunks(llama, x, cache, [50])
    assert all(c.is_trimmable() for c in cache) and cache[0].trim(10) == 10 and cache[0].offset == 40
    for c in cache[1:]:
        c.trim(10)
    again = run_in_chunks(llama, x[:, 40:], cache, [10, 1, 9])
    assert mx.max(mx.abs(again - ref[:, 40:])).item() < 1e-4
    twin = copy.deepcopy(cache)
    a = run_in_chunks(llama, x[:, :5], cache, [5])
    b = run_in_chunks(llama, x[:, :5], twin, [5])
    assert mx.array_equal(a, b) and twin[0].offset == cache[0].offset == 65
    prompt = x[0, :20]
    steps = lambda c: [int(t) for t, _ in zip((tok for tok, _ in generate_step(prompt, llama, prompt_cache=c)),
                                              range(6))]
    assert steps(exact()) == steps(mlx_cache.make_prompt_cache(llama))


def test_bad_input_is_named(llama):
    rope = rope_of(llama)[0]
    with pytest.raises(ValueError, match="more than the key codec's head size"):
        PreRopeCache(tq.TurboQuantKVCache(Identity(16)), rope)
    cache = PreRopeCache(tq.TurboQuantKVCache(Identity(32)), rope)
    for bad in ([[1.0]], mx.ones((2, 3, 32)), mx.ones((1, 2, 3, 16))):
        with pytest.raises(ValueError, match="keys must be an mx.array of shape"):
            cache.update_and_fetch(bad, mx.ones((1, 2, 3, 32)))
    fake = types.SimpleNamespace(layers=[types.SimpleNamespace()])
    with pytest.raises(ValueError, match="no self_attn.rope"):
        rope_of(fake)


# ---------------------------------------------------------------- the key mean turned with the position
def exact_turned(llama, sinks=1):
    from turboquant.codecs import Centered
    return tq.turned_mean(llama, tq.make_prompt_cache(llama, key_codec=lambda d: Centered(Identity(d)),
                                                      value_codec=Identity(32), sink_tokens=sinks))


@pytest.mark.parametrize("chunks", [[50, 20, 1, 1, 8], [5, 5, 5, 5, 60], [80]])
def test_turned_mean_with_exact_codecs_is_the_fp32_model(llama, chunks):
    """Exact codecs: the wrapper changes nothing but rounding, whether the mean is learned
    inside one update or across several (the first 17 tokens arrive in 1, 2 or 4 chunks), with
    decoded keys or from codes (q·R_t μ added to each score)."""
    x = toks(80)
    ref = run_in_chunks(llama, x, mlx_cache.make_prompt_cache(llama), chunks)
    out = run_in_chunks(llama, x, exact_turned(llama), chunks)
    with tq.codes_attention(llama):
        codes = run_in_chunks(llama, x, exact_turned(llama), chunks)
    assert mx.max(mx.abs(out - ref)).item() < 1e-4 and mx.max(mx.abs(codes - ref)).item() < 1e-4


def test_turned_mean_codes_are_read_without_decoding(llama):
    """TurboQuant codes: attention from codes (scores from the query table plus the turned
    mean's bias) gives what decoding gives; feeding the prompt in one piece or in chunks codes
    the same cache; the inner cache codes residuals with the plain codec, keeps S + F tokens
    exact and counts the mean in its bytes."""
    from turboquant.prerope import TurnedCodesView, TurnedMeanCache
    x = toks(80, seed=4)
    k, v = codecs_for(4, 4, True)
    make = lambda: tq.turned_mean(llama, tq.make_prompt_cache(llama, key_codec=k, value_codec=v, sink_tokens=1))
    dec = run_in_chunks(llama, x, make(), [50, 20, 1, 1, 8])
    one = run_in_chunks(llama, x, make(), [80])
    with tq.codes_attention(llama):
        cache = make()
        codes = run_in_chunks(llama, x, cache, [50, 20, 1, 1, 8])
    assert mx.max(mx.abs(dec - codes)).item() < 1e-4 and mx.max(mx.abs(dec - one)).item() < 1e-4
    c = cache[0]
    assert isinstance(c, TurnedMeanCache) and c.key_codec.config()["codec"] == "turboquant_mse"
    assert c.inner.sink_tokens == 17 and c.offset == 80 and c.mean.shape == (2, 32)
    assert c.nbytes == c.inner.nbytes and c.side_nbytes == 2 * 32 * 4     # the mean: side information
    assert c.code_nbytes() == c.inner.code_nbytes() > 0 and c.exact_nbytes == c.inner.exact_nbytes
    with returning_codes():
        kv, _ = c.update_and_fetch(mx.ones((1, 2, 1, 32)), mx.ones((1, 2, 1, 32)))
    assert isinstance(kv, TurnedCodesView)
    decoded = kv.dequantize()
    assert decoded.shape == (1, 2, 81, 32)
    assert mx.max(mx.abs(decoded[..., 80:, :] - 1)).item() < 0.5      # R_t μ added back: about the key given


def test_turned_mean_removes_a_bias_before_rope_like_coding_before_rope():
    """The known answer of the pre-RoPE test: keys that are one vector plus small noise before
    RoPE. The turned mean removes the vector exactly, as coding before RoPE does (both leave the
    codec the same energy, ‖k − μ‖ = ‖R_t k − R_t μ‖); a mean learned after RoPE does not."""
    from turboquant.prerope import TurnedMeanCache
    D, T = 64, 256
    rope = Rope(D, False, 10000.0, 1.0)
    pre = 4 * mx.random.normal((1, 1, 1, D), key=mx.random.key(2)) + 0.1 * mx.random.normal((1, 1, T, D),
                                                                                            key=mx.random.key(3))
    keys, values = rope.apply(pre, 0), mx.random.normal((1, 1, T, D), key=mx.random.key(4))

    def err(cache):
        k, _ = cache.update_and_fetch(keys, values)
        return (mx.sum((k - keys) ** 2) / mx.sum((keys - mx.mean(keys, axis=2, keepdims=True)) ** 2)).item()

    k, v = codecs_for(3, 3, True)
    make = lambda: tq.TurboQuantKVCache(k(D), v(D))
    after, before, turned = err(make()), err(PreRopeCache(make(), rope)), err(TurnedMeanCache(make(), rope))
    assert turned < after / 20 and 0.5 < turned / before < 2, (after, before, turned)


def test_turned_mean_trims_copies_and_runs_in_mlx_lm(llama):
    """A trim past the learned mean keeps it; a trim back into the tokens it was learned on
    forgets it and learns it again from what remains (then continuing is the fp32 model's
    output); a deep copy continues alike; mlx-lm's generation loop works."""
    import copy
    from mlx_lm.generate import generate_step
    x = toks(60, seed=3)
    ref = run_in_chunks(llama, x, mlx_cache.make_prompt_cache(llama), [60])
    for keep in (40, 10, 0):
        cache = exact_turned(llama)
        run_in_chunks(llama, x, cache, [50])
        assert all(c.trim(50 - keep) == 50 - keep for c in cache) and cache[0].offset == keep
        assert (cache[0].mean is None) == (keep < 17)
        again = run_in_chunks(llama, x[:, keep:], cache, [3, 1, 60 - keep - 4])
        assert mx.max(mx.abs(again - ref[:, keep:])).item() < 1e-4, keep
    twin = copy.deepcopy(cache)
    a, b = (run_in_chunks(llama, x[:, :5], c, [5]) for c in (cache, twin))
    assert mx.array_equal(a, b) and twin[0].offset == cache[0].offset == 65
    k, v = codecs_for(4, 4, True)
    cache = tq.turned_mean(llama, tq.make_prompt_cache(llama, key_codec=k, value_codec=v, sink_tokens=1))
    run_in_chunks(llama, x[:, :10], cache, [10])
    assert cache[0].trim(4) == 4 and cache[0].offset == 6 and cache[0].mean is None  # still learning
    prompt = x[0, :20]
    steps = lambda c: [int(t) for t, _ in zip((tok for tok, _ in generate_step(prompt, llama, prompt_cache=c)),
                                              range(6))]
    assert steps(exact_turned(llama)) == steps(mlx_cache.make_prompt_cache(llama))


def test_turned_mean_refusals(llama):
    from turboquant.codecs import Centered, OutlierSplit
    from turboquant.prerope import TurnedMeanCache, turned_mean
    rope = rope_of(llama)[0]
    k, v = codecs_for(4, 4, True)
    with pytest.raises(TypeError, match="sliding-window"):
        TurnedMeanCache(tq.TurboQuantRotatingKVCache(16, k(32)), rope)
    with pytest.raises(ValueError, match="unfitted Centered codec, got turboquant_mse"):
        TurnedMeanCache(tq.TurboQuantKVCache(v(32)), rope)
    with pytest.raises(ValueError, match="learns only the key mean"):
        TurnedMeanCache(tq.TurboQuantKVCache(k(32), OutlierSplit(32, n_outliers=8, outlier_bits=4, bits=2)), rope)
    with pytest.raises(ValueError, match="learns only the key mean"):
        TurnedMeanCache(tq.TurboQuantKVCache(k(32), Centered(v(32))), rope)
    used = tq.TurboQuantKVCache(k(32), v(32))
    used.update_and_fetch(mx.ones((1, 2, 20, 32)), mx.ones((1, 2, 20, 32)))
    with pytest.raises(ValueError, match="empty"):
        TurnedMeanCache(used, rope)
    with pytest.raises(ValueError, match="layers"):
        turned_mean(llama, tq.make_prompt_cache(llama, key_codec=k, value_codec=v)[:1])
    cache = TurnedMeanCache(tq.TurboQuantKVCache(k(32), v(32)), rope)
    for bad in ([[1.0]], mx.ones((2, 3, 32)), mx.ones((1, 2, 3, 16))):
        with pytest.raises(ValueError, match="keys must be an mx.array of shape"):
            cache.update_and_fetch(bad, mx.ones((1, 2, 3, 32)))
    with pytest.raises(ValueError, match="disagree"):
        cache.update_and_fetch(mx.ones((1, 2, 3, 32)), mx.ones((1, 2, 4, 32)))
    cache.update_and_fetch(mx.ones((1, 2, 3, 32)), mx.ones((1, 2, 3, 32)))
    with pytest.raises(ValueError, match="batch × kv heads"):
        cache.update_and_fetch(mx.ones((2, 2, 3, 32)), mx.ones((2, 2, 3, 32)))
    with pytest.raises(ValueError, match="every layer of this cache is a sliding-window"):
        turned_mean(llama, tq.make_prompt_cache(llama, key_codec=k, value_codec=v, max_kv_size=64))
    with pytest.raises(ValueError, match="give bits="):
        tq.make_prompt_cache(llama, turned_mean=True)
    with pytest.raises(ValueError, match="leave profile out"):
        tq.make_prompt_cache(llama, bits=4.25, profile=True, turned_mean=True)
    with pytest.raises(TypeError, match="turned_mean must be None"):
        tq.make_prompt_cache(llama, bits=4.25, turned_mean=1)


def test_a_failure_while_the_mean_is_handed_over_leaves_the_cache_usable(llama):
    """A layer that fails as it learns its mean (here on NaN keys) raises its own error and
    changes nothing: no other layer moved, so the prompt cache is not marked unusable."""
    cache = tq.make_prompt_cache(llama, bits=4.25, turned_mean=True)
    x = toks(30, seed=6)
    run_in_chunks(llama, x[:, :10], cache, [10])
    nan = mx.full((1, 2, 10, 32), float("nan"))
    with pytest.raises(ValueError, match="NaN or Inf"):
        cache[0].update_and_fetch(nan, nan)
    assert cache[0].mean is None and cache[0].offset == 10
    ref = run_in_chunks(llama, x, mlx_cache.make_prompt_cache(llama), [30])[:, 10:]
    got = run_in_chunks(llama, x[:, 10:], cache, [20])
    assert cache[0].mean is not None and mx.max(mx.abs(got - ref)).item() < 1.0


def test_turned_mean_wraps_the_global_layers_of_a_sliding_window_model():
    """Gemma 3: the global layers are wrapped, the sliding-window ones kept (their mean learned
    after RoPE); the layers-in-step check still covers the whole list."""
    gemma = tiny_model("gemma3", num_layers=6, hidden_size=64)
    cache = CONFIGS["turned-mean budget K4/V4"].make_cache(gemma)()
    kinds = [type(c).__name__ for c in cache]
    assert kinds == ["TurboQuantRotatingKVCache"] * 5 + ["TurnedMeanCache"], kinds
    x = toks(40, seed=4)
    run_in_chunks(gemma, x, cache, [5, 30])
    assert all(c.offset == 35 for c in cache) and cache[5].mean is not None
    from turboquant.attention import codes_attention
    with codes_attention(gemma):                                   # from codes: the wrapped layer adds q·R_t μ
        run_in_chunks(gemma, x[:, 35:], cache, [5])
    with pytest.raises(ValueError, match=r"layer 5 was given tokens while layer\(s\) 0..4 were not"):
        cache[5].update_and_fetch(mx.ones((1, 2, 2, 16)), mx.ones((1, 2, 2, 16)))
    with pytest.raises(ValueError, match="unusable"):        # the whole list says so from then on
        run_in_chunks(gemma, x[:, :1], cache, [1])


def test_turned_mean_suite_rows(llama):
    from turboquant.prerope import TurnedMeanCache
    cfg, plain = CONFIGS["turned-mean budget K3/V3"], CONFIGS["budget K3/V3"]
    assert cfg.turned_mean and not cfg.pre_rope and cfg.fidelity_codecs() is None
    assert cfg.bits(64) == plain.bits(64) and cfg.sink_tokens == plain.sink_tokens
    assert cfg.family == "budget, key mean before RoPE (lever)" and cfg.seeded(1, 32).turned_mean
    cache = cfg.make_cache(llama)()
    assert all(isinstance(c, TurnedMeanCache) for c in cache)
    assert cache[0].key_codec.config() == plain.make_cache(llama)()[0].key_codec.config()["inner"]


def test_turned_mean_learns_the_mean_before_rope_after_the_sinks():
    """μ is the per-head mean of the keys with RoPE undone at positions S … S + F − 1 (here
    S = 2 sinks, F = 16), over the batch too, however the prompt arrives."""
    from turboquant.prerope import TurnedMeanCache
    D, rope = 32, Rope(32, False, 10000.0, 1.0)
    keys = mx.random.normal((2, 3, 40, D), key=mx.random.key(7))
    k, v = codecs_for(4, 4, True)
    want = mx.mean(rope.apply(keys, 0, inverse=True)[..., 2:18, :], axis=(0, 2))
    for chunks in ([40], [1, 1, 15, 23], [18, 22]):
        cache, pos = TurnedMeanCache(tq.TurboQuantKVCache(k(D), v(D), sink_tokens=2), rope), 0
        for c in chunks:
            cache.update_and_fetch(keys[..., pos:pos + c, :], keys[..., pos:pos + c, :])
            pos += c
        assert cache.mean.shape == (3, D) and mx.max(mx.abs(cache.mean - want)).item() < 1e-5, chunks


def test_turned_mean_keeps_bfloat16_keys_exact(llama):
    """The residuals stay float32, so with exact codecs a bfloat16 model's outputs are exactly
    those of mlx-lm's cache when keys are decoded (a residual rounded to bfloat16, and rounded
    again after R_t μ is added back, would not be); from codes (attention in float32) they are
    those of the plain centred cache."""
    import copy
    from turboquant.codecs import Centered
    half = copy.deepcopy(llama)
    half.set_dtype(mx.bfloat16)
    x = toks(40, seed=5)
    ref = run_in_chunks(half, x, mlx_cache.make_prompt_cache(half), [20, 1, 19])
    out = run_in_chunks(half, x, exact_turned(half), [20, 1, 19])
    assert out.dtype == mx.bfloat16 and mx.array_equal(out, ref)
    plain = tq.make_prompt_cache(half, key_codec=lambda d: Centered(Identity(d)), value_codec=Identity(32),
                                 sink_tokens=1)
    with tq.codes_attention(half):
        codes = run_in_chunks(half, x, exact_turned(half), [20, 1, 19])
        centred = run_in_chunks(half, x, plain, [20, 1, 19])
    assert mx.max(mx.abs(codes.astype(mx.float32) - centred.astype(mx.float32))).item() < 1e-2


def test_turned_mean_layers_out_of_step_are_refused(llama):
    """While the mean is learned the inner caches see nothing; the wrappers check that the
    model's layers take tokens in step (a slice of the cache list passed to the model) and mark
    the prompt cache unusable, as the plain caches do."""
    k, v = codecs_for(4, 4, True)
    cache = tq.turned_mean(llama, tq.make_prompt_cache(llama, key_codec=k, value_codec=v, sink_tokens=1))
    x = toks(20, seed=6)
    run_in_chunks(llama, x[:, :10], cache[:1], [10])
    with pytest.raises(ValueError, match="unusable"):
        run_in_chunks(llama, x[:, 10:15], cache, [5])
    with pytest.raises(ValueError, match="unusable"):
        run_in_chunks(llama, x[:, 10:15], cache, [5])
    import copy
    twin = copy.deepcopy(tq.turned_mean(llama, tq.make_prompt_cache(llama, key_codec=k, value_codec=v)))
    run_in_chunks(llama, x[:, :10], twin[:1], [10])              # a copied list checks its own layers
    with pytest.raises(ValueError, match="unusable"):
        run_in_chunks(llama, x[:, 10:15], twin, [5])


@pytest.mark.parametrize("traditional,dims", [(False, 32), (True, 32), (False, 16)])
def test_score_bias_is_the_query_times_the_turned_mean(traditional, dims):
    """The cosine-and-sine form of q·R_t μ equals scoring the turned means themselves (RoPE on
    μ repeated at every position), for both pair layouts and a RoPE narrower than the head."""
    from turboquant.codes import CodeBuffer, CodesView
    from turboquant.prerope import TurnedCodesView, angle_table
    D, T, rope = 32, 50, Rope(dims, traditional, 10000.0, 1.0)
    mean = mx.random.normal((2, D), key=mx.random.key(8))
    buf = CodeBuffer({"x": mx.zeros((1, 2, T, 1))})
    view = TurnedCodesView(CodesView(Identity(D), buf, mx.float32), mean, rope)
    qf = mx.random.normal((1, 2, 3, 4, D), key=mx.random.key(9))
    direct = qf @ mx.swapaxes(view.turned_mean(), -1, -2)[:, :, None]
    assert mx.max(mx.abs(view.score_bias(qf) - direct)).item() < 1e-4
    assert angle_table(rope, T).shape == (T, dims)


def test_make_prompt_cache_pre_rope_is_the_one_place_keys_go_before_rope(llama, monkeypatch):
    """``make_prompt_cache(pre_rope=True)`` gives what wrapping by hand gives, bit for bit; the
    calibration search's candidates, the suite's lever and its calibrated fits before RoPE
    build their caches through it (each call seen here), and a model that does not allow it
    is refused with a ValueError before any cache is built."""
    from turboquant import calibration, prompt_cache, suite
    from turboquant.calibration.fitting import Choice
    from turboquant.calibration.search import candidate_caches
    from turboquant.prerope import TurnedMeanCache
    x = toks(40)
    made = tq.make_prompt_cache(llama, bits=4.25, pre_rope=True)
    by_hand = pre_rope(llama, tq.make_prompt_cache(llama, bits=4.25, turned_mean=False))
    assert all(isinstance(c, PreRopeCache) for c in made)
    assert mx.array_equal(run_in_chunks(llama, x, made, [30, 1]), run_in_chunks(llama, x, by_hand, [30, 1])).item()
    seen, real = [], prompt_cache.make_prompt_cache
    spy = lambda *a, **kw: seen.append(kw.get("pre_rope", False)) or real(*a, **kw)
    monkeypatch.setattr(suite, "make_prompt_cache", spy)
    monkeypatch.setattr(prompt_cache, "make_prompt_cache", spy)
    keys, values = codecs_for(4, 4, center_keys=True)
    for make in (candidate_caches(llama, keys, values, Choice(4.25, 4.25, pre_rope=True)),
                 CONFIGS["pre-RoPE budget K4/V4"].make_cache(llama)):
        seen.clear()
        assert all(isinstance(c, PreRopeCache) for c in make()) and seen == [True]
    monkeypatch.setattr(calibration, "fit_layers", lambda stats, **fit: ([keys] * 2, [values] * 2))
    fitted = CONFIGS["calibrated 4.25, keys before RoPE"]
    assert fitted.fit.get("pre_rope")
    assert all(isinstance(c, PreRopeCache) for c in fitted.make_cache(llama, stats={})())
    assert all(isinstance(c, TurnedMeanCache) for c in CONFIGS["turned-mean budget K4/V4"].make_cache(llama)())
    with pytest.raises(TypeError, match="pre_rope must be True or False, got 'yes'"):
        real(llama, bits=4.25, pre_rope="yes")
    with pytest.raises(ValueError, match="choose one"):
        real(llama, bits=4.25, pre_rope=True, turned_mean=True)
    with pytest.raises(ValueError, match="leave pre_rope out"):
        real(llama, bits=4.25, pre_rope=True, profile={"budgets": []})
    with pytest.raises(ValueError, match="pre_rope=True codes keys before RoPE, which this cache cannot hold: max_kv_size"):
        real(llama, bits=4.25, pre_rope=True, max_kv_size=64)
    gemma = tiny_model("gemma3", num_layers=6, hidden_size=64)
    with pytest.raises(ValueError, match="does not allow: the model has sliding-window layers"):
        real(gemma, bits=4.25, pre_rope=True)


def test_the_turned_mean_is_the_default_of_a_budget_where_the_model_allows_it(llama):
    """``make_prompt_cache(model, bits=b)`` turns the key mean (``turned_mean=None``): bit for bit
    the cache of ``turned_mean=True``; ``False`` keeps the centred rule. Where the model does not
    allow it (a RoPE that is not ``nn.RoPE``, ``max_kv_size``, a profile, keys before RoPE) the
    default is the centred rule and ``True`` is refused with the reason, before any cache is
    built. Wrapping the default again by hand gives it back (turned_mean) or names the fix
    (pre_rope)."""
    from turboquant.prerope import TurnedMeanCache, turned_mean
    x = toks(40, seed=9)
    default, asked = tq.make_prompt_cache(llama, bits=3.25), tq.make_prompt_cache(llama, bits=3.25, turned_mean=True)
    centred = tq.make_prompt_cache(llama, bits=3.25, turned_mean=False)
    assert all(isinstance(c, TurnedMeanCache) for c in default)
    assert all(type(c) is tq.TurboQuantKVCache for c in centred)
    a, b = run_in_chunks(llama, x, default, [30, 1, 9]), run_in_chunks(llama, x, asked, [30, 1, 9])
    assert mx.array_equal(a, b).item()
    assert not mx.array_equal(a, run_in_chunks(llama, x, centred, [30, 1, 9])).item()
    fresh = tq.make_prompt_cache(llama, bits=4.25)
    assert turned_mean(llama, fresh) is fresh
    with pytest.raises(TypeError, match="already a TurnedMeanCache.*turned_mean=False"):
        pre_rope(llama, tq.make_prompt_cache(llama, bits=4.25))
    ring = tq.make_prompt_cache(llama, bits=4.25, max_kv_size=64, warn_rotating=False)
    assert all(type(c) is tq.TurboQuantRotatingKVCache for c in ring)
    with pytest.raises(ValueError, match="turned_mean=True needs RoPE positions in order.*max_kv_size"):
        tq.make_prompt_cache(llama, bits=4.25, max_kv_size=64, turned_mean=True)
    assert all(isinstance(c, PreRopeCache) for c in tq.make_prompt_cache(llama, bits=4.25, pre_rope=True))

    class OtherRope(nn.RoPE):                  # a RoPE variant the wrappers do not know
        pass
    other = tiny_model("llama", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2)
    other.layers[1].self_attn.rope = OtherRope(32)
    assert all(type(c) is tq.TurboQuantKVCache for c in tq.make_prompt_cache(other, bits=4.25))
    with pytest.raises(ValueError, match="turned_mean=True needs RoPE.*layer 1's attention has RoPE OtherRope"):
        tq.make_prompt_cache(other, bits=4.25, turned_mean=True)
    gemma = tiny_model("gemma3", num_layers=6, hidden_size=64)
    kinds = [type(c).__name__ for c in tq.make_prompt_cache(gemma, bits=4.25, warn_rotating=False)]
    assert kinds == ["TurboQuantRotatingKVCache"] * 5 + ["TurnedMeanCache"], kinds
    assert [type(c).__name__ for c in tq.make_prompt_cache(tiny_model("gemma3", num_layers=3, hidden_size=64),
                                                           bits=4.25, warn_rotating=False)] == ["TurboQuantRotatingKVCache"] * 3


def test_to_turboquant_converts_to_the_default_where_the_model_allows_it(llama):
    """A filled mlx-lm cache converted with ``bits`` and ``model`` is what the default cache
    holds after taking the same keys and values in one update: the turned mean, bit for bit;
    sliding-window layers keep their ring; the centred rule without the model or when asked."""
    t = toks(30)
    ref = [mlx_cache.KVCache() for _ in llama.layers]
    run_in_chunks(llama, t, ref, [30])
    conv = tq.to_turboquant(ref, bits=4.25, model=llama)
    direct = tq.make_prompt_cache(llama, bits=4.25)                   # the default, fed the same tokens
    for c, r in zip(direct, ref):
        c.update_and_fetch(r.state[0][..., :30, :], r.state[1][..., :30, :])
    assert all(isinstance(c, TurnedMeanCache) for c in conv) and [c.offset for c in conv] == [30, 30]
    for a, b in zip(conv, direct):
        assert mx.array_equal(a.mean, b.mean).item()
        for ca, cb in zip(a.codes(), b.codes()):                    # key and value codes
            fa, fb = ca.buffer.fields, cb.buffer.fields
            assert fa.keys() == fb.keys() and all(mx.array_equal(fa[n], fb[n]).item() for n in fb)
        assert mx.array_equal(a.inner.sink_keys, b.inner.sink_keys).item()
        assert mx.array_equal(a.inner.sink_values, b.inner.sink_values).item()
    recent = tq.to_turboquant(ref, bits=4.25, model=llama, fp_window=3)
    assert all(isinstance(c, TurnedMeanCache) and c.inner.fp_window == 3 for c in recent)
    assert mx.array_equal(recent[0].inner.recent_values, ref[0].state[1][..., 27:30, :]).item()
    nxt = toks(1, seed=3)
    exact = llama(nxt, cache=ref)
    from turboquant.attention import cosine_similarity
    assert cosine_similarity(llama(nxt, cache=conv), exact).min().item() > 0.99
    assert all(type(c) is tq.TurboQuantKVCache for c in tq.to_turboquant(ref, bits=4.25))   # no model: no RoPE
    assert all(type(c) is tq.TurboQuantKVCache
               for c in tq.to_turboquant(ref, bits=4.25, model=llama, turned_mean=False))
    with pytest.raises(ValueError, match="turned_mean=True .*give model= "):
        tq.to_turboquant(ref, bits=4.25, turned_mean=True)
    wide = [mlx_cache.KVCache() for _ in llama.layers]              # another model's head size
    for c in wide:
        c.update_and_fetch(mx.ones((1, 2, 20, 64)), mx.ones((1, 2, 20, 64)))
    with pytest.raises(ValueError, match="head size 64, the model's are 32"):
        tq.to_turboquant(wide, bits=4.25, model=llama)
    ring = [mlx_cache.RotatingKVCache(max_size=64, keep=4) for _ in llama.layers]
    run_in_chunks(llama, t, ring, [30])
    with pytest.warns(UserWarning, match="2 rotating"):
        assert all(type(c) is tq.TurboQuantRotatingKVCache for c in tq.to_turboquant(ring, bits=4.25, model=llama))
    with pytest.raises(ValueError, match="turned_mean=True turns .*no plain layer of this cache holds tokens"):
        tq.to_turboquant(ring, bits=4.25, model=llama, turned_mean=True)
    uneven = [ref[0], copy.deepcopy(ref[1])]
    uneven[1].trim(5)                                               # layers holding 31 and 26 tokens
    assert [c.offset for c in tq.to_turboquant(uneven, bits=4.25, model=llama)] == [31, 26]
    with pytest.raises(TypeError, match="turned_mean must be None.*'yes'"):
        tq.to_turboquant(ref, bits=4.25, model=llama, turned_mean="yes")
    gemma = tiny_model("gemma3", num_layers=6, hidden_size=64)
    filled = mlx_cache.make_prompt_cache(gemma)
    run_in_chunks(gemma, toks(40), filled, [40])
    with pytest.warns(UserWarning, match="5 rotating"):
        conv = tq.to_turboquant(filled, bits=4.25, model=gemma)
    assert [type(c).__name__ for c in conv] == ["TurboQuantRotatingKVCache"] * 5 + ["TurnedMeanCache"]
    with pytest.warns(UserWarning, match="5 rotating"):                 # 8 bits: D = 16 is coarse at 4
        fine = tq.to_turboquant(filled, bits=8.25, model=gemma)
    assert cosine_similarity(gemma(nxt, cache=fine), gemma(nxt, cache=filled)).min().item() > 0.99
    plain = [mlx_cache.KVCache() for _ in gemma.layers]               # the local layers as plain caches
    run_in_chunks(gemma, toks(40), plain, [40])
    kinds = [type(c).__name__ for c in tq.to_turboquant(plain, bits=4.25, model=gemma)]
    assert kinds == ["TurboQuantKVCache"] * 5 + ["TurnedMeanCache"], kinds
    local = tiny_model("gemma3", num_layers=3, hidden_size=64)      # every layer a sliding window
    filled = mlx_cache.make_prompt_cache(local)
    g = geometry_from_model(local)
    for i, c in enumerate(filled):                                  # (three layers: the model itself cannot run)
        x = mx.random.normal((1, g.n_kv_heads, 40, g.head_dim), key=mx.random.key(i))
        c.update_and_fetch(x, x)
    with pytest.warns(UserWarning, match="3 rotating"):
        conv = tq.to_turboquant(filled, bits=4.25, model=local)
    assert all(type(c) is tq.TurboQuantRotatingKVCache for c in conv)
    with pytest.raises(ValueError, match="turned_mean=True needs RoPE positions in order.*every layer"):
        tq.to_turboquant(filled, bits=4.25, model=local, turned_mean=True)
