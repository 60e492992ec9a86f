"""Exact packing of b-bit indices into uint32 words (any b in 1..16).

Indices are laid end to end, little-endian within each word: index j occupies bits
[j·b, (j+1)·b) of the stream, so a width that does not divide 32 (3, 5, 6, 7, …) straddles
words. The stream pattern repeats every g = 32/gcd(b, 32) indices (b/gcd(b, 32) words),
so packing is a short static loop of vectorized shifts over those groups. Only the
ceil(n·b/32) words that hold bits are kept; the zero words of a last partial group are
dropped and restored on unpacking.
"""
from __future__ import annotations

import math

import mlx.core as mx

__all__ = ["pack", "unpack", "packed_words", "index_bits"]

MAX_PACK_BITS = 16


def index_bits(n_codewords: int) -> int:
    """Bits per index for a codebook of N codewords: ceil(log2 N), at least 1."""
    if isinstance(n_codewords, bool) or not isinstance(n_codewords, int) or n_codewords < 2:
        raise ValueError(f"a codebook needs an int N >= 2 codewords, got {n_codewords!r}")
    return max(1, math.ceil(math.log2(n_codewords)))


def _check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_PACK_BITS:
        raise ValueError(f"packing width must be an int in 1..{MAX_PACK_BITS}, got {bits!r}")
    return bits


def packed_words(n: int, bits: int) -> int:
    """uint32 words holding ``n`` indices of ``bits`` bits: ceil(n·bits/32)."""
    bits = _check_bits(bits)
    return -(-n * bits // 32)


def pack(indices: mx.array, bits: int) -> mx.array:
    """(..., n) integer indices in [0, 2^bits) → (..., packed_words(n, bits)) uint32."""
    bits = _check_bits(bits)
    if not isinstance(indices, mx.array):
        raise TypeError(f"indices must be an mx.array, got {type(indices).__name__}")
    if indices.ndim < 1:
        raise ValueError("indices must have at least one dimension")
    n = indices.shape[-1]
    g = 32 // math.gcd(bits, 32)
    words_per_group = bits * g // 32
    pad = -n % g
    idx = indices.astype(mx.uint32)
    if pad:
        idx = mx.concatenate([idx, mx.zeros((*idx.shape[:-1], pad), mx.uint32)], axis=-1)
    idx = idx.reshape(*idx.shape[:-1], -1, g)                     # (..., groups, g)
    words = [None] * words_per_group
    for j in range(g):
        v = idx[..., j]
        offset = j * bits
        w, s = divmod(offset, 32)
        parts = [(w, mx.left_shift(v, s) if s else v)]
        if s + bits > 32:
            parts.append((w + 1, mx.right_shift(v, 32 - s)))
        for wi, part in parts:
            words[wi] = part if words[wi] is None else mx.bitwise_or(words[wi], part)
    out = mx.stack(words, axis=-1)                                 # (..., groups, words)
    return out.reshape(*out.shape[:-2], -1)[..., :packed_words(n, bits)]


def unpack(words: mx.array, bits: int, n: int) -> mx.array:
    """Inverse of ``pack``: (..., packed_words(n, bits)) uint32 → (..., n) uint32."""
    bits = _check_bits(bits)
    if not isinstance(words, mx.array) or words.dtype != mx.uint32:
        raise TypeError("packed words must be an mx.array of dtype uint32")
    g = 32 // math.gcd(bits, 32)
    words_per_group = bits * g // 32
    expected = packed_words(n, bits)
    if words.ndim < 1 or words.shape[-1] != expected:
        raise ValueError(f"expected {expected} packed words for {n} indices of {bits} bits, "
                         f"got shape {tuple(words.shape)}")
    full = -(-n // g) * words_per_group
    if full > expected:
        words = mx.concatenate([words, mx.zeros((*words.shape[:-1], full - expected), mx.uint32)], -1)
    wg = words.reshape(*words.shape[:-1], -1, words_per_group)     # (..., groups, words)
    mask = mx.array((1 << bits) - 1, dtype=mx.uint32)
    cols = []
    for j in range(g):
        w, s = divmod(j * bits, 32)
        v = mx.right_shift(wg[..., w], s) if s else wg[..., w]
        if s + bits > 32:
            v = mx.bitwise_or(v, mx.left_shift(wg[..., w + 1], 32 - s))
        cols.append(mx.bitwise_and(v, mask))
    out = mx.stack(cols, axis=-1)                                  # (..., groups, g)
    out = out.reshape(*out.shape[:-2], -1)
    return out[..., :n]
