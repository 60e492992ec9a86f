"""TurboQuant caches in mlx-lm: exactness, generation, memory, attention from codes, save/load."""
import json

import mlx.core as mx
import pytest
from mlx_lm.generate import generate, generate_step, stream_generate
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache

from turboquant.attention import codes_attention
from turboquant.cache import TurboQuantKVCache, TurboQuantRotatingKVCache, returning_codes
from turboquant.codecs import (AffineCodec, Centered, FibQuant, Identity, OutlierSplit, PolarQuant, TurboQuantMSE,
                               TurboQuantProd)
from turboquant.models import ByteTokenizer, run_in_chunks, tiny_model
from turboquant.prompt_cache import load_prompt_cache, make_prompt_cache, save_prompt_cache, to_turboquant
from conftest import CODEC_EXAMPLES, codec_examples


ToyTokenizer = ByteTokenizer


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)


def tokens(n, seed=0):
    return mx.random.randint(1, 256, (1, n), key=mx.random.key(seed))


def run(model, cache, toks, chunks):
    return run_in_chunks(model, toks, cache, chunks)


SPLITS = {"long prefill": [300], "chunked": [128, 128, 44], "decode": [200] + [1] * 100}


@pytest.mark.parametrize("split", list(SPLITS))
def test_pass_through_caches_equal_mlx_lm(llama, split):
    toks = tokens(300)
    D = 16
    ref = run(llama, [RotatingKVCache(max_size=64) for _ in llama.layers], toks, SPLITS[split])
    ours = run(llama, [TurboQuantRotatingKVCache(64, Identity(D)) for _ in llama.layers], toks, SPLITS[split])
    assert mx.abs(ref - ours).max().item() < 1e-5
    ref = run(llama, [KVCache() for _ in llama.layers], toks, SPLITS[split])
    ours = run(llama, [TurboQuantKVCache(Identity(D)) for _ in llama.layers], toks, SPLITS[split])
    assert mx.abs(ref - ours).max().item() < 1e-5


def test_sliding_window_layers_of_gemma3_get_rotating_caches():
    model = tiny_model("gemma3", num_layers=6, hidden_size=64, num_heads=4, num_kv_heads=1, sliding_window=32)
    cache = make_prompt_cache(model, key_codec=lambda d: Identity(d))
    assert [type(c).__name__ for c in cache] == ["TurboQuantRotatingKVCache"] * 5 + ["TurboQuantKVCache"]
    toks = tokens(120, seed=1)
    for chunks in ([120], [50, 50, 20], [80] + [1] * 40):
        ref = run(model, mlx_make_prompt_cache(model), toks, chunks)
        ours = run(model, make_prompt_cache(model, key_codec=lambda d: Identity(d)), toks, chunks)
        assert mx.abs(ref - ours).max().item() < 1e-5




def test_generate_runs_with_every_codec(any_codec):
    name, factory = any_codec
    model = tiny_model("llama", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2)  # D = 32
    cache = make_prompt_cache(model, key_codec=factory, value_codec=lambda d: TurboQuantMSE(d, 3))
    prompt = mx.array(list(b"hello turboquant"))
    produced = [int(t) for t, _ in zip((tok for tok, _ in generate_step(prompt, model, prompt_cache=cache)), range(8))]
    # mlx-lm's loop through our cache = our own greedy loop through a fresh cache of the same codecs
    mine = make_prompt_cache(model, key_codec=factory, value_codec=lambda d: TurboQuantMSE(d, 3))
    model(prompt[None, :-1], cache=mine)                 # the same two chunks generate_step uses
    logits, expected = model(prompt[None, -1:], cache=mine), []
    for _ in range(8):
        expected.append(mx.argmax(logits[0, -1]).item())
        logits = model(mx.array([[expected[-1]]]), cache=mine)
    assert produced == expected
    assert len(prompt) + 7 <= cache[0].offset <= len(prompt) + 9     # generate_step runs one step ahead
    assert cache[0].key_codec.name == name and cache[0].value_codec.name == "turboquant_mse"   # asymmetric K/V


