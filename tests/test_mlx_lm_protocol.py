"""mlx-lm's own prompt-cache tests, adapted to TurboQuant caches (issue #13.17).

Adapted from ml-explore/mlx-lm ``tests/test_prompt_cache.py`` (Apple, MIT licence): the same
scenarios — save/load, rotating save/load then further updates, generation through a cache
split across calls, trimming counts, trim-then-generate, deep copies — run on our caches
with an exact codec (``Identity``) in place of ``KVCache``/``RotatingKVCache``, on a random
tiny llama instead of a hub model (no network). Where our protocol differs on purpose it is
tested as such: ``state`` is a tree of code fields plus the meta-state JSON, not
(keys, values), so the equivalent check compares every field; files are read by
``turboquant.load_prompt_cache``.
"""
import copy

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache, trim_prompt_cache

import turboquant as tq
from turboquant.models import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)


def exact(d=4):
    return tq.Identity(d)


def same_state(a, b):
    for x, y in zip(a.state[:3], b.state[:3]):
        assert sorted(x) == sorted(y)
        assert all(mx.array_equal(x[n], y[n]).item() for n in x)


def step_agrees(ours, ref, x, window):
    """One update of both rings: the same keys back, the same offset, the same masks."""
    k, _ = ours.update_and_fetch(x, x)
    rk, _ = ref.update_and_fetch(x, x)
    assert mx.array_equal(k, rk).item() and ours.offset == ref.offset
    for n in (1, 3):
        a, b = ours.make_mask(n, window_size=window), ref.make_mask(n, window_size=window)
        assert (a is None and b is None) or (isinstance(a, str) and a == b) or mx.array_equal(a, b).item()


def test_save_load(tmp_path):
    cache = [tq.TurboQuantKVCache(exact()) for _ in range(4)]
    for c in cache:
        x = mx.random.uniform(shape=(1, 8, 10, 4))
        c.update_and_fetch(x, x)
    tq.save_prompt_cache(tmp_path / "p.safetensors", cache, {"a": "b", "c": "d"})
    loaded, meta = tq.load_prompt_cache(tmp_path / "p.safetensors", return_metadata=True)
    assert len(loaded) == len(cache) and meta == {"a": "b", "c": "d"}
    for c, lc in zip(cache, loaded):
        assert c.offset == lc.offset
        same_state(c, lc)


def test_save_load_rotating_cache(tmp_path):
    path = tmp_path / "p.safetensors"
    cache = [tq.TurboQuantRotatingKVCache(8, exact(), keep=2) for _ in range(4)]
    for c in cache:
        x = mx.random.uniform(shape=(1, 8, 10, 4))
        c.update_and_fetch(x, x)
    tq.save_prompt_cache(path, cache)
    loaded = tq.load_prompt_cache(path)
    assert len(loaded) == len(cache)
    for c, lc in zip(cache, loaded):
        assert (c.offset, c.keep, c.max_size, c.step) == (lc.offset, lc.keep, lc.max_size, lc.step)
        same_state(c, lc)
    for _ in range(2):                                   # single-token updates: a rotation
        for c in cache:
            x = mx.random.uniform(shape=(1, 8, 1, 4))
            c.update_and_fetch(x, x)
    tq.save_prompt_cache(path, cache)
    loaded = tq.load_prompt_cache(path)
    for c, lc in zip(cache, loaded):
        x = mx.random.uniform(shape=(1, 8, 1, 4))
        k, v = c.update_and_fetch(x, x)
        lk, lv = lc.update_and_fetch(x, x)
        assert c.offset == lc.offset and mx.array_equal(k, lk).item() and mx.array_equal(v, lv).item()


def test_cache_with_generate(model):
    prompt = mx.array([5, 17, 99, 3, 42, 8])
    toks, all_logits = zip(*list(generate_step(prompt, model, max_tokens=4)))
    cache = tq.make_prompt_cache(model, key_codec=lambda d: tq.Identity(d))
    i = 0
    for tok, logits in generate_step(prompt, model, prompt_cache=cache, max_tokens=2):
        assert tok == toks[i] and mx.allclose(logits, all_logits[i], atol=1e-5).item()
        i += 1
    for tok, logits in generate_step(mx.array([toks[i]]), model, prompt_cache=cache, max_tokens=1):
        i += 1
        assert tok == toks[i] and mx.allclose(logits, all_logits[i], atol=1e-5).item()


