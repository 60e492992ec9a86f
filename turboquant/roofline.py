"""Decode is memory-bound: the bytes one step reads, and what they allow (Performance chapter).

Generating one token reads every weight once and, in every attention layer, the whole KV
cache; the arithmetic per byte is small (a matrix–vector product does 2 FLOPs per weight
of 2–4 bytes), so on a machine with bandwidth β a step takes at least

    t_step ≥ (W + C(T, b)) / β,    C(T, b) = kv_cache_bytes(geometry, T, b, s)

with W the weight bytes and C the cache bytes at context T and b bits per coordinate
(Chapter 1's formula). The cache overtakes the weights at the context T* where
C(T*, b) = W (``crossover_context``); compressing the cache from 16 to b bits can speed
a step up by at most (W + C(T, 16)) / (W + C(T, b)) (``bound_speedup``).

The roofline (Williams, Waterman and Patterson, 2009) says the same per kernel: a kernel
doing I FLOPs per byte runs at most min(peak, β · I) FLOP/s (``attainable_gflops``).
"""
from __future__ import annotations

import math

from .memory import AttentionGeometry, PRESETS, kv_cache_bytes

__all__ = ["model_weight_bytes", "decode_step_bytes", "crossover_context", "bound_speedup",
           "step_seconds_bound", "attainable_gflops", "attention_bytes"]


def _geometry(geometry) -> AttentionGeometry:
    g = PRESETS.get(geometry) if isinstance(geometry, str) else geometry
    if not isinstance(g, AttentionGeometry):
        raise ValueError(f"unknown geometry {geometry!r}; presets: {sorted(PRESETS)}")
    return g


def _positive(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {v!r}")
    return float(v)


def model_weight_bytes(model) -> int:
    """Bytes of an mlx model's parameters as stored (tied embeddings counted once: the
    output layer reads the same matrix)."""
    from mlx.utils import tree_flatten
    return sum(p.nbytes for _, p in tree_flatten(model.parameters()))


def decode_step_bytes(geometry, weight_bytes: float, context: int, bits: float = 16,
                      side_bits_per_vector: float = 0) -> dict:
    """Bytes one decode step reads at ``context`` tokens: {"weights", "cache", "total"}."""
    weight_bytes = _positive("weight_bytes", weight_bytes)
    cache = kv_cache_bytes(_geometry(geometry), context, bits, side_bits_per_vector)
    return {"weights": weight_bytes, "cache": cache, "total": weight_bytes + cache}


def crossover_context(geometry, weight_bytes: float, bits: float = 16, side_bits_per_vector: float = 0) -> float:
    """The context T* at which the cache read per step equals the weights (the smallest
    integer T with C(T) ≥ W); ``math.inf`` when the cache never gets there (sliding windows)."""
    g, w = _geometry(geometry), _positive("weight_bytes", weight_bytes)
    cache = lambda t: kv_cache_bytes(g, t, bits, side_bits_per_vector)  # noqa: E731
    hi = 1
    while cache(hi) < w:
        if hi > 1 << 40 or cache(2 * hi) == cache(hi):        # stopped growing: windows only
            return math.inf if cache(2 * hi) < w else float(2 * hi)
        hi *= 2
    lo = hi // 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if cache(mid) < w else (lo, mid)
    return float(hi)


def bound_speedup(geometry, weight_bytes: float, context: int, bits: float, side_bits_per_vector: float = 0,
                  base_bits: float = 16) -> float:
    """The most a ``bits`` cache can speed a memory-bound decode step up over a
    ``base_bits`` cache: (W + C(T, base)) / (W + C(T, bits))."""
    base = decode_step_bytes(geometry, weight_bytes, context, base_bits)["total"]
    return base / decode_step_bytes(geometry, weight_bytes, context, bits, side_bits_per_vector)["total"]


def step_seconds_bound(step_bytes: float, bandwidth_gb_s: float) -> float:
    """The least time a step reading ``step_bytes`` takes at ``bandwidth_gb_s``."""
    return _positive("step_bytes", step_bytes) / (_positive("bandwidth_gb_s", bandwidth_gb_s) * 1e9)


def attainable_gflops(intensity: float, peak_gflops: float, bandwidth_gb_s: float) -> float:
    """The roofline: min(peak, bandwidth · intensity) for ``intensity`` FLOPs per byte."""
    return min(_positive("peak_gflops", peak_gflops),
               _positive("bandwidth_gb_s", bandwidth_gb_s) * _positive("intensity", intensity))


def attention_bytes(tokens: int, kv_heads: int, head_dim: int, bits: float, side_bits_per_vector: float = 0) -> float:
    """Bytes of K and V one decode step's attention reads in one layer: 2·T·H_kv·(D·b + s)/8
    (``memory.kv_bytes``: what the cache holds is what a step reads)."""
    from .memory import kv_bytes
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be an int >= 1, got {tokens!r}")
    return kv_bytes(tokens, kv_heads, head_dim, bits, side_bits_per_vector)
