"""The decode memory model: bytes per step, the crossover context, the bound on speed-up."""
import math

import pytest

from turboquant import memory, roofline
from turboquant.models import tiny_model


def test_crossover_is_weights_over_cache_bytes_per_token():
    g = memory.PRESETS["smollm2-135m"]
    per_token = 2 * 30 * g.n_kv_heads * g.head_dim * 2               # bf16 K and V, every layer
    W = 134_515_008 * 2
    assert roofline.crossover_context(g, W) == math.ceil(W / per_token)
    assert roofline.crossover_context("smollm2-135m", W, bits=4) == math.ceil(W / (per_token / 4))
    assert memory.kv_cache_bytes(g, int(roofline.crossover_context(g, W))) >= W


def test_sliding_windows_only_never_cross():
    g = memory.AttentionGeometry("windows", (memory.Layer("sliding", 64),) * 2, n_kv_heads=1, head_dim=8)
    assert roofline.crossover_context(g, 1e9) == math.inf
    assert roofline.crossover_context(g, 100) < math.inf


def test_bound_speedup():
    W = 5e8
    assert roofline.bound_speedup("smollm2-135m", W, 1, 4) == pytest.approx(1.0, abs=1e-3)
    s8k = roofline.bound_speedup("smollm2-135m", W, 8192, 4, 16, base_bits=32)
    step = roofline.decode_step_bytes("smollm2-135m", W, 8192, 32)
    small = roofline.decode_step_bytes("smollm2-135m", W, 8192, 4, 16)
    assert s8k == pytest.approx(step["total"] / small["total"]) and 1 < s8k < 32 / 4.25
    assert small["weights"] == W and small["cache"] == memory.kv_cache_bytes("smollm2-135m", 8192, 4, 16)


def test_roofline_and_bytes():
    assert roofline.attainable_gflops(0.25, 200, 20) == 5
    assert roofline.attainable_gflops(100, 200, 20) == 200
    assert roofline.attention_bytes(16384, 8, 128, 32) == 2 * 16384 * 8 * 128 * 4
    assert roofline.step_seconds_bound(2e9, 20) == pytest.approx(0.1)


def test_model_weight_bytes():
    model = tiny_model(num_layers=2, hidden_size=32, num_heads=2, num_kv_heads=1, vocab_size=50)
    from mlx.utils import tree_flatten
    assert roofline.model_weight_bytes(model) == sum(4 * p.size for _, p in tree_flatten(model.parameters()))


@pytest.mark.parametrize("call", [lambda: roofline.crossover_context("nope", 1e9),
                                  lambda: roofline.decode_step_bytes("smollm2-135m", 0, 10),
                                  lambda: roofline.attainable_gflops(float("nan"), 1, 1),
                                  lambda: roofline.attention_bytes(0, 1, 64, 4),
                                  lambda: roofline.step_seconds_bound(1.0, -2)])
def test_bad_input(call):
    with pytest.raises(ValueError):
        call()
