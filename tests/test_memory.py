"""The memory model against hand-computed facts and mlx-lm's measured cache sizes."""
import math

import pytest
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache, make_prompt_cache

from turboquant import memory
from turboquant.memory import PRESETS, Layer, cached_tokens, kv_cache_bytes
from turboquant.models import tiny_model


def test_bit_axon_plan_numbers():
    # 8 SWA layers x 2 (K, V) x 4096 tokens x 2560 (32 x 80) x 2 bytes
    fp16 = kv_cache_bytes("bit-axon", 65536)
    assert fp16 == 8 * 2 * 4096 * 2560 * 2
    assert round(fp16 / 1e6, 1) == 335.5
    assert round(kv_cache_bytes("bit-axon", 65536, bits=4) / 1e6, 1) == 83.9
    # one fp16 norm per 80-dim vector adds 16/80 bits per coordinate
    with_norm = kv_cache_bytes("bit-axon", 65536, bits=4, side_bits_per_vector=16)
    assert with_norm == pytest.approx(fp16 * (4 + 16 / 80) / 16)


def test_window_caps_memory_and_ssm_layers_cost_nothing():
    assert kv_cache_bytes("bit-axon", 4096) == kv_cache_bytes("bit-axon", 1 << 20)
    assert kv_cache_bytes("bit-axon", 1000) < kv_cache_bytes("bit-axon", 4096)
    assert cached_tokens(Layer("ssm"), 10_000) == 0
    # gemma3-270m: 15 layers capped at 512, 3 global layers keep growing
    g = PRESETS["gemma3-270m"]
    assert sum(l.kind == "sliding" for l in g.layers) == 15
    t = 10_000
    assert kv_cache_bytes(g, t) == 2 * 2 * 256 * (15 * 512 + 3 * t)


def test_llama_8b_is_128k_per_token():
    # 32 layers x 8 kv heads x 128 x 2 (K,V) x 2 bytes = 131072 bytes per token
    assert kv_cache_bytes("llama-3.1-8b", 1) == 131072


def test_affine_side_bits():
    assert memory.affine_side_bits(128, 64) == 64   # two groups, fp16 scale + bias each
    assert memory.affine_side_bits(80, 64) == 64    # 80 does not divide: two groups still
    assert memory.bits_per_coordinate(4, 128, 64) == 4.5


@pytest.mark.parametrize("bad", [dict(context=-1), dict(bits=0), dict(bits=math.nan),
                                 dict(batch=0), dict(side_bits_per_vector=-1)])
def test_bad_input_raises(bad):
    kw = dict(context=128) | bad
    with pytest.raises(ValueError):
        kv_cache_bytes("llama-3.1-8b", **kw)


def test_unknown_preset_and_bad_layers():
    with pytest.raises(ValueError, match="no-such"):
        kv_cache_bytes("no-such", 10)
    with pytest.raises(ValueError, match="window"):
        Layer("sliding")
    with pytest.raises(ValueError, match="kind"):
        Layer("attention")


def test_formula_matches_mlx_lm_kvcache_on_a_model():
    model = tiny_model("llama", num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2)
    geometry = memory.geometry_from_model(model)
    measured = memory.measured_nbytes(model, make_prompt_cache(model), 300)
    # mlx-lm allocates keys and values in steps of 256 tokens; weights are float32
    assert measured == kv_cache_bytes(geometry, 300, bits=32, alloc_step=256)
    assert measured != kv_cache_bytes(geometry, 300, bits=32)


def test_formula_matches_rotating_cache_after_long_prefill():
    model = tiny_model("llama", num_layers=2)
    geometry = memory.geometry_from_model(model)
    window = 128
    cache = [RotatingKVCache(max_size=window) for _ in model.layers]
    measured = memory.measured_nbytes(model, cache, 400, decode_steps=2)
    swa = memory.AttentionGeometry("swa", tuple(Layer("sliding", window) for _ in model.layers),
                                   geometry.n_kv_heads, geometry.head_dim)
    assert measured == kv_cache_bytes(swa, 402, bits=32, alloc_step=256)


def test_formula_matches_quantized_cache():
    model = tiny_model("llama", num_layers=2, hidden_size=128, num_heads=2, num_kv_heads=2)
    geometry = memory.geometry_from_model(model)  # D = 64
    cache = [QuantizedKVCache(group_size=32, bits=4) for _ in model.layers]
    measured = memory.measured_nbytes(model, cache, 100)
    # scales and biases are stored in the keys' dtype (float32 here): 2 x 32 bits per group
    side = memory.affine_side_bits(geometry.head_dim, 32, scale_bits=32)
    assert measured == kv_cache_bytes(geometry, 100, bits=4, side_bits_per_vector=side, alloc_step=256)


def test_geometry_from_gemma3_model():
    model = tiny_model("gemma3", num_layers=6, sliding_window=16)
    g = memory.geometry_from_model(model)
    assert [l.kind for l in g.layers] == ["sliding"] * 5 + ["global"]
    assert g.layers[0].window == 16