def test_codes_attention_gives_the_same_logits_and_restores(llama):
    import mlx_lm.models.llama as llama_module
    original = llama_module.scaled_dot_product_attention
    toks = tokens(150, seed=2)
    make = lambda: make_prompt_cache(llama, key_codec=lambda d: TurboQuantMSE(d, 4),
                                     value_codec=lambda d: FibQuant(d, 2, 16))
    ref = run(llama, make(), toks, [100] + [1] * 50)
    with codes_attention(llama):
        assert llama_module.scaled_dot_product_attention is not original
        ours = run(llama, make(), toks, [100] + [1] * 50)
    assert llama_module.scaled_dot_product_attention is original
    assert mx.abs(ref - ours).max().item() < 1e-4


def test_stream_generate_under_codes_attention(llama):
    cache = make_prompt_cache(llama, key_codec=lambda d: TurboQuantMSE(d, 4))
    with codes_attention(llama):
        out = [r.token for r in stream_generate(llama, ToyTokenizer(), "abc", max_tokens=5, prompt_cache=cache)]
    assert len(out) == 5


@pytest.mark.parametrize("name", sorted(CODEC_EXAMPLES))
def test_nbytes_equals_bit_accounting(name):
    """For every registered codec (fitted beforehand, so no tokens are held exactly)."""
    D, B, H, T = 128, 1, 8, 1024
    (codec,) = [c for c in codec_examples(D) if c.name == name]
    c = TurboQuantKVCache(codec, codec)
    c.update_and_fetch(mx.random.normal((B, H, T, D)), mx.random.normal((B, H, T, D)))
    assert abs(c.nbytes / c.code_nbytes() - 1) < 0.01
    ideal = 2 * B * H * T * D * codec.bits_per_coordinate / 8
    assert abs(c.nbytes / ideal - 1) < 0.01
    # against mlx-lm's fp16 KVCache at the same shape
    ref = KVCache()
    ref.update_and_fetch(mx.zeros((B, H, T, D), mx.float16), mx.zeros((B, H, T, D), mx.float16))
    assert c.nbytes / ref.nbytes == pytest.approx(codec.bits_per_coordinate / 16, rel=0.01)
    assert not hasattr(c, "bits")


def test_rotating_memory_is_constant_over_65536_steps():
    D, W = 32, 64
    c = TurboQuantRotatingKVCache(W, TurboQuantMSE(D, 3))
    x = mx.random.normal((1, 2, 1, D))
    sizes = {}
    with returning_codes():                               # no dequantization per step
        for step in range(1, 65537):
            c.update_and_fetch(x, x)
            if step % 256 == 0:
                mx.eval(c.key_codes.fields, c.value_codes.fields)
            if step in (W, 1024, 16384, 65536):
                mx.eval(c.key_codes.fields, c.value_codes.fields)
                sizes[step] = c.nbytes
    assert len(set(sizes.values())) == 1 and c.offset == 65536 and c.size() == W


def test_trim_and_protocol(llama):
    plain = TurboQuantKVCache(TurboQuantMSE(16, 4))
    k = mx.random.normal((1, 2, 10, 16))
    plain.update_and_fetch(k, k)
    assert plain.is_trimmable() and plain.trim(3) == 3 and plain.offset == 7
    c = TurboQuantKVCache(TurboQuantMSE(16, 4), fp_window=4)
    assert c.empty() and c.nbytes == 0
    c.update_and_fetch(k, k)
    assert c.size() == 10 and not c.is_trimmable()                # exact trims only (issue #13.3)
    kd, _ = c.update_and_fetch(k[:, :, :2], k[:, :, :2])
    assert kd.shape == (1, 2, 12, 16)
    assert mx.allclose(kd[:, :, -2:], k[:, :, :2]).item()        # recent tokens are exact
    assert c.make_mask(1) is None and c.make_mask(5) == "causal"
    with pytest.raises(ValueError, match="shape"):
        c.update_and_fetch(mx.zeros((1, 2, 3, 8)), mx.zeros((1, 2, 3, 8)))


def test_to_turboquant_converts_filled_caches(llama):
    toks = tokens(200, seed=3)
    cache = [KVCache(), RotatingKVCache(max_size=64)]
    run(llama, cache, toks, [150] + [1] * 50)
    conv = to_turboquant(cache, key_codec=lambda d: Identity(d))
    assert isinstance(conv[1], TurboQuantRotatingKVCache) and conv[1].offset == 200
    ref = run(llama, cache, toks[:, :1], [1])
    ours = run(llama, conv, toks[:, :1], [1])
    assert mx.abs(ref - ours).max().item() < 1e-5


