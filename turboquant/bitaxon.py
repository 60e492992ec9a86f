"""Bit-Axon's sliding-window attention, in miniature, with a TurboQuant cache (Chapter 8).

Bit-Axon (an Apache-2.0 MLX model) has 8 sliding-window attention (SWA) layers: hidden
2560, 32 heads of D = 80, no grouped-query attention, no positional encoding on keys;
query i sees keys j with i − W < j ≤ i, W = 4096; attention runs in query chunks of 512
with plain matmul and softmax. Its cache, ``KVCache(window_size)`` (here ``ExactSWACache``:
no class of this package is named like an mlx-lm class), keeps arrays ``.k`` and ``.v`` of
shape (B, H, T, 80).

Upstream, ``update_and_fetch`` trims to the window *before* attention, so in a prefill
longer than W the early queries see no keys (NaN rows), and chunked prefill past the
window loses keys that early queries of a chunk still need. Here ``update_and_fetch``
returns the previous window *and* the new keys, the layer masks by absolute position, and
only then is the cache trimmed: any split of a sequence into prefill, chunks and single
steps gives full-sequence masked attention.

``QuantizedSWACache`` holds the window as codes in the package's one ring
(``TurboQuantRotatingKVCache``, compacted to W slots after every update: memory constant
in context length) and the layer attends from codes (``attention_from_codes``).
``TurboQuant(bits=…)`` is the plan's API: ``compress(kv_cache)`` / ``decompress(...)``.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from .attention import attention_from_codes, positions_mask, reference_attention
from .cache import TurboQuantRotatingKVCache
from .cache_base import CacheBase
from .checks import check_int
from .codes import CodesView
from .codecs.base import Codec
from .codecs.fibquant import FibQuant
from .codecs.scalar import TurboQuantMSE
from .codecs.spec import CodecSpec, codec_for

__all__ = ["SWAConfig", "BIT_AXON", "SMALL", "ExactSWACache", "SWAttention", "QuantizedSWACache", "TurboQuant",
           "full_sequence_attention", "window_attention", "ring_fidelity"]


@dataclass(frozen=True)
class SWAConfig:
    hidden: int = 2560
    n_heads: int = 32
    head_dim: int = 80
    window: int = 4096
    chunk: int = 512
    n_layers: int = 8

    def __post_init__(self):
        for f in ("hidden", "n_heads", "head_dim", "window", "chunk", "n_layers"):
            check_int(f, getattr(self, f), 1)          # 2.5, nan, True, 0 and negatives are refused
        if self.n_heads * self.head_dim != self.hidden:
            raise ValueError(f"n_heads × head_dim must equal hidden: {self.n_heads}×{self.head_dim} != {self.hidden}")


BIT_AXON = SWAConfig()
SMALL = SWAConfig(hidden=256, n_heads=4, head_dim=64, window=64, chunk=16, n_layers=1)


class ExactSWACache(CacheBase):
    """Bit-Axon's cache (upstream ``KVCache``: ``.k``, ``.v`` (B, H, T, D), ``window_size``),
    made exact: ``update_and_fetch`` returns previous + new keys for attention, then keeps
    the last W."""

    def __init__(self, window_size: int):
        self.window_size = check_int("window_size", window_size, 1)
        self.k = self.v = None
        self.offset = 0

    def update_and_fetch(self, xk: mx.array, xv: mx.array):
        k = xk if self.k is None else mx.concatenate([self.k, xk], axis=2)
        v = xv if self.v is None else mx.concatenate([self.v, xv], axis=2)
        self.k, self.v = k[..., -self.window_size:, :], v[..., -self.window_size:, :]
        self.offset += xk.shape[2]
        return k, v

    def size(self) -> int:
        return min(self.offset, self.window_size)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None) -> mx.array:
        """(N, held + N) bool: the next ``N`` queries over the keys ``update_and_fetch`` will
        return (the held window and the new ones), by the window rule p − W < j ≤ p."""
        held = 0 if self.k is None else self.k.shape[2]
        return positions_mask(mx.arange(self.offset, self.offset + N),
                              mx.arange(self.offset - held, self.offset + N), window_size or self.window_size)

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else self.k.nbytes + self.v.nbytes


class KVCache(ExactSWACache):
    """Deprecated name of ``ExactSWACache`` (it shadowed mlx-lm's ``KVCache``)."""

    def __init__(self, window_size: int):
        from .checks import deprecated
        deprecated("bitaxon.KVCache", "bitaxon.ExactSWACache")
        super().__init__(window_size)


class QuantizedSWACache:
    """Bit-Axon's cache face over the package's one ring of codes,
    ``TurboQuantRotatingKVCache`` (mlx-lm's ``RotatingKVCache`` semantics):
    ``QuantizedSWACache(window_size, codec, value_codec=None)`` (one codec for K and V, or
    ``value_codec``). A window of W needs the last W − 1 tokens plus the new ones:
    ``update_and_fetch`` hands attention exactly those as codes in temporal order, then
    compacts the ring to W slots, so memory is W slots of codes whatever the context."""

    def __init__(self, window_size: int, codec: Codec, value_codec: Optional[Codec] = None):
        window_size = check_int("window_size", window_size, 1)     # NumPy ints too; never True
        if not isinstance(codec, Codec):
            raise TypeError(f"codec must be a turboquant codec, got {type(codec).__name__}")
        if value_codec is None:                      # a learning codec is never shared by K and V
            value_codec = copy.deepcopy(codec) if hasattr(codec, "fit") else codec
        self.ring = TurboQuantRotatingKVCache(window_size, codec, value_codec)

    @classmethod
    def from_tokens(cls, window_size: int, k: mx.array, v: mx.array, offset: int, codec: Codec,
                    value_codec: Optional[Codec] = None) -> "QuantizedSWACache":
        """The ring after ``offset`` tokens whose last ones are ``k``, ``v`` (B, H, T, D)."""
        face = cls(window_size, codec, value_codec)
        face.ring = TurboQuantRotatingKVCache.from_tokens(window_size, k, v, face.key_codec, face.value_codec,
                                                          offset=offset)
        return face

    window_size = property(lambda self: self.ring.max_size)
    key_codec = property(lambda self: self.ring.key_codec)
    value_codec = property(lambda self: self.ring.value_codec)
    offset = property(lambda self: self.ring.offset)
    dtype = property(lambda self: self.ring.dtype)

    @property
    def k(self):
        """The number of old tokens the next update hands back (at most W − 1), as
        ``cache.k.shape[2]`` — what Bit-Axon's layer reads before an update."""
        if self.ring.empty():
            return None
        B, H = self.ring.codes()[0].shape[:2]
        return _Shape((B, H, min(self.offset, self.window_size - 1), self.key_codec.dim))

    def update_and_fetch(self, xk: mx.array, xv: mx.array):
        """Encode the new tokens; return ``CodesView`` objects of the last W − 1 held tokens plus
        the new ones (temporal order); then compact the ring to W slots."""
        self.ring.update_and_fetch(xk, xv)       # lazy: the dequantized return is never computed
        views = self.ring.codes()
        self.ring.compact()
        return views

    def codes(self):
        """The held tokens (at most W) as (keys, values) ``CodesView`` objects, oldest first."""
        return self.ring.codes()

    @property
    def nbytes(self) -> int:
        return self.ring.nbytes

    def __deepcopy__(self, memo):
        """An independent copy (arrays copied; codecs rebuilt from their configurations)."""
        new = QuantizedSWACache.__new__(QuantizedSWACache)
        new.ring = copy.deepcopy(self.ring, memo)
        memo[id(self)] = new
        return new


class _Shape:
    def __init__(self, shape):
        self.shape = shape


class SWAttention(nn.Module):
    """Bit-Axon's SWA layer: projections, no RoPE, window rule, query chunks (float32)."""

    def __init__(self, config: SWAConfig = SMALL):
        super().__init__()
        self.config = config
        h = config.hidden
        self.q_proj, self.k_proj = nn.Linear(h, h, bias=False), nn.Linear(h, h, bias=False)
        self.v_proj, self.o_proj = nn.Linear(h, h, bias=False), nn.Linear(h, h, bias=False)

    def project(self, x: mx.array):
        """x (B, T, hidden) → q, k, v each (B, H, T, D)."""
        B, T, _ = x.shape
        c = self.config
        split = lambda t: t.reshape(B, T, c.n_heads, c.head_dim).transpose(0, 2, 1, 3)
        return split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))

    def __call__(self, x: mx.array, cache=None) -> mx.array:
        B, T, _ = x.shape
        c = self.config
        q, k, v = self.project(x)
        out = window_attention(q, k, v, cache, c.window, c.chunk, 1 / math.sqrt(c.head_dim))
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, c.hidden))


