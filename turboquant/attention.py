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

from . import kernels

__all__ = ["reference_attention", "cosine_similarity", "relative_error", "attention_fidelity",
           "attention_from_codes", "codes_attention", "patch_attention", "output_fidelity"]


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
    s = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    H = q.shape[1]
    ds = (q.astype(mx.float32) * s) @ mx.swapaxes(_repeat_kv((k_hat - k).astype(mx.float32), H), -1, -2)
    return output_fidelity(approx, exact) | {"score_rmse": mx.sqrt(mx.mean(ds * ds)).item()}


def output_fidelity(approx: mx.array, exact: mx.array) -> dict:
    """Attention outputs (..., D) against exact ones: mean and minimum cosine similarity of
    the rows and the relative error over everything."""
    cos = cosine_similarity(approx, exact)
    return {"cos_mean": mx.mean(cos).item(), "cos_min": mx.min(cos).item(),
            "rel_error": relative_error(approx, exact)}


# ------------------------------------------------------------------ from codes (Chapter 7)
def _rotated(codec) -> bool:
    return hasattr(codec, "decode_rotated") and hasattr(codec, "rotation")


def _causal(mask, Tq: int, T: int):
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown mask {mask!r}")
        return mx.arange(T - Tq, T)[:, None] >= mx.arange(T)[None]
    return mask


