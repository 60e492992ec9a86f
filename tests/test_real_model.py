"""The default real model, offline: conversion, the Paris check, fp32 perplexity ≈ 22, and
evaluation through caches on it (Chapter 9)."""
import numpy as np
import pytest

from turboquant import make_prompt_cache
from turboquant.cache import FIT_TOKENS
from turboquant.codecs import Centered, Identity, TurboQuantMSE
from turboquant.convert import unpermute_qk
from turboquant.data import load_text
from turboquant.evaluation import (capture_qkv, encode_text, layer_fidelity, needle_prompt,
                             perplexity)
from turboquant.models import load_default


def llamacpp_permute(w, n_heads):
    """llama.cpp's converter (HF → GGUF), written out as the reference to invert."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("heads", [1, 3, 9])
def test_unpermute_inverts_llamacpp_permute(heads):
    w = np.random.default_rng(0).normal(size=(heads * 64, 40)).astype(np.float32)
    assert np.array_equal(unpermute_qk(llamacpp_permute(w, heads), heads), w)
    assert not np.array_equal(llamacpp_permute(w, heads), w)
    with pytest.raises(ValueError, match="unpermute"):
        unpermute_qk(w[:63], heads)


@pytest.fixture(scope="module")
def smol():
    return load_default()


@pytest.fixture(scope="module")
def wiki(smol):
    return encode_text(smol[1], load_text("wikipedia"), 2048)


def test_geometry_and_the_paris_check(smol):
    from mlx_lm import generate
    model, tok = smol
    a = model.args
    assert (a.num_hidden_layers, a.num_attention_heads, a.num_key_value_heads, a.hidden_size) == (30, 9, 3, 576)
    assert a.rope_theta == 1e5 and a.tie_word_embeddings
    assert "Paris" in generate(model, tok, "The capital of France is", max_tokens=4)
    assert tok.encode("2024", add_special_tokens=False) == [tok.convert_tokens_to_ids(c) for c in "2024"]


def test_fp32_perplexity_on_wikipedia_is_about_22(smol, wiki):
    r = perplexity(smol[0], wiki, None, window=512, chunk=512)
    assert r["windows"] == 4 and r["n_scored"] == 4 * 511
    assert 21.0 < r["ppl"] < 23.5                      # the reference: ≈ 22 (21.56 there)
    # chunked prefill through an exact cache changes nothing
    exact = perplexity(smol[0], wiki[:1024], lambda: make_prompt_cache(smol[0], key_codec=lambda d: Identity(d)),
                       window=512, chunk=100)
    full = perplexity(smol[0], wiki[:1024], None, window=512, chunk=512)
    assert abs(exact["ppl"] / full["ppl"] - 1) < 1e-4
    assert exact["bits"] == 32.0 * 656 / 512     # chunks of 100 grow storage in 256-slot steps: 656 slots


def test_compression_costs_perplexity_in_order_of_bits(smol, wiki):
    ids = wiki[:1024]
    ppl = {b: perplexity(smol[0], ids, lambda b=b: make_prompt_cache(smol[0], key_codec=lambda d: TurboQuantMSE(d, b)))["ppl"]
           for b in (2, 4)}
    ref = perplexity(smol[0], ids, None)["ppl"]
    assert ref < ppl[4] < 1.1 * ref < ppl[2]


def test_budget_cache_is_centered_with_a_sink_and_within_budget(smol, wiki):
    model = smol[0]
    cache = make_prompt_cache(model, bits=4.25, turned_mean=False)    # the centred rule
    assert isinstance(cache[0].key_codec, Centered) and cache[0].sink_tokens == 1    # before its first update
    assert cache[0].key_codec.inner.bits == 4 and cache[0].value_codec.bits == 4
    # + one fp32 sink and the FIT_TOKENS exact tokens the mean is fitted on, of 512: the
    # centred rule and the default (the mean turned with each position) hold the same bytes
    for turned in (False, None):
        r = perplexity(model, wiki[:512], lambda t=turned: make_prompt_cache(model, bits=4.25, turned_mean=t))
        assert abs(r["bits"] - (4.25 + 32 * (1 + FIT_TOKENS) / 512)) < 1e-9
    assert make_prompt_cache(model, bits=3.3, turned_mean=False)[0].key_codec.inner.bits == 3
    with pytest.raises(ValueError, match="smallest"):
        make_prompt_cache(model, bits=1.5, profile=False)
    with pytest.raises(ValueError, match="not both"):
        make_prompt_cache(model, bits=4, key_codec=lambda d: TurboQuantMSE(d, 4))


def test_the_shipped_profile_gives_calibrated_codecs_that_hold_on_other_text(smol):
    """SmolLM2's profile (calibrated on Wikipedia, asked for with profile=True) on news text
    it never saw: a 4.25-bit cache of per-layer transform coders, keys coded before RoPE (the
    search's choice), within 3 % of fp32 on 1024 tokens (Chapter 10 measures it on four kinds
    of text)."""
    from turboquant.codecs.transform import TransformCoder
    from turboquant.data import load_text
    from turboquant.prerope import PreRopeCache
    model, tok = smol
    cache = make_prompt_cache(model, bits=4.25, profile=True)
    assert all(isinstance(c, PreRopeCache) and isinstance(c.key_codec, TransformCoder) for c in cache)
    assert cache[0].sink_tokens == 1
    assert cache[0].key_codec.heads == 3 and cache[0].key_codec.bits_per_coordinate <= 4.25
    lee = encode_text(tok, load_text("lee"), 1024)
    ref = perplexity(model, lee, None)["ppl"]
    r = perplexity(model, lee, lambda: make_prompt_cache(model, bits=4.25, profile=True))
    assert abs(r["bits"] - (4.25 + 2 * 32 / 512 / 2)) < 1e-9
    assert ref < r["ppl"] < 1.03 * ref, (ref, r["ppl"])
    with pytest.raises(ValueError, match="no configuration within 2 bits"):
        make_prompt_cache(model, bits=2, profile=True)


def test_capture_and_layer_fidelity(smol, wiki):
    cap = capture_qkv(smol[0], wiki[:128])
    assert len(cap) == 30
    assert cap[0]["q"].shape == (1, 9, 128, 64) and cap[0]["k"].shape == (1, 3, 128, 64)
    exact = layer_fidelity(cap[:3], lambda d: Identity(d), lambda d: Identity(d), queries=32)
    assert all(f["cos_mean"] > 1 - 1e-6 for f in exact)
    lossy = layer_fidelity(cap[:3], lambda d: TurboQuantMSE(d, 2), Identity, queries=32)   # values exact
    assert all(f["cos_mean"] < 0.999 and f["key_rel_mse"] > 0.05 for f in lossy)
    both = layer_fidelity(cap[:3], lambda d: TurboQuantMSE(d, 2), lambda d: TurboQuantMSE(d, 2), queries=32)
    assert all(b["cos_mean"] < f["cos_mean"] for b, f in zip(both, lossy))           # 2-bit values cost more


def test_needle_prompt_places_the_fact(smol):
    tok = smol[1]
    hay = encode_text(tok, load_text("lee"), 600)
    ids = needle_prompt(tok, hay, 512, 0.5, "4721")
    assert len(ids) == 512
    text = tok.decode(ids)
    assert "secret code of the blue door is 4721" in text and text.rstrip().endswith("door is")
    with pytest.raises(ValueError, match="depth"):
        needle_prompt(tok, hay, 512, 1.5, "1")


def test_measured_bits_count_every_byte_of_the_tokens_held(smol):
    """One rule for KV bytes (memory.kv_bytes): measured bits divide the bytes by the
    coordinates the cache holds — a sliding-window cache holds its window, not every token
    it has seen (before #27 eval divided by ``offset``: 1.6 bits for this ring)."""
    import mlx.core as mx
    from turboquant.memory import fp16_cache_bytes, measured_bits
    model = smol[0]
    for kw, held in (({}, 256), ({"max_kv_size": 128}, 128)):
        cache = make_prompt_cache(model, key_codec=lambda d: TurboQuantMSE(d, 3), **kw)
        model(mx.array([list(range(100, 355))]), cache=cache)
        model(mx.array([[355]]), cache=cache)          # one decode step: a ring is back to its window
        assert measured_bits(model, cache) == 3.25
        assert fp16_cache_bytes(model, cache) == len(cache) * held * 2 * 3 * 64 * 2
    from mlx_lm.models.cache import QuantizedKVCache                  # no size() of its own: its offset
    cache = [QuantizedKVCache(group_size=64, bits=4) for _ in model.layers]
    model(mx.array([list(range(100, 356))]), cache=cache)
    assert measured_bits(model, cache) == 5.0                          # 4 + 2·16/64, allocated in 256-steps


def test_bitaxon_ring_on_real_keys(smol, wiki):
    """Chapter 8's measurement, smaller: a prefill of 4 windows through the ring of codes."""
    from turboquant.bitaxon import ring_fidelity
    cap = capture_qkv(smol[0], wiki[:512])[::6]                       # 5 of the 30 layers
    exact = ring_fidelity(cap, lambda d: Identity(d), window=128, chunk=64)
    assert all(f["rel_error"] < 1e-5 for f in exact)                  # pass-through ring = exact window
    cos = {b: np.mean([f["cos_mean"] for f in ring_fidelity(cap, lambda d: TurboQuantMSE(d, b), 128, 64)])
           for b in (4, 3, 2)}
    assert 0.98 < cos[4] < 1 and cos[4] > cos[3] > cos[2] > 0.8, cos
    keys_only = ring_fidelity(cap, lambda d: TurboQuantMSE(d, 3), 128, 64, value_codec=lambda d: Identity(d))
    values_only = ring_fidelity(cap, lambda d: Identity(d), 128, 64, value_codec=lambda d: TurboQuantMSE(d, 3))
    assert np.mean([f["cos_mean"] for f in keys_only]) < np.mean([f["cos_mean"] for f in values_only])


def test_needle_values_are_distinct_and_extend_chapter_9s():
    from turboquant.evaluation import NEEDLE_VALUES, needle_values
    v = needle_values(21)
    assert len(set(v)) == 21 and v[:4] == NEEDLE_VALUES and all(len(x) == 4 and x.isdigit() for x in v)
    assert needle_values(21) == v and needle_values(2) == NEEDLE_VALUES[:2]
    with pytest.raises(ValueError, match="int ≥ 1"):
        needle_values(0)


@pytest.mark.parametrize("kind", ["fp32", "centered TQ-mse 3"])
def test_needle_trials_sharing_the_haystack_equal_trials_run_alone(smol, kind):
    """needle_accuracy prefills the haystack before the needle once per cell and deep-copies
    the cache: only whole chunks are shared, so every trial runs the chunks it would run
    alone — the same answers, the same logits."""
    import mlx.core as mx
    from turboquant.evaluation import fill_cache, needle_accuracy, prefill_logits
    model, tok = smol
    mk = None if kind == "fp32" else (lambda: make_prompt_cache(model, key_codec=lambda d: Centered(TurboQuantMSE(d, 3)),
                                                                value_codec=lambda d: TurboQuantMSE(d, 3)))
    hay = encode_text(tok, load_text("lee"), 400)
    values = ("4721", "8356")
    shared = needle_accuracy(model, tok, hay, [320], [0.9], mk, values=values, chunk=64, max_tokens=3)
    alone = needle_accuracy(model, tok, hay, [320], [0.9], mk, values=values, chunk=64, max_tokens=3,
                            share_prefix=False)
    assert [t["answer"] for t in shared["trials"]] == [t["answer"] for t in alone["trials"]]
    assert [(t["start_logp"], t["start_margin"], t["code_logp"]) for t in shared["trials"]] == \
        [(t["start_logp"], t["start_margin"], t["code_logp"]) for t in alone["trials"]]
    assert shared["cells"] == alone["cells"] and [c["n"] for c in shared["cells"]] == [2]
    assert all(0 <= c["lo"] <= c["ok"] / 2 <= c["hi"] <= 1 for c in shared["cells"])
    prompts = [needle_prompt(tok, hay, 320, 0.9, v) for v in values]
    same = next(i for i in range(320) if len({p[i] for p in prompts}) > 1)    # where the values differ
    s = same // 64 * 64
    assert s >= 192
    fresh = (lambda: mk()) if mk else (lambda: __import__("mlx_lm").models.cache.make_prompt_cache(model))
    whole = prefill_logits(model, mx.array(prompts[1])[None], fresh(), 64)
    base = fresh()
    prefill_logits(model, mx.array(prompts[1][:s])[None], base, 64)
    rest = prefill_logits(model, mx.array(prompts[1][s:])[None], __import__("copy").deepcopy(base), 64)
    assert mx.array_equal(whole[:, s:], rest).item()
    headless = fresh()                          # fill_cache: the same cache without the output head
    fill_cache(model, mx.array(prompts[1][:s])[None], headless, 64)
    assert mx.array_equal(prefill_logits(model, mx.array(prompts[1][s:])[None], headless, 64), rest).item()


def test_a_needle_trial_scores_the_right_answer_as_the_model_does(smol):
    """start_logp and code_logp are the log-probabilities of " " + value's tokens that one
    forward pass over prompt + answer gives (fp32: up to float rounding), and a trial's greedy
    answer is what it was before they were scored (the scoring runs on a copy of the cache)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache as mlx_prompt_cache

    from turboquant.evaluation import greedy, needle_accuracy, prefill_logits
    model, tok = smol
    hay = encode_text(tok, load_text("lee"), 400)
    r = needle_accuracy(model, tok, hay, [320], [0.5], None, values=("4721",), chunk=64, max_tokens=3)
    t = r["trials"][0]
    ids = needle_prompt(tok, hay, 320, 0.5, "4721")
    answer = encode_text(tok, " 4721")
    assert len(answer) > 1
    logits = prefill_logits(model, mx.array(ids + answer)[None], mlx_prompt_cache(model), 64)[0]
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    first = lp[len(ids) - 1, answer[0]].item()
    rest = sum(lp[len(ids) - 1 + j, answer[j]].item() for j in range(1, len(answer)))
    assert t["start_logp"] == pytest.approx(first, abs=1e-3) and t["code_logp"] == pytest.approx(rest, abs=1e-3)
    assert t["start_logp"] < 0 and t["code_logp"] < 0
    rival = mx.max(mx.concatenate([lp[len(ids) - 1, :answer[0]], lp[len(ids) - 1, answer[0] + 1:]])).item()
    assert t["start_margin"] == pytest.approx(first - rival, abs=1e-3)
    alone = greedy(model, mx.array(ids)[None], mlx_prompt_cache(model), 3, 64)
    assert t["answer"] == tok.decode(alone) and (t["start_margin"] > 0) == (alone[0] == answer[0])


def test_scoring_a_needle_trial_leaves_a_compressed_cache_as_it_was(smol):
    """Through the default 4.25-bit cache (turned mean) a trial's greedy answer is what a fresh
    cache of that kind answers without the scoring pass, whose lead says how the answer starts."""
    import mlx.core as mx

    from turboquant.evaluation import greedy, needle_accuracy
    model, tok = smol
    hay = encode_text(tok, load_text("lee"), 400)
    mk = lambda: make_prompt_cache(model, bits=4.25)
    r = needle_accuracy(model, tok, hay, [320], [0.9], mk, values=("4721", "8356"), chunk=64, max_tokens=3)
    for t in r["trials"]:
        alone = greedy(model, mx.array(needle_prompt(tok, hay, 320, 0.9, t["value"]))[None], mk(), 3, 64)
        first = encode_text(tok, " " + t["value"])[0]
        assert t["answer"] == tok.decode(alone) and (t["start_margin"] > 0) == (alone[0] == first)


def test_held_out_calibration_text_is_scored_only_past_the_calibration_windows(smol):
    """``start`` skips tokens of the corpus: past the calibration windows (8 × 512) calibrated
    rows may be scored on their own calibration corpus — held-out calibration text, where
    the profiles' levers are decided — and not before."""
    from turboquant.suite import calibration_corpus_for, evaluate
    model, tok = smol
    with pytest.raises(ValueError, match="calibration corpus"):
        calibration_corpus_for(["calibrated 4.25"], ["wikipedia"], "wikipedia", start=4095)
    assert calibration_corpus_for(["calibrated 4.25"], ["wikipedia"], "wikipedia", start=4096) == "wikipedia"
    from turboquant.calibration import find_profile
    p = find_profile(model)
    used = len(p["calibration"]["ids"]) + p["heldout"]["tokens"]      # its windows and its search's tokens
    with pytest.raises(ValueError, match=f"from start ≥ {used}"):
        evaluate(model, tok, ["profile 4.25"], corpus="wikipedia", calibration_corpus="lee", start=4096,
                 tokens=512, agreement_tokens=0, fidelity_tokens=0, progress=False)
    r = evaluate(model, tok, ["fp32"], corpus="wikipedia", start=512, tokens=512, agreement_tokens=0,
                 fidelity_tokens=0, progress=False)
    alone = perplexity(model, encode_text(tok, load_text("wikipedia"), 1024)[512:], None, bos=r["setup"]["bos"])
    assert r["setup"]["start"] == 512 and r["results"]["fp32"]["ppl"] == alone["ppl"]


def _recalibrated(monkeypatch, model):
    """As if the model were calibrated again: ``find_profile`` (which the caches and a row's
    recorded digest both read) returns the shipped profile with one field changed."""
    from turboquant.calibration import profiles
    shipped = profiles.find_profile(model)
    changed = {**shipped, "seconds": shipped["seconds"] + 1.0}
    monkeypatch.setattr(profiles, "find_profile", lambda m: changed)


def test_a_needle_grid_resumes_and_remeasures_a_changed_profile(smol, tmp_path, monkeypatch):
    """``needles.needle_grid`` writes its JSON after every cell; a second call keeps what the
    file holds (an interrupted run measures only its missing cells), and measures again a
    profile row whose profile changed."""
    import json

    from turboquant import needles
    model, tok = smol
    out = tmp_path / "grid.json"
    kw = dict(depths=[0.1, 0.5], values=1, out=out, chunk=64, progress=False)
    first = needles.needle_grid(model, tok, ["fp32", "profile 4.25"], [192], **kw)
    assert json.loads(out.read_text()) == first
    cell = first["results"]["fp32"]["cells"][1]
    assert (cell["context"], cell["depth"], cell["n"]) == (192, 0.5, 1) and 0 <= cell["lo"] <= cell["hi"] <= 1
    assert first["results"]["profile 4.25"]["profile_sha256"]
    calls = []
    import turboquant.evaluation as ev
    orig = ev.needle_accuracy
    monkeypatch.setattr(ev, "needle_accuracy", lambda *a, **k: calls.append(a[4]) or orig(*a, **k))
    again = needles.needle_grid(model, tok, ["fp32", "profile 4.25"], [192], **kw)
    assert calls == [] and again["results"] == first["results"]
    cut = json.loads(out.read_text())                    # as if stopped before fp32's last cell was written
    del cut["results"]["fp32"]["cells"][1], cut["results"]["fp32"]["trials"][1]
    out.write_text(json.dumps(cut))
    resumed = needles.needle_grid(model, tok, ["fp32", "profile 4.25"], [192], **kw)
    assert calls == [[0.5]] and resumed["results"]["fp32"]["cells"] == first["results"]["fp32"]["cells"]
    calls.clear()
    _recalibrated(monkeypatch, model)
    needles.needle_grid(model, tok, ["fp32", "profile 4.25"], [192], **kw)
    digest = json.loads(out.read_text())["results"]["profile 4.25"]["profile_sha256"]
    assert calls == [[0.1], [0.5]] and digest != first["results"]["profile 4.25"]["profile_sha256"]
    with pytest.raises(ValueError, match="another setup"):
        needles.needle_grid(model, tok, ["fp32"], [192], **{**kw, "values": 2})
    with pytest.raises(ValueError, match="unknown configuration"):
        needles.needle_grid(model, tok, ["nope"], [192], **kw)


def test_a_needle_grid_fits_calibrated_rows_over_the_positions_it_records(smol, tmp_path, monkeypatch):
    """A grid's calibrated rows are fitted with their keys spread over the model's context (a
    needle sits far past one calibration window); each row records those positions, is not
    fitted again when resumed with the same, and is measured again with others."""
    from turboquant import needles, suite
    from turboquant.calibration.phases import context_length
    model, tok = smol
    seen = []
    fitted = suite.calibration_statistics

    def one_window(model, tok, names, corpus, windows, progress, positions=None):   # the grid fits on 8
        seen.append(positions)
        return fitted(model, tok, names, corpus, 1, progress, positions=positions)

    monkeypatch.setattr(suite, "calibration_statistics", one_window)
    kw = dict(depths=[0.5], values=1, out=tmp_path / "grid.json", chunk=64, progress=False)
    first = needles.needle_grid(model, tok, ["KVQuant-style 4"], [192], **kw)
    assert seen == [context_length(model)] == [first["results"]["KVQuant-style 4"]["calibration_positions"]]
    needles.needle_grid(model, tok, ["KVQuant-style 4"], [192], **kw)
    assert seen == [context_length(model)]                       # resumed: nothing fitted or measured again
    again = needles.needle_grid(model, tok, ["KVQuant-style 4"], [192], positions=None, **kw)
    assert seen == [context_length(model), None] and again["results"]["KVQuant-style 4"]["calibration_positions"] is None
    assert len(again["results"]["KVQuant-style 4"]["cells"]) == 1
    with pytest.raises(ValueError, match="positions must be .* got 100"):
        needles.needle_grid(model, tok, ["KVQuant-style 4"], [192], positions=100, **kw)


def test_channel_profile_sees_an_outlier_channel_and_the_rotation_spread_it():
    """One channel 20× the others: it holds half the energy of the raw channels; after a
    random rotation the outlier's direction is spread over all channels (its largest share
    is a few times 1/D, not a constant) and the mean fourth moment of the coordinates is the
    Beta law's 3/(D(D+2)) (Chapter 2) to sampling error (16.8× it before)."""
    from turboquant.evaluation import channel_profile
    from turboquant.rotation import Rotation
    from turboquant.sphere import coordinate_moment
    D = 128
    x = np.random.default_rng(0).normal(size=(4000, D))
    x[:, 5] *= 20
    raw, rot = channel_profile(x), channel_profile(x, Rotation("haar", D, seed=1))
    assert raw["peak_to_median"] > 8 and raw["top_share"] > 0.5 and np.argmax(raw["rms"]) == 5
    assert rot["peak_to_median"] < 4 and rot["top_share"] < 0.1
    assert abs(rot["fourth_moment"] / coordinate_moment(D, 4) - 1) < 0.1
    assert raw["fourth_moment"] > 10 * coordinate_moment(D, 4)
    with pytest.raises(ValueError, match="zero"):
        channel_profile(np.zeros((2, D)))
    with pytest.raises(ValueError, match="NaN"):
        channel_profile(np.full((2, D), np.nan))
    with pytest.raises(ValueError, match="dim 64"):
        channel_profile(x, Rotation("haar", 64))
    import matplotlib.pyplot as plt

    from turboquant.viz import plot_key_channels
    fig = plot_key_channels([raw], [rot], 0)
    assert "peak/median" in fig.axes[0].get_title()
    plt.close(fig)
    with pytest.raises(ValueError, match="layer must lie"):
        plot_key_channels([raw], [rot], 1)


def test_needle_attention_reads_what_attention_reads(smol):
    """``needle_attention``'s weights on the code's tokens are the softmax of the model's own
    queries and keys (recomputed here from ``capture_qkv`` of prompt + answer in one pass);
    an exact cache adds no score noise and reads the same weights; the default 4.25-bit
    cache adds noise in every layer; its log p(code | start) is ``answer_logprobs``'."""
    import mlx.core as mx

    from turboquant.codecs import Identity
    from turboquant.evaluation import capture_qkv, needle_accuracy, needle_attention
    model, tok = smol
    hay = encode_text(tok, load_text("lee"), 400)
    fp = needle_attention(model, tok, hay, 320, 0.5, "4721", None, chunk=64)
    ids = needle_prompt(tok, hay, 320, 0.5, "4721")
    answer = encode_text(tok, " 4721")
    code = fp["code_tokens"]
    assert [ids[i] for i in code] == answer[1:]                 # the code's own tokens in the needle
    qkv = capture_qkv(model, ids + answer[:-1])
    L = len(answer) - 1
    for n in (0, 17):                # mlx's own attention, reading values that mark the code's tokens
        q, k, s = qkv[n]["q"], qkv[n]["k"], qkv[n]["scale"]
        T = k.shape[2]
        marks = mx.zeros((T,)).at[mx.array(code)].add(1.0)
        v = mx.broadcast_to(marks[None, None, :, None], (1, k.shape[1], T, 1))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=s, mask="causal")   # (1, Hq, T, 1)
        mass = np.array(out[0, :, -L:, 0].mean(-1))
        assert np.allclose(fp["mass"][n], mass, atol=1e-4)
    assert fp["noise"] == [0.0] * len(fp["noise"]) and fp["noise_code"] == [0.0] * len(fp["noise"])
    assert fp["value_noise"] == [0.0] * len(fp["noise"]) == fp["value_incoherent"]
    exact = needle_attention(model, tok, hay, 320, 0.5, "4721",
                             lambda: make_prompt_cache(model, key_codec=Identity, value_codec=Identity), chunk=64)
    assert exact["noise"] == [0.0] * len(fp["noise"]) and np.allclose(exact["mass"], fp["mass"], atol=1e-4)
    assert exact["value_noise"] == [0.0] * len(fp["noise"])
    assert np.array(fp["score_lift"]).tolist() == np.array(exact["score_lift"]).tolist() == \
        np.zeros((len(fp["noise"]), len(fp["mass"][0]))).tolist()             # exact keys move no score
    # through a wrapper (keys stored before RoPE and turned back): the exact keys it is given are
    # what it returns, so an exact coder adds no noise there either
    wrapped = needle_attention(model, tok, hay, 320, 0.5, "4721", lambda: make_prompt_cache(
        model, key_codec=Identity, value_codec=Identity, pre_rope=True), chunk=64)
    assert max(wrapped["noise"]) < 1e-4 and np.allclose(wrapped["mass"], fp["mass"], atol=1e-3)
    assert max(wrapped["value_noise"]) < 1e-6                 # the values pass through the wrapper exactly
    mk = lambda: make_prompt_cache(model, bits=4.25)
    coded = needle_attention(model, tok, hay, 320, 0.5, "4721", mk, chunk=64)
    assert all(x > 0 for x in coded["noise"])              # coding adds score noise in every layer
    assert all(x > 0 for x in coded["value_noise"]) and all(x > 0 for x in coded["value_incoherent"])
    # each half's measure reads its own half: exact keys add no score noise, exact values no value noise
    from turboquant.budget import codecs_for
    k4, v4 = codecs_for(4, 4, True)
    keys_only = needle_attention(model, tok, hay, 320, 0.5, "4721", lambda: make_prompt_cache(
        model, key_codec=k4, value_codec=Identity, sink_tokens=1), chunk=64)
    values_only = needle_attention(model, tok, hay, 320, 0.5, "4721", lambda: make_prompt_cache(
        model, key_codec=Identity, value_codec=v4, sink_tokens=1), chunk=64)
    assert keys_only["value_noise"] == [0.0] * len(fp["noise"]) and min(keys_only["noise"]) > 0
    assert values_only["noise"] == [0.0] * len(fp["noise"]) and min(values_only["value_noise"]) > 0
    assert not np.any(values_only["score_lift"]) and np.all(np.any(keys_only["score_lift"], axis=1))
    # the score lift, recomputed in the first layer from the exact run's queries and keys and the
    # keys a keys-only cache gives back: the code's mean score error minus the other tokens'
    # (the needle's other tokens and the answer's own left out)
    from turboquant.evaluation.needle import NEEDLE
    from turboquant.evaluation.prefilling import next_logits
    back = {}
    cache = make_prompt_cache(model, key_codec=k4, value_codec=Identity, sink_tokens=1)
    inner = cache[0].update_and_fetch
    cache[0].update_and_fetch = lambda keys, values: back.__setitem__(0, inner(keys, values)) or back[0]
    next_logits(model, mx.array(ids)[None], cache, 64)
    model(mx.array(answer[:-1])[None], cache=cache)
    needle = encode_text(tok, " " + NEEDLE.format(value="4721") + " ")
    code = keys_only["code_tokens"]
    at = code[0] - next(i for i in range(len(needle)) if needle[i:i + len(code)] == answer[1:])
    q, s = np.array(qkv[0]["q"][0]), qkv[0]["scale"]
    k, kh = (np.repeat(np.array(x[0]), q.shape[0] // x.shape[1], axis=0) for x in (qkv[0]["k"], back[0][0]))
    err = ((q[:, -L:] @ (kh - k).transpose(0, 2, 1)) * s)                      # (Hq, L, T)
    others = [i for i in range(k.shape[1] - L) if not at <= i < at + len(needle)]
    lift = (err[:, :, code].mean(-1) - err[:, :, others].mean(-1)).mean(-1)
    assert np.allclose(keys_only["score_lift"][0], lift, atol=1e-4)
    # the value measures, recomputed in the first layer (whose inputs no coding has touched yet)
    # from the exact run's queries and keys (exact keys: the same weights) and the values the
    # cache was given and gave back, captured from its update_and_fetch
    held = {}
    cache = make_prompt_cache(model, key_codec=Identity, value_codec=v4, sink_tokens=1)
    for n, c in enumerate(cache):
        def keep(keys, values, inner=c.update_and_fetch, n=n):
            out = inner(keys, values)
            held[n] = (values if n not in held else mx.concatenate([held[n][0], values], axis=2), out[1])
            return out
        c.update_and_fetch = keep
    next_logits(model, mx.array(ids)[None], cache, 64)
    model(mx.array(answer[:-1])[None], cache=cache)
    for n in (0,):
        q, s = np.array(qkv[n]["q"][0]), qkv[n]["scale"]
        k, v, vh = (np.repeat(np.array(x[0]), q.shape[0] // x.shape[1], axis=0)
                    for x in (qkv[n]["k"], *held[n]))
        T = k.shape[1]
        scores = np.where(np.tril(np.ones((T, T), bool)), (q @ k.transpose(0, 2, 1)) * s, -np.inf)[:, -L:]
        w = np.exp(scores - scores.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        dv, out = vh - v, np.linalg.norm(w @ v, axis=-1)
        assert values_only["value_noise"][n] == pytest.approx((np.linalg.norm(w @ dv, axis=-1) / out).mean(), rel=1e-3)
        incoherent = np.sqrt((w * w) @ (dv * dv).sum(-1)[..., None])[..., 0] / out
        assert values_only["value_incoherent"][n] == pytest.approx(incoherent.mean(), rel=1e-3)
    t = needle_accuracy(model, tok, hay, [320], [0.5], mk, values=("4721",), chunk=64, max_tokens=1)["trials"][0]
    assert coded["code_logp"] == pytest.approx(t["code_logp"], abs=1e-3)


def test_needle_attention_refuses_what_it_cannot_read(smol):
    from turboquant.evaluation import needle_attention
    from turboquant.models import ByteTokenizer, tiny_model
    gemma = tiny_model("gemma3", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=1)
    with pytest.raises(ValueError, match="sliding-window layers"):
        needle_attention(gemma, ByteTokenizer(), list(range(1, 400)), 256, 0.5, "4721")
    model, tok = smol
    hay = encode_text(tok, load_text("lee"), 400)
    with pytest.raises(ValueError, match="depth must lie in"):
        needle_attention(model, tok, hay, 320, 1.5, "4721")
    with pytest.raises(ValueError, match="chunk must be"):
        needle_attention(model, tok, hay, 320, 0.5, "4721", chunk=0)
    with pytest.raises(ValueError, match="sliding-window layers"):         # a window on every layer
        needle_attention(model, tok, hay, 320, 0.5, "4721", lambda: make_prompt_cache(model, bits=4.25,
                                                                                    max_kv_size=128,
                                                                                    warn_rotating=False))
    from mlx_lm.models.cache import QuantizedKVCache
    with pytest.raises(ValueError, match="packed tuples"):
        needle_attention(model, tok, hay, 320, 0.5, "4721", lambda: [QuantizedKVCache() for _ in model.layers])


def test_the_profile_halves_hold_one_side_exactly(smol):
    """"profile 4.25, exact keys/values": the shipped profile's coders on one side, the other
    side ``Identity`` (float32), keys before RoPE only when the profile's keys are coded."""
    from turboquant.calibration import find_profile
    from turboquant.calibration.store import profile_codecs
    from turboquant.codecs import Identity
    from turboquant.prerope import PreRopeCache
    from turboquant.suite import CONFIGS
    model, _ = smol
    keys, values, _, entry = profile_codecs(model, find_profile(model), 4.25)
    exact_k = CONFIGS["profile 4.25, exact keys"].make_cache(model)()
    exact_v = CONFIGS["profile 4.25, exact values"].make_cache(model)()
    assert all(isinstance(c.key_codec, Identity) and c.value_codec.config() == v.config()
               for c, v in zip(exact_k, values))
    assert all(isinstance(c.value_codec, Identity) and c.key_codec.config() == k.config()
               for c, k in zip(exact_v, keys))
    assert not isinstance(exact_k[0], PreRopeCache)
    assert isinstance(exact_v[0], PreRopeCache) == bool(entry["choice"].get("pre_rope"))
    assert CONFIGS["profile 4.25, exact keys"].bits(64) == (4.25 + 32) / 2


def test_a_mixed_cache_takes_each_half_from_its_own_configuration(smol):
    """"profile 4.25 keys, KVQuant-style 4 values" and the reverse: each half's coders are
    those its configuration fits (the same calibration statistics), keys before RoPE exactly
    when the key half codes them there; halves from rows that are not calibrated, or that
    keep different sink tokens, are refused by name."""
    from dataclasses import replace

    from turboquant import suite
    from turboquant.prerope import PreRopeCache
    from turboquant.suite import CONFIGS, Mixed
    model, tok = smol
    names = ["profile 4.25 keys, KVQuant-style 4 values", "KVQuant-style 4 keys, profile 4.25 values"]
    stats = suite.calibration_statistics(model, tok, names, "wikipedia", windows=1, positions=2048)
    pk, pv, _, pre = CONFIGS["profile 4.25"].coders(model)
    qk, qv, _, _ = CONFIGS["KVQuant-style 4"].coders(model, stats)
    for name, keys, values, before in ((names[0], pk, qv, pre), (names[1], qk, pv, False)):
        cache = CONFIGS[name].make_cache(model, stats)()
        assert [c.key_codec.config() for c in cache] == [k.config() for k in keys]
        assert [c.value_codec.config() for c in cache] == [v.config() for v in values]
        assert isinstance(cache[0], PreRopeCache) == before
        assert CONFIGS[name].bits(64) == (CONFIGS["profile 4.25"].bits(64) + CONFIGS["KVQuant-style 4"].bits(64)) / 2
    assert pre                                           # the shipped profile codes keys before RoPE at 4.25
    from turboquant.codecs import Identity
    for half, cache in (("keys", CONFIGS["KVQuant-style 4, exact keys"].make_cache(model, stats)()),
                        ("values", CONFIGS["KVQuant-style 4, exact values"].make_cache(model, stats)())):
        exact, coded, theirs = (("key_codec", "value_codec", qv) if half == "keys" else ("value_codec", "key_codec", qk))
        assert all(isinstance(getattr(c, exact), Identity) for c in cache)
        assert [getattr(c, coded).config() for c in cache] == [x.config() for x in theirs]
        assert not isinstance(cache[0], PreRopeCache) and cache[0].sink_tokens == 1
    assert CONFIGS["KVQuant-style 4, exact keys"].bits(64) == (32 + CONFIGS["KVQuant-style 4"].bits(64)) / 2
    with pytest.raises(ValueError, match=r"not \['fp32'\]"):
        Mixed("fp32", "profile 4.25").make_cache(model, stats)
    with pytest.raises(ValueError, match=r"one half 'exact'; not \['exact', 'exact'\]"):
        Mixed("exact", "exact").make_cache(model, stats)
    CONFIGS["two sinks"] = replace(CONFIGS["KVQuant-style 4"], sink_tokens=2)
    try:
        with pytest.raises(ValueError, match="'two sinks' keeps 2 exact sink tokens and 'profile 4.25' 1"):
            Mixed("two sinks", "profile 4.25").make_cache(model, stats)
    finally:
        del CONFIGS["two sinks"]


def test_the_key_probes_spend_kvquant_style_4s_bits_and_change_one_thing_each(smol):
    """``suite.KEY_PROBES``: each "…, exact values" row codes its keys with the coder it names
    (Identity values), 280 bits per 64-coordinate key like KVQuant-style 4's; the channel
    probe with water-filling differs from KVQuant-style 4 only in its allocation, the KLT
    probes only in theirs, and the pre-RoPE probe is KVQuant-style 4's coder before RoPE.
    A half given as an unnamed configuration that is not calibrated is refused."""
    from turboquant import suite
    from turboquant.codecs import Identity
    from turboquant.prerope import PreRopeCache
    from turboquant.suite import CONFIGS, KEY_PROBES, Mixed
    model, tok = smol
    names = [f"{name}, exact values" for name, _, _ in KEY_PROBES]
    stats = suite.calibration_statistics(model, tok, names + ["KVQuant-style 4"], "wikipedia", windows=1,
                                         positions=2048)
    caches = {n: CONFIGS[n].make_cache(model, stats)() for n in names + ["KVQuant-style 4, exact values"]}
    for name, cache in caches.items():
        assert all(isinstance(c.value_codec, Identity) for c in cache)
        assert isinstance(cache[0], PreRopeCache) == name.startswith("pre-RoPE")
        assert all(c.key_codec.bits_per_coordinate * 64 == 280 and c.key_codec.outliers == 1 for c in cache)
    keys = lambda n: [c.key_codec for c in caches[n]]
    alloc = lambda k: list(k.alloc)
    # equal bits: every axis 4; by variance: not all equal, the same 256 in all
    for n in ("KVQuant-style 4, exact values", "pre-RoPE KVQuant-style 4, exact values", "KLT, equal bits, exact values"):
        assert all(alloc(k) == [4] * 64 for k in keys(n)), n
    for n in ("channels, water-filling, exact values", "KLT, water-filling, exact values"):
        assert all(sum(alloc(k)) == 256 and len(set(alloc(k))) > 1 for k in keys(n)), n
    kinds = lambda ns: {k.kind for n in ns for k in keys(n)}
    assert kinds(names[:2] + ["KVQuant-style 4, exact values"]) == {"channels"} and kinds(names[2:]) == {"klt+metric"}
    with pytest.raises(ValueError, match="calibrated or profile rows"):
        Mixed(CONFIGS["TQ-mse 4"], "exact").make_cache(model, stats)


def test_the_needle_reading_command_prints_the_recorded_value_measures(tmp_path, capsys):
    """``turboquant needle --attention`` on the book's recorded reading measures nothing again and
    prints, per row, the value noise in the reading layers with its ratio to what independent
    per-token errors would give (none for fp32, whose values are exact) and the score lift there
    (exactly 0 for fp32, whose keys are exact)."""
    import json
    import shutil
    from pathlib import Path

    from turboquant import cli
    from turboquant.needles import reading_layers, score_lift, value_noise
    recorded = Path(__file__).resolve().parents[1] / "book" / "results" / "needle_reading_smollm2.json"
    out = tmp_path / "reading.json"
    shutil.copy(recorded, out)
    assert cli.main(["needle", "--attention", "--contexts", "4096", "--depths", "0.1", "--values", "4",
                     "--configs", "fp32", "KVQuant-style 4", "--out", str(out), "--quiet"]) == 0
    assert out.read_bytes() == recorded.read_bytes()
    lines = {line.split("  ")[0].split(" L")[0].strip(): line for line in capsys.readouterr().out.splitlines()}
    record = json.loads(recorded.read_text())
    measured, independent = (v[reading_layers(record)].mean() for v in value_noise(record, "KVQuant-style 4"))
    lift = score_lift(record, "KVQuant-style 4")[reading_layers(record)].mean()
    assert f"value noise {measured:.3f} ({measured / independent:.1f}×)  lift {lift:+.3f}" in lines["KVQuant-style 4"]
    assert "value noise 0.000  lift +0.000  log p" in lines["fp32"]


def test_a_needle_reading_resumes_and_names_the_reading_layers(smol, tmp_path, monkeypatch):
    """``needles.needle_reading`` writes its JSON after every configuration and keeps, on a
    second call, what the file holds; a profile row whose profile changed is read again.
    ``reading_layers`` are those where fp32's answer gives the code's tokens ≥ 0.1."""
    import json

    from turboquant import needles
    from turboquant.evaluation import needle as ev_needle
    model, tok = smol
    out = tmp_path / "reading.json"
    kw = dict(values=1, out=out, progress=False)
    first = needles.needle_reading(model, tok, ["fp32", "profile 4.25"], 320, 0.5, **kw)
    assert json.loads(out.read_text()) == first and first["setup"]["kind"] == "needle reading"
    mass = np.array(first["results"]["fp32"]["trials"][0]["mass"]).sum(-1)
    assert needles.reading_layers(first) == [n for n in range(len(mass)) if mass[n] >= 0.1] != []
    calls = []
    orig = ev_needle.needle_attention
    monkeypatch.setattr(ev_needle, "needle_attention", lambda *a, **k: calls.append(a[5]) or orig(*a, **k))
    assert needles.needle_reading(model, tok, ["fp32", "profile 4.25"], 320, 0.5, **kw) == first and calls == []
    _recalibrated(monkeypatch, model)
    again = needles.needle_reading(model, tok, ["fp32", "profile 4.25"], 320, 0.5, **kw)
    assert calls == ["4721"] and again["results"]["profile 4.25"]["profile_sha256"] != \
        first["results"]["profile 4.25"]["profile_sha256"]
    older = json.loads(out.read_text())           # a row read before the value measures existed
    del older["results"]["fp32"]["trials"][0]["value_noise"]
    out.write_text(json.dumps(older))
    calls.clear()
    renewed = needles.needle_reading(model, tok, ["fp32", "profile 4.25"], 320, 0.5, **kw)
    assert calls == ["4721"] and renewed["results"]["fp32"] == first["results"]["fp32"]
    with pytest.raises(ValueError, match="another setup"):
        needles.needle_reading(model, tok, ["fp32"], 320, 0.1, **kw)
