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
scaling; linear scaling is an ``nn.RoPE`` and works). ``save_prompt_cache`` keeps it (the
codes, keys before RoPE, and the RoPE it undoes); a batch (``batch.BatchCodesCache``) gives
each sequence its own row, which undoes RoPE at its own positions.

``TurnedMeanCache`` keeps what the lever gains and drops that cost. RoPE is orthogonal, so
‖k_t − μ‖ = ‖R_t k_t − R_t μ‖: coding the post-RoPE residual R_t k_t − R_t μ, with μ the key
mean learned *before* RoPE, leaves the codec exactly the energy a pre-RoPE cache codes, and the
codes stay in the frame attention reads. The mean simply turns with the position. Attention from
codes scores the residual codes with the one rotated query as usual and adds q·R_t μ to each
score — per RoPE pair a cosine and a sine of the position, weighted by the query and μ: one
(T, dims) table of the positions' angles shared by every layer and head, and one matrix product
per query, no decoding (``TurnedCodesView.score_bias``, ``angle_table``: recomputed when the
length changes, T·dims floats, never part of the cache).
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .cache import TurboQuantKVCache, TurboQuantRotatingKVCache, check_in_step, codec_ready, tag_group
from .cache_base import CacheBase, codes_mode
from .checks import check_int
from .codes import CodesView

__all__ = ["Rope", "rope_of", "PreRopeCache", "pre_rope", "TurnedMeanCache", "TurnedCodesView", "turned_mean",
           "angle_table", "centering_residual"]


@dataclass(frozen=True)
class Rope:
    """One layer's RoPE as ``mx.fast.rope`` computes it: rotate the first ``dims`` channels of
    (…, T, D) keys at positions offset…offset+T−1 (``traditional``: adjacent pairs, else halves)."""

    dims: int
    traditional: bool
    base: float
    scale: float

    def settings(self) -> dict:
        """The fields a cache file records (``from_settings`` reads them back)."""
        return {"dims": self.dims, "traditional": self.traditional, "base": self.base, "scale": self.scale}

    @classmethod
    def from_settings(cls, r, head_dim: int, where: str) -> "Rope":
        """``settings`` read back from a file, each field checked (``ValueError`` naming
        ``where`` and the bad field): even dims ≤ ``head_dim``, a positive base, a non-zero scale."""
        if not isinstance(r, dict) or set(r) != {"dims", "traditional", "base", "scale"}:
            raise ValueError(f"{where} 'rope' must have dims, traditional, base, scale; got {r!r}")
        dims = check_int(f"{where} rope dims", r["dims"], 2, head_dim)

        def num(x) -> bool:                         # a finite number, not a bool
            return isinstance(x, (int, float)) and not isinstance(x, bool) and abs(x) < float("inf")
        if dims % 2 or not isinstance(r["traditional"], bool) or not (num(r["base"]) and r["base"] > 0) \
                or not (num(r["scale"]) and r["scale"] != 0):
            raise ValueError(f"{where} rope {r!r} is not a RoPE (even dims ≤ {head_dim}, a positive base, a "
                             "non-zero scale)")
        return cls(dims, r["traditional"], float(r["base"]), float(r["scale"]))

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


def _refuse_wrapping(name: str, inner, rope) -> None:
    """What both wrappers of this module refuse: anything but an empty plain
    ``TurboQuantKVCache`` (a sliding-window cache's slots do not hold positions in order), or a
    ``rope`` that is not a ``Rope``."""
    if isinstance(inner, _Wrapper):
        raise TypeError(f"{name} wraps a plain TurboQuantKVCache; this layer is already a {type(inner).__name__} "
                        "(make_prompt_cache(model, bits=…) turns the key mean by default: pass turned_mean=False "
                        "for the centred cache, or pre_rope=True for keys before RoPE)")
    if isinstance(inner, TurboQuantRotatingKVCache) or not isinstance(inner, TurboQuantKVCache):
        raise TypeError(f"{name} wraps a plain TurboQuantKVCache, got {type(inner).__name__} "
                        "(sliding-window layers are not supported)")
    if not inner.empty():
        raise ValueError(f"{name} needs an empty cache; this one holds {inner.offset} tokens")
    if not isinstance(rope, Rope):
        raise TypeError(f"rope must be a turboquant.prerope.Rope, got {type(rope).__name__}")