def test_save_load_round_trip_is_bit_exact(tmp_path, llama):
    toks = tokens(90, seed=4)
    cache = make_prompt_cache(llama, key_codec=lambda d: OutlierSplit(d, n_outliers=4, outlier_bits=4, bits=2,
                                                                       rotation="haar"),
                              value_codec=lambda d: TurboQuantMSE(d, 3, seed=7), fp_window=8)
    run(llama, cache, toks, [60] + [1] * 30)
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, cache, {"note": "hi"})
    loaded, meta = load_prompt_cache(path, return_metadata=True)
    assert meta == {"note": "hi"}
    for a, b in zip(cache, loaded):
        assert a.meta_state == b.meta_state
        for x, y in zip(a.state[:3], b.state[:3]):
            assert x.keys() == y.keys() and all(mx.array_equal(x[n], y[n]).item() for n in x)
    nxt = tokens(1, seed=5)
    assert mx.array_equal(llama(nxt, cache=cache), llama(nxt, cache=loaded)).item()


def test_rotating_save_load(tmp_path, llama):
    cache = [TurboQuantRotatingKVCache(32, FibQuant(16, 2, 16)) for _ in llama.layers]
    run(llama, cache, tokens(70, seed=6), [40] + [1] * 30)
    save_prompt_cache(tmp_path / "r.safetensors", cache)
    loaded = load_prompt_cache(tmp_path / "r.safetensors")
    nxt = tokens(1, seed=7)
    assert mx.array_equal(llama(nxt, cache=cache), llama(nxt, cache=loaded)).item()