def test_trim_cache():
    cache = [tq.TurboQuantKVCache(exact()) for _ in range(2)]
    for c in cache:
        x = mx.random.uniform(shape=(1, 8, 10, 4))
        c.update_and_fetch(x, x)
    assert trim_prompt_cache(cache, 7) == 7
    assert trim_prompt_cache(cache, 4) == 3                # more than remain
    cache = [tq.TurboQuantKVCache(exact()), tq.TurboQuantKVCache(exact(), fp_window=2)]
    for c in cache:
        x = mx.random.uniform(shape=(1, 8, 10, 4))
        c.update_and_fetch(x, x)
    assert trim_prompt_cache(cache, 1) == 0                # all caches have to be trimmable
    cache = [tq.TurboQuantRotatingKVCache(6, exact()) for _ in range(2)]
    for c in cache:
        x = mx.random.uniform(shape=(1, 8, 5, 4))
        c.update_and_fetch(x, x)
    assert trim_prompt_cache(cache, 4) == 4
    for c in cache:                                       # past max_size: no longer trimmable
        x = mx.random.uniform(shape=(1, 8, 10, 4))
        c.update_and_fetch(x, x)
    assert trim_prompt_cache(cache, 4) == 0


def test_trim_cache_with_generate(model):
    prompt = mx.array([5, 17, 99, 3, 42, 8])
    cache = tq.make_prompt_cache(model, key_codec=lambda d: tq.TurboQuantMSE(d, 3))
    last, _ = next(generate_step(prompt, model, prompt_cache=cache))
    last = mx.array([last])
    toks, logits = zip(*(r for _, r in zip(range(2), generate_step(last, model, prompt_cache=cache))))
    trim_prompt_cache(cache, 3)                           # back to just after the prompt
    toks2, logits2 = zip(*(r for _, r in zip(range(2), generate_step(last, model, prompt_cache=cache))))
    assert toks == toks2 and all(mx.allclose(a, b).item() for a, b in zip(logits, logits2))


@pytest.mark.parametrize("max_size, steps", [(8, [20, 1, 1, 1]), (8, [3, 1, 1, 1, 1, 1, 1, 1])])
def test_rotating_masks_and_updates_equal_mlx_lm(max_size, steps):
    ours, ref = tq.TurboQuantRotatingKVCache(max_size, exact()), RotatingKVCache(max_size=max_size)
    for s in steps:
        step_agrees(ours, ref, mx.random.uniform(shape=(1, 2, s, 4)), window=4)


def test_plain_masks_equal_mlx_lm():
    ours, ref = tq.TurboQuantKVCache(exact()), KVCache()
    x = mx.random.uniform(shape=(1, 2, 9, 4))
    ours.update_and_fetch(x, x)
    ref.update_and_fetch(x, x)
    for n, w in ((1, None), (4, None), (4, 3)):
        a, b = ours.make_mask(n, window_size=w, return_array=False), ref.make_mask(n, window_size=w, return_array=False)
        assert (a is None and b is None) or (isinstance(a, str) and a == b) or mx.array_equal(a, b).item()


@pytest.mark.parametrize("keep", [0, 2])
@pytest.mark.parametrize("steps", [[20, 1, 1, 5, 1, 1, 9, 1], [3, 1, 1, 1, 1, 1, 1, 1, 4, 1], [1] * 12 + [7, 7]])
def test_compacting_the_ring_changes_no_later_output(steps, keep):
    # compact() after every update (what Bit-Axon's face does) against mlx-lm's own ring
    ours, ref = tq.TurboQuantRotatingKVCache(8, exact(), keep=keep), RotatingKVCache(max_size=8, keep=keep)
    seen = []
    for i, s in enumerate(steps):
        x = mx.random.uniform(shape=(1, 2, s, 4), key=mx.random.key(i))
        seen.append(x)
        step_agrees(ours, ref, x, window=5)
        ordered = ours.codes()[0].dequantize()           # oldest first: the true history
        ours.compact()
        held = ours.codes()[0].dequantize()
        history = mx.concatenate(seen, axis=2)
        T = history.shape[2]
        assert held.shape[2] == min(T, 8) and ours.nbytes <= mx.zeros((1, 2, 8, 4)).nbytes * 2
        expect = history if T <= 8 else mx.concatenate([history[..., :keep, :], history[..., T - 8 + keep:, :]], axis=2)
        assert mx.array_equal(held, expect).item()
        n = held.shape[2] - keep if T > keep else 0                # the recent part agrees too
        assert mx.array_equal(ordered[..., ordered.shape[2] - n:, :], held[..., held.shape[2] - n:, :]).item()


