"""The laws of a uniform point on the unit sphere S^{D-1} (Chapter 2).

One coordinate of a uniform unit vector in R^D has the Beta-type density

    f_D(x) = Γ(D/2) / (√π Γ((D−1)/2)) · (1 − x²)^((D−3)/2),   x ∈ [−1, 1],

i.e. (x + 1)/2 ~ Beta((D−1)/2, (D−1)/2), with variance 1/D and Gaussian limit N(0, 1/D).
A block of k coordinates has the spherical-Beta density on the unit ball B^k

    f_{D,k}(u) = Γ(D/2) / (π^{k/2} Γ((D−k)/2)) · (1 − ‖u‖²)^((D−k−2)/2),

with ‖u‖² ~ Beta(k/2, (D−k)/2). After a random rotation every normalized key follows
these laws, whatever the model: that is what makes data-oblivious codebooks possible.
All functions work in float64 NumPy; samplers are seeded.
"""
from __future__ import annotations

import numpy as np
from scipy import special

from .checks import check_int

__all__ = ["coordinate_pdf", "coordinate_cdf", "coordinate_ppf", "gaussian_limit_pdf",
           "coordinate_moment", "block_pdf", "sample_sphere", "unit_vectors", "sample_block",
           "block_radius_sq_mean", "block_radius_summary"]


def _check_block(dim: int, k) -> int:
    return check_int("block size k", k, 1, dim)


def coordinate_pdf(x, dim: int):
    """Density f_D(x) of one coordinate of a uniform point on S^{D-1}; D ≥ 3."""
    dim = check_int("dim", dim, 3)
    x = np.asarray(x, dtype=np.float64)
    logc = special.gammaln(dim / 2) - 0.5 * np.log(np.pi) - special.gammaln((dim - 1) / 2)
    inside = np.abs(x) < 1
    out = np.zeros_like(x)
    out[inside] = np.exp(logc + (dim - 3) / 2 * np.log1p(-x[inside] ** 2))
    return out


def coordinate_cdf(x, dim: int):
    """P(X ≤ x) for one coordinate: the regularized incomplete Beta at (x + 1)/2."""
    dim = check_int("dim", dim, 2)
    a = (dim - 1) / 2
    return special.betainc(a, a, np.clip((np.asarray(x, dtype=np.float64) + 1) / 2, 0, 1))


def coordinate_ppf(p, dim: int):
    """Inverse of ``coordinate_cdf``."""
    dim = check_int("dim", dim, 2)
    a = (dim - 1) / 2
    return 2 * special.betaincinv(a, a, np.asarray(p, dtype=np.float64)) - 1


def gaussian_limit_pdf(x, dim: int):
    """The D → ∞ limit of f_D: the N(0, 1/D) density."""
    dim = check_int("dim", dim, 1)
    x = np.asarray(x, dtype=np.float64)
    return np.sqrt(dim / (2 * np.pi)) * np.exp(-dim * x * x / 2)


def coordinate_moment(dim: int, order: int):
    """E[X^p] for one coordinate: 0 for odd p, Γ(m+½)Γ(D/2)/(√π Γ(D/2+m)) for p = 2m."""
    dim = check_int("dim", dim, 2)
    if order % 2:
        return 0.0
    m = order // 2
    return float(np.exp(special.gammaln(m + 0.5) + special.gammaln(dim / 2)
                        - 0.5 * np.log(np.pi) - special.gammaln(dim / 2 + m)))


def block_pdf(u, dim: int, k: int):
    """Spherical-Beta density f_{D,k}(u) on the unit ball B^k; ``u`` has shape (..., k)."""
    dim = check_int("dim", dim, 3)
    k = _check_block(dim, k)
    if k > dim - 2:
        raise ValueError(f"the block density exists for k <= D-2, got k={k}, D={dim}")
    u = np.asarray(u, dtype=np.float64)
    if u.shape[-1] != k:
        raise ValueError(f"u must have last dimension k={k}, got shape {u.shape}")
    r2 = np.sum(u * u, axis=-1)
    logc = special.gammaln(dim / 2) - k / 2 * np.log(np.pi) - special.gammaln((dim - k) / 2)
    out = np.zeros_like(r2)
    inside = r2 < 1
    out[inside] = np.exp(logc + (dim - k - 2) / 2 * np.log1p(-r2[inside]))
    return out


def block_radius_sq_mean(dim: int, k: int) -> float:
    """E‖u‖² = k/D for a k-block (‖u‖² ~ Beta(k/2, (D−k)/2))."""
    return _check_block(check_int("dim", dim, 2), k) / dim


def block_radius_summary(dim: int, k: int) -> dict:
    """Three "typical" radii ‖u‖ of a k-block, which differ: the root-mean-square
    √(k/D), the median √(Beta(k/2, (D−k)/2) quantile ½), and the mode of the radius's
    density ∝ r^(k−1) (1 − r²)^((D−k−2)/2), √((k−1)/(D−3)) (0 for k = 1, where the
    density of the absolute value is largest at 0). Requires D ≥ 3 and k < D."""
    dim = check_int("dim", dim, 3)
    k = check_int("block size k", k, 1, dim - 1)
    return {"rms": float(np.sqrt(k / dim)),
            "median": float(np.sqrt(special.betaincinv(k / 2, (dim - k) / 2, 0.5))),
            "mode": float(np.sqrt((k - 1) / (dim - 3)))}


def sample_sphere(n: int, dim: int, seed: int = 0) -> np.ndarray:
    """``n`` uniform points on S^{D-1}: shape (n, D), float64 (normalized Gaussians)."""
    dim = check_int("dim", dim, 1)
    if not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    g = np.random.default_rng(seed).standard_normal((n, dim))
    return g / np.linalg.norm(g, axis=1, keepdims=True)



def unit_vectors(n: int, dim: int, seed: int = 0):
    """``sample_sphere`` as an mx float32 array (n, dim): uniform unit vectors, seeded."""
    import mlx.core as mx
    return mx.array(sample_sphere(n, dim, seed), dtype=mx.float32)

def sample_block(n: int, dim: int, k: int, seed: int = 0) -> np.ndarray:
    """``n`` samples of f_{D,k}: shape (n, k), float64, without drawing whole D-vectors.

    ‖u‖² ~ Beta(k/2, (D−k)/2) and the direction is uniform on S^{k−1}, independently.
    """
    dim = check_int("dim", dim, 2)
    k = _check_block(dim, k)
    rng = np.random.default_rng(seed)
    g = rng.standard_normal((n, k))
    direction = g / np.linalg.norm(g, axis=1, keepdims=True)
    if k == dim:
        return direction
    r2 = rng.beta(k / 2, (dim - k) / 2, size=(n, 1))
    return direction * np.sqrt(r2)
