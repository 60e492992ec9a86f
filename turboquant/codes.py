"""Codes as first-class objects: buffers of code fields and the views attention reads.

A ``CodeBuffer`` holds the fields of a codec's ``Code`` stacked along the token axis, each
(B, H, T, w); caches grow, slice and overwrite them. A ``CodesView`` is what a cache hands
to attention from codes: the codec, a buffer of T tokens, the dtype of the cached tensors,
and the tokens held exactly (the first S sinks, the last R recent tokens).
"""
from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .codecs.base import Code, Codec

__all__ = ["CodeBuffer", "CodesView"]


class CodeBuffer:
    """Code fields stacked along the token axis: name → (B, H, T, w) arrays."""

    def __init__(self, fields: dict):
        self.fields = dict(fields)

    @property
    def length(self) -> int:
        return next(iter(self.fields.values())).shape[2]

    def slice(self, a: int, b: Optional[int] = None) -> "CodeBuffer":
        return CodeBuffer({n: f[..., a:b, :] for n, f in self.fields.items()})

    @staticmethod
    def concat(parts) -> "CodeBuffer":
        parts = [p for p in parts if p is not None and p.length > 0]
        return CodeBuffer({n: mx.concatenate([p.fields[n] for p in parts], axis=2) for n in parts[0].fields})

    def zeros(self, n: int) -> "CodeBuffer":
        return CodeBuffer({k: mx.zeros((*f.shape[:2], n, f.shape[3]), f.dtype) for k, f in self.fields.items()})

    def assign(self, start: int, other: "CodeBuffer") -> None:
        for n, f in self.fields.items():
            f[..., start:start + other.length, :] = other.fields[n]

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.fields.values())

    def copy(self) -> "CodeBuffer":
        """An independent copy: in-place writes into one are not seen by the other."""
        return CodeBuffer({n: mx.array(f) for n, f in self.fields.items()})


class CodesView:
    """What ``update_and_fetch`` returns in codes mode: the codes attention should read."""

    def __init__(self, codec: Codec, buffer: CodeBuffer, dtype, recent: Optional[mx.array] = None,
                 sink: Optional[mx.array] = None):
        self.codec, self.buffer, self.dtype, self.recent, self.sink = codec, buffer, dtype, recent, sink
        B, H = next(iter(buffer.fields.values())).shape[:2]
        self.shape = (B, H, buffer.length, codec.dim)

    def code(self) -> Code:
        return Code(self.buffer.fields, self.shape[:3], self.dtype, self.codec.config())

    def exact_spans(self) -> tuple[int, int]:
        """(s, r): the first s and the last r of the T tokens are held exactly (sink and
        recent window, never overlapping: the recent window yields to the sink)."""
        T = self.shape[2]
        s = 0 if self.sink is None else min(self.sink.shape[2], T)
        r = 0 if self.recent is None else min(self.recent.shape[2], T - s)
        return s, r

    def dequantize(self) -> mx.array:
        x = self.codec.decode(self.code())
        s, r = self.exact_spans()
        if s or r:
            T = x.shape[2]
            parts = [self.sink[..., :s, :].astype(x.dtype)] if s else []
            parts.append(x[..., s:T - r, :])
            if r:
                parts.append(self.recent[..., self.recent.shape[2] - r:, :].astype(x.dtype))
            x = mx.concatenate(parts, axis=2)
        return x
