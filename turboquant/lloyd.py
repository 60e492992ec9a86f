"""Lloyd–Max quantizers for a 1-D density (Chapter 3).

A b-bit scalar quantizer with N = 2^b levels is optimal for mean squared error when

    thresholds  t_i = (c_i + c_{i+1}) / 2          (nearest-neighbour condition)
    centroids   c_i = E[X | t_{i−1} < X ≤ t_i]     (centroid condition)

Lloyd's algorithm alternates the two. Each law provides the cell mass ∫f and first moment
∫x f in closed form (Beta coordinate law, Gaussian) or by quadrature (``QuadratureLaw``),
so iterations are exact, not Monte-Carlo. Codebooks are deterministic and cached.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy import integrate, special

from .checks import check_int
from .sphere import coordinate_cdf, coordinate_moment, coordinate_pdf, coordinate_ppf

__all__ = ["ScalarCodebook", "BetaLaw", "GaussianLaw", "QuadratureLaw", "lloyd_max",
           "beta_codebook", "gaussian_codebook", "MAX_BITS"]

MAX_BITS = 8


class BetaLaw:
    """One coordinate of a uniform point on S^{D-1} (``sphere.coordinate_pdf``)."""

    def __init__(self, dim: int):
        self.dim = dim
        self.lo, self.hi = -1.0, 1.0
        self.alpha = (dim - 3) / 2
        self.logc = (special.gammaln(dim / 2) - 0.5 * np.log(np.pi)
                     - special.gammaln((dim - 1) / 2))
        self.second_moment = coordinate_moment(dim, 2)  # 1/D

    def pdf(self, x):
        return coordinate_pdf(x, self.dim)

    def mass(self, a, b):
        return coordinate_cdf(b, self.dim) - coordinate_cdf(a, self.dim)

    def first_moment(self, a, b):
        # ∫ x c (1−x²)^α dx = −c (1−x²)^(α+1) / (2(α+1))
        g = lambda x: -np.exp(self.logc + (self.alpha + 1) * np.log1p(-np.minimum(x * x, 1.0)))
        with np.errstate(divide="ignore"):
            return (g(b) - g(a)) / (2 * (self.alpha + 1))

    def ppf(self, p):
        return coordinate_ppf(p, self.dim)

    def companded_ppf(self, p):
        # f^{1/3} ∝ (1−x²)^(α/3): again a symmetric Beta law, with a = α/3 + 1
        a = self.alpha / 3 + 1
        return 2 * special.betaincinv(a, a, np.asarray(p, dtype=np.float64)) - 1


class GaussianLaw:
    """N(0, σ²); with σ² = 1/D it is the large-D limit of ``BetaLaw``."""

    def __init__(self, sigma: float):
        self.sigma = float(sigma)
        self.lo, self.hi = -np.inf, np.inf
        self.second_moment = self.sigma ** 2

    def pdf(self, x):
        return np.exp(-np.asarray(x) ** 2 / (2 * self.sigma ** 2)) / (self.sigma * np.sqrt(2 * np.pi))

    def mass(self, a, b):
        s = self.sigma * np.sqrt(2)
        return 0.5 * (special.erf(np.asarray(b) / s) - special.erf(np.asarray(a) / s))

    def first_moment(self, a, b):
        # ∫ x f = σ² (f(a) − f(b))
        s2f = lambda x: self.sigma / np.sqrt(2 * np.pi) * np.exp(-np.asarray(x) ** 2 / (2 * self.sigma ** 2))
        return s2f(a) - s2f(b)

    def ppf(self, p):
        return self.sigma * np.sqrt(2) * special.erfinv(2 * np.asarray(p) - 1)

    def companded_ppf(self, p):
        # f^{1/3} of N(0, σ²) is N(0, 3σ²)
        return np.sqrt(3) * self.ppf(p)


class QuadratureLaw:
    """Any bounded density on [lo, hi], normalized here; cell integrals by adaptive quadrature."""

    def __init__(self, pdf, lo: float, hi: float):
        self.pdf, self.lo, self.hi = pdf, float(lo), float(hi)
        self._z = integrate.quad(pdf, lo, hi, limit=200)[0]
        self.second_moment = integrate.quad(lambda x: x * x * pdf(x), lo, hi, limit=200)[0] / self._z
        grid = np.linspace(lo, hi, 4097)
        cdf = np.concatenate([[0.0], np.cumsum([self.mass(a, b) for a, b in zip(grid[:-1], grid[1:])])])
        self._grid, self._cdf = grid, cdf / cdf[-1]

    def density(self, x):
        return np.asarray(self.pdf(x)) / self._z

    def mass(self, a, b):
        return np.array([integrate.quad(self.pdf, x, y, limit=100)[0] / self._z
                         for x, y in zip(np.atleast_1d(a), np.atleast_1d(b))])

    def first_moment(self, a, b):
        return np.array([integrate.quad(lambda t: t * self.pdf(t), x, y, limit=100)[0] / self._z
                         for x, y in zip(np.atleast_1d(a), np.atleast_1d(b))])

    def ppf(self, p):
        return np.interp(p, self._cdf, self._grid)


@dataclass(frozen=True)
class ScalarCodebook:
    """A Lloyd–Max codebook: ``centroids`` (N,) and ``thresholds`` (N−1,), float64, sorted.

    ``mse`` is E(X − Q(X))² per coordinate under the law it was fitted to.
    """

    centroids: np.ndarray
    thresholds: np.ndarray
    mse: float
    iterations: int

    @property
    def n_levels(self) -> int:
        return len(self.centroids)


def lloyd_max(law, n_levels: int, tol: float = 1e-12, max_iter: int = 20000) -> ScalarCodebook:
    """Lloyd's algorithm on ``law``; exact cell integrals each step.

    It starts from the high-rate optimum (Panter–Dite: point density ∝ f^{1/3}) when the
    law provides ``companded_ppf``, else from the law's quantiles; either start converges
    to the same fixed point, the first in far fewer iterations at 6–8 bits.
    """
    if isinstance(n_levels, bool) or not isinstance(n_levels, (int, np.integer)) or n_levels < 1:
        raise ValueError(f"n_levels must be a positive int, got {n_levels!r}")
    start = getattr(law, "companded_ppf", law.ppf)
    c = np.asarray(start((np.arange(n_levels) + 0.5) / n_levels), dtype=np.float64)
    it = 0
    for it in range(1, max_iter + 1):
        new = _lloyd_step(law, c)
        residual = np.max(np.abs(new - c))
        if it > 20 and hasattr(law, "pdf") and residual > tol:
            newton = _newton_step(law, c, new - c)
            if newton is not None and np.max(np.abs(_lloyd_step(law, newton) - newton)) < residual:
                new = newton
        c = new
        if residual < tol:
            break
    t = (c[:-1] + c[1:]) / 2
    edges = np.concatenate([[law.lo], t, [law.hi]])
    m0 = law.mass(edges[:-1], edges[1:])
    m1 = law.first_moment(edges[:-1], edges[1:])
    mse = law.second_moment - float(np.sum(np.where(m0 > 0, m1 * m1 / np.where(m0 > 0, m0, 1), 0)))
    return ScalarCodebook(c, t, mse, it)


def _edges(law, c):
    return np.concatenate([[law.lo], (c[:-1] + c[1:]) / 2, [law.hi]])


def _lloyd_step(law, c):
    """One Lloyd iteration: thresholds at midpoints, then cell centroids."""
    e = _edges(law, c)
    m0, m1 = law.mass(e[:-1], e[1:]), law.first_moment(e[:-1], e[1:])
    return np.where(m0 > 0, m1 / np.where(m0 > 0, m0, 1), c)


def _newton_step(law, c, residual):
    """Newton on F(c) = L(c) − c, where L is the Lloyd map; ∂L/∂c is tridiagonal.

    With t_i the thresholds and m0_i the cell masses: ∂L_i/∂t_i = f(t_i)(t_i − L_i)/m0_i
    and ∂L_i/∂t_{i−1} = f(t_{i−1})(L_i − t_{i−1})/m0_i; each t depends on its two
    neighbouring centroids with weight ½.
    """
    from scipy.linalg import solve_banded
    n = len(c)
    if n < 2:
        return None
    e = _edges(law, c)
    m0 = law.mass(e[:-1], e[1:])
    if np.any(m0 <= 0):
        return None
    lc = c + residual
    t = e[1:-1]
    ft = law.pdf(t)
    up = ft * (t - lc[:-1]) / m0[:-1]      # ∂L_i/∂t_i, i = 0..n−2
    down = ft * (lc[1:] - t) / m0[1:]      # ∂L_{i+1}/∂t_i
    diag = np.zeros(n)
    diag[:-1] += up / 2
    diag[1:] += down / 2
    jac = np.zeros((3, n))                 # banded form of J = ∂L/∂c − I
    jac[0, 1:] = up / 2                    # super-diagonal ∂L_i/∂c_{i+1}
    jac[1] = diag - 1
    jac[2, :-1] = down / 2                 # sub-diagonal ∂L_{i+1}/∂c_i
    try:
        step = solve_banded((1, 1), jac, -residual)
    except (np.linalg.LinAlgError, ValueError):
        return None
    new = c + step
    if not np.all(np.diff(new) > 0) or new[0] < law.lo or new[-1] > law.hi:
        return None
    return new


# Validation happens before the cache: lru_cache would treat True as 1.
def beta_codebook(dim: int, bits: int) -> ScalarCodebook:
    """Lloyd–Max codebook with 2^bits levels for one coordinate of S^{dim−1} (cached)."""
    return _beta_codebook(check_int("dim", dim, 3), check_int("bits", bits, 1, MAX_BITS))


def gaussian_codebook(dim: int, bits: int) -> ScalarCodebook:
    """Lloyd–Max codebook for the Gaussian limit N(0, 1/dim) (cached)."""
    return _gaussian_codebook(check_int("dim", dim, 1), check_int("bits", bits, 1, MAX_BITS))


@lru_cache(maxsize=None)
def _beta_codebook(dim: int, bits: int) -> ScalarCodebook:
    return lloyd_max(BetaLaw(dim), 2 ** bits)


@lru_cache(maxsize=None)
def _gaussian_codebook(dim: int, bits: int) -> ScalarCodebook:
    return lloyd_max(GaussianLaw(1 / np.sqrt(dim)), 2 ** bits)


# ------------------------------------------------------------------ vector Lloyd (k-means)
def nearest(x: np.ndarray, codebook: np.ndarray, chunk: int = 1 << 22) -> tuple[np.ndarray, np.ndarray]:
    """Nearest codeword for each row: x (n, k), codebook (N, k) → (indices (n,), squared
    distances (n,)), in row chunks so memory stays O(chunk)."""
    c2 = np.sum(codebook * codebook, axis=1)
    rows = max(1, chunk // max(1, len(codebook)))
    idx = np.empty(len(x), dtype=np.int64)
    dist = np.empty(len(x))
    for s in range(0, len(x), rows):
        xs = x[s:s + rows]
        d = np.sum(xs * xs, axis=1)[:, None] - 2 * xs @ codebook.T + c2[None, :]
        idx[s:s + rows] = np.argmin(d, axis=1)
        dist[s:s + rows] = np.maximum(d[np.arange(len(xs)), idx[s:s + rows]], 0)
    return idx, dist


def kmeans(x: np.ndarray, init: np.ndarray, max_iter: int = 200, tol: float = 1e-7) -> tuple[np.ndarray, float]:
    """Lloyd's algorithm for vectors from ``init`` (N, k); never returns a codebook worse
    on ``x`` than ``init``. Empty cells take the worst-served sample. → (codebook, mse)."""
    c = np.array(init, dtype=np.float64)
    n_codes, k = c.shape
    idx, dist = nearest(x, c)
    best_c, best = c.copy(), float(dist.mean())
    for _ in range(max_iter):
        counts = np.bincount(idx, minlength=n_codes)
        sums = np.stack([np.bincount(idx, weights=x[:, j], minlength=n_codes) for j in range(k)], 1)
        new = np.where(counts[:, None] > 0, sums / np.maximum(counts, 1)[:, None], c)
        for e in np.flatnonzero(counts == 0):      # deterministic repair of empty cells
            worst = int(np.argmax(dist))
            new[e] = x[worst]
            dist[worst] = 0
        c = new
        idx, dist = nearest(x, c)
        cur = float(dist.mean())
        if cur < best:
            improved = (best - cur) / max(best, 1e-300)
            best_c, best = c.copy(), cur
            if improved < tol:
                break
        else:
            break
    return best_c, best


def kmeans_pp(x: np.ndarray, n_codes: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding (D² sampling) from the rows of x."""
    centers = [x[rng.integers(len(x))]]
    d = np.sum((x - centers[0]) ** 2, axis=1)
    for _ in range(1, n_codes):
        p = d / d.sum() if d.sum() > 0 else None
        centers.append(x[rng.choice(len(x), p=p)])
        d = np.minimum(d, np.sum((x - centers[-1]) ** 2, axis=1))
    return np.array(centers)
