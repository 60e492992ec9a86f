"""Attention: the float32 reference and the error measures used throughout the book.

Shapes follow mlx: queries (B, H, Tq, D), keys and values (B, H_kv, T, D) with H a
multiple of H_kv (grouped-query attention repeats each kv head H/H_kv times).
"""
from __future__ import annotations

import contextvars
import math
import threading
from contextlib import contextmanager

import mlx.core as mx


__all__ = ["reference_attention", "repeat_kv", "causal_mask", "positions_mask", "cosine_similarity", "relative_error",
           "attention_fidelity",
           "attention_from_codes", "codes_attention", "patch_attention", "output_fidelity"]


def repeat_kv(x: mx.array, n_heads: int) -> mx.array:
    """(B, H_kv, T, D) → (B, n_heads, T, D): each kv head repeated for its query heads (GQA)."""
    B, H_kv, T, D = x.shape
    if n_heads == H_kv:
        return x
    if n_heads % H_kv:
        raise ValueError(f"query heads {n_heads} are not a multiple of kv heads {H_kv}")
    return mx.repeat(x, n_heads // H_kv, axis=1)


def reference_attention(q: mx.array, k: mx.array, v: mx.array, scale: float | None = None,
                        mask: mx.array | None = None) -> mx.array:
    """softmax(q kᵀ · scale + mask) v in float32, written out: (B, H, Tq, D).

    ``mask`` is additive (0 / −inf) or boolean (True = keep), broadcastable to (B, H, Tq, T),
    or "causal" (the last Tq of T positions, as ``attention_from_codes`` takes it).
    """
    for name, a in (("q", q), ("k", k), ("v", v)):
        if not isinstance(a, mx.array) or a.ndim != 4:
            raise ValueError(f"{name} must have shape (B, H, T, D), got {getattr(a, 'shape', type(a).__name__)}")
    mask = _causal(mask, q.shape[2], k.shape[2])
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    H = q.shape[1]
    k, v = repeat_kv(k.astype(mx.float32), H), repeat_kv(v.astype(mx.float32), H)
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
    s = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    H = q.shape[1]
    ds = (q.astype(mx.float32) * s) @ mx.swapaxes(repeat_kv((k_hat - k).astype(mx.float32), H), -1, -2)
    return output_fidelity(approx, exact) | {"score_rmse": mx.sqrt(mx.mean(ds * ds)).item()}


def output_fidelity(approx: mx.array, exact: mx.array) -> dict:
    """Attention outputs (..., D) against exact ones: mean and minimum cosine similarity of
    the rows and the relative error over everything."""
    cos = cosine_similarity(approx, exact)
    return {"cos_mean": mx.mean(cos).item(), "cos_min": mx.min(cos).item(),
            "rel_error": relative_error(approx, exact)}


# ------------------------------------------------------------------ from codes (Chapter 7)
def positions_mask(q_pos: mx.array, k_pos: mx.array, window: int | None = None) -> mx.array:
    """Query at position p sees key at position j when j ≤ p (and p − W < j with a window
    W): (Tq, Tk) bool, True = keep. The one mask rule: ``causal_mask``, the evaluation's
    fidelity and sink measurements and Bit-Axon's sliding window use it."""
    d = q_pos[:, None] - k_pos[None, :]
    return d >= 0 if window is None else (d >= 0) & (d < window)


def causal_mask(Tq: int, T: int, window: int | None = None) -> mx.array:
    """(Tq, T) bool: the last ``Tq`` of ``T`` positions as queries over all ``T`` as keys."""
    return positions_mask(mx.arange(T - Tq, T), mx.arange(T), window)


def _causal(mask, Tq: int, T: int):
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}")
        return causal_mask(Tq, T)
    return mask


def _apply_mask(scores: mx.array, mask, H: int) -> mx.array:
    """scores (B, H_kv, R, Tq, T) with a mask broadcastable to (B, H, Tq, T) (boolean keep, or
    additive), "causal", or None; a per-query-head mask is split into (H_kv, R)."""
    if mask is None:
        return scores
    B, Hk, R, Tq, T = scores.shape
    m = _causal(mask, Tq, T)
    if m.ndim == 4 and m.shape[1] == H and H != 1:
        m = m.reshape(m.shape[0], Hk, R, *m.shape[2:])
    elif m.ndim == 4:
        m = mx.expand_dims(m, 2)
    elif m.ndim > 4:
        raise ValueError(f"mask must broadcast to (B, H, Tq, T), got shape {tuple(m.shape)}")
    return mx.where(m, scores, -mx.inf) if m.dtype == mx.bool_ else scores + m


