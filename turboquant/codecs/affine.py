"""Affine group quantization (``mx.quantize``), the baseline every chapter compares with.

Each group of g coordinates stores b-bit integers with an fp16 scale and bias:
bits_per_coordinate = b + 32/g. An optional rotation (as in TurboQuant) is applied first.
``mx.quantize`` accepts g ∈ {32, 64, 128} dividing D and b ∈ {2, 3, 4, 5, 6, 8}; other
values are refused here with a clear error rather than inside mlx.
"""
from __future__ import annotations

import mlx.core as mx

from ..rotation import Rotation
from .base import Code, Codec, check_input, check_int, check_spans, register

__all__ = ["AffineCodec"]

_GROUPS = (32, 64, 128)
_BITS = (2, 3, 4, 5, 6, 8)


@register
class AffineCodec(Codec):
    """``AffineCodec(dim, bits, group_size=64, *, rotation=None, seed=0)``.

    Code fields ``w`` (…, D·b/32) uint32, ``scales`` and ``biases`` (…, D/g) float16.
    """

    @classmethod
    def example(cls, dim: int) -> "AffineCodec":
        """One instance for the codec contract tests: 4 bits, groups of 32."""
        return cls(dim, 4, 32)

    name = "affine"

    def __init__(self, dim: int, bits: int, group_size: int = 64, *, rotation: str | None = None,
                 seed: int = 0):
        bits, group_size = check_int("bits", bits), check_int("group_size", group_size)
        dim, seed = check_int("dim", dim, 1), check_int("seed", seed, 0)
        if bits not in _BITS:
            raise ValueError(f"mx.quantize supports bits in {_BITS}, got {bits!r}")
        if group_size not in _GROUPS:
            raise ValueError(f"mx.quantize supports group_size in {_GROUPS}, got {group_size!r}")
        if dim % group_size:
            raise ValueError(f"dim must be a positive multiple of group_size={group_size}, got {dim!r}")
        self.dim, self.bits, self.group_size, self.seed = dim, bits, group_size, seed
        self.rotation = Rotation(rotation, dim, seed) if rotation else None

    @property
    def payload_bits(self) -> float:
        return float(self.bits)

    @property
    def bits_per_coordinate(self) -> float:
        """float: payload plus an fp16 scale and bias per group of g, b + 32/g."""
        return self.bits + 32 / self.group_size

    @property
    def nbytes_per_vector(self) -> int:
        return self.dim * self.bits // 8 + 4 * (self.dim // self.group_size)

    def config(self) -> dict:
        return {"codec": self.name, "dim": self.dim, "bits": self.bits, "group_size": self.group_size,
                "rotation": self.rotation.kind if self.rotation else None, "seed": self.seed}

    def _encode(self, x: mx.array) -> Code:
        dtype = x.dtype if isinstance(x, mx.array) else None
        x = check_input(x, self.dim)
        lead = x.shape[:-1]
        x = x.reshape(-1, self.dim)                       # mx.quantize wants a matrix
        if self.rotation is not None:
            x = self.rotation.apply(x)
        g = x.reshape(-1, self.dim // self.group_size, self.group_size)
        check_spans(mx.max(g, axis=-1) - mx.min(g, axis=-1), 1 << self.bits)   # fp16 scales: the range rule
        w, s, b = mx.quantize(x.astype(mx.float16), group_size=self.group_size, bits=self.bits)
        fields = {"w": w, "scales": s, "biases": b}
        return Code({n: a.reshape(*lead, a.shape[-1]) for n, a in fields.items()}, tuple(lead), dtype,
                    self.config())

    def _decode(self, code: Code) -> mx.array:
        flat = [code[n].reshape(-1, code[n].shape[-1]) for n in ("w", "scales", "biases")]
        x = mx.dequantize(*flat, group_size=self.group_size, bits=self.bits).astype(mx.float32)
        x = x.reshape(*code.shape, self.dim)
        if self.rotation is not None:
            x = self.rotation.invert(x)
        return x.astype(code.dtype)
