"""Reproductions of the defects found by probing the package as a new user would (issue
#13), one test per defect, so each stays fixed."""
import copy
import threading
import warnings

import mlx.core as mx
import numpy as np
import pytest

import turboquant as tq
from turboquant.cache import FIT_TOKENS
from turboquant.suite import CONFIGS
from turboquant.codecs.base import Code


def all_codecs(dim=64):
    """One instance of every registered codec at head size ``dim`` (fitted where needed)."""
    from conftest import codec_examples
    return codec_examples(dim)


# -------------------------------------------------------------- 8. empty input
@pytest.mark.parametrize("codec", all_codecs(), ids=lambda c: c.name)
@pytest.mark.parametrize("shape", [(0, 64), (1, 8, 0, 64), (0, 3, 64)])
def test_empty_input_gives_empty_results(codec, shape):
    code = codec.encode(mx.zeros(shape, mx.float16))
    full = codec.encode(mx.ones((1, 64)))
    assert code.shape == shape[:-1]
    for name, a in code.arrays.items():
        assert a.shape == (*shape[:-1], full[name].shape[-1]) and a.dtype == full[name].dtype
    x = codec.decode(code)
    assert x.shape == shape and x.dtype == mx.float16


# -------------------------------------------------------------- 9. one set of input rules
def _seeded():
    """A maker seed → codec for every registered codec whose configuration has a seed."""
    from conftest import codec_examples
    return [(c.name, lambda v, cfg=c.config(): tq.from_config({**cfg, "seed": v}))
            for c in codec_examples(64, fitted=False) if "seed" in c.config()]


@pytest.mark.parametrize("make", [m for _, m in _seeded()], ids=[n for n, _ in _seeded()])
def test_seed_rules_are_the_same_everywhere(make):
    with pytest.raises(ValueError, match="seed must be an int >= 0, got -1"):
        make(-1)
    with pytest.raises(ValueError, match=r"seed must be an int, got 1\.5"):
        make(1.5)
    with pytest.raises(ValueError, match="seed must be an int"):
        make(True)
    assert make(np.int64(3)) == make(3)
    assert type(make(np.int64(3)).config()["seed"]) is int


def test_numpy_integers_are_normalised_and_serialise():
    import json
    c = tq.FibQuant(np.int64(64), k=np.int32(2), bits=2)
    assert c == tq.FibQuant(64, 2, bits=2)
    hash(c)
    json.dumps(c.config())
    for c in (tq.TurboQuantMSE(np.int64(64), np.int64(4)), tq.PolarQuant(np.int16(64), (np.int8(4), 2)),
              tq.QJL(np.int64(64), m=np.int64(32))):
        json.dumps(c.config())


@pytest.mark.parametrize("make, name", [(lambda: tq.TurboQuantMSE(64, 4.0), "bits"),
                                        (lambda: tq.TurboQuantMSE(64.0, 4), "dim"),
                                        (lambda: tq.QJL(64, m=3.5), "m"),
                                        (lambda: tq.AffineCodec(64, 4, group_size=64.0), "group_size"),
                                        (lambda: tq.PolarQuant(64, (4, 2.5)), r"level_bits\[1\]"),
                                        (lambda: tq.OutlierSplit(64, 8.0), "n_outliers")])
def test_floats_are_rejected_with_the_parameter_name(make, name):
    with pytest.raises(ValueError, match=name):
        make()


def test_outlier_split_speaks_in_the_users_terms():
    with pytest.raises(ValueError, match=r"dim=100, n_outliers=32.*32 and 68 channels.*haar"):
        tq.OutlierSplit(100)
    assert tq.OutlierSplit(100, rotation="haar").dim == 100


def test_affine_accepts_every_input_shape_the_others_accept():
    c = tq.AffineCodec(64, 4)
    x = mx.random.normal((64,), key=mx.random.key(0))
    one = c.decode(c.encode(x))
    batch = c.decode(c.encode(x.reshape(1, 1, 1, 64)))
    assert one.shape == (64,) and batch.shape == (1, 1, 1, 64)
    assert mx.array_equal(one, batch.reshape(64)).item()