def _per_head(x: mx.array) -> mx.array:
    """(B, H_kv, T, w) → (B, H_kv, 1, T, w): broadcast over the R query heads of a kv head."""
    return x.astype(mx.float32)[:, :, None]


def _mean_scores(qf: mx.array, mu: mx.array) -> mx.array:
    """q·μ for μ (H_kv, D) or (D,): (B, H_kv, R, Tq, 1)."""
    return qf @ mu[:, None, :, None] if mu.ndim == 2 else (qf @ mu)[..., None]


def attention_from_codes(q: mx.array, keys, values, scale: float | None = None, mask=None) -> mx.array:
    """softmax(q kᵀ·scale) v with K and V read from ``CodesView`` objects: (B, H, Tq, D).

    A codec that offers the query-table protocol (``score_table``/``value_sum``: the
    rotated-table codecs, TurboQuant_mse and FibQuant) is read without decoding: its query
    table gives the scores ⟨q, x̂_t⟩ and its weighted sum Σ_t p_t x̂_t, both in the model's
    frame (inside, the query is rotated once, scores are ν_t·⟨Πq, c[i_t]⟩, the value side is
    summed in the rotated frame and rotated back once; fused kernels, when active, sit
    behind the protocol). Other codecs are decoded. A codec that stores
    x − μ (``Centered``, through ``attention_view``) gets μ back exactly: q·μ added to the
    coded scores, μ times the coded softmax mass added to the output; keys whose view has a
    ``score_bias`` (a mean that turns with the position, ``prerope.TurnedCodesView``) get it
    added to every score. Exact sink (first S)
    and recent tokens enter as such. Equal to dequantize-then-attend up to float rounding.
    """
    B, H, Tq, D = q.shape
    Hk, T = keys.shape[1], keys.shape[2]
    if H % Hk:
        raise ValueError(f"query heads {H} are not a multiple of kv heads {Hk}")
    R = H // Hk
    scale = 1 / math.sqrt(D) if scale is None else scale
    qf = (q.astype(mx.float32) * scale).reshape(B, Hk, R, Tq, D)

    kc, code, mu = keys.codec.attention_view(keys.code())
    bias = getattr(keys, "score_bias", None)          # a key mean that turns with the position (prerope)
    fused = None if bias is not None else _attend_fused(q.reshape(B, Hk, R, Tq, D), scale, kc, code, values, mask,
                                                        keys.exact_spans())
    if fused is not None:
        return fused.reshape(B, H, Tq, D).astype(q.dtype)
    if hasattr(kc, "score_table"):
        scores = kc.score_table(qf).scores(code)
    else:
        scores = qf @ mx.swapaxes(_per_head(kc.decode(code)), -1, -2)
    if mu is not None:
        scores = scores + _mean_scores(qf, mu)
    s, r = keys.exact_spans()
    exact = lambda x: qf @ mx.swapaxes(_per_head(x), -1, -2)  # noqa: E731
    parts = ([exact(keys.sink[..., :s, :])] if s else []) + [scores[..., s:T - r]] + (
        [exact(keys.recent[..., keys.recent.shape[2] - r:, :])] if r else [])
    scores = mx.concatenate(parts, axis=-1)
    if bias is not None:                                      # every position, exact ones too
        scores = scores + bias(qf)
    p = mx.softmax(_apply_mask(scores, mask, H), axis=-1, precise=True)

    vc, code, mu = values.codec.attention_view(values.code())
    s, r = values.exact_spans()
    pc = p[..., s:T - r]                                      # weights of the coded tokens
    if hasattr(vc, "value_sum"):                               # exact tokens weigh nothing here
        out = vc.value_sum(mx.pad(pc, [(0, 0)] * 4 + [(s, r)]), code)
    else:
        out = pc @ _per_head(vc.decode(code))[..., s:T - r, :]
    if mu is not None:
        out = out + pc.sum(axis=-1, keepdims=True) * (mu[:, None, None, :] if mu.ndim == 2 else mu)
    if s:
        out = out + p[..., :s] @ _per_head(values.sink[..., :s, :])
    if r:
        out = out + p[..., T - r:] @ _per_head(values.recent[..., values.recent.shape[2] - r:, :])
    return out.reshape(B, H, Tq, D).astype(q.dtype)


