"""Outlier-channel split: a few high-energy channels at more bits, the rest at fewer.

TurboQuant's 2.5-bit setting (arXiv 2504.19874, §4) keeps 32 of 128 channels at 3 bits
and 96 at 2 bits: (32·3 + 96·2)/128 = 2.25 payload bits, 2.5 with two fp16 norms. Each
part is its own TurboQuant_mse (own norm, own rotation). The outlier channels are chosen
once, by ``fit``, as the highest-RMS channels of the tensor it is fitted on; after that the
codec is fixed and its ``config()`` (which lists the channels) rebuilds it bit for bit.
"""
from __future__ import annotations

import mlx.core as mx

from .base import Code, Codec, check_input, check_int, register
from .scalar import TurboQuantMSE

__all__ = ["OutlierSplit"]


@register
class OutlierSplit(Codec):
    """``OutlierSplit(dim, n_outliers=32, outlier_bits=3, bits=2, *, rotation="hadamard", seed=0,
    channels=None)``. Its two parts rotate separately (``.outliers.rotation``,
    ``.rest.rotation``), so ``.rotation`` is None.

    Code fields: ``o_idx``, ``o_norm`` (outlier part), ``r_idx``, ``r_norm`` (the rest).
    """

    @classmethod
    def example(cls, dim: int) -> "OutlierSplit":
        """One instance for the codec contract tests: 4 outlier channels at 4 bits, the rest
        at 2 (unfitted: it learns its channels)."""
        return cls(dim, n_outliers=4, outlier_bits=4, bits=2, rotation="haar")

    name = "outlier_split"

    def __init__(self, dim: int, n_outliers: int = 32, outlier_bits: int = 3, bits: int = 2, *,
                 rotation: str = "hadamard", seed: int = 0, channels=None):
        dim, seed = check_int("dim", dim, 6), check_int("seed", seed, 0)
        n_outliers = check_int("n_outliers", n_outliers, 3, dim - 3)
        outlier_bits, bits = check_int("outlier_bits", outlier_bits, 1, 8), check_int("bits", bits, 1, 8)
        self.dim, self.n_outliers, self.outlier_bits, self.bits, self.seed = dim, n_outliers, outlier_bits, bits, seed
        self.rotation = None                      # each part has its own
        try:
            self.outliers = TurboQuantMSE(n_outliers, outlier_bits, rotation=rotation, seed=seed)
            self.rest = TurboQuantMSE(dim - n_outliers, bits, rotation=rotation, seed=seed + 1)
        except ValueError as e:
            if rotation != "hadamard":
                raise
            raise ValueError(f"OutlierSplit(dim={dim}, n_outliers={n_outliers}) rotates its two parts "
                             f"separately ({n_outliers} and {dim - n_outliers} channels); "
                             f"rotation='hadamard' needs each size to be 2^a, 12·2^a or 20·2^a: "
                             f"choose n_outliers so that both are, or use rotation='haar'") from None
        self.channels = None
        if channels is not None:
            self._set_channels(list(channels))

    def _set_channels(self, channels):
        if len(channels) != self.n_outliers or len(set(channels)) != len(channels) or \
                not all(isinstance(c, int) and 0 <= c < self.dim for c in channels):
            raise ValueError(f"channels must be {self.n_outliers} distinct ints in [0, {self.dim}), got {channels!r}")
        self.channels = sorted(channels)
        rest = sorted(set(range(self.dim)) - set(self.channels))
        self._o = mx.array(self.channels, dtype=mx.int32)
        self._r = mx.array(rest, dtype=mx.int32)
        self._inverse = mx.argsort(mx.concatenate([self._o, self._r]))

    @property
    def fitted(self) -> bool:
        return self.channels is not None

    def fit(self, x: mx.array) -> "OutlierSplit":
        """Choose the ``n_outliers`` channels of largest RMS over all vectors of x (…, D)."""
        x = check_input(x, self.dim)
        rms = mx.mean(x.reshape(-1, self.dim) ** 2, axis=0)
        self._set_channels([int(c) for c in mx.argsort(-rms)[: self.n_outliers].tolist()])
        return self

    @property
    def payload_bits(self) -> float:
        """(n_outliers · outlier_bits + (D − n_outliers) · bits) / D."""
        return (self.n_outliers * self.outlier_bits + (self.dim - self.n_outliers) * self.bits) / self.dim

    @property
    def bits_per_coordinate(self) -> float:
        """float: payload plus the two parts' fp16 norms, + 32/D."""
        return (self.n_outliers * self.outlier_bits + (self.dim - self.n_outliers) * self.bits + 32) / self.dim

    @property
    def nbytes_per_vector(self) -> int:
        return self.outliers.nbytes_per_vector + self.rest.nbytes_per_vector

    def config(self) -> dict:
        return {"codec": self.name, "dim": self.dim, "n_outliers": self.n_outliers,
                "outlier_bits": self.outlier_bits, "bits": self.bits, "seed": self.seed,
                "channels": self.channels, "rotation": self.outliers.rotation.kind}

    def _encode(self, x: mx.array) -> Code:
        if not self.fitted:
            raise ValueError("OutlierSplit has no channels yet: call fit(x) first (caches do this "
                             "on their first fit_tokens tokens)")
        dtype = x.dtype if isinstance(x, mx.array) else None
        x = check_input(x, self.dim)
        o = self.outliers.encode(mx.take(x, self._o, axis=-1))
        r = self.rest.encode(mx.take(x, self._r, axis=-1))
        return Code({"o_idx": o["idx"], "o_norm": o["norm"], "r_idx": r["idx"], "r_norm": r["norm"]},
                    tuple(x.shape[:-1]), dtype, self.config())

    def _decode(self, code: Code) -> mx.array:
        o = self.outliers.decode(Code({"idx": code["o_idx"], "norm": code["o_norm"]}, code.shape,
                                      mx.float32, self.outliers.config()))
        r = self.rest.decode(Code({"idx": code["r_idx"], "norm": code["r_norm"]}, code.shape,
                                  mx.float32, self.rest.config()))
        return mx.take(mx.concatenate([o, r], axis=-1), self._inverse, axis=-1).astype(code.dtype)