# -------------------------------------------------------------- 10. decode checks Code.shape
@pytest.mark.parametrize("codec", all_codecs(), ids=lambda c: c.name)
def test_decode_refuses_a_code_whose_shape_contradicts_its_fields(codec):
    code = codec.encode(mx.random.normal((3, 64), key=mx.random.key(1)))
    forged = Code(code.arrays, (1,), code.dtype, code.codec)
    with pytest.raises(ValueError, match=r"code's shape is \(1,\)"):
        codec.decode(forged)
    one_field_cut = dict(code.arrays)
    name = next(iter(one_field_cut))
    one_field_cut[name] = one_field_cut[name][:2]
    with pytest.raises(ValueError, match=name):
        codec.decode(Code(one_field_cut, code.shape, code.dtype, code.codec))


# -------------------------------------------------------------- 11. out of the storage range
def test_identity_float16_refuses_values_beyond_its_range():
    c = tq.Identity(64, "float16")
    with pytest.raises(ValueError, match="float16's range"):
        c.encode(mx.full((2, 64), 1e6))
    assert mx.all(mx.isfinite(c.decode(c.encode(mx.full((2, 64), 6e4))))).item()


# -------------------------------------------------------------- caches on a tiny llama
from mlx_lm.models import cache as mlx_cache  # noqa: E402

from turboquant.models import run_in_chunks, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)


def toks(n, seed=0):
    return mx.random.randint(1, 256, (1, n), key=mx.random.key(seed))


# 2. max_kv_size is honoured for models with make_cache (llama)
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


# 3. trim is exact or refused
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


# 4, 7. a cache file is validated; any file name works
@pytest.fixture
def saved(tmp_path, llama):
    cache = tq.make_prompt_cache(llama, key_codec=lambda d: tq.FibQuant(d, 2, 16),
                                 value_codec=lambda d: tq.TurboQuantMSE(d, 3), fp_window=4, sink_tokens=1)
    run_in_chunks(llama, toks(30), cache, [30])
    path = tmp_path / "cache.bin"
    tq.save_prompt_cache(path, cache)
    return path, cache


def _rewrite(path, out, edit_header=None, edit_arrays=None, fix_checksum=True):
    import json
    from turboquant.prompt_cache import content_digest
    arrays, meta = mx.load(str(path), format="safetensors", return_metadata=True)
    header = json.loads(meta["turboquant"])
    if edit_header:
        header = edit_header(header)
    if edit_arrays:
        edit_arrays(arrays)
    meta["turboquant"] = json.dumps(header)
    if fix_checksum:
        meta["turboquant_sha256"] = content_digest(meta["turboquant"], arrays)
    _save(out, arrays, meta)
    return out


def _save(out, arrays, meta):
    """mx.save_safetensors appends '.safetensors' to other names: write, then rename."""
    tmp = out.with_name(out.name + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), arrays, meta)
    tmp.replace(out)


@pytest.mark.parametrize("name", ["cache.bin", "cache", "c.safetensors"])
def test_any_file_name_saves_and_loads(tmp_path, llama, name):
    cache = tq.make_prompt_cache(llama)
    run_in_chunks(llama, toks(10), cache, [10])
    tq.save_prompt_cache(tmp_path / name, cache)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
    assert tq.load_prompt_cache(tmp_path / name)[0].offset == 10


def _drop_layer(h):
    h["layers"] = h["layers"][:1]
    return h


def _set(layer, key, value):
    def edit(h):
        h["layers"][layer][key] = value
        return h
    return edit


def _codec_n(h):
    h["layers"][0]["key_codec"]["n_codewords"] = 9     # 4-bit indices, of which 9..15 now unused
    return h


def _huge(h):
    h["layers"][0]["key_codec"]["n_codewords"] = 65536
    return h


def _drop(name):
    return lambda a: a.pop(name)


def _add(name):
    return lambda a: a.__setitem__(name, mx.zeros((1, 2, 3, 4)))


@pytest.mark.parametrize("edit_header, edit_arrays, match", [
    (_drop_layer, None, "orphan tensor '1"),
    (_set(0, "fp_window", 2), None, "exact tensor r.k"),
    (_set(0, "sink_tokens", 0), None, "exact-token tensors"),
    (_set(0, "offset", 29), None, "stored tokens for offset 29"),
    (_set(0, "dtype", "foo"), None, "dtype must be one of"),
    (_set(0, "class", "Nope"), None, "unknown cache class"),
    (_set(0, "key_codec", [1, 2]), None, "key_codec must be a codec configuration"),
    (_codec_n, None, "tensor k.idx names codeword"),
    (_huge, None, "would take about"),
    (lambda h: [h], None, "JSON object"),
    (lambda h: {k: v for k, v in h.items() if k != "layers"}, None, "'layers' must be a list"),
    (None, _drop("0.r.k"), "exact-token tensors"),
    (None, _add("0.x.idx"), "orphan tensor '0.x.idx'"),
    (None, _add("junk"), "orphan tensor 'junk'"),
])
def test_a_crafted_file_is_refused_naming_the_field(saved, tmp_path, edit_header, edit_arrays, match):
    path, _ = saved
    bad = _rewrite(path, tmp_path / "bad.bin", edit_header, edit_arrays)
    with pytest.raises(ValueError, match=match):
        tq.load_prompt_cache(bad)


