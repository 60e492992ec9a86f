"""PolarQuant: recursive polar angles with per-level Lloyd–Max codebooks (Chapter 5).

Han et al., "PolarQuant", arXiv 2502.02617. After a random rotation, group coordinates in
pairs and convert to polar form, then pair the radii and repeat, L times:

    level 1: ψ = atan2(x_{2j}, x_{2j−1}) ∈ [0, 2π),   r = ‖(x_{2j−1}, x_{2j})‖
    level ℓ: ψ = atan2(r_{2j}, r_{2j−1}) ∈ [0, π/2],   r = ‖(r_{2j−1}, r_{2j})‖

leaving one radius per block of 2^L coordinates (stored in fp16) and D/2 + D/4 + … angles.
For a rotationally invariant input the level-1 angle is uniform and a level-ℓ angle
(ℓ ≥ 2) has density ∝ sin^(2^(ℓ−1)−1)(2ψ), independent of everything else; each level
gets the Lloyd–Max codebook of its law. With (4, 2, 2, 2) bits: (16 + 8·4 + 4·2 + 2·2 +
1·2)/16 = 3.875 bits per coordinate.
"""
from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx
import numpy as np

from ..lloyd import QuadratureLaw, ScalarCodebook, lloyd_max
from ..packing import pack, packed_bytes, unpack
from ..rotation import Rotation
from .base import Code, Codec, check_input, check_int, check_norms, register
from .scalar import bucketize

__all__ = ["PolarQuant", "angle_codebook", "angle_pdf", "polar_transform", "polar_inverse"]

_TWO_PI = 2 * math.pi


def angle_pdf(level: int):
    """Density of a level-ℓ angle: uniform on [0, 2π) for ℓ = 1, else ∝ sin^(2^(ℓ−1)−1)(2ψ)
    on [0, π/2] (normalized). Returns (pdf, lo, hi)."""
    if level == 1:
        return (lambda t: np.full_like(np.asarray(t, dtype=np.float64), 1 / _TWO_PI)), 0.0, _TWO_PI
    n = 2 ** (level - 1)
    # ∫_0^{π/2} sin^{n−1}(2ψ) dψ = ½ B(n/2, ½)
    z = 0.5 * math.exp(math.lgamma(n / 2) + math.lgamma(0.5) - math.lgamma(n / 2 + 0.5))
    return (lambda t: np.sin(2 * np.asarray(t, dtype=np.float64)) ** (n - 1) / z), 0.0, math.pi / 2


@lru_cache(maxsize=None)
def angle_codebook(level: int, bits: int) -> ScalarCodebook:
    """Lloyd–Max codebook for a level-ℓ angle with 2^bits levels (cached).

    Level 1 is uniform on a circle: its Lloyd–Max quantizer is the uniform one, levels at
    (i + ½)·2π/N (a fixed point of Lloyd's iteration, checked in the tests)."""
    if level < 1 or not 1 <= bits <= 8:
        raise ValueError(f"need level >= 1 and bits in 1..8, got level={level}, bits={bits}")
    n = 2 ** bits
    if level == 1:
        c = (np.arange(n) + 0.5) * _TWO_PI / n
        return ScalarCodebook(c, (c[:-1] + c[1:]) / 2, (_TWO_PI / n) ** 2 / 12, 0)
    pdf, lo, hi = angle_pdf(level)
    return lloyd_max(QuadratureLaw(pdf, lo, hi), n)


def polar_transform(y: mx.array, levels: int) -> tuple[list[mx.array], mx.array]:
    """y (…, D), D divisible by 2^L → ([angles level 1 (…, D/2), …, level L (…, D/2^L)],
    radii (…, D/2^L))."""
    angles = []
    pairs = y.reshape(*y.shape[:-1], -1, 2)                              # (…, D/2, 2)
    psi = mx.arctan2(pairs[..., 1], pairs[..., 0])
    angles.append(mx.where(psi < 0, psi + _TWO_PI, psi))
    r = mx.sqrt(mx.sum(pairs * pairs, axis=-1))
    for _ in range(1, levels):
        pairs = r.reshape(*r.shape[:-1], -1, 2)                          # (…, n/2, 2)
        angles.append(mx.arctan2(pairs[..., 1], pairs[..., 0]))
        r = mx.sqrt(mx.sum(pairs * pairs, axis=-1))
    return angles, r


def polar_inverse(angles: list[mx.array], r: mx.array) -> mx.array:
    """Inverse of ``polar_transform``: rebuild (…, D) from the angles and top radii."""
    for psi in reversed(angles[1:]):
        r = mx.stack([r * mx.cos(psi), r * mx.sin(psi)], axis=-1).reshape(*psi.shape[:-1], -1)
    psi = angles[0]
    return mx.stack([r * mx.cos(psi), r * mx.sin(psi)], axis=-1).reshape(*psi.shape[:-1], -1)