class _Wrapper(CacheBase):
    """What both wrappers of this module share: a plain ``TurboQuantKVCache`` inside
    (``inner``) and a place in the prompt cache's group (``cache.tag_group``). The wrapper is the
    group's member: it checks that the layers take tokens in step before every update (its inner
    cache hands its tokens on changed, or not at once), the inner cache shares the group's
    verdict and knows the list's length (``codes_attention``); a deep copy of the whole list
    keeps the check among the copies."""

    _peers = _index = None                      # the prompt cache's members, this one's place

    @property
    def fitted_positions(self):
        """Positions the inner cache's key coders were fitted for, or None when they carry no
        limit (every key coder that is not fitted after RoPE)."""
        return self.inner.fitted_positions

    def join_group(self, group: dict, index: int, n_layers: int) -> None:
        """Become layer ``index`` of ``group`` (``cache.tag_group``)."""
        self.inner.n_layers, self.inner.group, self.inner.group_index = n_layers, group, None
        self._peers, self._index = group["caches"], index

    def _check_in_step(self, T: int) -> None:
        """Before T tokens are taken: refuse if the prompt cache is marked unusable, or if the
        layers are not in step (``cache.check_in_step``, which marks it)."""
        peers, i = self._peers, self._index
        group = getattr(self.inner, "group", None)
        if group is not None and group["broken"]:
            raise ValueError(group["broken"])
        if peers is None or i is None or i >= len(peers) or peers[i] is not self:
            return
        check_in_step(peers, i, self.offset, T, group)

    def __deepcopy__(self, memo):
        import copy
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(self.__dict__)
        new._peers = memo.get(id(self._peers))      # the copy of the list being copied, if it is
        new.inner = copy.deepcopy(self.inner, memo)
        return new


class PreRopeCache(_Wrapper):
    """``PreRopeCache(inner, rope)``: ``inner`` (a plain ``TurboQuantKVCache``, empty) codes
    the keys with ``rope`` undone; ``update_and_fetch`` returns keys with RoPE applied again.
    Everything else (offset, bytes, masks, trimming, the codecs) is ``inner``'s. Saved by
    ``save_prompt_cache`` (``file_state``); a loaded one refuses a model whose RoPE differs."""

    def __init__(self, inner: TurboQuantKVCache, rope: Rope):
        _refuse_wrapping("PreRopeCache", inner, rope)
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
        self._check_in_step(keys.shape[2])
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
    sink_tokens = property(lambda self: self.inner.sink_tokens)
    exact_nbytes = property(lambda self: self.inner.exact_nbytes)
    n_layers = property(lambda self: getattr(self.inner, "n_layers", None))   # codes_attention's layer check
    state = property(lambda self: self.inner.state)
    meta_state = property(lambda self: self.inner.meta_state)

    def code_nbytes(self, n_tokens=None) -> int:
        return self.inner.code_nbytes(n_tokens)

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

    def codes(self):
        """The held (keys, values) in temporal order as attention reads them, decoded — keys with
        RoPE applied again (these codes cannot be read without decoding); (B, H, T, D) each."""
        k, v = self.inner.codes()
        return self.rope.apply(k.dequantize(), 0), v.dequantize()

    # ----------------------------------------------------------------- batching
    def merge(self, caches):
        """One batch cache (``turboquant.batch.BatchCodesCache``) from one cache of this kind
        per sequence, as mlx-lm's batching calls it: each row undoes RoPE at its own positions
        (a row holds only its sequence's real tokens), nothing re-encoded."""
        from .batch import BatchCodesCache
        return BatchCodesCache.merge(caches)

    batch_size = property(lambda self: self.inner.batch_size)

    def file_state(self) -> dict:
        """The setting ``save_prompt_cache`` writes beside the wrapped cache: the RoPE it undoes
        (the codes themselves are the inner cache's, keys before RoPE)."""
        return {"rope": self.rope.settings()}

    @classmethod
    def from_file_state(cls, inner: TurboQuantKVCache, settings) -> "PreRopeCache":
        """The wrapper ``file_state`` describes around ``inner`` (a plain cache, possibly holding
        tokens: its codes are keys before RoPE); ``ValueError`` naming what is wrong."""
        if not isinstance(settings, dict) or set(settings) != {"rope"}:
            raise ValueError(f"setting 'pre_rope' must have rope only; got {settings!r}")
        if isinstance(inner, TurboQuantRotatingKVCache) or not isinstance(inner, TurboQuantKVCache):
            raise ValueError(f"pre_rope wraps a plain cache, this layer is {type(inner).__name__}")
        new = cls.__new__(cls)
        new.inner, new.rope = inner, Rope.from_settings(settings["rope"], inner.key_codec.dim, "pre_rope")
        return new

    def __repr__(self) -> str:
        return f"PreRopeCache({self.inner!r}, {self.rope})"


