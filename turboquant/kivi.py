"""A KIVI-style KV cache, for comparison (Chapter 10, ``turboquant.suite``).

KIVI (Liu et al., 2024, arXiv 2402.02750) quantizes keys *per channel* and values *per
token*, and keeps the most recent tokens in full precision. Keys have a few channels with
large, persistent magnitude, so a scale per channel over a group of G tokens fits them
better than a scale per token; values have no such channels and their error is averaged
by attention, so per-token groups suffice.

``KIVICache(bits, group=32, residual=32, value_group=64)`` stores

* keys of complete groups of ``group`` tokens as ``mx.quantize`` codes along the token
  axis (per channel: one fp16 scale and bias per channel per group: b + 32/G bits),
* values of the same tokens as ``mx.quantize`` codes along the head axis in groups of
  ``value_group`` coordinates (b + 32/g bits),
* the newest tokens in float16 (between ``residual`` and ``residual + group − 1`` of them
  once the context is long enough), so ``nbytes`` counts them at the context where it is
  read: at 512 tokens the window is a large share of the cache, at 32K a small one.

What this simplifies: KIVI's fused kernels (attention here dequantizes what it reads, as
mlx-lm's own caches do), and its exact residual policy (KIVI flushes the residual when it
reaches R; here the oldest complete group leaves once R + G tokens are waiting).
"""
from __future__ import annotations


import mlx.core as mx

from .cache_base import CacheBase
from .checks import check_int
from .codecs.base import FP16_MAX

__all__ = ["KIVICache"]

_BITS = (2, 3, 4, 5, 6, 8)
_GROUPS = (32, 64, 128)


def _cat(old, new, axis):
    return new if old is None else mx.concatenate([old, new], axis=axis)


class KIVICache(CacheBase):
    """KIVICache(bits, group=32, residual=32, value_group=64): mlx-lm's cache protocol
    (``offset``, ``update_and_fetch``, ``make_mask``, ``nbytes``, ``empty``, ``size``);
    keys and values (B, H, T, D). Not trimmable and not saved (a comparison baseline). Its bit
    width is ``n_bits``: an attribute named ``bits`` would make mlx-lm route the cache to its
    own quantized attention."""

    def __init__(self, bits: int, group: int = 32, residual: int = 32, value_group: int = 64):
        bits, group = check_int("bits", bits), check_int("group", group)
        if bits not in _BITS:
            raise ValueError(f"KIVICache supports bits in {_BITS} (mx.quantize), got {bits!r}")
        if group not in _GROUPS or value_group not in _GROUPS:
            raise ValueError(f"group and value_group must be in {_GROUPS}, got {group!r}, {value_group!r}")
        value_group = check_int("value_group", value_group)
        self.n_bits, self.group, self.value_group = bits, group, value_group
        self.residual = check_int("residual", residual, 0)
        self.offset = 0
        self.kq = self.vq = None           # (w, scales, biases) triples
        self.fk = self.fv = None           # float16 (B, H, r, D)

    def _flush(self, k: mx.array, v: mx.array) -> None:
        """Quantize ``k``, ``v`` (B, H, n·G, D) and append them to the codes."""
        kt = mx.swapaxes(k, -1, -2).astype(mx.float16)                   # (B, H, D, n·G)
        kq = mx.quantize(kt, group_size=self.group, bits=self.n_bits)
        vq = mx.quantize(v.astype(mx.float16), group_size=self.value_group, bits=self.n_bits)
        self.kq = kq if self.kq is None else tuple(_cat(a, b, -1) for a, b in zip(self.kq, kq))
        self.vq = vq if self.vq is None else tuple(_cat(a, b, -2) for a, b in zip(self.vq, vq))

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.ndim != 4 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(f"keys and values must be (B, H, T, D) with equal (B, H, T), "
                             f"got {keys.shape} and {values.shape}")
        D, Dv = keys.shape[-1], values.shape[-1]
        if Dv % self.value_group:
            raise ValueError(f"value head size {Dv} is not a multiple of value_group={self.value_group}")
        self.dtype = keys.dtype
        big = mx.maximum(mx.max(mx.abs(keys)), mx.max(mx.abs(values))).item()
        if not big <= FP16_MAX:                        # also NaN
            raise ValueError(f"keys/values reach {big:.4g}: KIVICache stores float16 (largest {FP16_MAX})")
        self.fk = _cat(self.fk, keys.astype(mx.float16), 2)
        self.fv = _cat(self.fv, values.astype(mx.float16), 2)
        self.offset += keys.shape[2]
        r = self.fk.shape[2]
        n = max(0, (r - self.residual) // self.group) * self.group
        if n:
            self._flush(self.fk[:, :, :n], self.fv[:, :, :n])
            self.fk, self.fv = self.fk[:, :, n:], self.fv[:, :, n:]
        k, v = self.fk, self.fv
        if self.kq is not None:
            kd = mx.swapaxes(mx.dequantize(*self.kq, group_size=self.group, bits=self.n_bits), -1, -2)
            vd = mx.dequantize(*self.vq, group_size=self.value_group, bits=self.n_bits)
            k, v = mx.concatenate([kd, k], axis=2), mx.concatenate([vd, v], axis=2)
        return k.astype(self.dtype), v.astype(self.dtype)

    def __deepcopy__(self, memo):
        """An independent copy (a needle trial continues a shared prefill from one): mlx arrays
        are never changed in place here (updates concatenate new ones), so the copy may hold
        the same arrays; ``copy.deepcopy`` of the dtype itself would fail."""
        import copy
        return copy.copy(self)

    @property
    def state(self):
        """The arrays held (for ``mx.eval``, as mlx-lm's generation loop does); not a saveable
        state: this comparison baseline cannot be saved or restored."""
        return [a for a in (*(self.kq or ()), *(self.vq or ()), self.fk, self.fv) if a is not None]

    @state.setter
    def state(self, v):
        raise NotImplementedError("KIVICache is a comparison baseline and is not saved or restored")

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)