def _score_table(q_rot: mx.array, codec, code) -> mx.array:
    """Vector codes: per-query table of ⟨q-block, codeword⟩, looked up per block.

    q_rot (B, H_kv, R, Tq, D) → scores of the unit codes (B, H_kv, R, Tq, T)."""
    from .packing import unpack
    B, H, R, Tq, D = q_rot.shape
    k, n = codec.k, codec.n_codewords
    table = q_rot.reshape(B, H, R, Tq, D // k, k) @ codec.codewords.T           # (B, H, R, Tq, D/k, N)
    idx = unpack(code["idx"], codec.index_bits, D // k).astype(mx.int32)        # (B, H, T, D/k)
    T = idx.shape[2]
    pos = (idx + mx.arange(D // k, dtype=mx.int32) * n).reshape(B, H, 1, T * (D // k))
    looked = mx.take_along_axis(table.reshape(B, H, R * Tq, D // k * n),       # one row per query
                                mx.broadcast_to(pos, (B, H, R * Tq, T * (D // k))), axis=-1)
    return looked.reshape(B, H, R, Tq, T, D // k).sum(axis=-1)


def _byte_table_scores(q_rot: mx.array, codec, code) -> mx.array:
    """Scalar codes with b ∈ {1, 2, 4, 8}: each stored byte holds 8/b indices, so a per-query
    table of 256 entries per byte position gives the scores from T·D·b/8 lookups of the
    stored bytes, with no unpacking and no per-coordinate centroid gather.

    q_rot (B, H_kv, R, Tq, D) → scores of the unit codes (B, H_kv, R, Tq, T)."""
    B, H, R, Tq, D = q_rot.shape
    b = codec.bits
    per, P = 8 // b, D * b // 8
    byte = mx.arange(256, dtype=mx.uint32)
    cents = [mx.take(codec.centroids, ((byte >> (b * s)) & ((1 << b) - 1)).astype(mx.int32)) for s in range(per)]
    qp = q_rot.reshape(B, H, R * Tq, P, per)
    table = sum(qp[..., s:s + 1] * cents[s] for s in range(per))              # (B, H, R·Tq, P, 256)
    idx = code["idx"]                                                          # (B, H, T, P) uint8
    T = idx.shape[2]
    pos = (idx.astype(mx.int32) + mx.arange(P, dtype=mx.int32) * 256).reshape(B, H, 1, T * P)
    looked = mx.take_along_axis(table.reshape(B, H, R * Tq, P * 256),
                                mx.broadcast_to(pos, (B, H, R * Tq, T * P)), axis=-1)
    return looked.reshape(B, H, R, Tq, T, P).sum(axis=-1)


def _unwrap(view):
    """(codec that made the stored arrays, its Code): a ``Centered`` codec is unwrapped to its
    inner codec; the caller adds the mean's exact contribution."""
    from .codecs.center import Centered
    codec, code = view.codec, view.code()
    if isinstance(codec, Centered):
        return codec.inner, codec.inner_code(code)
    return codec, code


def attention_from_codes(q: mx.array, keys, values, scale: float | None = None, mask=None) -> mx.array:
    """softmax(q kᵀ·scale) v with K and V read from ``CodesView`` objects: (B, H, Tq, D).

    For codecs with a rotated frame (TurboQuant_mse, FibQuant) the query is rotated once,
    scores are ν_t·⟨Πq, c[i_t]⟩ (vector codes: a table of ⟨q-block, codeword⟩ per query,
    looked up per block; scalar codes with b ∈ {1, 2, 4, 8}: the same idea per stored byte;
    other scalar codes: gathered centroids), the softmax weights times the
    value norms sum the value codewords in the rotated frame, and one inverse rotation
    ends it. With a GPU back-end (``turboquant.kernels``) the scores and the value sums of
    TurboQuant_mse and FibQuant codes come from fused kernels that read the packed bytes.
    Other codecs are dequantized first. Full-precision recent tokens are used as
    such, and so are sink tokens (the first S). A ``Centered`` codec's mean enters exactly: q·μ added to the coded scores, and
    μ times the softmax mass on coded tokens added to the output. Equal to dequantize-then-attend up to float rounding.
    """
    B, H, Tq, D = q.shape
    Hk = keys.shape[1]
    if H % Hk:
        raise ValueError(f"query heads {H} are not a multiple of kv heads {Hk}")
    R = H // Hk
    scale = 1 / math.sqrt(D) if scale is None else scale
    qf = (q.astype(mx.float32) * scale).reshape(B, Hk, R, Tq, D)
    T = keys.shape[2]
    s, r = keys.exact_spans()

    kc, code = _unwrap(keys)
    if _rotated(kc):
        qr = kc.rotation.apply(qf)
        fused = kernels.for_attention(kc, B * H * Tq, B * Hk, T)
        if fused is not None:                                 # scores from the packed bytes
            unit = kernels.unit_scores(*fused, qr, code["idx"])
        elif hasattr(kc, "codewords"):
            unit = _score_table(qr, kc, code)
        elif getattr(kc, "bits", None) in (1, 2, 4, 8) and hasattr(kc, "centroids"):
            unit = _byte_table_scores(qr, kc, code)
        else:
            unit = qr @ mx.swapaxes(kc.decode_rotated(code), -1, -2)[:, :, None]
        scores = unit * mx.swapaxes(code["norm"].astype(mx.float32), -1, -2)[:, :, None]
    else:
        scores = qf @ mx.swapaxes(kc.decode(code).astype(mx.float32), -1, -2)[:, :, None]
    if kc is not keys.codec:                                  # Centered: add q·μ back
        mu = keys.codec.mean                                  # (Hk, D) or (D,)
        scores = scores + (qf @ mu[:, None, :, None] if mu.ndim == 2 else (qf @ mu)[..., None])
    if s or r:                                                # exact sink / recent tokens
        exact = lambda x: qf @ mx.swapaxes(x.astype(mx.float32), -1, -2)[:, :, None]  # noqa: E731
        parts = [exact(keys.sink[..., :s, :])] if s else []
        parts.append(scores[..., s:T - r])
        if r:
            parts.append(exact(keys.recent[..., keys.recent.shape[2] - r:, :]))
        scores = mx.concatenate(parts, axis=-1)

    if mask is not None:
        m = _causal(mask, Tq, T)
        if m.ndim == 4 and m.shape[1] == H and H != 1:            # per query head: (B, Hk, R, Tq, T)
            m = m.reshape(m.shape[0], Hk, R, *m.shape[2:])
        elif m.ndim == 4:                                         # one mask for all heads
            m = mx.expand_dims(m, 2)
        elif m.ndim > 4:
            raise ValueError(f"mask must broadcast to (B, H, Tq, T), got shape {tuple(m.shape)}")
        scores = mx.where(m, scores, -mx.inf) if m.dtype == mx.bool_ else scores + m
    p = mx.softmax(scores, axis=-1, precise=True)                              # (B, Hk, R, Tq, T)

    vc, code = _unwrap(values)
    sv, rv = values.exact_spans()
    pc = p[..., sv:T - rv]                                    # weights of the coded tokens
    if _rotated(vc):
        w = pc * mx.swapaxes(code["norm"].astype(mx.float32), -1, -2)[:, :, None][..., sv:T - rv]
        fused = kernels.for_attention(vc, B * H * Tq, B * Hk, T)
        if fused is not None:                                 # Σ w_t c[i_t] from the packed bytes
            w = mx.pad(w, [(0, 0)] * (w.ndim - 1) + [(sv, rv)])  # exact tokens weigh nothing here
            out = vc.rotation.invert(kernels.rotated_values(*fused, w, code["idx"]))
        else:
            units = vc.decode_rotated(code)[..., sv:T - rv, :]
            out = vc.rotation.invert(w @ units[:, :, None])
    else:
        vfull = vc.decode(code).astype(mx.float32)[..., sv:T - rv, :]
        out = pc @ vfull[:, :, None]
    if vc is not values.codec:                                # Centered: + (Σ p over codes)·μ
        mu = values.codec.mean
        out = out + pc.sum(axis=-1, keepdims=True) * (mu[:, None, None, :] if mu.ndim == 2 else mu)
    if sv:
        out = out + p[..., :sv] @ values.sink[..., :sv, :].astype(mx.float32)[:, :, None]
    if rv:
        out = out + p[..., T - rv:] @ values.recent[..., values.recent.shape[2] - rv:, :].astype(mx.float32)[:, :, None]
    return out.reshape(B, H, Tq, D).astype(q.dtype)


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
        _WRAPS.set(tuple(w for w in _WRAPS.get() if w is not wrap))
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
    from .cache import CodesView, returning_codes
    n_layers = len(model.layers) if hasattr(model, "layers") else None

    def wrap(original):
        def sdpa(queries, keys, values, cache=None, scale=1.0, mask=None, **kwargs):
            held = getattr(cache, "n_layers", None)
            if held is not None and n_layers is not None and held != n_layers:
                raise ValueError(f"this prompt cache was made for {held} layers, the model has "
                                 f"{n_layers} (mlx-lm would silently skip or ignore layers)")
            if isinstance(keys, CodesView):
                if kwargs.get("sinks") is not None:
                    raise ValueError("attention sinks are not supported from codes")
                return attention_from_codes(queries, keys, values, scale=scale, mask=mask)
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)
        return sdpa

    with returning_codes(), patch_attention(model, wrap):
        yield model
