"""What a codec does to attention on a real model's activations (Chapter 9):
``capture_qkv`` records every layer's queries, keys and values; ``layer_fidelity`` scores
attention through a codec against exact; ``key_statistics`` measures the attention sink
and what centering leaves."""
from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx

from ..attention import attention_fidelity, causal_mask, patch_attention, repeat_kv

__all__ = ["capture_qkv", "layer_fidelity", "key_statistics", "position_error"]


def recording(model, record: list):
    """Record (queries, keys, values, scale) at every attention call of ``model``."""
    def wrap(original):
        def sdpa(queries, keys, values, cache=None, scale=1.0, mask=None, **kwargs):
            record.append((queries, keys, values, scale))
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)
        return sdpa
    return patch_attention(model, wrap)


def capture_qkv(model, tokens: Sequence[int]) -> list[dict]:
    """Each layer's attention inputs on ``tokens``: [{"q": (1, H, T, D), "k", "v": (1, H_kv,
    T, D), "scale"}] in layer order (keys after RoPE, as the cache would store them)."""
    record = []
    x = mx.array(list(tokens))[None]
    with recording(model, record):
        model(x)
    mx.eval([r[:3] for r in record])
    return [{"q": q, "k": k, "v": v, "scale": s} for q, k, v, s in record]


_SAME = object()


def layer_fidelity(captured: list[dict], key_codec: Callable, value_codec=_SAME,
                   queries: int = 128, sink_tokens: int = 0) -> list[dict]:
    """Per layer: attention with codec-reconstructed K and V against exact, causal, on the
    last ``queries`` positions. ``key_codec``/``value_codec`` are callables dim → codec (a
    fresh one per layer, fitted on the layer's keys when it learns from data);
    ``value_codec`` defaults to ``key_codec``, as in ``make_prompt_cache`` — pass
    ``Identity`` to keep values exact. The first ``sink_tokens`` tokens stay exact, as in
    a cache with sink tokens. Returns attention_fidelity's dict per layer plus
    "key_rel_mse" (‖k̂ − k‖² / ‖k‖²)."""
    from ..checks import deprecated
    if value_codec is None:                     # the old meaning, for one release
        deprecated("layer_fidelity(value_codec=None) for exact values",
                   "value_codec=Identity (None will mean 'same as keys', as in make_prompt_cache)")
    elif value_codec is _SAME:                  # changed in #27: say so for one release
        deprecated("layer_fidelity without value_codec (values were kept exact until #27; now they "
                   "go through the key codec, as in make_prompt_cache)",
                   "value_codec=Identity for exact values, or the codec you mean, to silence this")
        value_codec = key_codec
    out = []
    for layer in captured:
        q, k, v, scale = layer["q"], layer["k"], layer["v"], layer["scale"]
        T, D = k.shape[2], k.shape[3]
        kc = key_codec(D)
        if hasattr(kc, "fit"):
            kc.fit(k)
        k_hat = kc.decode(kc.encode(k))
        v_hat = v
        if value_codec is not None:
            vc = value_codec(D)
            if hasattr(vc, "fit"):
                vc.fit(v)
            v_hat = vc.decode(vc.encode(v))
        if sink_tokens:
            k_hat = mx.concatenate([k[:, :, :sink_tokens], k_hat[:, :, sink_tokens:]], axis=2)
            v_hat = mx.concatenate([v[:, :, :sink_tokens], v_hat[:, :, sink_tokens:]], axis=2)
        nq = min(queries, T)
        mask = causal_mask(nq, T)
        f = attention_fidelity(q[:, :, T - nq:], k, v, k_hat, v_hat, scale=scale, mask=mask)
        f["key_rel_mse"] = (mx.sum((k_hat - k) ** 2) / mx.sum(k * k)).item()
        out.append(f)
    return out


def key_statistics(captured: list[dict]) -> dict:
    """Per layer, from ``capture_qkv`` output: "sink_mass" — mean causal attention weight on
    the first token; "centered_energy" — Σ‖k − μ_h‖² / Σ‖k‖² with μ_h the per-head key mean
    (what centering leaves for the codec); "sink_distance" — ‖k_0 − μ‖ / mean ‖k_t − μ‖."""
    mass, energy, dist = [], [], []
    for layer in captured:
        q, k, s = layer["q"], layer["k"], layer["scale"]
        T = k.shape[2]
        scores = (q * s) @ mx.swapaxes(repeat_kv(k, q.shape[1]), -1, -2)
        p = mx.softmax(mx.where(causal_mask(T, T), scores, -mx.inf), axis=-1, precise=True)
        mass.append(mx.mean(p[..., 1:, 0]).item())
        mu = mx.mean(k, axis=2, keepdims=True)
        energy.append((mx.sum((k - mu) ** 2) / mx.sum(k * k)).item())
        d = mx.linalg.norm(k - mu, axis=-1)                                   # (1, H, T)
        dist.append(mx.mean(d[..., 0] / mx.mean(d[..., 1:], axis=-1)).item())
    return {"sink_mass": mass, "centered_energy": energy, "sink_distance": dist}


def position_error(captured: list[dict], cache: list, edges: Sequence[int]) -> dict:
    """How a cache's error depends on where a token sits: each layer's captured keys and
    values (``capture_qkv``, keys after RoPE) stored through ``cache`` (a fresh prompt cache
    of the same model, all layers in order, as a forward pass would) and read back. Per layer
    and per band of positions [edges[i], edges[i+1]): the mean relative squared error
    ‖x̂ − x‖² / ‖x‖² of keys and of values, averaged over heads and tokens. Tokens the cache
    holds exactly (sink tokens, an ``fp_window``) count with error 0.

    A codec fitted on short windows sees keys only at the positions it was fitted on; RoPE
    turns every key pair by an angle proportional to its position, so keys further on have
    other statistics (Chapter 10). Returns {"edges", "keys": (L, bands), "values": (L, bands)}
    as nested lists."""
    import numpy as np
    edges = [int(e) for e in edges]
    if len(edges) < 2 or any(b <= a for a, b in zip(edges, edges[1:])) or edges[0] < 0:
        raise ValueError(f"edges must be at least two increasing positions ≥ 0, got {edges}")
    if any(getattr(c, "offset", 0) for c in cache):
        raise ValueError("position_error needs an empty prompt cache (make a fresh one): this one holds tokens")
    if len(cache) != len(captured):
        raise ValueError(f"the cache has {len(cache)} layer(s), the capture {len(captured)}: "
                         "pass the whole prompt cache")
    T = captured[0]["k"].shape[2]
    if edges[-1] > T:
        raise ValueError(f"the last edge {edges[-1]} lies beyond the {T} captured tokens")
    out = {"edges": edges, "keys": [], "values": []}
    for layer, c in zip(captured, cache):
        k, v = layer["k"].astype(mx.float32), layer["v"].astype(mx.float32)
        k_hat, v_hat = c.update_and_fetch(k, v)
        for name, x, x_hat in (("keys", k, k_hat), ("values", v, v_hat)):
            x_hat = x_hat[..., :T, :].astype(mx.float32)
            rel = np.array(mx.sum((x_hat - x) ** 2, axis=-1) / mx.sum(x * x, axis=-1))   # (1, H, T)
            per_token = rel.reshape(-1, T).mean(axis=0)
            out[name].append([float(per_token[a:b].mean()) for a, b in zip(edges, edges[1:])])
    return out
