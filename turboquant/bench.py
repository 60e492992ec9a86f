"""Timing helpers: every speed claim is a ratio to a baseline measured in the same run."""
from __future__ import annotations

import time

import mlx.core as mx

__all__ = ["time_call", "encode_decode_seconds", "affine_seconds"]


def time_call(fn, *args, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall seconds of ``fn(*args)`` with its result evaluated (mx.eval)."""
    for _ in range(warmup):
        mx.eval(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn(*args))
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def encode_decode_seconds(codec, x: mx.array, repeats: int = 5) -> float:
    """Median seconds for ``codec.decode(codec.encode(x))``."""
    return time_call(lambda v: codec.decode(codec.encode(v)), x, repeats=repeats)


def affine_seconds(x: mx.array, bits: int, group_size: int = 64, repeats: int = 5) -> float:
    """Median seconds for ``mx.dequantize(*mx.quantize(x))``: mlx's affine baseline."""
    def run(v):
        w, s, b = mx.quantize(v, group_size=group_size, bits=bits)
        return mx.dequantize(w, s, b, group_size=group_size, bits=bits)
    return time_call(run, x, repeats=repeats)


def decode_attention_seconds(T: int, codec, H: int = 8, D: int = 128, repeats: int = 5,
                             seed: int = 0) -> dict:
    """Median seconds of one decode step's attention (B = 1, one query, float32) over T
    cached tokens, four ways measured in the same run:

    ``sdpa_fp32``: mx.fast.scaled_dot_product_attention on full-precision K/V;
    ``mlx_lm_q4``: mlx-lm's QuantizedKVCache path (quantized matmuls, 4 bits, groups of 64);
    ``dequantize``: decode this codec's K/V codes, then mx.fast SDPA;
    ``from_codes``: ``attention_from_codes`` on the same codes.
    """
    import math
    from mlx_lm.models.base import quantized_scaled_dot_product_attention
    from .attention import attention_from_codes
    from .cache import CodeBuffer, CodesView
    key = mx.random.key(seed)
    k1, k2, k3 = mx.random.split(key, 3)
    k = mx.random.normal((1, H, T, D), key=k1)
    v = mx.random.normal((1, H, T, D), key=k2)
    q = mx.random.normal((1, H, 1, D), key=k3)
    scale = 1 / math.sqrt(D)
    qk, qv = mx.quantize(k, 64, 4), mx.quantize(v, 64, 4)
    kv = CodesView(codec, CodeBuffer(codec.encode(k).arrays), mx.float32)
    vv = CodesView(codec, CodeBuffer(codec.encode(v).arrays), mx.float32)
    mx.eval(k, v, q, qk, qv, kv.buffer.fields, vv.buffer.fields)
    return {
        "sdpa_fp32": time_call(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale), repeats=repeats),
        "mlx_lm_q4": time_call(lambda: quantized_scaled_dot_product_attention(
            q, qk, qv, scale=scale, mask=None, group_size=64, bits=4), repeats=repeats),
        "dequantize": time_call(lambda: mx.fast.scaled_dot_product_attention(
            q, kv.dequantize(), vv.dequantize(), scale=scale), repeats=repeats),
        "from_codes": time_call(lambda: attention_from_codes(q, kv, vv, scale=scale), repeats=repeats),
    }