def _attend_fused(q, scale, kc, kcode, values, mask, key_spans):
    """Both passes in one kernel call, when a back-end offers it (the CPU kernels) and
    nothing needs the general path: no mask (a decode step), no exact sink or recent
    tokens, rotated-table codecs on both sides. A key mean μ shifts every score of a query
    equally and leaves the softmax unchanged; a value mean μ adds μ·Σp = μ. None otherwise."""
    from .codecs.table import accelerator
    acc = accelerator()
    if acc is None or mask is not None or key_spans != (0, 0) or values.exact_spans() != (0, 0) \
            or not hasattr(acc, "attend") or not hasattr(kc, "score_table"):
        return None
    vc, vcode, vmu = values.codec.attention_view(values.code())
    if not hasattr(vc, "value_sum"):
        return None
    out = acc.attend(kc, kcode, vc, vcode, q, scale)
    if out is None:
        return None
    if vmu is not None:
        out = out + (vmu[:, None, None, :] if vmu.ndim == 2 else vmu)
    return out


_PATCH_LOCK = threading.Lock()
_PATCHED: dict = {}          # module → [its own scaled_dot_product_attention, users]
_WRAPS: contextvars.ContextVar[tuple] = contextvars.ContextVar("turboquant_attention_wraps", default=())


def _dispatcher(original):
    """What a patched module calls: ``original`` wrapped by the wraps active in this context
    (thread or task), so overlapping ``patch_attention`` blocks in other threads do not see
    each other's wraps."""
    def sdpa(*args, **kwargs):
        f = original
        for wrap in _WRAPS.get():
            f = wrap(f)
        return f(*args, **kwargs)
    sdpa.__wrapped__ = original
    return sdpa


@contextmanager
def patch_attention(model, wrap):
    """Replace ``scaled_dot_product_attention`` by ``wrap(original)`` in every module that
    defines one of ``model``'s layers (mlx-lm model files import it by name), for calls made
    in this thread inside the block.

    The modules are patched once, reference-counted under a lock, and restored when the
    last block exits, in whatever order blocks in different threads enter and exit; which
    wraps apply is a per-context (ContextVar) choice."""
    import sys
    modules = {sys.modules[type(m).__module__] for m in model.modules()}
    modules = [m for m in modules if hasattr(m, "scaled_dot_product_attention")]
    with _PATCH_LOCK:
        for m in modules:
            if m in _PATCHED:
                _PATCHED[m][1] += 1
            else:
                original = m.scaled_dot_product_attention
                _PATCHED[m] = [original, 1]
                m.scaled_dot_product_attention = _dispatcher(original)
    _WRAPS.set(_WRAPS.get() + (wrap,))
    try:
        yield model
    finally:
        wraps = list(_WRAPS.get())
        wraps.reverse()
        wraps.remove(wrap)                                  # this block's own (the innermost) entry
        wraps.reverse()
        _WRAPS.set(tuple(wraps))
        with _PATCH_LOCK:
            for m in modules:
                entry = _PATCHED[m]
                entry[1] -= 1
                if entry[1] == 0:
                    m.scaled_dot_product_attention = entry[0]
                    del _PATCHED[m]


@contextmanager
def codes_attention(model):
    """Route an mlx-lm model's attention through ``attention_from_codes`` while TurboQuant
    caches are in use; restored on exit.

    Calls whose keys are not ``CodesView`` (other caches, no cache) go to the original
    function (``patch_attention``).
    """
    from .cache import returning_codes
    from .codes import CodesView
    from .memory import cache_count
    if not callable(model):
        raise TypeError(f"codes_attention needs an mlx-lm model, got {type(model).__name__}")
    n_layers = cache_count(model) if hasattr(model, "layers") else None

    def wrap(original):
        def sdpa(queries, keys, values, cache=None, scale=1.0, mask=None, **kwargs):
            held = getattr(cache, "n_layers", None)
            if held is not None and n_layers is not None and held != n_layers:
                raise ValueError(f"this prompt cache was made for {held} layers, the model has "
                                 f"{n_layers} (mlx-lm would silently skip or ignore layers)")
            if hasattr(keys, "attend_rows"):              # a batch of sequences (turboquant.batch.RowsView)
                if kwargs.get("sinks") is not None:
                    raise ValueError("attention sinks are not supported from codes")
                return keys.attend_rows(queries, scale, attention_from_codes)
            if isinstance(keys, CodesView):
                if kwargs.get("sinks") is not None:
                    raise ValueError("attention sinks are not supported from codes")
                return attention_from_codes(queries, keys, values, scale=scale, mask=mask)
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)
        return sdpa

    with returning_codes(), patch_attention(model, wrap):
        yield model
