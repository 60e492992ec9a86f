"""QJL sign sketches and TurboQuant_prod: unbiased inner products (Chapter 4).

QJL (Zandieh, Daliri, Han, arXiv 2406.03482): store sign(S k) ∈ {±1}^m and ‖k‖; for a
query q the estimator

    ⟨q, k⟩ ≈ c · ‖k‖ · ⟨S q, sign(S k)⟩

is unbiased. For S with i.i.d. N(0, 1) entries c = √(π/2)/m, because
E[⟨s, q⟩ sign⟨s, k⟩] = √(2/π)·⟨q, k⟩/‖k‖, and Var = (π/2·‖q‖²‖k‖² − ⟨q, k⟩²)/m.
With ``orthogonal=True`` the rows are unit rows of independent Haar matrices (blocks of
D); each row is uniform on S^{D−1}, so E[⟨s, q⟩ sign⟨s, k⟩] = E|s_1|·⟨q, k⟩/‖k‖ and
c = 1/(m·E|s_1|), E|s_1| = Γ(D/2)/(√π Γ((D+1)/2)).

TurboQuant_prod (arXiv 2504.19874, Algorithm 2): TurboQuant_mse at b − 1 bits, then QJL
with m = D on the residual r = x − x̃_mse, whose norm γ is stored in fp16.
"""
from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
from scipy.special import gammaln

from ..packing import pack, packed_bytes, unpack
from ..rotation import Rotation
from .base import Code, Codec, check_input, check_int, register, split_norm
from .scalar import TurboQuantMSE

__all__ = ["QJL", "TurboQuantProd"]


