"""Bits across layers by measured sensitivity (Chapter 10's levers).

Within a head, reverse water-filling gives each coordinate the bits that lower the error
most (``TransformCoder``). Across layers the error that matters is not the coder's but the
model's: a layer whose keys and values the rest of the network leans on costs more
perplexity per unit of distortion. ``sensitivity.layer_sensitivity`` measures it: the increase of the
mean negative log-likelihood per token when layer l *alone* is coded at a low probe rate
(every other layer exact). Under the high-rate law, distortion and so this loss fall as
2^(−2b), so layer l at b_l bits costs about a_l·2^(−2 b_l) with a_l = s_l·2^(2·b_probe);
``allocate_layers`` minimises Σ_l a_l 2^(−2 b_l) at a fixed mean rate — reverse
water-filling across layers, b_l = b + ½ log2(a_l / geometric mean of a), here solved
greedily on the coders' own grid of 1/D bits (``TransformCoder.vector_bits``) so that
the mean is met exactly.
"""
from __future__ import annotations

import heapq
import math
from typing import Sequence

import numpy as np

__all__ = ["allocate_layers", "PROBE_BITS", "SPREAD"]

PROBE_BITS = 2.25           # the probe rate: low enough that every layer's loss is measurable
SPREAD = 1.5                # a layer's bits stay within the budget ± SPREAD


def allocate_layers(sensitivity: Sequence[float], bits: float, dim: int, probe_bits: float = PROBE_BITS,
                    spread: float = SPREAD, floor_bits: float = 1.0) -> list[float]:
    """Bits per layer, mean exactly ⌊bits·D⌋/D: greedy reverse water-filling of units of
    1/D bits on the high-rate loss a_l·2^(−2 b_l), a_l = s_l·2^(2·probe_bits), each layer
    within [max(floor_bits, bits − spread), min(8, bits + spread)] (``fit_layers`` raises
    ``floor_bits`` by the exact outliers' 24 bits per vector). Sensitivities below 2 % of
    the largest are raised to it (a layer measured as free still costs something)."""
    s = np.asarray(sensitivity, dtype=np.float64)
    if s.ndim != 1 or s.size == 0 or not np.all(np.isfinite(s)):
        raise ValueError(f"sensitivity must be a non-empty 1-D array of finite values, got {s!r:.80}")
    if not (math.isfinite(bits) and floor_bits <= bits <= 8):
        raise ValueError(f"bits must lie in [{floor_bits:g}, 8] to be allocated across layers, got {bits!r}")
    if s.max() <= 0:
        raise ValueError("no layer's sensitivity is positive: nothing to allocate by (measure on more tokens)")
    a = np.maximum(s, 0.02 * s.max()) * 2.0 ** (2 * probe_bits)
    lo, hi = int(math.ceil(max(floor_bits, bits - spread) * dim - 1e-9)), int(math.floor(min(8.0, bits + spread) * dim))
    total = int(math.floor(bits * dim + 1e-9)) * s.size
    units = [lo] * s.size
    step = 2.0 ** (-2.0 / dim)
    heap = [(-a[i] * 2.0 ** (-2.0 * lo / dim) * (1 - step), i) for i in range(s.size)]   # gain of one more unit
    heapq.heapify(heap)
    for _ in range(total - lo * s.size):
        gain, i = heapq.heappop(heap)
        units[i] += 1
        if units[i] < hi:
            heapq.heappush(heap, (gain * step, i))
    return [u / dim for u in units]