@register
class PolarQuant(Codec):
    """``PolarQuant(dim, level_bits=(4, 2, 2, 2), *, rotation="hadamard", seed=0)``.

    Vectors are zero-padded to a multiple of 2^L (the padding is counted in
    ``bits_per_coordinate``) and rotated in the padded space. Code fields ``b{w}``: the
    angle indices of all levels that use w bits, concatenated and packed into one uint8
    stream (fewer padding bits than one stream per level); ``radius`` (…, D_pad/2^L) fp16.
    """

    @classmethod
    def example(cls, dim: int) -> "PolarQuant":
        """One instance for the codec contract tests: a Haar rotation (any dimension)."""
        return cls(dim, rotation="haar")

    name = "polarquant"

    def __init__(self, dim: int, level_bits=(4, 2, 2, 2), *, rotation: str = "hadamard", seed: int = 0):
        dim, seed = check_int("dim", dim, 2), check_int("seed", seed, 0)
        if isinstance(level_bits, (str, bytes)) or not hasattr(level_bits, "__iter__"):
            raise ValueError(f"level_bits must be a sequence of ints in 1..8, got {level_bits!r}")
        level_bits = tuple(check_int(f"level_bits[{i}]", b, 1, 8) for i, b in enumerate(level_bits))
        if not level_bits:
            raise ValueError("level_bits must hold at least one level")
        self.dim, self.level_bits, self.seed = dim, level_bits, seed
        self.levels = len(level_bits)
        block = 2 ** self.levels
        self.padded_dim = -(-dim // block) * block
        try:
            self.rotation = Rotation(rotation, self.padded_dim, seed)
        except ValueError as e:
            raise ValueError(f"PolarQuant pads D={dim} to {self.padded_dim} (a multiple of 2^L = "
                             f"{block}) and rotates there: {e}") from None
        self.books = [angle_codebook(l + 1, b) for l, b in enumerate(level_bits)]
        self._centroids = [mx.array(b.centroids, dtype=mx.float32) for b in self.books]
        self._thresholds = [mx.array(b.thresholds, dtype=mx.float32) for b in self.books]

    def _counts(self):
        return [self.padded_dim // 2 ** (l + 1) for l in range(self.levels)]

    @property
    def payload_bits(self) -> float:
        """Angle bits per (unpadded) coordinate."""
        return sum(n * b for n, b in zip(self._counts(), self.level_bits)) / self.dim

    @property
    def bits_per_coordinate(self) -> float:
        """float: payload plus one fp16 radius per block of 2^L padded coordinates."""
        angle_bits = sum(n * b for n, b in zip(self._counts(), self.level_bits))
        return (angle_bits + 16 * self.padded_dim // 2 ** self.levels) / self.dim

    def _streams(self) -> dict[int, list[int]]:
        """bit-width → the levels (0-based) packed together in that stream."""
        streams: dict[int, list[int]] = {}
        for l, b in enumerate(self.level_bits):
            streams.setdefault(b, []).append(l)
        return streams

    @property
    def nbytes_per_vector(self) -> int:
        counts = self._counts()
        nbytes = sum(packed_bytes(sum(counts[l] for l in ls), b) for b, ls in self._streams().items())
        return nbytes + 2 * (self.padded_dim // 2 ** self.levels)

    @property
    def expected_mse(self) -> float:
        """float: first-order E‖u − û‖² for unit u, Σ_ℓ C_ℓ, the angle codebooks' MSEs (rad²).

        An angle error δ at any level turns a sub-block of radius r by δ, an error of r·δ;
        the radii of one level split ‖u‖² = 1, so each level adds its angle MSE C_ℓ."""
        return float(sum(b.mse for b in self.books))

    def config(self) -> dict:
        return {"codec": self.name, "dim": self.dim, "level_bits": list(self.level_bits),
                "seed": self.seed, "rotation": self.rotation.kind}

    def _pad(self, x):
        if self.padded_dim == self.dim:
            return x
        return mx.concatenate([x, mx.zeros((*x.shape[:-1], self.padded_dim - self.dim), x.dtype)], -1)

    def _encode(self, x: mx.array) -> Code:
        dtype = x.dtype if isinstance(x, mx.array) else None
        x = check_input(x, self.dim)
        check_norms(mx.linalg.norm(x, axis=-1))               # the radius is stored in fp16
        angles, r = polar_transform(self.rotation.apply(self._pad(x)), self.levels)
        idx = [bucketize(psi, t) for psi, t in zip(angles, self._thresholds)]
        arrays = {f"b{b}": pack(mx.concatenate([idx[l] for l in ls], axis=-1), b)
                  for b, ls in self._streams().items()}
        arrays["radius"] = r.astype(mx.float16)
        return Code(arrays, tuple(x.shape[:-1]), dtype, self.config())

    def _decode(self, code: Code) -> mx.array:
        counts = self._counts()
        angles = [None] * self.levels
        for b, ls in self._streams().items():
            idx = unpack(code[f"b{b}"], b, sum(counts[l] for l in ls)).astype(mx.int32)
            start = 0
            for l in ls:
                angles[l] = mx.take(self._centroids[l], idx[..., start:start + counts[l]])
                start += counts[l]
        y = polar_inverse(angles, code["radius"].astype(mx.float32))
        return self.rotation.invert(y)[..., :self.dim].astype(code.dtype)
