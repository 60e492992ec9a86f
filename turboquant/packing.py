"""Exact packing of b-bit indices into a byte stream (any b in 1..16).

Indices are laid end to end, little-endian: index j occupies bits [j·b, (j+1)·b) of the
stream, so a width that does not divide 32 (3, 5, 6, 7, …) straddles words. The shifts
work on uint32 words: the pattern repeats every g = 32/gcd(b, 32) indices (b/gcd(b, 32)
words), so packing is a short static loop of vectorized shifts over those groups. The
words are then viewed as bytes and only the ceil(n·b/8) bytes that hold bits are kept, so
a code costs exactly its bits rounded up to a byte (D = 80 at 3 bits: 30 bytes, not 32).
"""
from __future__ import annotations

import math

import mlx.core as mx

from .checks import check_int

__all__ = ["pack", "unpack", "packed_bytes", "index_bits"]

MAX_PACK_BITS = 16


def index_bits(n_codewords: int) -> int:
    """Bits per index for a codebook of N codewords: ceil(log2 N), at least 1."""
    if isinstance(n_codewords, bool) or not isinstance(n_codewords, int) or n_codewords < 2:
        raise ValueError(f"a codebook needs an int N >= 2 codewords, got {n_codewords!r}")
    return max(1, math.ceil(math.log2(n_codewords)))


def _check_bits(bits) -> int:
    return check_int("packing width (bits)", bits, 1, MAX_PACK_BITS)


def packed_bytes(n: int, bits: int) -> int:
    """Bytes holding ``n`` indices of ``bits`` bits: ceil(n·bits/8)."""
    bits = _check_bits(bits)
    return -(-n * bits // 8)


def pack(indices: mx.array, bits: int) -> mx.array:
    """(..., n) integer indices in [0, 2^bits) → (..., packed_bytes(n, bits)) uint8."""
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
    words_flat = out.reshape(*out.shape[:-2], -1)                  # (..., words) uint32
    return words_flat.view(mx.uint8)[..., :packed_bytes(n, bits)]


def unpack(packed: mx.array, bits: int, n: int) -> mx.array:
    """Inverse of ``pack``: (..., packed_bytes(n, bits)) uint8 → (..., n) uint32."""
    bits = _check_bits(bits)
    if not isinstance(packed, mx.array) or packed.dtype != mx.uint8:
        raise TypeError("packed codes must be an mx.array of dtype uint8")
    g = 32 // math.gcd(bits, 32)
    words_per_group = bits * g // 32
    expected = packed_bytes(n, bits)
    if packed.ndim < 1 or packed.shape[-1] != expected:
        raise ValueError(f"expected {expected} packed bytes for {n} indices of {bits} bits, "
                         f"got shape {tuple(packed.shape)}")
    full = -(-n // g) * words_per_group * 4
    if full > expected:
        packed = mx.concatenate([packed, mx.zeros((*packed.shape[:-1], full - expected), mx.uint8)], -1)
    words = packed.view(mx.uint32)
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
