"""Centering: subtract a per-head mean before encoding, add it back after decoding.

Softmax ignores a constant added to all of one query's scores, so for keys

    softmax_j(q·k_j) = softmax_j(q·(k_j − μ) + q·μ) = softmax_j(q·(k_j − μ)),

and for values Σ_j p_j v_j = Σ_j p_j (v_j − μ) + μ because Σ_j p_j = 1. Removing a mean μ
shared by every cached token of a head is therefore exact for attention, while the codec
only has to represent k − μ. Real keys carry a large common component (Chapter 9 measures
it), which a norm-and-direction codec otherwise spends its bits on.

``Centered(inner)`` learns μ with ``fit`` (caches fit it on their first ``fit_tokens``
tokens after the sinks, however they are fed, as for ``OutlierSplit``): one mean per head for (…, H, T, D) input,
one overall mean for (N, D). μ is kept in float32 and saved in the configuration, so a
saved cache reloads bit for bit. Its storage, H·D floats per layer, is not per token and
is left out of ``bits_per_coordinate`` (``side_nbytes`` reports it).
"""
from __future__ import annotations

from typing import Mapping, Optional

import mlx.core as mx

from .base import Code, Codec, check_input, from_config, register

__all__ = ["Centered"]


@register
class Centered(Codec):
    """``Centered(inner, *, mean=None)``: ``inner`` is a codec or its config; ``mean`` is (H, D) or
    (D,) nested lists (normally learned by ``fit``). Code fields are the inner codec's."""

    @classmethod
    def example(cls, dim: int) -> "Centered":
        """One instance for the codec contract tests: TurboQuant_mse 4 bits inside (unfitted:
        it learns its mean)."""
        return cls({"codec": "turboquant_mse", "dim": dim, "bits": 4})

    name = "centered"

    def __init__(self, inner, *, mean=None):
        if isinstance(inner, Mapping):
            inner = from_config(inner)
        if not isinstance(inner, Codec):
            raise TypeError(f"inner must be a codec or a codec config, got {type(inner).__name__}")
        self.inner, self.dim = inner, inner.dim
        self.mean: Optional[mx.array] = None
        self._config = None
        if mean is not None:
            m = mx.array(mean, dtype=mx.float32)
            if m.ndim not in (1, 2) or m.shape[-1] != self.dim:
                raise ValueError(f"mean must have shape (D,) or (H, D), D={self.dim}; got shape {tuple(m.shape)}")
            if not mx.all(mx.isfinite(m)).item():
                raise ValueError(f"mean must be finite; it holds {int(mx.sum(~mx.isfinite(m)).item())} NaN or Inf values")
            self.mean = m

    @property
    def fitted(self) -> bool:
        return self.mean is not None and getattr(self.inner, "fitted", True)

    def fit(self, x: mx.array) -> "Centered":
        """μ from x: per head (axis −3) for (…, H, T, D) input, overall for (N, D); an inner
        codec that learns from data (``OutlierSplit``) is then fitted on x − μ."""
        x = check_input(x, self.dim)
        if x.size == 0:
            raise ValueError(f"cannot fit a mean on 0 vectors (input shape {tuple(x.shape)})")
        if x.ndim >= 3:
            self.mean = mx.mean(mx.moveaxis(x, -3, 0).reshape(x.shape[-3], -1, self.dim), axis=1)
        else:
            self.mean = mx.mean(x.reshape(-1, self.dim), axis=0)
        mx.eval(self.mean)
        if hasattr(self.inner, "fit"):
            self.inner.fit(x - self.broadcast_mean(x.ndim))
        self._config = None
        return self

    def broadcast_mean(self, ndim: int) -> mx.array:
        """μ shaped to broadcast against (…, H, T, D) arrays of ``ndim`` dimensions."""
        if self.mean.ndim == 1:
            return self.mean
        if ndim < 3:
            raise ValueError(f"a per-head mean needs (…, H, T, D) input, got {ndim} dimensions")
        return self.mean[:, None, :]

    @property
    def rotation(self):
        return self.inner.rotation

    @property
    def payload_bits(self) -> float:
        return self.inner.payload_bits

    @property
    def bits_per_coordinate(self) -> float:
        """The inner codec's; μ is per layer, not per token (``side_nbytes``)."""
        return self.inner.bits_per_coordinate

    @property
    def nbytes_per_vector(self) -> int:
        return self.inner.nbytes_per_vector

    @property
    def side_nbytes(self) -> int:
        """Bytes of μ (float32), stored once per layer."""
        return 0 if self.mean is None else self.mean.size * 4

    def config(self) -> dict:
        """Built once per fitted mean (``mean.tolist()`` is a host sync: keep it out of the
        per-step encode/decode path); a copy is returned."""
        if self._config is None:
            self._config = {"codec": self.name, "inner": self.inner.config(),
                            "mean": None if self.mean is None else self.mean.tolist()}
        return {**self._config, "inner": dict(self._config["inner"])}

    def _encode(self, x: mx.array) -> Code:
        if self.mean is None:
            raise ValueError("Centered has no mean yet: call fit(x) first (caches do this on "
                             "their first fit_tokens tokens)")
        dtype = x.dtype if isinstance(x, mx.array) else None
        x = check_input(x, self.dim, finite=False)
        m = self.broadcast_mean(x.ndim)
        if self.mean.ndim == 2 and x.shape[-3] != self.mean.shape[0]:
            raise ValueError(f"mean was fitted on {self.mean.shape[0]} heads, input has {x.shape[-3]} "
                             f"(shape {tuple(x.shape)})")
        code = self.inner.encode(x - m)
        return Code(dict(code.arrays), tuple(x.shape[:-1]), dtype, self.config())

    def attention_view(self, code: Code):
        """(inner codec, the code as the inner codec's, μ (H, D) or (D,))."""
        return self.inner, self.inner_code(code), self.mean

    def inner_code(self, code: Code) -> Code:
        """The same arrays as a code of the inner codec (for attention from codes)."""
        return Code(code.arrays, code.shape, mx.float32, self.inner.config())

    def validate_code(self, fields: dict) -> None:
        self.inner.validate_code(fields)

    def _decode(self, code: Code) -> mx.array:
        x = self.inner.decode(self.inner_code(code)).astype(mx.float32)
        return (x + self.broadcast_mean(x.ndim)).astype(code.dtype)
