"""Cache files (``turboquant.cache_files``): any file name, every crafted or damaged file
refused naming the field, another model refused, mlx-lm-saved TurboQuant caches, a cache
trimmed to zero, models with fewer caches than layers."""
import json

import mlx.core as mx
import pytest

import turboquant as tq

from mlx_lm.models import cache as mlx_cache

from turboquant.models import run_in_chunks, tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)


def toks(n, seed=0):
    return mx.random.randint(1, 256, (1, n), key=mx.random.key(seed))


# a cache file is validated; any file name works
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


# a cache for another model
def test_loading_for_a_different_model_raises(saved, llama):
    path, _ = saved
    assert len(tq.load_prompt_cache(path, model=llama)) == 2
    for other, match in ((tiny_model("llama", num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2), "3"),
                         (tiny_model("llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=1), "kv heads"),
                         (tiny_model("llama", num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2), "head size")):
        with pytest.raises(ValueError, match=match):
            tq.load_prompt_cache(path, model=other)


# files written by mlx_lm.save_prompt_cache
def test_mlx_lm_saved_turboquant_caches_load(tmp_path, llama):
    cache = tq.make_prompt_cache(llama, key_codec=lambda d: tq.Centered(tq.TurboQuantMSE(d, 4)), fp_window=4)
    run_in_chunks(llama, toks(30), cache, [30])
    mlx_cache.save_prompt_cache(str(tmp_path / "m.safetensors"), cache, {"who": "mlx-lm"})
    loaded, meta = tq.load_prompt_cache(tmp_path / "m.safetensors", return_metadata=True)
    assert meta == {"who": "mlx-lm"}
    nxt = toks(1, seed=3)
    assert mx.array_equal(llama(nxt, cache=cache), llama(nxt, cache=loaded)).item()


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


# turned-mean layers (prerope.TurnedMeanCache): the wrapped codes, and the mean or the exact tokens held
def _turned(llama):
    from turboquant.budget import codecs_for
    k, v = codecs_for(4, 3, True)
    return tq.turned_mean(llama, tq.make_prompt_cache(llama, key_codec=k, value_codec=v, sink_tokens=1))


def _filled_saved_loaded(path, llama, cache, n, kind, version):
    """``cache`` after ``n`` tokens, saved to ``path`` and loaded: the same wrappers and offsets,
    in a file of format ``version``."""
    if n:
        run_in_chunks(llama, toks(n), cache, [n])
    tq.save_prompt_cache(path, cache, model=llama)
    loaded = tq.load_prompt_cache(path, model=llama)
    assert all(isinstance(c, kind) for c in loaded) and [c.offset for c in loaded] == [n] * len(cache)
    assert json.loads(mx.load(str(path), format="safetensors", return_metadata=True)[1]["turboquant"])["version"] \
        == version
    return loaded


@pytest.mark.parametrize("n", [0, 10, 30])        # empty, still learning the mean (< 1 + 16 tokens), learned
def test_turned_mean_layers_save_and_load(tmp_path, llama, n):
    from turboquant.attention import codes_attention
    from turboquant.prerope import TurnedMeanCache
    cache = _turned(llama)
    loaded = _filled_saved_loaded(tmp_path / "t.bin", llama, cache, n, TurnedMeanCache, 4)
    assert (loaded[0].mean is None) == (n < 17) and loaded[0].rope == cache[0].rope
    nxt = toks(20, seed=3)                     # continuing: bit for bit the original's, decoded and from codes
    assert mx.array_equal(llama(nxt, cache=cache), llama(nxt, cache=loaded)).item()
    with codes_attention(llama):
        assert mx.array_equal(llama(nxt[:, :1], cache=cache), llama(nxt[:, :1], cache=loaded)).item()
    with pytest.raises(ValueError, match="layer 1 was given tokens"):   # the loaded list checks its layers
        run_in_chunks(llama, nxt[:, :2], loaded[1:], [2])


def _turned_set(key, value, sub=None):
    def edit(h):
        t = h["layers"][0]["turned_mean"]
        (t[sub] if sub else t)[key] = value
        return h
    return edit


@pytest.mark.parametrize("n, edit_header, edit_arrays, match", [
    (30, None, _drop("0.t.mean"), "turned_mean tensors \\[\\]; a layer holding 30 coded tokens needs \\['mean'\\]"),
    (30, None, lambda a: a.__setitem__("0.t.mean", mx.zeros((2, 8))), "tensor 'mean' is \\(2, 8\\)"),
    (30, None, lambda a: a.__setitem__("0.t.mean", mx.full((2, 16), float("nan"))), "Inf or NaN"),
    (30, _turned_set("dims", 3, "rope"), None, "is not a RoPE"),
    (30, _turned_set("fit_tokens", 4), None, "sink_tokens must be 5"),
    (30, _turned_set("dtype", "int8"), None, "turned_mean dtype"),
    (30, _turned_set("extra", 1), None, "must have rope, fit_from"),
    (30, lambda h: h["layers"][0].pop("turned_mean") and h, None, "no 'turned_mean' setting"),
    (30, lambda h: {**h, "version": 3}, None, r"orphan tensor '\d.t.mean'"),
    (10, None, _drop("0.t.wv"), "needs \\['wk', 'wv'\\]"),
    (10, None, lambda a: a.__setitem__("0.t.wk", a["0.t.wk"][:, :, :4]), "expected two \\(B, H, n, 16\\)"),
])
def test_a_crafted_turned_mean_layer_is_refused(tmp_path, llama, n, edit_header, edit_arrays, match):
    cache = _turned(llama)
    run_in_chunks(llama, toks(n), cache, [n])
    tq.save_prompt_cache(tmp_path / "t.bin", cache)
    bad = _rewrite(tmp_path / "t.bin", tmp_path / "bad.bin", edit_header, edit_arrays)
    with pytest.raises(ValueError, match=match):
        tq.load_prompt_cache(bad)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("n", [5, 30])
def test_turned_mean_layers_of_a_half_precision_model_save_and_load(tmp_path, n, dtype):
    half = tiny_model("llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    half.set_dtype(dtype)
    cache = tq.make_prompt_cache(half, bits=4.25, turned_mean=True)
    run_in_chunks(half, toks(n), cache, [n])
    tq.save_prompt_cache(tmp_path / "t.bin", cache, model=half)
    loaded = tq.load_prompt_cache(tmp_path / "t.bin", model=half)
    nxt = toks(3, seed=5)
    assert mx.array_equal(half(nxt, cache=cache), half(nxt, cache=loaded)).item()
    assert loaded[0].dtype == dtype


def _as_turned(h):
    """A plain budget layer's settings dressed as a turned-mean layer's."""
    h["layers"][0]["turned_mean"] = {"rope": {"dims": 16, "traditional": False, "base": 10000.0, "scale": 1.0},
                                     "fit_from": 0, "fit_tokens": 1, "dtype": "float32"}
    return h


def test_crafted_turned_mean_settings_on_other_layers_are_refused(tmp_path, llama):
    cache = _turned(llama)
    tq.save_prompt_cache(tmp_path / "t.bin", cache)             # empty: a version-3 label would hide the setting
    bad = _rewrite(tmp_path / "t.bin", tmp_path / "bad.bin", lambda h: {**h, "version": 3})
    with pytest.raises(ValueError, match="'turned_mean' needs format version 4, the file says 3"):
        tq.load_prompt_cache(bad)
    from turboquant.budget import codecs_for
    k, v = codecs_for(4, 3, True)
    plain = tq.make_prompt_cache(llama, key_codec=k, value_codec=v, sink_tokens=1)   # centred after RoPE
    tq.save_prompt_cache(tmp_path / "p.bin", plain)
    bad = _rewrite(tmp_path / "p.bin", tmp_path / "bad.bin", lambda h: {**_as_turned(h), "version": 4})
    with pytest.raises(ValueError, match="codes keys with the codec inside its Centered.*key codec centered"):
        tq.load_prompt_cache(bad)
    cache = _turned(llama)
    run_in_chunks(llama, toks(10), cache, [10])                 # still learning the mean: exact tokens held
    tq.save_prompt_cache(tmp_path / "w.bin", cache)
    three = lambda a: [a.__setitem__(n, mx.concatenate([a[n], a[n][:, :1]], axis=1)) for n in ("0.t.wk", "0.t.wv")]
    bad = _rewrite(tmp_path / "w.bin", tmp_path / "bad.bin", edit_arrays=three)
    assert tq.load_prompt_cache(bad)[0].offset == 10               # a valid file in itself …
    with pytest.raises(ValueError, match="layer 0 holds 3 kv heads, the model has 2"):
        tq.load_prompt_cache(bad, model=llama)                      # … for another model


def test_a_file_whose_layers_disagree_is_refused(tmp_path, llama):
    cache = tq.make_prompt_cache(llama)
    run_in_chunks(llama, toks(10), cache, [10])
    tq.save_prompt_cache(tmp_path / "c.bin", cache)
    cache[1].trim(3)                                  # as if a forward pass had stopped part-way
    with pytest.raises(ValueError, match="save_prompt_cache: layer 1 has offset 7, layer 0 10"):
        tq.save_prompt_cache(tmp_path / "c.bin", cache)   # refused; the file saved before is kept
    assert tq.load_prompt_cache(tmp_path / "c.bin")[1].offset == 10

    def cut(a):                                       # the same disagreement, written by hand
        for g in ("k", "v"):
            for name in [n for n in a if n.startswith(f"1.{g}.")]:
                a[name] = a[name][:, :, :7]
    bad = _rewrite(tmp_path / "c.bin", tmp_path / "bad.bin",
                   lambda h: (h["layers"][1].update(offset=7), h)[1], cut)
    with pytest.raises(ValueError, match="layer 1 has offset 7, layer 0 10"):
        tq.load_prompt_cache(bad)


@pytest.mark.parametrize("kind", ["TurnedMeanCache", "PreRopeCache"])
def test_a_wrapped_cache_saved_by_mlx_lm_is_refused_saying_how_to_save_it(tmp_path, llama, kind):
    cache = {"TurnedMeanCache": _turned, "PreRopeCache": _before_rope}[kind](llama)
    run_in_chunks(llama, toks(30), cache, [30])
    mlx_cache.save_prompt_cache(str(tmp_path / "m.safetensors"), cache)
    with pytest.raises(ValueError, match=f"a {kind} saved by mlx_lm.save_prompt_cache.*save such caches with "
                                         "turboquant.save_prompt_cache"):
        tq.load_prompt_cache(tmp_path / "m.safetensors")


def test_a_turned_mean_cache_loads_only_for_a_model_with_its_rope(tmp_path, llama):
    cache = _turned(llama)
    run_in_chunks(llama, toks(30), cache, [30])
    tq.save_prompt_cache(tmp_path / "t.bin", cache)
    bad = _rewrite(tmp_path / "t.bin", tmp_path / "bad.bin", _turned_set("base", 500.0, "rope"))
    assert tq.load_prompt_cache(bad)[0].rope.base == 500.0          # without a model: as saved
    with pytest.raises(ValueError, match="layer 0 turns its key mean with .*base=500.0.*the model's RoPE is"):
        tq.load_prompt_cache(bad, model=llama)


def _before_rope(llama):
    from turboquant.prerope import pre_rope
    return pre_rope(llama, tq.make_prompt_cache(llama, key_codec=lambda d: tq.TurboQuantMSE(d, 3),
                                                value_codec=lambda d: tq.TurboQuantMSE(d, 3), sink_tokens=1))


@pytest.mark.parametrize("n", [0, 30])
def test_layers_coding_keys_before_rope_save_and_load(tmp_path, llama, n):
    """A ``PreRopeCache`` list (a profile that codes keys before RoPE makes one) is saved with
    the RoPE it undoes (format version 5 only then), loads as the same wrappers, continues bit
    for bit, and refuses a model with another RoPE or a crafted RoPE, naming the field."""
    from turboquant.prerope import PreRopeCache
    import copy
    cache = _before_rope(llama)
    loaded = _filled_saved_loaded(tmp_path / "p.bin", llama, cache, n, PreRopeCache, 5)
    copied = copy.deepcopy(loaded)
    nxt = toks(12, seed=3)
    assert mx.array_equal(llama(nxt, cache=cache), llama(nxt, cache=loaded)).item()
    for whole in (loaded, copied):             # loaded or copied, the list checks its layers take tokens in step
        with pytest.raises(ValueError, match="layer 1 was given tokens"):
            run_in_chunks(llama, nxt[:, :2], whole[1:], [2])
        with pytest.raises(ValueError, match="this prompt cache is unusable"):
            llama(nxt[:, :2], cache=whole)

    def rope_set(key, value):
        def edit(h):
            h["layers"][0]["pre_rope"]["rope"][key] = value
            return h
        return edit
    moved = _rewrite(tmp_path / "p.bin", tmp_path / "moved.bin", rope_set("base", 500.0))
    assert tq.load_prompt_cache(moved)[0].rope.base == 500.0          # without a model: as saved
    with pytest.raises(ValueError, match="layer 0 undid RoPE on its keys with .*base=500.0.*the model's RoPE is"):
        tq.load_prompt_cache(moved, model=llama)
    for edit, match in ((rope_set("dims", 3), "pre_rope rope .* is not a RoPE"),
                        (lambda h: (h["layers"][0]["pre_rope"].update(x=1), h)[1], "must have rope only"),
                        (lambda h: {**h, "version": 4}, "'pre_rope' needs format version 5"),
                        (lambda h: (h["layers"][0].update(turned_mean={}), h)[1], "says both")):
        with pytest.raises(ValueError, match=match):
            tq.load_prompt_cache(_rewrite(tmp_path / "p.bin", tmp_path / "bad.bin", edit))