def test_rotating_settings_are_checked(tmp_path, llama):
    cache = tq.make_prompt_cache(llama, max_kv_size=16)
    run_in_chunks(llama, toks(40), cache, [20] + [1] * 20)
    path = tmp_path / "r.bin"
    tq.save_prompt_cache(path, cache)
    for key, value, match in (("max_size", 8, "do not fit"), ("keep", 16, "keep must be an int in 0..15"),
                              ("max_size", 0, "max_size must be an int >= 1")):
        with pytest.raises(ValueError, match=match):
            tq.load_prompt_cache(_rewrite(path, tmp_path / "bad.bin", _set(0, key, value)))


def test_a_changed_byte_is_reported(saved, tmp_path):
    path, _ = saved
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF                                        # a byte of the last tensor
    (tmp_path / "flipped.bin").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum mismatch"):
        tq.load_prompt_cache(tmp_path / "flipped.bin")
    unchecked = _rewrite(path, tmp_path / "nosum.bin")
    arrays, meta = mx.load(str(unchecked), format="safetensors", return_metadata=True)
    del meta["turboquant_sha256"]
    _save(tmp_path / "nosum.bin", arrays, meta)
    with pytest.raises(ValueError, match="checksum"):
        tq.load_prompt_cache(tmp_path / "nosum.bin")