def test_a_ring_from_tokens_continues_like_one_that_saw_them():
    x = mx.random.uniform(shape=(1, 2, 30, 4), key=mx.random.key(0))
    built = tq.TurboQuantRotatingKVCache.from_tokens(8, x[..., 22:, :], x[..., 22:, :], exact(), offset=30)
    ref = RotatingKVCache(max_size=8)
    ref.update_and_fetch(x, x)
    assert built.offset == 30 and built.size() == 8
    for i in range(3):
        y = mx.random.uniform(shape=(1, 2, 1 + 2 * i, 4), key=mx.random.key(i + 1))
        assert mx.array_equal(built.update_and_fetch(y, y)[0], ref.update_and_fetch(y, y)[0]).item()
    with pytest.raises(ValueError, match="offset"):
        tq.TurboQuantRotatingKVCache.from_tokens(8, x, x, exact(), offset=3)
    with pytest.raises(ValueError, match="holds 8 of them; 3 given"):     # too few for its history
        tq.TurboQuantRotatingKVCache.from_tokens(8, x[..., :3, :], x[..., :3, :], exact(), offset=10)


def test_cache_copying():
    """mlx-lm's ``test_cache_copying`` as written there: ``keys`` reads like ``KVCache.keys``
    (issue #26.12: it was a code buffer)."""
    cache = [tq.TurboQuantKVCache(exact())]
    x = mx.random.uniform(shape=(1, 8, 10, 4))
    cache[0].update_and_fetch(x, x)
    y = mx.random.uniform(shape=(1, 8, 1, 4))
    cache[0].update_and_fetch(y, y)
    old_cache = copy.deepcopy(cache)
    trim_prompt_cache(cache, 1)
    assert old_cache[0].offset == 11 and cache[0].offset == 10
    z = mx.random.uniform(shape=(1, 8, 1, 4))
    cache[0].update_and_fetch(z, z)
    assert mx.allclose(old_cache[0].keys[..., 10:11, :], y).item()
    assert mx.allclose(cache[0].keys[..., 10:11, :], z).item()
    assert mx.allclose(cache[0].values[..., :10, :], x).item()


def test_keys_and_values_are_views_that_take_an_mx_depends():
    """deepseek_v2/v3, glm4_moe, ministral3 and qwen3_5 write ``cache[-1].keys =
    mx.depends(cache[-1].keys, h)``: accepted; anything else is refused (a read-only view)."""
    for c in (tq.TurboQuantKVCache(tq.TurboQuantMSE(16, 4)), tq.TurboQuantRotatingKVCache(6, tq.TurboQuantMSE(16, 4))):
        assert c.keys is None and c.values is None
        x = mx.random.normal((1, 2, 9, 16), key=mx.random.key(0))
        k, v = c.update_and_fetch(x, x)
        assert mx.array_equal(c.keys, k).item() and mx.array_equal(c.values, v).item()
        h = mx.ones((3,))
        c.keys = mx.depends(c.keys, h)
        c.values = mx.depends(c.values, h)
        assert mx.array_equal(c.keys, k).item() and c.offset == 9
        with pytest.raises(ValueError, match="read-only view"):
            c.keys = mx.zeros((1, 2, 3, 16))
    with pytest.raises(ValueError, match="empty"):
        tq.TurboQuantKVCache(exact()).values = mx.zeros((1, 1, 1, 4))
