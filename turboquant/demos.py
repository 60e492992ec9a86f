"""Demonstrations for the book: defects reproduced on purpose, so a chapter can show them.
Nothing here is used by the package itself."""
from __future__ import annotations

import math

import mlx.core as mx

from .attention import positions_mask
from .bitaxon import SWAttention

__all__ = ["upstream_trimmed_prefill"]


def upstream_trimmed_prefill(layer: SWAttention, x: mx.array) -> mx.array:
    """Reproduces the upstream defect, for the book: the cache keeps only the last W keys
    *before* attention, so in a prefill of T > W tokens the first T − W queries see no key
    at all and their softmax is over −inf only (NaN rows). Returns (B, T, hidden)."""
    B, T, _ = x.shape
    c = layer.config
    q, k, v = layer.project(x)
    k, v = k[:, :, -c.window:], v[:, :, -c.window:]                     # trimmed first
    k_pos = mx.arange(T)[-c.window:]
    scores = (q / math.sqrt(c.head_dim)) @ mx.swapaxes(k, -1, -2)
    scores = mx.where(positions_mask(mx.arange(T), k_pos, c.window), scores, -mx.inf)
    out = mx.softmax(scores, axis=-1) @ v
    return layer.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, c.hidden))