def window_attention(q: mx.array, k: mx.array, v: mx.array, cache, window: int, chunk: int,
                     scale: float) -> mx.array:
    """Bit-Axon's attention step for new tokens: q (B, H, T, D), k and v (B, H_kv, T, D)
    (H a multiple of H_kv) → (B, H, T, D).

    The number of held keys is read from ``cache.k.shape[2]`` *before* the update, as
    upstream does; the cache returns held + new keys (or their codes); queries attend in
    chunks of ``chunk`` with the mask i − W < j ≤ i built from absolute positions."""
    window, chunk = check_int("window", window, 1), check_int("chunk", chunk, 1)
    T = q.shape[2]
    n_prev = 0 if cache is None or cache.k is None else cache.k.shape[2]
    start = 0 if cache is None else cache.offset
    if cache is not None:
        k, v = cache.update_and_fetch(k, v)
    k_pos = mx.arange(start - n_prev, start + T)
    outs = []
    for s in range(0, T, chunk):                                        # query chunks
        e = min(T, s + chunk)
        q_pos = mx.arange(start + s, start + e)
        lo = max(0, (start + s - window + 1) - (start - n_prev))        # first key any query here sees
        hi = (start + e) - (start - n_prev)
        mask = positions_mask(q_pos, k_pos[lo:hi], window)
        if isinstance(k, CodesView):
            kv = CodesView(k.codec, k.buffer.slice(lo, hi), k.dtype)
            vv = CodesView(v.codec, v.buffer.slice(lo, hi), v.dtype)
            outs.append(attention_from_codes(q[:, :, s:e], kv, vv, scale=scale, mask=mask))
        else:
            outs.append(reference_attention(q[:, :, s:e], k[:, :, lo:hi], v[:, :, lo:hi], scale, mask))
    return mx.concatenate(outs, axis=2)


