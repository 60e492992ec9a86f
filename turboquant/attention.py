"""Attention: the float32 reference and the error measures used throughout the book.

Shapes follow mlx: queries (B, H, Tq, D), keys and values (B, H_kv, T, D) with H a
multiple of H_kv (grouped-query attention repeats each kv head H/H_kv times).
"""
from __future__ import annotations

import math

import mlx.core as mx

__all__ = ["reference_attention", "cosine_similarity", "relative_error"]


def _repeat_kv(x: mx.array, n_heads: int) -> mx.array:
    B, H_kv, T, D = x.shape
    if n_heads == H_kv:
        return x
    if n_heads % H_kv:
        raise ValueError(f"query heads {n_heads} are not a multiple of kv heads {H_kv}")
    return mx.repeat(x, n_heads // H_kv, axis=1)


def reference_attention(q: mx.array, k: mx.array, v: mx.array, scale: float | None = None,
                        mask: mx.array | None = None) -> mx.array:
    """softmax(q kᵀ · scale + mask) v in float32, written out: (B, H, Tq, D).

    ``mask`` is additive (0 / −inf) or boolean (True = keep), broadcastable to (B, H, Tq, T).
    """
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim != 4:
            raise ValueError(f"{name} must have shape (B, H, T, D), got {tuple(a.shape)}")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    H = q.shape[1]
    k, v = _repeat_kv(k.astype(mx.float32), H), _repeat_kv(v.astype(mx.float32), H)
    scores = (q.astype(mx.float32) * scale) @ mx.swapaxes(k, -1, -2)        # (B, H, Tq, T)
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask
    return mx.softmax(scores, axis=-1, precise=True) @ v


def cosine_similarity(a: mx.array, b: mx.array) -> mx.array:
    """Cosine similarity along the last axis, float32."""
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    num = mx.sum(a * b, axis=-1)
    return num / mx.maximum(mx.linalg.norm(a, axis=-1) * mx.linalg.norm(b, axis=-1), 1e-30)


def relative_error(approx: mx.array, exact: mx.array) -> float:
    """‖approx − exact‖ / ‖exact‖ over the whole array."""
    diff = (approx.astype(mx.float32) - exact.astype(mx.float32))
    return (mx.linalg.norm(diff.reshape(-1)) / mx.linalg.norm(exact.astype(mx.float32).reshape(-1))).item()


def attention_fidelity(q: mx.array, k: mx.array, v: mx.array, k_hat: mx.array,
                       v_hat: mx.array | None = None, scale: float | None = None,
                       mask: mx.array | None = None) -> dict:
    """Compare attention with exact (k, v) and with reconstructed (k_hat, v_hat).

    Returns mean and minimum cosine similarity of the output rows, the relative output
    error, and the RMS error of the scaled scores q·kᵀ·scale."""
    exact = reference_attention(q, k, v, scale, mask)
    approx = reference_attention(q, k_hat, v if v_hat is None else v_hat, scale, mask)
    cos = cosine_similarity(approx, exact)
    s = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    H = q.shape[1]
    ds = (q.astype(mx.float32) * s) @ mx.swapaxes(_repeat_kv((k_hat - k).astype(mx.float32), H), -1, -2)
    return {"cos_mean": mx.mean(cos).item(), "cos_min": mx.min(cos).item(),
            "rel_error": relative_error(approx, exact), "score_rmse": mx.sqrt(mx.mean(ds * ds)).item()}