def _sketch_matrix(dim: int, m: int, orthogonal: bool, seed: int) -> np.ndarray:
    rng = np.random.default_rng([int(seed), dim, m, int(orthogonal), 7919])
    if not orthogonal:
        return rng.standard_normal((m, dim))
    blocks = []
    for _ in range(-(-m // dim)):
        q, r = np.linalg.qr(rng.standard_normal((dim, dim)))
        blocks.append((q * np.sign(np.diag(r))[None, :]).T)  # rows of a Haar matrix
    return np.concatenate(blocks)[:m]


@register
class QJL(Codec):
    """``QJL(dim, m=None, *, orthogonal=False, seed=0)``: a 1-bit sketch of m projections.

    Code fields ``signs`` (…, ceil(m/8)) uint8, ``norm`` (…, 1) float16.
    ``decode`` returns the unbiased estimate c·‖k‖·Sᵀ sign(S k) (…, D).
    """

    @classmethod
    def example(cls, dim: int) -> "QJL":
        """One instance for the codec contract tests: the one-bit sketch."""
        return cls(dim)

    name = "qjl"

    def __init__(self, dim: int, m: int | None = None, *, orthogonal: bool = False, seed: int = 0):
        dim, seed = check_int("dim", dim, 2), check_int("seed", seed, 0)
        m = dim if m is None else check_int("m", m, 1)
        if not isinstance(orthogonal, (bool, np.bool_)):
            raise ValueError(f"orthogonal must be True or False, got {orthogonal!r}")
        self.dim, self.m, self.orthogonal, self.seed = dim, m, bool(orthogonal), seed
        self.S = mx.array(_sketch_matrix(dim, m, self.orthogonal, seed), dtype=mx.float32)  # (m, D)
        self.scale = self.constant(dim, m, self.orthogonal)

    @staticmethod
    def constant(dim: int, m: int, orthogonal: bool) -> float:
        """The estimator's constant c: √(π/2)/m (Gaussian rows) or 1/(m·E|s_1|) (unit rows)."""
        if not orthogonal:
            return math.sqrt(math.pi / 2) / m
        e_abs = math.exp(gammaln(dim / 2) - 0.5 * math.log(math.pi) - gammaln((dim + 1) / 2))
        return 1.0 / (m * e_abs)

    @staticmethod
    def variance(q_norm_sq, k_norm_sq, inner, m: int):
        """Var of the Gaussian-S estimator: (π/2·‖q‖²‖k‖² − ⟨q,k⟩²)/m."""
        return (math.pi / 2 * q_norm_sq * k_norm_sq - inner ** 2) / m

    rotation = None          # a sketch S, not a rotation

    @property
    def payload_bits(self) -> float:
        """float: m signs per D coordinates, m/D."""
        return self.m / self.dim

    @property
    def bits_per_coordinate(self) -> float:
        """float: payload plus the fp16 norm, (m + 16)/D."""
        return (self.m + 16) / self.dim

    @property
    def nbytes_per_vector(self) -> int:
        return packed_bytes(self.m, 1) + 2

    def config(self) -> dict:
        return {"codec": self.name, "dim": self.dim, "m": self.m, "orthogonal": self.orthogonal,
                "seed": self.seed}

    def _encode(self, x: mx.array) -> Code:
        dtype = x.dtype if isinstance(x, mx.array) else None
        x = check_input(x, self.dim, finite=False)
        return self._encode_checked(x, dtype, floor=True)

    def _encode_checked(self, x: mx.array, dtype, floor: bool) -> Code:
        norm, u = split_norm(x, floor)
        bits = (u @ self.S.T >= 0).astype(mx.uint32)                     # (…, m)
        return Code({"signs": pack(bits, 1), "norm": norm.astype(mx.float16)},
                    tuple(x.shape[:-1]), dtype, self.config())

    def signs(self, code: Code) -> mx.array:
        """±1 float32 signs (…, m)."""
        return unpack(code["signs"], 1, self.m).astype(mx.float32) * 2 - 1

    def _decode(self, code: Code) -> mx.array:
        x = self.scale * code["norm"].astype(mx.float32) * (self.signs(code) @ self.S)
        return x.astype(code.dtype)

    def inner(self, q: mx.array, code: Code) -> mx.array:
        """Estimates of ⟨q_i, k_t⟩: q (…, Q, D), code for k (…, T, D) → (…, Q, T) float32."""
        code = self._check_code(code)
        q = check_input(q, self.dim)
        sq = q @ self.S.T                                                 # (…, Q, m)
        norms = code["norm"].astype(mx.float32)                           # (…, T, 1)
        return self.scale * (sq @ mx.swapaxes(self.signs(code), -1, -2)) * mx.swapaxes(norms, -1, -2)


@register
class TurboQuantProd(Codec):
    """``TurboQuant_prod(dim, bits, *, rotation="hadamard", seed=0)``: unbiased inner products.

    bits − 1 bits of TurboQuant_mse (none when bits = 1), plus a QJL sketch (m = D) of the
    residual with its fp16 norm γ. bits_per_coordinate = bits + 32/D (16/D when bits = 1).
    """

    @classmethod
    def example(cls, dim: int) -> "TurboQuantProd":
        """One instance for the codec contract tests: three bits."""
        return cls(dim, 3)

    name = "turboquant_prod"

    def __init__(self, dim: int, bits: int, *, rotation: str = "hadamard", seed: int = 0):
        dim, bits, seed = check_int("dim", dim, 3), check_int("bits", bits, 1, 9), check_int("seed", seed, 0)
        self.dim, self.bits, self.seed = dim, bits, seed
        self.mse = TurboQuantMSE(dim, bits - 1, rotation=rotation, seed=seed) if bits > 1 else None
        # the TurboQuant_mse part's rotation (built here only to check the kind when b = 1)
        self.rotation = self.mse.rotation if self.mse else Rotation(rotation, dim, seed)
        self.qjl = QJL(dim, m=dim, seed=seed)

    @property
    def payload_bits(self) -> float:
        """float: b − 1 TurboQuant_mse bits plus one QJL sign per coordinate, b."""
        return (self.mse.payload_bits if self.mse else 0) + self.qjl.payload_bits

    @property
    def bits_per_coordinate(self) -> float:
        """float: payload plus two fp16 norms (ν and γ), b + 32/D (b + 16/D when b = 1)."""
        return (self.mse.bits_per_coordinate if self.mse else 0) + self.qjl.bits_per_coordinate

    @property
    def nbytes_per_vector(self) -> int:
        return (self.mse.nbytes_per_vector if self.mse else 0) + self.qjl.nbytes_per_vector

    def expected_inner_error(self, y_norm_sq: float = 1.0) -> float:
        """E|⟨y,x⟩ − ⟨y,x̃⟩|² for unit x and y uniform with ‖y‖² = y_norm_sq:
        (π/2 − 1/D)·‖y‖²·D_mse(b − 1)/D, with D_mse(0) = 1."""
        r2 = self.mse.expected_mse if self.mse else 1.0
        return (math.pi / 2 - 1 / self.dim) * y_norm_sq * r2 / self.dim

    def config(self) -> dict:
        return {"codec": self.name, "dim": self.dim, "bits": self.bits, "seed": self.seed,
                "rotation": self.rotation.kind}

    def _encode(self, x: mx.array) -> Code:
        dtype = x.dtype if isinstance(x, mx.array) else None
        x = check_input(x, self.dim)
        arrays = {}
        residual = x
        if self.mse is not None:
            c = self.mse.encode(x)
            arrays.update(c.arrays)
            residual = x - self.mse.decode(c)
        # a residual's norm γ only bounds an absolute error: no lower bound on it (check_norms)
        r = self.qjl._encode_checked(residual, residual.dtype, floor=self.mse is None)
        arrays.update({"signs": r["signs"], "gamma": r["norm"]})
        return Code(arrays, tuple(x.shape[:-1]), dtype, self.config())

    def _parts(self, code: Code):
        shape, dt = code.shape, mx.float32
        mse = Code({"idx": code["idx"], "norm": code["norm"]}, shape, dt, self.mse.config()) if self.mse else None
        qjl = Code({"signs": code["signs"], "norm": code["gamma"]}, shape, dt, self.qjl.config())
        return mse, qjl

    def _decode(self, code: Code) -> mx.array:
        mse, qjl = self._parts(code)
        x = self.qjl.decode(qjl)
        if mse is not None:
            x = x + self.mse.decode(mse)
        return x.astype(code.dtype)

    def inner(self, q: mx.array, code: Code) -> mx.array:
        """Unbiased ⟨q_i, x_t⟩: q (…, Q, D) against codes (…, T) → (…, Q, T) float32."""
        code = self._check_code(code)
        mse, qjl = self._parts(code)
        out = self.qjl.inner(q, qjl)
        if mse is not None:
            out = out + check_input(q, self.dim) @ mx.swapaxes(self.mse.decode(mse), -1, -2)
        return out