def full_sequence_attention(layer: SWAttention, x: mx.array) -> mx.array:
    """The reference: one masked attention over the whole sequence, no cache, no chunks."""
    B, T, _ = x.shape
    c = layer.config
    q, k, v = layer.project(x)
    pos = mx.arange(T)
    scores = (q / math.sqrt(c.head_dim)) @ mx.swapaxes(k, -1, -2)
    scores = mx.where(positions_mask(pos, pos, c.window), scores, -mx.inf)
    out = mx.softmax(scores, axis=-1, precise=True) @ v
    return layer.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, c.hidden))


class TurboQuant:
    """The plan's API: ``TurboQuant(payload_bits=4)`` then ``compress(kv_cache)`` → a
    ``QuantizedSWACache`` and ``decompress(qcache)`` → an ``ExactSWACache``.

    ``payload_bits`` are stored index bits per coordinate, without the fp16 norm (so 4 →
    4 + 16/D bits per coordinate); ``make_prompt_cache(bits=)`` is a different thing, a
    budget that includes side information, hence the different name. Integer payloads use
    TurboQuant_mse; fractional ones FibQuant with k = 2 (N = 2^(2b) codewords, so b must be
    a multiple of ½); or pass ``codec`` (any codec spec: an instance, a config dict or a
    callable head_dim → codec; ``turboquant.codecs.spec``). Head size 80 works with every
    codec."""

    def __init__(self, payload_bits: float = 4, codec: CodecSpec = None, seed: int = 0, **kwargs):
        if "bits" in kwargs:
            raise TypeError("TurboQuant(bits=) is now TurboQuant(payload_bits=): index bits per "
                            "coordinate without the fp16 norm (make_prompt_cache's bits= is a budget "
                            "that includes it)")
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}")
        if codec is None and not (isinstance(payload_bits, (int, float)) and not isinstance(payload_bits, bool)
                                  and payload_bits > 0):
            raise ValueError(f"payload_bits must be a positive number, got {payload_bits!r}")
        self.payload_bits, self.codec_spec, self.seed = payload_bits, codec, check_int("seed", seed, 0)

    def codec(self, head_dim: int) -> Codec:
        if self.codec_spec is not None:
            return codec_for(self.codec_spec, head_dim)
        if float(self.payload_bits).is_integer():
            return TurboQuantMSE(head_dim, int(self.payload_bits), seed=self.seed)
        return FibQuant(head_dim, k=2, bits=float(self.payload_bits), seed=self.seed)

    def compress(self, kv_cache: ExactSWACache) -> QuantizedSWACache:
        if not isinstance(kv_cache, ExactSWACache):
            raise TypeError(f"compress takes a bitaxon.ExactSWACache, got {type(kv_cache).__name__}")
        if kv_cache.k is None:
            raise ValueError("cannot compress an empty cache")
        return QuantizedSWACache.from_tokens(kv_cache.window_size, kv_cache.k, kv_cache.v, kv_cache.offset,
                                             self.codec(kv_cache.k.shape[-1]))

    def decompress(self, qcache: QuantizedSWACache) -> ExactSWACache:
        if not isinstance(qcache, QuantizedSWACache):
            raise TypeError(f"decompress takes a QuantizedSWACache, got {type(qcache).__name__}")
        out = ExactSWACache(qcache.window_size)
        out.offset = qcache.offset
        if not qcache.ring.empty() and qcache.offset:
            kv, vv = qcache.codes()
            out.k, out.v = kv.dequantize(), vv.dequantize()
        return out


def ring_fidelity(captured: list[dict], codec: Callable[[int], Codec], window: int, chunk: int = 512,
                  value_codec: Optional[Callable[[int], Codec]] = None) -> list[dict]:
    """Per layer of a real model: the window attention of its captured queries, keys and
    values (``turboquant.evaluation.capture_qkv``; one prefill, so it runs past the window) through
    a ``QuantizedSWACache`` (keys with ``codec(D)``, values with ``value_codec`` or the same)
    against the same attention on exact keys and values. Returns per layer {"cos_mean",
    "cos_min", "rel_error"} over every query row and head."""
    from .attention import output_fidelity
    out = []
    for layer in captured:
        q, k, v, scale = layer["q"], layer["k"], layer["v"], layer["scale"]
        D = k.shape[-1]
        ring = QuantizedSWACache(window, codec(D), None if value_codec is None else value_codec(D))
        approx = window_attention(q, k, v, ring, window, chunk, scale)
        exact = window_attention(q, k, v, None, window, chunk, scale)
        out.append(output_fidelity(approx, exact))
    return out
