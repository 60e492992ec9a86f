"""The second real model, Gemma-3-270M, offline (issue #15): conversion, the Paris check,
fp32 perplexity, and the sliding-window caches on its 15 real sliding layers."""
import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache

from turboquant import make_prompt_cache, memory
from turboquant.codecs import Identity, TurboQuantMSE
from turboquant.data import load_text
from turboquant.evaluation import bos_id, encode_text, perplexity
from turboquant.models import MODELS, load


@pytest.fixture(scope="module")
def gemma():
    return load("gemma3-270m")


@pytest.fixture(scope="module")
def wiki(gemma):
    return encode_text(gemma[1], load_text("wikipedia"), 2048)


def test_geometry_matches_the_memory_preset(gemma):
    model, _ = gemma
    a = model.args
    assert (a.num_hidden_layers, a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim,
            a.sliding_window, a.vocab_size) == (18, 640, 4, 1, 256, 512, 262144)
    assert sum(layer.self_attn.is_sliding for layer in model.layers) == 15
    g = memory.geometry_from_model(model)
    assert g.layers == memory.PRESETS["gemma3-270m"].layers
    assert (g.n_kv_heads, g.head_dim) == (1, 256)


def test_paris_is_among_the_three_most_likely_next_tokens(gemma):
    # the base 270M model continues greedily with " the capital of the country of France."
    # (Paris third, p ≈ 0.08); with the norm shift left in, the model outputs noise
    model, tok = gemma
    logits = model(mx.array(tok.encode("The capital of France is"))[None])[0, -1]
    paris = tok.encode(" Paris", add_special_tokens=False)[0]
    assert int(mx.sum(logits > logits[paris]).item()) < 3
    assert tok.encode("a")[0] == bos_id(tok) == 2


def test_fp32_perplexity_with_bos_at_512_token_windows(gemma, wiki):
    model, tok = gemma
    r = perplexity(model, wiki[:512], None, window=512, chunk=256, bos=bos_id(tok))
    assert 15 < r["ppl"] < 40                      # measured 26.1 over two windows (Chapter 9)
    # chunked scoring gives the loss of one full-window forward pass
    x = mx.array([2] + wiki[:512])[None]
    import mlx.nn as nn
    full = nn.losses.cross_entropy(model(x)[:, 1:-1].astype(mx.float32), x[:, 2:], reduction="mean").item()
    assert abs(r["nll"] - full) < 1e-4


def _hidden(model, tokens, cache, splits):
    out, i = [], 0
    for n in splits:
        out.append(model.model(tokens[:, i:i + n], cache=cache))
        mx.eval(out[-1])
        i += n
    return mx.concatenate(out, axis=1)


@pytest.mark.parametrize("splits", [[600], [256, 256, 88], [520] + [1] * 8 + [72], [100] * 6])
def test_identity_caches_equal_mlx_lm_on_the_real_sliding_layers(gemma, wiki, splits):
    model, _ = gemma
    x = mx.array([2] + wiki[:599])[None]
    ours = make_prompt_cache(model, key_codec=lambda d: Identity(d))
    assert [type(c).__name__ for c in ours].count("TurboQuantRotatingKVCache") == 15
    a = _hidden(model, x, ours, splits)
    b = _hidden(model, x, mlx_make_prompt_cache(model), splits)
    assert mx.array_equal(a, b).item()


def test_sliding_layers_stay_bounded_and_the_preset_counts_the_bytes(gemma, wiki):
    model, _ = gemma
    codec = lambda d: TurboQuantMSE(d, 4)                                   # noqa: E731
    cache = make_prompt_cache(model, key_codec=codec)
    x = mx.array([2] + wiki[:2047])[None]
    sliding = [i for i, layer in enumerate(model.layers) if layer.self_attn.is_sliding]
    sizes = {}
    for i in range(0, 2048, 256):
        mx.eval(model.model(x[:, i:i + 256], cache=cache))
        if i + 256 in (1024, 2048):
            sizes[i + 256] = [cache[j].nbytes for j in sliding]
    assert sizes[1024] == sizes[2048]                                       # W − 1 + chunk tokens of codes
    assert max(sizes[2048]) <= (512 - 1 + 256) * TurboQuantMSE(256, 4).nbytes_per_vector * 2
    mx.eval(model.model(mx.array([[5]]), cache=cache))                     # one step: the ring holds W
    per_vector = TurboQuantMSE(256, 4).nbytes_per_vector
    expect = memory.kv_cache_bytes("gemma3-270m", 2049, bits=4, side_bits_per_vector=16, alloc_step=256)
    assert sum(c.nbytes for c in cache) == expect == 2 * per_vector * (15 * 512 + 3 * 2304)


def test_license_is_named():
    assert "Gemma" in MODELS["gemma3-270m"]["license"]
