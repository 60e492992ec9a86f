"""TurboQuant_mse: rotation + per-coordinate Lloyd–Max codebook (Chapter 3).

Zandieh et al., "TurboQuant: Online Vector Quantization with Near-optimal Distortion
Rate", arXiv 2504.19874, Algorithm 1. For x of shape (..., D)::

    ν = ‖x‖ (fp16),  y = Π (x/ν),  i_j = argmin_c |y_j − c|  (b bits each, packed)
    x̂ = ν · Πᵀ c[i]

After the rotation each y_j follows the Beta coordinate law of S^{D−1}, so one codebook
(``lloyd.beta_codebook(D, b)``) serves every input: E‖u − û‖² = D · C(f_D, b).
"""
from __future__ import annotations

from collections import OrderedDict

import mlx.core as mx

from ..lloyd import MAX_BITS, beta_codebook, gaussian_codebook
from ..rotation import Rotation
from .base import Code, check_int, register
from .table import RotatedTable

__all__ = ["TurboQuantMSE", "bucketize"]

_FUSED_MAX_THRESHOLDS = 63  # up to 6 bits a fused compare-and-count beats binary search


def bucketize(y: mx.array, thresholds: mx.array) -> mx.array:
    """Index of the cell of each element of ``y`` given sorted ``thresholds`` (N−1,):
    i = #{t : y > t}, uint32, same shape as y. A chain of compare-and-add steps (one
    fused pass under ``mx.compile``, no (…, N−1) temporary) up to 63 thresholds; a binary
    search with gathers beyond."""
    n = thresholds.shape[0]
    if n <= _FUSED_MAX_THRESHOLDS:
        idx = mx.zeros(y.shape, mx.uint32)
        for i in range(n):
            idx = idx + (y > thresholds[i]).astype(mx.uint32)
        return idx
    levels = (n + 1).bit_length() - 1
    idx = mx.zeros(y.shape, mx.uint32)
    for s in range(levels - 1, -1, -1):
        probe = idx + (1 << s)                                # candidate cell index
        t = mx.take(thresholds, (probe - 1).astype(mx.int32))
        idx = mx.where(y > t, probe, idx)
    return idx


# Compiled cores by configuration: codecs of one configuration hold bit-identical arrays, so
# they share compiled functions (a 30-layer model's 60 per-layer codecs compile once, not 60
# times: a 5-token prompt's first prefill took 12 s). The oldest entries go beyond 64.
_CORES: "OrderedDict[tuple, tuple]" = OrderedDict()


def _cores(codec: "TurboQuantMSE") -> tuple:
    """(quantize core, decode core) for ``codec``'s configuration, compiled once."""
    key = tuple(sorted(codec.config().items()))
    hit = _CORES.get(key)
    if hit is None:
        hit = (mx.compile(lambda u: codec.quantize_rotated(codec.rotation.apply(u))),
               mx.compile(lambda idx, norm: codec.rotation.invert(mx.take(codec.centroids, idx)) * norm))
        _CORES[key] = hit
        while len(_CORES) > 64:
            _CORES.popitem(last=False)
    return hit


@register
class TurboQuantMSE(RotatedTable):
    """``TurboQuant_mse(dim, bits, *, rotation="hadamard", seed=0, law="beta")``.

    ``bits`` in 1..8 per coordinate; ``rotation`` "hadamard" (D = 2^a, 12·2^a, 20·2^a) or
    "haar" (any D); ``law`` "beta" (exact coordinate law) or "gaussian" (its N(0, 1/D)
    limit). A rotated table with K = 1 (``RotatedTable``). Code fields: ``idx``
    (..., ceil(D·b/8)) uint8, ``norm`` (..., 1) float16.
    """

    @classmethod
    def example(cls, dim: int) -> "TurboQuantMSE":
        """One instance for the codec contract tests: four bits."""
        return cls(dim, 4)

    name = "turboquant_mse"

    def __init__(self, dim: int, bits: int, *, rotation: str = "hadamard", seed: int = 0,
                 law: str = "beta"):
        dim, bits = check_int("dim", dim, 3), check_int("bits", bits, 1, MAX_BITS)
        seed = check_int("seed", seed, 0)
        if law not in ("beta", "gaussian"):
            raise ValueError(f"law must be 'beta' or 'gaussian', got {law!r}")
        self.dim, self.bits, self.seed, self.law = dim, bits, seed, law
        self.rotation = Rotation(rotation, dim, seed)
        book = (beta_codebook if law == "beta" else gaussian_codebook)(dim, bits)
        self.codebook = book
        self.centroids = mx.array(book.centroids, dtype=mx.float32)     # (2^b,)
        self._set_table(self.centroids[:, None], bits, mx.array(book.thresholds, dtype=mx.float32))
        # Compiled cores fuse the elementwise chains into single passes over the data. Bit
        # packing stays outside them: mlx 0.32.4's compiler miscompiles shift-and-mask
        # chains with scalar constants (``mx.compile(lambda w: (w >> 1) & 63)`` returns 0
        # for uint32 input; Chapter 3), so ``pack``/``unpack`` always run eagerly.
        self._quantize_core, self._decode_core = _cores(self)

    @property
    def expected_mse(self) -> float:
        """float: E‖u − û‖² for unit u, D · C(f, b), the codebook's per-coordinate MSE times D."""
        return self.dim * self.codebook.mse

    @property
    def inner_product_slope(self) -> float:
        """E[x̂ | x] = α·x with α = 1 − D·C(f, b) (Haar rotation, averaged over Π).

        At the Lloyd fixed point Σ c_i m1_i = E[y²] − C, so α = D·E[y Q(y)] = 1 − D·C:
        ≈ 2/π at one bit. Inner products ⟨q, x̂⟩ are shrunk by this factor."""
        return 1.0 - self.expected_mse

    def config(self) -> dict:
        return {"codec": self.name, "dim": self.dim, "bits": self.bits,
                "rotation": self.rotation.kind, "seed": self.seed, "law": self.law}

    def quantize_rotated(self, y: mx.array) -> mx.array:
        """Rotated unit coordinates (..., D) → cell indices (..., D) uint32."""
        return bucketize(y, self.thresholds)

    def _quantize_unit(self, u: mx.array) -> mx.array:
        return self._quantize_core(u)

    def decode_rotated(self, code: Code) -> mx.array:
        """Unit vectors in the rotated frame, c[i]: (..., D) float32 (no norm, no Πᵀ)."""
        return mx.take(self.centroids, self.indices(code))

    def _decode(self, code: Code) -> mx.array:
        x = self._decode_core(self.indices(code), code["norm"].astype(mx.float32))
        return x.astype(code.dtype)
