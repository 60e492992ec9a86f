"""A pass-through codec: stores vectors unchanged (float32 or float16).

It lets the compressed caches be tested for exactness against mlx-lm's own caches: with
it, any difference in logits is the cache's bookkeeping, not quantization.
"""
from __future__ import annotations

import mlx.core as mx

from .base import Code, Codec, check_input, register

__all__ = ["Identity"]


@register
class Identity(Codec):
    """Identity(dim, dtype="float32"). Code field ``x`` (…, D)."""

    name = "identity"

    def __init__(self, dim: int, dtype: str = "float32"):
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        if dtype not in ("float32", "float16"):
            raise ValueError(f"dtype must be 'float32' or 'float16', got {dtype!r}")
        self.dim, self.dtype = dim, dtype
        self._dtype = getattr(mx, dtype)

    @property
    def bits_per_coordinate(self) -> float:
        return 32.0 if self.dtype == "float32" else 16.0

    @property
    def nbytes_per_vector(self) -> int:
        return self.dim * (4 if self.dtype == "float32" else 2)

    def config(self) -> dict:
        return {"codec": self.name, "dim": self.dim, "dtype": self.dtype}

    def encode(self, x: mx.array) -> Code:
        dtype = x.dtype if isinstance(x, mx.array) else None
        x = check_input(x, self.dim)
        return Code({"x": x.astype(self._dtype)}, tuple(x.shape[:-1]), dtype, self.config())

    def decode(self, code: Code) -> mx.array:
        code = self._check_code(code)
        return code["x"].astype(code.dtype)