def pre_rope(model, cache: list) -> list:
    """``cache`` (a fresh prompt cache for ``model``, e.g. from ``make_prompt_cache``) with
    every layer's cache wrapped in a ``PreRopeCache`` using that layer's RoPE: its keys are
    coded before RoPE. Sliding-window layers are refused (see the module's docstring)."""
    ropes = rope_of(model)
    if len(ropes) != len(cache):
        raise ValueError(f"the cache has {len(cache)} layers, the model {len(ropes)}")
    return tag_group([PreRopeCache(c, r) for c, r in zip(cache, ropes)])


class TurnedCodesView(CodesView):
    """The keys of a ``TurnedMeanCache`` as attention from codes reads them: codes (and exact
    sinks) of the residuals R_t k_t − R_t μ, plus the pre-RoPE mean μ (H_kv, D) and the RoPE that
    turns it. ``score_bias`` gives q·R_t μ for every held position; ``dequantize`` adds R_t μ."""

    def __init__(self, view: CodesView, mean: mx.array, rope: Rope):
        super().__init__(view.codec, view.buffer, view.dtype, view.recent, view.sink)
        self.mean, self.rope = mean, rope

    def turned_mean(self) -> mx.array:
        """R_t μ for t = 0…T−1: (1, H_kv, T, D), float32."""
        return _turned(self.mean, 0, self.shape[2], self.rope)

    def score_bias(self, qf: mx.array) -> mx.array:
        """q·R_t μ: (B, H_kv, R, Tq, T) for scaled queries ``qf`` (B, H_kv, R, Tq, D).

        Per RoPE pair i (channels x, y of μ and q₁, q₂ of q, angle tθ_i), q·R_t μ sums
        cos(tθ_i)(q₁x + q₂y) + sin(tθ_i)(q₂x − q₁y): one product of the query's 2·(dims/2)
        coefficients with a (T, dims) table of cosines and sines that depends on the positions
        only (``angle_table``, shared by every layer and head), plus q·μ over channels RoPE
        leaves alone."""
        d, mu = self.rope.dims, self.mean.astype(mx.float32)[None, :, None, None, :]   # (1, H_kv, 1, 1, D)
        q = qf[..., :d]
        if self.rope.traditional:                   # pairs (2i, 2i+1)
            q1, q2, x, y = q[..., 0::2], q[..., 1::2], mu[..., 0:d:2], mu[..., 1:d:2]
        else:                                       # pairs (i, i + d/2)
            h = d // 2
            q1, q2, x, y = q[..., :h], q[..., h:], mu[..., :h], mu[..., h:d]
        a, b = q1 * x + q2 * y, q2 * x - q1 * y
        ab = (mx.stack([a, b], axis=-1).reshape(*a.shape[:-1], d) if self.rope.traditional
              else mx.concatenate([a, b], axis=-1))
        bias = ab @ angle_table(self.rope, self.shape[2]).T
        if d < self.mean.shape[-1]:
            bias = bias + mx.sum(qf[..., d:] * mu[..., d:], axis=-1, keepdims=True)
        return bias

    def dequantize(self) -> mx.array:
        x = super().dequantize()
        return (x.astype(mx.float32) + self.turned_mean()).astype(x.dtype)


_TABLE: dict = {}          # the last angle table: (rope, T) → (T, dims); one per step, shared by the layers