def test_corrupt_truncated_and_foreign_files_raise(tmp_path, llama):
    cache = make_prompt_cache(llama, key_codec=lambda d: TurboQuantMSE(d, 4))
    run(llama, cache, tokens(20), [20])
    good = tmp_path / "good.safetensors"
    save_prompt_cache(good, cache)
    data = good.read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_prompt_cache(tmp_path / "trunc.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(ValueError):
        load_prompt_cache(tmp_path / "junk.safetensors")
    mx.save_safetensors(str(tmp_path / "foreign.safetensors"), {"a": mx.zeros(3)})
    with pytest.raises(ValueError, match="no TurboQuant header"):
        load_prompt_cache(tmp_path / "foreign.safetensors")
    arrays, meta = mx.load(str(good), return_metadata=True)
    assert '"version": 3' in meta["turboquant"]
    meta["turboquant"] = meta["turboquant"].replace('"version": 3', '"version": 99')
    mx.save_safetensors(str(tmp_path / "future.safetensors"), arrays, meta)
    with pytest.raises(ValueError, match="version 99"):
        load_prompt_cache(tmp_path / "future.safetensors")
    arrays["0.k.idx"] = arrays["0.k.idx"][..., :1]
    mx.save_safetensors(str(tmp_path / "bad.safetensors"), arrays, mx.load(str(good), return_metadata=True)[1])
    with pytest.raises(ValueError, match="checksum mismatch"):
        load_prompt_cache(tmp_path / "bad.safetensors")
    with pytest.raises(TypeError):
        save_prompt_cache(tmp_path / "x.safetensors", [KVCache()])
    assert good.read_bytes() == data                 # failed loads never touch the file


@pytest.mark.parametrize("version", ["1", "true", "1.0", '"3"'])
def test_the_file_cannot_switch_its_checksum_off(tmp_path, llama, version):
    """Issue #26.3: a header that claims version 1 (or a version that only looks like an
    int) used to skip the SHA-256 check, so tampered tensors loaded."""
    cache = make_prompt_cache(llama, key_codec=lambda d: TurboQuantMSE(d, 4))
    run(llama, cache, tokens(20), [20])
    good = tmp_path / "good.safetensors"
    save_prompt_cache(good, cache)
    arrays, meta = mx.load(str(good), return_metadata=True)
    arrays["0.k.norm"] = arrays["0.k.norm"] * 2                      # tampered tensors
    meta["turboquant"] = meta["turboquant"].replace('"version": 3', f'"version": {version}')
    mx.save_safetensors(str(tmp_path / "t.safetensors"), arrays, meta)
    with pytest.raises(ValueError, match="version"):
        load_prompt_cache(tmp_path / "t.safetensors")
    del meta["turboquant_sha256"]                                    # stripped as well: a real v1 file?
    mx.save_safetensors(str(tmp_path / "t1.safetensors"), arrays, meta)
    if version == "1":                                               # no v2 field left: read as v1
        assert load_prompt_cache(tmp_path / "t1.safetensors")[0].offset == 20
    else:
        with pytest.raises(ValueError, match="version"):
            load_prompt_cache(tmp_path / "t1.safetensors")


def test_non_finite_norms_are_refused(tmp_path, llama):
    cache = make_prompt_cache(llama, key_codec=lambda d: TurboQuantMSE(d, 4))
    run(llama, cache, tokens(20), [20])
    good = tmp_path / "good.safetensors"
    save_prompt_cache(good, cache)
    arrays, meta = mx.load(str(good), return_metadata=True)
    arrays["1.v.norm"] = mx.where(mx.arange(arrays["1.v.norm"].shape[2])[:, None] == 3, mx.inf,
                                  arrays["1.v.norm"]).astype(arrays["1.v.norm"].dtype)
    from turboquant.prompt_cache import content_digest
    meta["turboquant_sha256"] = content_digest(meta["turboquant"], arrays)   # a consistent checksum
    mx.save_safetensors(str(tmp_path / "inf.safetensors"), arrays, meta)
    with pytest.raises(ValueError, match="Inf or NaN"):
        load_prompt_cache(tmp_path / "inf.safetensors")


@pytest.mark.parametrize("kc, vc, fp_window, sinks", [
    (lambda d: TurboQuantMSE(d, 4), lambda d: TurboQuantMSE(d, 2), 0, 0),
    (lambda d: TurboQuantMSE(d, 3), lambda d: TurboQuantMSE(d, 8), 0, 0),
    (lambda d: TurboQuantMSE(d, 1, rotation="haar"), lambda d: FibQuant(d, 4, 256), 0, 0),
    (lambda d: FibQuant(d, 2, 16), lambda d: PolarQuant(d), 0, 0),
    (lambda d: TurboQuantMSE(d, 4), lambda d: TurboQuantMSE(d, 4), 32, 0),
    (lambda d: AffineCodec(d, 4, 64), lambda d: TurboQuantProd(d, 3), 16, 0),
    (lambda d: Centered(TurboQuantMSE(d, 4)), lambda d: Centered(FibQuant(d, 2, 16)), 0, 0),
    (lambda d: Centered(TurboQuantMSE(d, 3)), lambda d: Centered(PolarQuant(d)), 24, 4),
    (lambda d: Centered(TurboQuantMSE(d, 4)), lambda d: TurboQuantMSE(d, 3), 0, 1),
    (lambda d: FibQuant(d, 2, 16), lambda d: AffineCodec(d, 4, 64), 300, 4),
])
def test_attention_from_codes_equals_dequantize_then_sdpa(kc, vc, fp_window, sinks):
    from turboquant.attention import attention_from_codes, reference_attention
    D, T = 64, 300
    k = mx.random.normal((1, 2, T, D), key=mx.random.key(0)) + 3.0      # a common offset, as real keys
    v = mx.random.normal((1, 2, T, D), key=mx.random.key(1)) - 1.0
    q = mx.random.normal((1, 8, 3, D), key=mx.random.key(2)) * 0.3      # GQA: 8 query heads, 2 kv heads
    c = TurboQuantKVCache(kc(D), vc(D), fp_window=fp_window, sink_tokens=sinks)
    k_hat, v_hat = c.update_and_fetch(k[:, :, :200], v[:, :, :200])       # sinks come from the first chunk
    k_hat, v_hat = c.update_and_fetch(k[:, :, 200:], v[:, :, 200:])
    if sinks:
        assert mx.array_equal(k_hat[:, :, :sinks], k[:, :, :sinks])
    causal = mx.arange(T - 3, T)[:, None] >= mx.arange(T)[None]
    ref = reference_attention(q, k_hat, v_hat, mask=causal)
    kv, vv = c.codes()
    for mask in (causal, "causal"):
        assert mx.abs(attention_from_codes(q, kv, vv, mask=mask) - ref).max().item() < 1e-4


def test_top1_agreement_is_one_for_pass_through_and_lower_for_one_bit(llama):
    from turboquant.evaluation import top1_agreement
    prompt, cont = tokens(40, seed=8), tokens(30, seed=9)
    same = top1_agreement(llama, prompt, cont, lambda: make_prompt_cache(llama, key_codec=lambda d: Identity(d)))
    assert same == 1.0
    low = top1_agreement(llama, prompt, cont, lambda: make_prompt_cache(llama, key_codec=lambda d: TurboQuantMSE(d, 1)))
    assert low < 1.0


def test_a_cache_from_another_model_of_the_same_shape_is_refused(tmp_path):
    """Issue #26.4: a tiny-llama cache loaded silently into a tiny-gemma3 of equal shape."""
    from turboquant.models import tiny_model
    from turboquant.prompt_cache import model_fingerprint
    llama_a = tiny_model("llama", seed=0, sliding_window=1024)
    llama_b = tiny_model("llama", seed=1, sliding_window=1024)
    cache = make_prompt_cache(llama_a, key_codec=lambda d: TurboQuantMSE(d, 4))
    run(llama_a, cache, tokens(12), [12])
    path = tmp_path / "a.safetensors"
    save_prompt_cache(path, cache, {"model": "a"}, model=llama_a)
    assert load_prompt_cache(path, model=llama_a)[0].offset == 12             # its own model
    assert model_fingerprint(llama_a)["layers"] == model_fingerprint(llama_b)["layers"]
    with pytest.raises(ValueError, match="filled by llama .* not by the model given"):
        load_prompt_cache(path, model=llama_b)                                 # same shape, other weights
    gemma = tiny_model("gemma3", seed=0)
    if model_fingerprint(gemma)["layers"] == model_fingerprint(llama_a)["layers"]:
        with pytest.raises(ValueError, match="gemma3|layers"):
            load_prompt_cache(path, model=gemma)
    assert load_prompt_cache(path)[0].offset == 12                           # no model: nothing to check


def test_a_failed_forward_pass_marks_the_prompt_cache_unusable(llama):
    """Issue #26.5: offsets went [5,5,5] → error → [7,5,5], and the next call continued
    silently at [8,6,6]."""
    cache = make_prompt_cache(llama, key_codec=lambda d: TurboQuantMSE(d, 4))
    run(llama, cache, tokens(5), [5])
    bad = cache[1].key_codec

    class Boom(Exception):
        pass

    def encode(x):
        raise Boom("key norms exceed float16")
    original, bad.encode = bad.encode, encode
    with pytest.raises(ValueError, match=r"unusable: a forward pass failed in layer 1 \(Boom: key norms"):
        llama(tokens(2, seed=1), cache=cache)
    bad.encode = original                                      # even with the cause gone:
    with pytest.raises(ValueError, match="unusable"):
        llama(tokens(1, seed=2), cache=cache)
    assert [c.offset for c in cache][:2] == [7, 5]             # nothing moved after the failure
    fresh = make_prompt_cache(llama, key_codec=lambda d: TurboQuantMSE(d, 4))
    fresh[0].key_codec.encode = encode                         # the first layer failing changes nothing:
    with pytest.raises(Boom):
        llama(tokens(2, seed=1), cache=fresh)
    del fresh[0].key_codec.encode
    llama(tokens(2, seed=1), cache=fresh)                      # the cache is still usable
    assert {c.offset for c in fresh} == {2}


def test_a_slice_of_the_cache_list_is_refused(llama):
    """Issue #26.11: mlx-lm zips layers with caches, so ``cache[:k]`` runs k layers silently."""
    n = len(make_prompt_cache(llama))
    assert n >= 2
    cache = make_prompt_cache(llama, key_codec=lambda d: TurboQuantMSE(d, 4))
    llama(tokens(3), cache=cache[:n - 1])                      # the first call cannot tell...
    with pytest.raises(ValueError, match=rf"layer\(s\) {n - 1}\.\.{n - 1} were not.*cache\[:1\]"):
        llama(tokens(1, seed=1), cache=cache[:n - 1])          # ...the next one does
    with pytest.raises(ValueError, match="unusable"):
        llama(tokens(1, seed=1), cache=cache)                  # and the whole list stays refused
    tail = make_prompt_cache(llama, key_codec=lambda d: TurboQuantMSE(d, 4))
    with pytest.raises(ValueError, match=r"layer 1 was given tokens while layer\(s\) 0\.\.0"):
        llama(tokens(3), cache=tail[1:])                       # a list without its first layers: at once
    whole = make_prompt_cache(llama, key_codec=lambda d: TurboQuantMSE(d, 4))
    for t in (3, 1, 2):                                        # the whole list in any chunking is fine
        llama(tokens(t), cache=whole)
    assert {c.offset for c in whole} == {6}
    import copy                                                # a copied list checks its own layers …
    twin = copy.deepcopy(whole)
    with pytest.raises(ValueError, match=r"layer 1 was given tokens while layer\(s\) 0\.\.0"):
        llama(tokens(1), cache=twin[1:])
    llama(tokens(1), cache=whole)                              # … and the original is not touched
    assert {c.offset for c in whole} == {7}


def test_another_batch_or_head_count_after_the_first_update_is_a_clear_error():
    """Issue #26.11: a raw mlx broadcast error before."""
    c = TurboQuantKVCache(TurboQuantMSE(16, 4))
    k = mx.random.normal((1, 2, 5, 16), key=mx.random.key(0))
    c.update_and_fetch(k, k)
    for shape in ((2, 2, 1, 16), (1, 3, 1, 16)):
        x = mx.zeros(shape)
        with pytest.raises(ValueError, match="this cache holds batch 1 × 2 kv heads"):
            c.update_and_fetch(x, x)
    assert c.offset == 5


CENTERED = dict(key_codec=lambda d: Centered(TurboQuantMSE(d, 3)), value_codec=lambda d: TurboQuantMSE(d, 3),
                sink_tokens=1)


@pytest.mark.parametrize("fit_tokens", [8, 32])
def test_a_learning_codec_gives_the_same_result_however_the_prompt_is_fed(llama, fit_tokens):
    """Issue #26.2: Centered's mean came from the first chunk alone (perplexity 32.50 as one
    chunk, 33.28 as 1 + 255, 32.28 in chunks of 16). Now it is fitted on the first
    ``fit_tokens`` tokens after the sinks, which stay exact with them: every chunking gives the same
    logits to float rounding."""
    toks = tokens(48)
    outs, means = [], []
    for chunks in ([48], [1, 47], [4] * 12, [5, 2, 30, 11], [1] * 10 + [38]):
        cache = make_prompt_cache(llama, **CENTERED)
        for c in cache:
            c.fit_tokens = fit_tokens
        outs.append(run(llama, cache, toks, chunks))
        means.append(cache[1].key_codec.mean)
        assert cache[0].sink_tokens == 1 + fit_tokens and cache[0].learning is False
    for o, m in zip(outs[1:], means[1:]):
        assert mx.max(mx.abs(o - outs[0])).item() < 1e-4
        assert mx.max(mx.abs(m - means[0])).item() < 1e-5
    # the mean is layer 0's keys averaged over positions 1 … F (after the one sink)
    exact = mlx_make_prompt_cache(llama)
    llama(toks, cache=exact)
    k0 = exact[0].state[0][0, :, 1:1 + fit_tokens, :]
    cache = make_prompt_cache(llama, **CENTERED)
    for c in cache:
        c.fit_tokens = fit_tokens
    run(llama, cache, toks, [48])
    assert mx.max(mx.abs(cache[0].key_codec.mean - mx.mean(k0, axis=1))).item() < 1e-5


def test_a_cache_saved_while_its_codec_learns_continues_as_if_never_saved(llama, tmp_path):
    """Short prompts (fewer than fit_tokens) are saved mid-fit: the exact first tokens and
    the chunks so far travel in the file, and the loaded cache goes on exactly."""
    toks = tokens(40)
    whole = make_prompt_cache(llama, **CENTERED)
    ref = run(llama, whole, toks, [10, 30])
    cache = make_prompt_cache(llama, **CENTERED)
    run(llama, cache, toks[:, :10], [10])
    assert cache[0].learning and cache[0].nbytes > 0
    path = tmp_path / "warm.safetensors"
    save_prompt_cache(path, cache, model=llama)
    loaded = load_prompt_cache(path, model=llama)
    assert loaded[0].learning and loaded[0].meta_state["learning"]["chunks"] == [10]
    out = llama(toks[:, 10:], cache=loaded)
    assert mx.max(mx.abs(out - ref[:, 10:])).item() < 1e-4 and loaded[0].learning is False
    import copy
    twin = copy.deepcopy(cache)                                 # mlx-lm copies caches too
    assert mx.max(mx.abs(llama(toks[:, 10:], cache=twin) - ref[:, 10:])).item() < 1e-4


def test_trimming_while_a_codec_learns_forgets_the_trimmed_tokens(llama):
    toks = tokens(40)
    ref = run(llama, make_prompt_cache(llama, **CENTERED), toks, [40])
    cache = make_prompt_cache(llama, **CENTERED)
    run(llama, cache, tokens(12, seed=5), [12])               # 12 tokens the cache should forget
    for c in cache:
        assert c.trim(12) == 12
    out = run(llama, cache, toks, [6, 34])
    assert mx.max(mx.abs(out - ref)).item() < 1e-4


def test_a_failed_update_while_learning_changes_nothing(llama):
    cache = make_prompt_cache(llama, **CENTERED)
    run(llama, cache, tokens(5), [5])
    before = {n: mx.array(a) for n, a in cache[0].state[0].items()}, cache[0].key_codec.mean
    with pytest.raises(ValueError):
        cache[0].update_and_fetch(mx.full((1, 2, 3, 16), float("nan")), mx.zeros((1, 2, 3, 16)))
    assert cache[0].offset == 5 and cache[0].meta_state["learning"]["chunks"] == [5]
    assert all(mx.array_equal(a, cache[0].state[0][n]).item() for n, a in before[0].items())
    assert mx.array_equal(before[1], cache[0].key_codec.mean).item()


def test_a_ring_with_a_learning_codec_shares_the_fit_not_the_first_queries():
    """A rotating cache has no sinks, so the first ``fit_tokens`` queries see provisional
    fits that depend on the chunking: documented, and measured here (the fit itself is
    the same: layer 0's mean does not depend on the chunking)."""
    model = tiny_model("llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    toks = tokens(48)
    outs, means = [], []
    for chunks in ([48], [4] * 12):
        cache = make_prompt_cache(model, key_codec=lambda d: Centered(TurboQuantMSE(d, 3)), max_kv_size=40)
        outs.append(run(model, cache, toks, chunks))
        means.append(cache[0].key_codec.mean)
        assert cache[0].learning is False and cache[0].sink_tokens == 0
    assert mx.max(mx.abs(means[1] - means[0])).item() < 1e-5


def test_a_file_cannot_claim_a_fit_that_would_have_ended(llama, tmp_path):
    """Review of #26.2: a learning state holding more tokens than the fit takes lost tokens
    on the next update; the loader refuses it."""
    cache = make_prompt_cache(llama, **CENTERED)
    run(llama, cache, tokens(9), [4, 5])
    path = tmp_path / "w.safetensors"
    save_prompt_cache(path, cache)
    arrays, meta = mx.load(str(path), return_metadata=True)
    head = json.loads(meta["turboquant"])
    head["layers"][0]["fit_tokens"] = 5                      # 1 + 5 < 9 tokens: the fit had ended
    meta["turboquant"] = json.dumps(head)
    from turboquant.prompt_cache import content_digest
    meta["turboquant_sha256"] = content_digest(meta["turboquant"], arrays)
    mx.save_safetensors(str(tmp_path / "bad.safetensors"), arrays, meta)
    with pytest.raises(ValueError, match="would have ended"):
        load_prompt_cache(tmp_path / "bad.safetensors")


def test_a_trim_back_into_the_fitted_tokens_refits():
    # a server reuses conversation A's cache for B when they share a prefix; if that prefix is
    # shorter than sinks + fit_tokens, B must not inherit the mean fitted on A's tokens
    import numpy as np
    from turboquant.codecs import Centered
    key = mx.random.key(3)
    a = mx.random.normal((1, 2, 40, 32), key=key) + 2.0
    b = mx.random.normal((1, 2, 36, 32), key=mx.random.split(key)[0]) - 1.0
    make = lambda: TurboQuantKVCache(Centered(TurboQuantMSE(32, 4)), TurboQuantMSE(32, 4, seed=1), sink_tokens=1)
    reused = make()
    reused.update_and_fetch(a, a)
    assert reused.trim(36) == 36 and reused.offset == 4 and reused.learning     # learning again
    reused.update_and_fetch(b, b)
    fresh = make()
    fresh.update_and_fetch(a[..., :4, :], a[..., :4, :])
    fresh.update_and_fetch(b, b)
    assert reused.key_codec.config() == fresh.key_codec.config()
    for x, y in ((reused.keys, fresh.keys), (reused.values, fresh.values)):
        assert np.array_equal(np.array(x), np.array(y))
    # and the rule survives a copy (mlx-lm's prompt-cache LRU deep-copies before it trims)
    again = make()
    again.update_and_fetch(a, a)
    import copy
    copied = copy.deepcopy(again)
    copied.trim(36)
    copied.update_and_fetch(b, b)
    assert copied.key_codec.config() == fresh.key_codec.config()