# 5. a cache for another model
def test_loading_for_a_different_model_raises(saved, llama):
    path, _ = saved
    assert len(tq.load_prompt_cache(path, model=llama)) == 2
    for other, match in ((tiny_model("llama", num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2), "3"),
                         (tiny_model("llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=1), "kv heads"),
                         (tiny_model("llama", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2), "head size")):
        with pytest.raises(ValueError, match=match):
            tq.load_prompt_cache(path, model=other)


def test_codes_attention_refuses_a_cache_of_another_depth(llama):
    six = tiny_model("llama", num_layers=6, hidden_size=64, num_heads=4, num_kv_heads=2)
    cache = tq.make_prompt_cache(llama)
    with tq.codes_attention(six), pytest.raises(ValueError, match="made for 2 layers, the model has 6"):
        six(toks(5), cache=cache)
    with pytest.raises(ValueError, match="2 layers, the model has 6"):
        tq.to_turboquant([mlx_cache.KVCache(), mlx_cache.KVCache()], model=six)


# 6. FibQuant construction is bounded
def test_fibquant_refuses_a_build_it_cannot_finish():
    import time
    t = time.perf_counter()
    with pytest.raises(ValueError, match=r"N=65536 .* would take about"):
        tq.FibQuant(64, k=2, bits=8)
    assert time.perf_counter() - t < 5


# 12. fp_window / sink_tokens on sliding-window layers
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


# 13. codes_attention from overlapping threads restores mlx-lm
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


# 14. files written by mlx_lm.save_prompt_cache
def test_mlx_lm_saved_turboquant_caches_load(tmp_path, llama):
    cache = tq.make_prompt_cache(llama, key_codec=lambda d: tq.Centered(tq.TurboQuantMSE(d, 4)), fp_window=4)
    run_in_chunks(llama, toks(30), cache, [30])
    mlx_cache.save_prompt_cache(str(tmp_path / "m.safetensors"), cache, {"who": "mlx-lm"})
    loaded, meta = tq.load_prompt_cache(tmp_path / "m.safetensors", return_metadata=True)
    assert meta == {"who": "mlx-lm"}
    nxt = toks(1, seed=3)
    assert mx.array_equal(llama(nxt, cache=cache), llama(nxt, cache=loaded)).item()


# 15. per-query-head masks under grouped-query attention
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


# 16. deep copies
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


def test_codecs_pickle_and_deep_copy_through_their_configuration():
    import pickle
    for codec in all_codecs():
        assert pickle.loads(pickle.dumps(codec)) == codec
        twin = copy.deepcopy(codec)
        x = mx.random.normal((3, 64), key=mx.random.key(2))
        assert all(mx.array_equal(codec.encode(x)[n], twin.encode(x)[n]).item() for n in codec.encode(x).arrays)


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


def test_a_long_codebook_build_shows_a_progress_bar_on_a_terminal(tmp_path, monkeypatch):
    import io
    import sys

    from turboquant.codecs import fibquant

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setenv("TURBOQUANT_CACHE", str(tmp_path))
    fibquant.clear_memory_cache()
    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    assert fibquant.build_seconds(32, 2, 128) > 2
    fibquant.fibquant_codebook(32, 2, 128, seed=5)
    assert "FibQuant codebook D=32 k=2 N=128" in err.getvalue()
    quiet = io.StringIO()                                      # not a terminal: no bar
    monkeypatch.setattr(sys, "stderr", quiet)
    fibquant.clear_memory_cache()
    fibquant.fibquant_codebook(32, 2, 128, seed=6)
    assert quiet.getvalue() == ""


def test_to_turboquant_takes_the_options_of_make_prompt_cache(llama):
    t = toks(30)
    ref = [mlx_cache.KVCache() for _ in llama.layers]
    run_in_chunks(llama, t, ref, [30])
    keys = ref[0].state[0][..., :30, :]
    conv = tq.to_turboquant(ref, bits=4.25, model=llama)
    kept = tq.to_turboquant(ref, sink_tokens=2, fp_window=3)
    direct = tq.make_prompt_cache(llama, bits=4.25)
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


# -------------------------------------------------------------- found in review
def test_a_cache_trimmed_to_zero_saves_and_loads(tmp_path, llama):
    for cache in (tq.make_prompt_cache(llama), tq.make_prompt_cache(llama, max_kv_size=16)):
        run_in_chunks(llama, toks(10), cache, [10])
        assert mlx_cache.trim_prompt_cache(cache, 10) == 10
        tq.save_prompt_cache(tmp_path / "zero.bin", cache)
        loaded = tq.load_prompt_cache(tmp_path / "zero.bin")
        nxt = toks(3, seed=2)
        assert mx.array_equal(llama(nxt, cache=cache), llama(nxt, cache=loaded)).item()


def test_models_that_take_fewer_caches_than_layers_are_accepted(llama, tmp_path):
    shared = tiny_model("llama", num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2)
    shared.make_cache = lambda: [mlx_cache.KVCache() for _ in range(2)]   # e.g. layers sharing a cache
    cache = tq.make_prompt_cache(shared)
    assert len(cache) == 2
    from turboquant.prompt_cache import check_layers
    check_layers(cache, shared)
    with pytest.raises(ValueError, match="3"):
        check_layers(cache + cache[:1], shared)


def test_bit_axon_ring_does_not_share_a_learning_codec():
    from turboquant.bitaxon import QuantizedSWACache
    ring = QuantizedSWACache(8, tq.Centered(tq.TurboQuantMSE(64, 4)))
    k = mx.random.normal((1, 2, 5, 64), key=mx.random.key(0)) + 3
    v = mx.random.normal((1, 2, 5, 64), key=mx.random.key(1)) - 3
    ring.update_and_fetch(k, v)
    assert ring.key_codec is not ring.value_codec
    assert mx.mean(ring.key_codec.mean).item() > 2 and mx.mean(ring.value_codec.mean).item() < -2


def test_unregistered_codec_subclasses_still_copy():
    class Mine(tq.TurboQuantMSE):
        name = "mine_not_registered"

        def config(self):
            return {**super().config(), "codec": self.name}

    c = Mine(64, 3)
    assert copy.deepcopy(c).config() == c.config()


def test_scalar_byte_tables_only_where_whole_bytes_hold_indices():
    from turboquant.attention import attention_from_codes, reference_attention
    codec = tq.TurboQuantMSE(20, 1, rotation="haar")                 # D·b = 20 bits: not whole bytes
    c = tq.TurboQuantKVCache(codec)
    k = mx.random.normal((1, 1, 6, 20), key=mx.random.key(0))
    kd, vd = c.update_and_fetch(k, k)
    kv, vv = c.codes()
    q = mx.random.normal((1, 2, 1, 20), key=mx.random.key(1))
    assert mx.abs(attention_from_codes(q, kv, vv) - reference_attention(q, kd, vd)).max().item() < 1e-5
