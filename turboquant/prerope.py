"""Keys coded before RoPE (KVQuant's finding; a lever of Chapter 10's ablation).

mlx-lm's attention turns keys by RoPE before the cache sees them: a layer's cache receives
R_t k_t, where R_t rotates pairs of channels by angles proportional to the position t. A
structure the keys share across tokens — a per-channel bias (Qwen2's ``k_proj`` has one),
channels of persistently large magnitude — is one fixed vector before RoPE, but after it the
vector turns with t, so a cache-wide mean (``Centered``) or a per-channel range fits it only
on average over positions.

``PreRopeCache`` undoes RoPE on the way in (R_t is orthogonal and R_t⁻¹ = R_{−t}: the same
``mx.fast.rope`` with the scale negated), hands the position-free keys k_t to a
``TurboQuantKVCache`` — which codes them, centres them, keeps its sinks, as it would any
keys — and applies R_t to the decoded keys on the way out. Attention therefore sees R_t k̂_t,
and the only new error is the rounding of the two rotations, computed in float32 whatever the
keys' dtype (≈ 1e-7 relative; the result is cast back to the keys' dtype).

What it costs at decode: attention from codes (``turboquant.attention``) cannot read these
codes. Its per-query table rotates the query once for all cached keys, but q·R_t k̂_t =
(R_t⁻¹ q)·k̂_t needs a different query for every position t. So a ``PreRopeCache`` decodes
every cached key and value and applies RoPE to the keys at each step (the codecs' inverse
rotation of every vector: O(T·D log D) with the default randomized Hadamard, O(T·D²) with a
Haar rotation; transient memory of a few B·H_kv·T·D floats per layer, like a dequantizing
cache); inside ``codes_attention`` it returns those decoded keys and values, so that layer's
attention runs as for an exact cache (``mlx_lm.generate`` and ``codes_attention`` work, at
that cost; Chapter 10 measures it). It supports plain (global) layers; sliding-window layers
(``TurboQuantRotatingKVCache``), whose slots do not hold positions 0…T−1 in order, are
refused, as are RoPE variants other than mlx's ``nn.RoPE`` (Llama-3, YaRN, dynamic NTK
scaling; linear scaling is an ``nn.RoPE`` and works). Not supported either: saving
(``save_prompt_cache`` refuses it) and batching (no ``merge``).
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .cache import TurboQuantKVCache, TurboQuantRotatingKVCache
from .cache_base import CacheBase, codes_mode

__all__ = ["Rope", "rope_of", "PreRopeCache", "pre_rope", "centering_residual"]


@dataclass(frozen=True)
class Rope:
    """One layer's RoPE as ``mx.fast.rope`` computes it: rotate the first ``dims`` channels of
    (…, T, D) keys at positions offset…offset+T−1 (``traditional``: adjacent pairs, else halves)."""

    dims: int
    traditional: bool
    base: float
    scale: float

    def apply(self, x: mx.array, offset: int, inverse: bool = False) -> mx.array:
        """R_t x (``inverse``: R_t⁻¹ x = R_{−t} x) for x of shape (…, T, D), t = offset + row."""
        y = mx.fast.rope(x.astype(mx.float32), self.dims, traditional=self.traditional, base=self.base,
                         scale=-self.scale if inverse else self.scale, offset=int(offset))
        return y.astype(x.dtype)


def rope_of(model) -> list:
    """The ``Rope`` of each of ``model``'s layers (``layer.self_attn.rope``), for the models
    this package installs (mlx-lm's llama, qwen2 and gemma3). A layer without one, or with a
    RoPE variant other than ``nn.RoPE`` (Llama-3, YaRN, dynamic NTK scaling), is refused."""
    layers = getattr(model, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has no .layers: not an mlx-lm language model")
    out = []
    for i, layer in enumerate(layers):
        rope = getattr(getattr(layer, "self_attn", None), "rope", None)
        if rope is None:
            raise ValueError(f"layer {i} has no self_attn.rope: keys coded before RoPE need a RoPE model")
        if type(rope) is not nn.RoPE:
            raise ValueError(f"layer {i}'s attention has RoPE {type(rope).__name__}; keys coded before RoPE "
                             "need mlx's nn.RoPE (linear scaling works; Llama-3, YaRN and dynamic NTK do not)")
        out.append(Rope(int(rope.dims), bool(rope.traditional), float(rope.base), float(rope.scale)))
    return out


class PreRopeCache(CacheBase):
    """``PreRopeCache(inner, rope)``: ``inner`` (a plain ``TurboQuantKVCache``, empty) codes
    the keys with ``rope`` undone; ``update_and_fetch`` returns keys with RoPE applied again.
    Everything else (offset, bytes, masks, trimming, the codecs) is ``inner``'s. Not saved by
    ``save_prompt_cache`` (it refuses anything but TurboQuant caches)."""

    def __init__(self, inner: TurboQuantKVCache, rope: Rope):
        if isinstance(inner, TurboQuantRotatingKVCache) or not isinstance(inner, TurboQuantKVCache):
            raise TypeError(f"PreRopeCache wraps a plain TurboQuantKVCache, got {type(inner).__name__} "
                            "(sliding-window layers are not supported)")
        if not inner.empty():
            raise ValueError(f"PreRopeCache needs an empty cache; this one holds {inner.offset} tokens after RoPE")
        if not isinstance(rope, Rope):
            raise TypeError(f"rope must be a turboquant.prerope.Rope, got {type(rope).__name__}")
        if rope.dims > inner.key_codec.dim:
            raise ValueError(f"RoPE turns {rope.dims} channels, more than the key codec's head size "
                             f"{inner.key_codec.dim}")
        self.inner, self.rope = inner, rope

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys, values: (B, H, T, D), keys after RoPE at positions offset…offset+T−1. Returns
        all held keys (after RoPE, decoded) and values, (B, H, offset+T, D) — also inside
        ``codes_attention`` (these codes cannot be read without decoding)."""
        if not isinstance(keys, mx.array) or keys.ndim != 4 or keys.shape[-1] != self.inner.key_codec.dim:
            raise ValueError(f"keys must be an mx.array of shape (B, H, T, {self.inner.key_codec.dim}), got "
                             f"{tuple(keys.shape) if isinstance(keys, mx.array) else type(keys).__name__}")
        token = codes_mode.set(0)                 # the inner cache decodes, whatever the caller's mode
        try:
            k, v = self.inner.update_and_fetch(self.rope.apply(keys, self.inner.offset, inverse=True), values)
        finally:
            codes_mode.reset(token)
        return self.rope.apply(k, 0), v

    offset = property(lambda self: self.inner.offset)
    nbytes = property(lambda self: self.inner.nbytes)
    key_codec = property(lambda self: self.inner.key_codec)
    value_codec = property(lambda self: self.inner.value_codec)
    n_layers = property(lambda self: getattr(self.inner, "n_layers", None))   # codes_attention's layer check
    state = property(lambda self: self.inner.state)
    meta_state = property(lambda self: self.inner.meta_state)

    def size(self) -> int:
        return self.inner.size()

    def empty(self) -> bool:
        return self.inner.empty()

    def is_trimmable(self) -> bool:
        return self.inner.is_trimmable()

    def trim(self, n: int) -> int:
        return self.inner.trim(n)

    def make_mask(self, *args, **kwargs):
        return self.inner.make_mask(*args, **kwargs)

    def __repr__(self) -> str:
        return f"PreRopeCache({self.inner!r}, {self.rope})"


def pre_rope(model, cache: list) -> list:
    """``cache`` (a fresh prompt cache for ``model``, e.g. from ``make_prompt_cache``) with
    every layer's cache wrapped in a ``PreRopeCache`` using that layer's RoPE: its keys are
    coded before RoPE. Sliding-window layers are refused (see the module's docstring)."""
    ropes = rope_of(model)
    if len(ropes) != len(cache):
        raise ValueError(f"the cache has {len(cache)} layers, the model {len(ropes)}")
    return [PreRopeCache(c, r) for c, r in zip(cache, ropes)]


def centering_residual(keys: mx.array, rope: Rope, fit_tokens: int = 16, sinks: int = 1) -> tuple:
    """What a cache-wide key mean leaves to code, after RoPE and before it.

    ``keys``: (1, H, T, D), one layer's keys after RoPE at positions 0…T−1 (as
    ``evaluation.capture_qkv`` gives them). The mean is learned as ``Centered`` learns it in a
    cache — per head, over the ``fit_tokens`` tokens after the ``sinks`` exact ones — once from
    the keys as they are and once from the keys with RoPE undone. Returns (after, before): over
    the keys the cache codes (those past the sinks and the fit tokens, which it keeps exact),
    the squared norm of the centred keys over that of the keys, Σ‖k − μ‖² / Σ‖k‖², each way.
    A codec behind a random rotation errs in proportion to the norm it codes (exactly in
    expectation over a Haar rotation, approximately for the seeded Hadamard default), so
    ``before / after`` is about the share of the error a pre-RoPE cache keeps: RoPE is
    orthogonal too, and coding k_t − μ before RoPE costs what coding R_t k_t − R_t μ after it
    would, a mean that turns with the position."""
    if keys.ndim != 4 or keys.shape[0] != 1 or keys.shape[-1] < rope.dims:
        raise ValueError(f"keys must have shape (1, H, T, D) with D >= {rope.dims}, got {tuple(keys.shape)}")
    T = keys.shape[2]
    if sinks < 0 or fit_tokens < 1 or sinks + fit_tokens >= T:
        raise ValueError(f"{sinks} sinks + {fit_tokens} fit tokens do not fit in {T} keys")

    def residual(k):
        mu = mx.mean(k[:, :, sinks:sinks + fit_tokens], axis=2, keepdims=True)
        rest = k[:, :, sinks + fit_tokens:]
        return (mx.sum((rest - mu) ** 2) / mx.sum(rest ** 2)).item()

    keys = keys.astype(mx.float32)
    return residual(keys), residual(rope.apply(keys, 0, inverse=True))
