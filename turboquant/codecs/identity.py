"""A pass-through codec: stores vectors unchanged (float32 or float16).

It lets the compressed caches be tested for exactness against mlx-lm's own caches: with
it, any difference in logits is the cache's bookkeeping, not quantization.
"""
from __future__ import annotations

import mlx.core as mx

from .base import FP16_MAX, FP16_TINY, Code, Codec, check_input, check_int, register

__all__ = ["Identity"]


@register
class Identity(Codec):
    """Identity(dim, dtype="float32"). Code field ``x`` (…, D)."""

    @classmethod
    def example(cls, dim: int) -> "Identity":
        """One instance for the codec contract tests: float32 (the default)."""
        return cls(dim)

    name = "identity"

    def __init__(self, dim: int, dtype: str = "float32"):
        dim = check_int("dim", dim, 1)
        if dtype not in ("float32", "float16"):
            raise ValueError(f"dtype must be 'float32' or 'float16', got {dtype!r}")
        self.dim, self.dtype = dim, dtype
        self._dtype = getattr(mx, dtype)

    rotation = None

    @property
    def payload_bits(self) -> float:
        return 32.0 if self.dtype == "float32" else 16.0

    @property
    def bits_per_coordinate(self) -> float:
        """float: the payload (no side information)."""
        return self.payload_bits

    @property
    def nbytes_per_vector(self) -> int:
        return self.dim * (4 if self.dtype == "float32" else 2)

    def config(self) -> dict:
        return {"codec": self.name, "dim": self.dim, "dtype": self.dtype}

    def _encode(self, x: mx.array) -> Code:
        dtype = x.dtype if isinstance(x, mx.array) else None
        x = check_input(x, self.dim, finite=self.dtype != "float16")
        if self.dtype == "float16" and x.size:
            # the range rule for values stored in fp16 (as check_norms for norms): |x| ≤ FP16_MAX,
            # and a nonzero vector must reach FP16_TINY somewhere, or it would flush to zero
            peak = mx.max(mx.abs(x), axis=-1)
            largest, smallest = mx.stack([mx.max(peak), mx.min(mx.where(peak > 0, peak, mx.inf))]).tolist()
            if not largest <= FP16_MAX:
                if not mx.all(mx.isfinite(x)).item():
                    raise ValueError("input contains NaN or Inf")
                raise ValueError(f"input exceeds float16's range (|x| <= {FP16_MAX}); use "
                                 "Identity(dim, 'float32') or scale the input down")
            if smallest < FP16_TINY and dtype != mx.float16:       # fp16 input is stored exactly as it is
                raise ValueError(f"a vector whose largest entry is {smallest:.3g} lies below float16's normal "
                                 f"range ({FP16_TINY:.3g}) and would lose precision or flush to zero; use "
                                 "Identity(dim, 'float32') or scale the input up")
        return Code({"x": x.astype(self._dtype)}, tuple(x.shape[:-1]), dtype, self.config())

    def _decode(self, code: Code) -> mx.array:
        return code["x"].astype(code.dtype)