def angle_table(rope: Rope, T: int) -> mx.array:
    """cos(tθ_i) and sin(tθ_i) for t = 0…T−1, laid out as RoPE lays out a pair's two channels
    ((T, dims) float32: cosines in the x channels, sines in the y channels), computed by RoPE
    itself (a unit vector in every x channel, turned), so the angles are bit for bit the
    model's. The last table is kept (a step's layers share it; T·dims floats), not more."""
    key = (rope, int(T))
    table = _TABLE.get(key)
    if table is None:
        d = rope.dims
        unit = mx.zeros((d,), mx.float32)
        unit = unit.at[0:d:2].add(1.0) if rope.traditional else unit.at[:d // 2].add(1.0)
        table = Rope(d, rope.traditional, rope.base, rope.scale).apply(
            mx.broadcast_to(unit, (1, 1, int(T), d)), 0)[0, 0]
        _TABLE.clear()
        _TABLE[key] = table
    return table


def _turned(mean: mx.array, offset: int, T: int, rope: Rope) -> mx.array:
    """R_t μ for t = offset…offset+T−1: (1, H, T, D) float32 from μ (H, D)."""
    H, D = mean.shape
    return rope.apply(mx.broadcast_to(mean[None, :, None, :], (1, H, T, D)), offset)


class TurnedMeanCache(_Wrapper):
    """``TurnedMeanCache(inner, rope)``: keys centred by a mean learned before RoPE and turned
    with each position; codes read by attention from codes without decoding.

    ``inner``: an empty plain ``TurboQuantKVCache`` whose key codec is ``Centered`` (not yet
    fitted) around a codec that learns nothing else, with a value codec that learns nothing
    (the budgets of ``make_prompt_cache(budget=…)`` and ``budget.codecs_for(…, center_keys=True)``).
    The wrapper takes it over: its key codec becomes the one inside ``Centered``, and the mean is
    learned here, as ``Centered`` learns it in a cache — per kv head, on the ``fit_tokens`` = F
    keys after the S sinks, but with RoPE undone (μ = mean of R_t⁻¹ k_t). Until S + F tokens
    have come the wrapper holds them exactly (whatever chunks they arrive in); then ``inner``
    receives all of them at once and every later token as R_t k_t − R_t μ, and keeps the first
    S + F exactly (as the centred cache it replaces does). The residuals and the values are
    handed over in float32 whatever the model's dtype, so the exact tokens stay exact (their
    copies then take float32 bytes) and the inner cache holds one dtype. Every query sees the
    same cache however the prompt is fed, to float rounding; the model's layers must take
    tokens in step (checked before every update when the wrappers belong to a prompt cache:
    ``turned_mean``, ``load_prompt_cache``).

    ``update_and_fetch`` returns keys with R_t μ added back (decoded), or under
    ``codes_attention`` a ``TurnedCodesView`` (scores from codes plus q·R_t μ). Offsets, bytes
    (codes and exact tokens; the (H_kv, D) float32 mean is ``side_nbytes``, as ``Centered``'s
    is), trimming and masks are the wrapped cache's; a trim back into the first S + F tokens
    forgets the mean and learns it again from the tokens that remain. Plain (global) layers only.
    Saved and loaded by ``save_prompt_cache``/``load_prompt_cache`` (``file_state``: the mean or
    the exact tokens held, and the RoPE); batched by ``BatchCodesCache`` (``merge``: one row per
    sequence, each with its own mean and positions)."""

    def __init__(self, inner: TurboQuantKVCache, rope: Rope):
        self.refuse(inner, rope)
        kc = inner.key_codec
        self.fit_from, self.fit_tokens = inner.sink_tokens, inner.fit_tokens
        inner.key_codec = kc.inner
        inner.fitted_positions = getattr(kc.inner, "positions", None)
        inner.sink_tokens = self.fit_from + self.fit_tokens
        self.inner, self.rope = inner, rope
        self.mean = None                            # (H_kv, D) float32, once learned
        self._warm_k = self._warm_v = None          # the exact tokens held until then
        self.dtype = mx.float32                     # of the keys given (the inner cache holds float32 residuals)

    @staticmethod
    def refuse(inner, rope) -> None:
        """Raise if ``inner`` and ``rope`` cannot be wrapped (before anything is changed)."""
        from .codecs import Centered
        _refuse_wrapping("TurnedMeanCache", inner, rope)
        kc = inner.key_codec
        if not isinstance(kc, Centered) or kc.mean is not None:
            raise ValueError("TurnedMeanCache replaces a learned key mean: the cache's key codec must be an "
                             f"unfitted Centered codec, got {kc.config()['codec']}"
                             + (" (already fitted)" if isinstance(kc, Centered) else ""))
        if not (codec_ready(kc.inner) and codec_ready(inner.value_codec)):
            raise ValueError("TurnedMeanCache learns only the key mean; codecs that learn from data "
                             f"({kc.inner.config()['codec']} inside Centered, {inner.value_codec.config()['codec']} "
                             "for values) are not supported")
        if rope.dims > kc.dim:
            raise ValueError(f"RoPE turns {rope.dims} channels, more than the key codec's head size {kc.dim}")

    # ----------------------------------------------------------------- protocol
    @property
    def offset(self) -> int:
        return self.inner.offset if self.mean is not None else (0 if self._warm_k is None else self._warm_k.shape[2])

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys, values: (B, H, T, D), keys after RoPE at positions offset…offset+T−1. Returns all
        held keys (after RoPE; R_t μ added back) and values, (B, H, offset+T, D), or their codes
        under ``codes_attention`` (exact arrays while the mean is not yet learned)."""
        D = self.inner.key_codec.dim
        for name, a in (("keys", keys), ("values", values)):
            if not isinstance(a, mx.array) or a.ndim != 4 or a.shape[-1] != D:
                raise ValueError(f"{name} must be an mx.array of shape (B, H, T, {D}), got "
                                 f"{tuple(a.shape) if isinstance(a, mx.array) else type(a).__name__}")
        if keys.shape[:3] != values.shape[:3]:
            raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} disagree in (B, H, T)")
        self._check_in_step(keys.shape[2])
        if self.mean is not None:
            # residuals and values in float32: the exact tokens among them stay exact in any dtype, and the
            # inner cache holds one dtype (what its files record)
            o, T = self.inner.offset, keys.shape[2]
            self.dtype = keys.dtype
            return self._out(*self.inner.update_and_fetch(
                keys.astype(mx.float32) - _turned(self.mean, o, T, self.rope), values.astype(mx.float32)))
        if self._warm_k is not None and self._warm_k.shape[:2] != keys.shape[:2]:
            raise ValueError(f"this cache holds batch × kv heads {tuple(self._warm_k.shape[:2])}; new keys have "
                             f"{tuple(keys.shape[:2])}")
        k = keys if self._warm_k is None else mx.concatenate([self._warm_k, keys], axis=2)
        v = values if self._warm_v is None else mx.concatenate([self._warm_v, values], axis=2)
        S, F, n = self.fit_from, self.fit_tokens, k.shape[2]
        if n < S + F:
            self._warm_k, self._warm_v, self.dtype = k, v, keys.dtype
            return k, v
        fit = self.rope.apply(k[..., S:S + F, :].astype(mx.float32), S, inverse=True)
        mean = mx.mean(mx.moveaxis(fit, 1, 0).reshape(fit.shape[1], -1, D), axis=1)
        res = k.astype(mx.float32) - _turned(mean, 0, n, self.rope)
        out = self.inner.update_and_fetch(res, v.astype(mx.float32))   # a failure leaves this cache as it was
        self.mean, self._warm_k, self._warm_v, self.dtype = mean, None, None, keys.dtype
        return self._out(*out)

    def _out(self, k, v):
        if isinstance(k, CodesView):
            return TurnedCodesView(k, self.mean, self.rope), v
        return (k.astype(mx.float32) + _turned(self.mean, 0, k.shape[2], self.rope)).astype(self.dtype), \
            v.astype(self.dtype)

    @property
    def nbytes(self) -> int:
        """The wrapped cache's bytes (its codes and exact tokens), or the exact tokens held while
        the mean is learned. The mean, per layer like ``Centered``'s, is ``side_nbytes``."""
        return self.inner.nbytes + self._warm_nbytes()

    def _warm_nbytes(self) -> int:
        return 0 if self._warm_k is None else self._warm_k.nbytes + self._warm_v.nbytes

    @property
    def exact_nbytes(self) -> int:
        """Bytes of the tokens held exactly (``TurboQuantKVCache.exact_nbytes``)."""
        return self.inner.exact_nbytes + self._warm_nbytes()

    def code_nbytes(self, n_tokens=None) -> int:
        """The bit accounting of the codes (``TurboQuantKVCache.code_nbytes``); 0 while learning."""
        return 0 if self.mean is None else self.inner.code_nbytes(n_tokens)

    @property
    def side_nbytes(self) -> int:
        """Bytes of the float32 mean μ (H_kv, D), once learned."""
        return 0 if self.mean is None else self.mean.nbytes

    key_codec = property(lambda self: self.inner.key_codec)
    value_codec = property(lambda self: self.inner.value_codec)
    n_layers = property(lambda self: getattr(self.inner, "n_layers", None))   # codes_attention's layer check

    @property
    def state(self):
        """Arrays to evaluate (mlx-lm's generation loop evaluates ``state``); not a saveable state."""
        if self.mean is None:
            return [] if self._warm_k is None else [self._warm_k, self._warm_v]
        return [self.mean, *self.inner.state[:3]]

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return self.inner.is_trimmable()

    def trim(self, n: int) -> int:
        n = min(check_int("trim(n): n", n, 0), self.offset)
        keep = self.offset - n
        if self.mean is None:
            if self._warm_k is not None:
                self._warm_k, self._warm_v = ((self._warm_k[..., :keep, :], self._warm_v[..., :keep, :])
                                              if keep else (None, None))
            return n
        if keep >= self.fit_from + self.fit_tokens:
            return self.inner.trim(n)
        if not self.inner.is_trimmable():
            return self.inner.trim(n)                        # the wrapped cache's own refusal
        # back into the tokens the mean was learned on: all held exactly; learn again from them
        k = self.inner.sink_keys[..., :keep, :]
        k = (k.astype(mx.float32) + _turned(self.mean, 0, keep, self.rope)).astype(self.dtype)
        v = self.inner.sink_values[..., :keep, :].astype(self.dtype)
        self.inner.trim(self.inner.offset)
        self.mean = None
        self._warm_k, self._warm_v = (k, v) if keep else (None, None)
        return n

    # ----------------------------------------------------------------- batching
    def merge(self, caches):
        """One batch cache (``turboquant.batch.BatchCodesCache``) from one cache of this kind
        per sequence, as mlx-lm's batching calls it: each row keeps its own mean and its own
        positions (a row holds only its sequence's real tokens), nothing re-encoded."""
        from .batch import BatchCodesCache
        return BatchCodesCache.merge(caches)

    @property
    def batch_size(self):
        """Sequences held (None while empty)."""
        if self.mean is not None:
            return self.inner.batch_size
        return None if self._warm_k is None else self._warm_k.shape[0]

    def codes(self):
        """The held (keys, values) in temporal order as attention reads them: a ``TurnedCodesView``
        and the values' ``CodesView`` once the mean is learned; before that the exact arrays."""
        if self.mean is None:
            if self._warm_k is None:
                raise ValueError("the cache is empty: no codes yet")
            return self._warm_k, self._warm_v
        k, v = self.inner.codes()
        return TurnedCodesView(k, self.mean, self.rope), v

    # ----------------------------------------------------------------- files (cache_files)
    def file_state(self) -> tuple[dict, dict]:
        """(settings, arrays) that ``save_prompt_cache`` writes beside the wrapped cache's: the
        RoPE, the fit tokens, the keys' dtype; the mean μ (``mean``) once learned, else the
        exact tokens held (``wk``, ``wv``; none while empty)."""
        settings = {"rope": self.rope.settings(),
                    "fit_from": self.fit_from, "fit_tokens": self.fit_tokens, "dtype": str(self.dtype).split(".")[-1]}
        if self.mean is not None:
            return settings, {"mean": self.mean}
        return settings, ({} if self._warm_k is None else {"wk": self._warm_k, "wv": self._warm_v})

    @classmethod
    def from_file_state(cls, inner: TurboQuantKVCache, settings, arrays: dict) -> "TurnedMeanCache":
        """The wrapper ``file_state`` describes around ``inner`` (the wrapped cache as saved: its
        key codec already the one inside ``Centered``); every setting and array checked against
        it (``ValueError`` naming what is wrong)."""
        if not isinstance(settings, dict) or set(settings) != {"rope", "fit_from", "fit_tokens", "dtype"}:
            raise ValueError(f"setting 'turned_mean' must have rope, fit_from, fit_tokens, dtype; got {settings!r}")
        D = inner.key_codec.dim
        rope = Rope.from_settings(settings["rope"], D, "turned_mean")
        if isinstance(inner, TurboQuantRotatingKVCache) or not isinstance(inner, TurboQuantKVCache):
            raise ValueError(f"turned_mean wraps a plain cache, this layer is {type(inner).__name__}")
        from .codecs import Centered
        kc, vc = inner.key_codec, inner.value_codec
        if isinstance(kc, Centered) or inner.learning or not (codec_ready(kc) and codec_ready(vc)):
            raise ValueError("a turned-mean layer codes keys with the codec inside its Centered and learns nothing "
                             f"else; this one has key codec {kc.config()['codec']}, value codec "
                             f"{vc.config()['codec']}{' and is still learning' if inner.learning else ''}")
        S = check_int("turned_mean fit_from", settings["fit_from"], 0)
        F = check_int("turned_mean fit_tokens", settings["fit_tokens"], 1)
        if inner.sink_tokens != S + F:
            raise ValueError(f"a turned-mean layer keeps its {S} sinks and {F} fit tokens exact: sink_tokens must "
                             f"be {S + F}, got {inner.sink_tokens}")
        dtype = getattr(mx, settings["dtype"], None) if isinstance(settings["dtype"], str) else None
        if dtype not in (mx.float32, mx.float16, mx.bfloat16):
            raise ValueError(f"turned_mean dtype must be float32, float16 or bfloat16, got {settings['dtype']!r}")
        want = {"mean"} if inner.offset else ({"wk", "wv"} if arrays else set())
        if set(arrays) != want:
            raise ValueError(f"turned_mean tensors {sorted(arrays)}; a layer holding {inner.offset} coded tokens "
                             f"needs {sorted(want) or 'none'}")
        mean = wk = wv = None
        if inner.offset:
            if inner.offset < S + F:
                raise ValueError(f"a turned-mean layer codes from its {S + F}th token on, this one holds "
                                 f"{inner.offset}")
            H = next(iter(inner.key_codes.fields.values())).shape[1]
            mean = arrays["mean"]
            if tuple(mean.shape) != (H, D) or mean.dtype != mx.float32:
                raise ValueError(f"turned_mean tensor 'mean' is {tuple(mean.shape)} {mean.dtype}; expected ({H}, {D}) "
                                 "float32")
        elif arrays:
            wk, wv = arrays["wk"], arrays["wv"]
            if wk.ndim != 4 or tuple(wk.shape) != tuple(wv.shape) or wk.shape[-1] != D or wk.dtype != dtype \
                    or wv.dtype != dtype or not 0 < wk.shape[2] < S + F:
                raise ValueError(f"turned_mean exact tokens are {tuple(wk.shape)} {wk.dtype} and {tuple(wv.shape)} "
                                 f"{wv.dtype}; expected two (B, H, n, {D}) {dtype} arrays, 0 < n < {S + F}")
        new = cls.__new__(cls)
        new.inner, new.rope = inner, rope
        new.fit_from, new.fit_tokens, new.mean, new._warm_k, new._warm_v = S, F, mean, wk, wv
        new.dtype, new._peers, new._index = dtype, None, None
        return new

    def __deepcopy__(self, memo):
        new = super().__deepcopy__(memo)
        new.mean, new._warm_k, new._warm_v = (None if a is None else mx.array(a)
                                               for a in (self.mean, self._warm_k, self._warm_v))
        return new

    def __repr__(self) -> str:
        return f"TurnedMeanCache({self.inner!r}, {self.rope})"


def turned_mean(model, cache: list) -> list:
    """``cache`` (a fresh prompt cache for ``model`` with centred keys, e.g.
    ``make_prompt_cache(model, bits=…)``) with every plain (global) layer's cache wrapped in a
    ``TurnedMeanCache``: the key mean learned before RoPE and turned with each position, the
    codes still read by attention from codes. Sliding-window layers (Gemma 3's local layers:
    their ring's slots do not hold positions in order) are kept as they are, their mean learned
    after RoPE; a cache with no plain layer is refused. The caches given are taken over (use
    the list returned). A cache whose plain layers are all ``TurnedMeanCache`` already (what
    ``make_prompt_cache(model, bits=…)`` now makes by default) is returned as it is."""
    ropes = rope_of(model)
    if len(ropes) != len(cache):
        raise ValueError(f"the cache has {len(cache)} layers, the model {len(ropes)}")
    plain = [not isinstance(c, TurboQuantRotatingKVCache) for c in cache]
    if any(isinstance(c, TurnedMeanCache) for c in cache) and \
            all(isinstance(c, TurnedMeanCache) for c, p in zip(cache, plain) if p):
        return cache                                # turned already (the default of make_prompt_cache)
    if not any(plain):
        raise ValueError("turned_mean wraps plain (global) layers; every layer of this cache is a sliding-window "
                         f"{type(cache[0]).__name__}")
    for c, r, p in zip(cache, ropes, plain):
        if p:
            TurnedMeanCache.refuse(c, r)            # every layer checked before any is changed
    return tag_group([TurnedMeanCache(c, r) if p else c for c, r, p in zip(cache, ropes, plain)])


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
