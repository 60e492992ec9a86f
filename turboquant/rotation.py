"""Seeded random rotations with exact inverses (Chapter 2).

A ``Rotation`` is rebuilt bit for bit from (kind, dim, seed):

- ``"haar"``: Π = Q·diag(sign(diag R)) from the QR of a Gaussian matrix; the sign fix makes
  Π Haar-distributed on O(D) (Mezzadri 2007). Any D. Cost D² per vector.
- ``"hadamard"``: Π = H·diag(s)/√D with random signs s ∈ {±1}^D and a Hadamard matrix H.
  For D = 2^a it uses ``mx.hadamard_transform`` (D log D); for D = 12·2^a and 20·2^a
  (80, 96, …) an exact Paley ⊗ Sylvester matrix built here and checked orthogonal in
  float64 — mlx's own transform is wrong or crashes at several of those sizes.

Vectors are rows: ``apply(x)`` maps x of shape (..., D) to y = x Πᵀ (y = Πx per vector);
``invert(y)`` maps back with Πᵀ.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import mlx.core as mx
import numpy as np

__all__ = ["Rotation", "hadamard_matrix", "hadamard_sizes_ok", "MAX_DIM"]

_KINDS = ("haar", "hadamard")
# The largest head sizes a rotation is built for: Haar holds a dense D×D matrix (4096: 64 MB
# in float32, a QR of seconds); randomized Hadamard holds D signs.
MAX_DIM = {"haar": 4096, "hadamard": 1 << 16}


def _paley_i(q: int) -> np.ndarray:
    """Paley construction I: a Hadamard matrix of order q+1 for a prime q ≡ 3 (mod 4)."""
    residues = {(i * i) % q for i in range(1, q)}
    chi = np.array([0] + [1 if i in residues else -1 for i in range(1, q)])
    jac = chi[(np.arange(q)[None, :] - np.arange(q)[:, None]) % q]  # Jacobsthal, Q[i,j] = χ(j−i)
    s = np.zeros((q + 1, q + 1), dtype=np.int64)
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = jac
    return np.eye(q + 1, dtype=np.int64) + s


def _odd_part(dim: int) -> tuple[int, int]:
    a = 0
    while dim % 2 == 0 and dim > 1:
        dim //= 2
        a += 1
    return dim, a


def hadamard_sizes_ok(dim: int) -> bool:
    """True when an exact Hadamard matrix of order ``dim`` is built here: 2^a, 12·2^a, 20·2^a."""
    if dim < 1:
        return False
    odd, a = _odd_part(dim)
    return odd == 1 or (odd == 3 and a >= 2) or (odd == 5 and a >= 2)


@lru_cache(maxsize=32)
def hadamard_matrix(dim: int) -> np.ndarray:
    """A ±1 Hadamard matrix of order ``dim`` (H Hᵀ = D·I), int64. Raises for other sizes."""
    if not isinstance(dim, (int, np.integer)) or not hadamard_sizes_ok(int(dim)):
        raise ValueError(
            f"no Hadamard matrix of order {dim!r} here: supported sizes are 2^a, 12·2^a and "
            f"20·2^a (64, 80, 96, 128, 256, ...); use rotation='haar' for any size")
    odd, a = _odd_part(dim)
    base = {1: np.ones((1, 1), np.int64), 3: _paley_i(11), 5: _paley_i(19)}[odd]
    h = base
    for _ in range(a - (2 if odd > 1 else 0)):
        h = np.block([[h, h], [h, -h]])
    if h.shape != (dim, dim) or not np.array_equal(h @ h.T, dim * np.eye(dim, dtype=np.int64)):
        raise AssertionError(f"internal error: Hadamard construction failed at {dim}")
    return h


@dataclass(frozen=True)
class Rotation:
    """A seeded random orthogonal transform of R^D; see the module docstring."""

    kind: str
    dim: int
    seed: int = 0
    _matrix: mx.array | None = field(default=None, init=False, repr=False, compare=False)
    _signs: mx.array | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"rotation kind must be one of {_KINDS}, got {self.kind!r}")
        if isinstance(self.dim, bool) or not isinstance(self.dim, (int, np.integer)) or self.dim < 2:
            raise ValueError(f"rotation dim must be an int >= 2, got {self.dim!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise ValueError(f"rotation seed must be a non-negative int, got {self.seed!r}")
        limit = MAX_DIM[self.kind]
        if self.dim > limit:                      # refused before anything of size D² or D is drawn
            raise ValueError(f"rotation dim {self.dim} is above the {limit} a {self.kind} rotation supports "
                             f"(a {'dense D×D matrix' if self.kind == 'haar' else 'transform'} per codec); "
                             "KV heads are 64–256 wide")
        if self.kind == "hadamard" and not hadamard_sizes_ok(int(self.dim)):
            hadamard_matrix(int(self.dim))        # raises, naming the sizes that exist
        rng = np.random.default_rng([int(self.seed), int(self.dim), _KINDS.index(self.kind)])
        if self.kind == "haar":
            q, r = np.linalg.qr(rng.standard_normal((self.dim, self.dim)))
            matrix = q * np.sign(np.diag(r))[None, :]
        else:
            signs = rng.choice(np.array([-1.0, 1.0]), size=self.dim)
            if self.dim & (self.dim - 1) == 0:
                object.__setattr__(self, "_signs", mx.array(signs, dtype=mx.float32))
                return
            matrix = hadamard_matrix(self.dim) * signs[None, :] / np.sqrt(self.dim)
        object.__setattr__(self, "_matrix", mx.array(matrix, dtype=mx.float32))

    def matrix(self) -> np.ndarray:
        """Π as a float64 (D, D) NumPy array (y = Π x)."""
        if self._matrix is not None:
            return np.array(self._matrix, dtype=np.float64)
        h = hadamard_matrix(self.dim) / np.sqrt(self.dim)
        return h * np.array(self._signs, dtype=np.float64)[None, :]

    def _check(self, x: mx.array) -> mx.array:
        if not isinstance(x, mx.array):
            raise TypeError(f"expected an mx.array, got {type(x).__name__}")
        if x.ndim < 1 or x.shape[-1] != self.dim:
            raise ValueError(f"expected last dimension {self.dim}, got shape {tuple(x.shape)}")
        return x.astype(mx.float32)

    def apply(self, x: mx.array) -> mx.array:
        """y = Π x for every row: (..., D) → (..., D), float32."""
        x = self._check(x)
        if self._signs is not None:
            return mx.hadamard_transform(x * self._signs)
        return x @ self._matrix.T

    def invert(self, y: mx.array) -> mx.array:
        """x = Πᵀ y for every row: (..., D) → (..., D), float32."""
        y = self._check(y)
        if self._signs is not None:
            return mx.hadamard_transform(y) * self._signs
        return y @ self._matrix

    def config(self) -> dict:
        return {"kind": self.kind, "dim": int(self.dim), "seed": int(self.seed)}


def coordinate_over_rotations(x, kind: str, n_draws: int, seed0: int = 0) -> np.ndarray:
    """First coordinate of Π x/‖x‖ for ``n_draws`` rotations with seeds seed0, seed0+1, …

    For Haar rotations this is exactly the Beta coordinate law of S^{D−1}, for any x;
    for randomized Hadamard it is a Rademacher sum Σ ±H_1j x_j/‖x‖ and depends on x.
    ``x``: (D,) array-like. Returns (n_draws,) float64.
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1 or not np.all(np.isfinite(x)) or not np.any(x):
        raise ValueError("x must be a finite, non-zero vector of shape (D,)")
    u = mx.array(x / np.linalg.norm(x), dtype=mx.float32)
    return np.array([Rotation(kind, x.shape[0], seed0 + i).apply(u)[0].item()
                     for i in range(n_draws)], dtype=np.float64)
