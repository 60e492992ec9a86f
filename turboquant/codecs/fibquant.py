"""FibQuant: vector codebooks on the spherical-Beta source (Chapter 6).

After normalizing and a Haar rotation every block of k coordinates has the law f_{D,k}
on the unit ball (``sphere.block_pdf``), whatever the model, so one codebook of N
codewords per (D, k) serves every input, at rate b = log2(N)/k bits per coordinate —
fractional, and below one bit when N < 2^k (FibQuant, arXiv 2605.11478).

Construction (``fibquant_codebook``):

- radii by Bennett–Gersho companding: the optimal point density is ∝ f^{k/(k+2)}, so
  radii satisfy r² ~ Beta(k/2, β), β = 1 + (k/(k+2))·(D−k−2)/2, taken at the quantiles
  q_n = (n − ½)/N: r_n = sqrt(I⁻¹_{q_n}(k/2, β)) (on the sphere itself when k = D);
- directions: k = 2 a golden-angle spiral θ_n = 2πn(1 − 1/φ); k = 3 a Fibonacci sphere;
  k ≥ 4 a Roberts–Kronecker sequence (φ_k the root of x^(k+1) = x + 1) mapped to S^(k−1)
  through the Gaussian quantile function;
- refinement: Lloyd (k-means) on seeded samples of f_{D,k}, restarted from the spiral and
  from k-means++ seeds; the result with the lowest held-out MSE wins, the spiral included,
  so refinement is never worse than its initialization.

Codebooks are pure functions of (D, k, N, seed), cached in memory and on disk.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import numpy as np
from scipy import special

from ..lloyd import kmeans, kmeans_pp, nearest
from ..packing import MAX_PACK_BITS, index_bits
from ..rotation import Rotation
from ..paths import cache_root
from ..sphere import sample_block
from .base import check_int, register
from .table import RotatedTable

__all__ = ["FibQuant", "VectorCodebook", "fibquant_codebook", "spiral_codebook",
           "companded_radii", "directions", "generalized_golden", "build_seconds", "clear_memory_cache",
           "CODEBOOK_VERSION", "MAX_BUILD_SECONDS"]

CODEBOOK_VERSION = 2
GOLDEN = (1 + math.sqrt(5)) / 2


@dataclass(frozen=True)
class VectorCodebook:
    """codewords (N, k) float64; ``mse``: held-out E‖u_b − c‖² per block; ``init_mse``
    the same for the spiral before refinement; ``start``: which start won (−1: the spiral
    unrefined, 0: Lloyd from the spiral, r ≥ 1: Lloyd from k-means++ seed r);
    ``seconds`` to build (0 if cached)."""

    codewords: np.ndarray
    mse: float
    init_mse: float
    dim: int
    seed: int
    start: int = 0
    seconds: float = 0.0

    @property
    def start_label(self) -> str:
        """The winning start named for a reader ("spiral (unrefined)", "Lloyd from the
        spiral" or "Lloyd from k-means++ seed r")."""
        if self.start < 0:
            return "spiral (unrefined)"
        return "Lloyd from the spiral" if self.start == 0 else f"Lloyd from k-means++ seed {self.start}"

    @property
    def k(self) -> int:
        return self.codewords.shape[1]

    @property
    def n(self) -> int:
        return self.codewords.shape[0]


def companded_radii(dim: int, k: int, n: int) -> np.ndarray:
    """Codeword radii r_1 < … < r_N from the companded law r² ~ Beta(k/2, β)."""
    if k == dim:
        return np.ones(n)
    beta = 1 + (k / (k + 2)) * (dim - k - 2) / 2
    q = (np.arange(1, n + 1) - 0.5) / n
    return np.sqrt(special.betaincinv(k / 2, beta, q))


def generalized_golden(k: int) -> float:
    """φ_k: the positive root of x^(k+1) = x + 1 (φ_1 = golden ratio)."""
    x = 2.0
    for _ in range(100):
        x = (1 + x) ** (1 / (k + 1))
    return x


def directions(k: int, n: int) -> np.ndarray:
    """n low-discrepancy unit directions in R^k: (n, k)."""
    idx = np.arange(n)
    if k == 1:
        return np.where(idx % 2 == 0, 1.0, -1.0)[:, None]
    if k == 2:
        theta = 2 * np.pi * idx * (1 - 1 / GOLDEN)
        return np.stack([np.cos(theta), np.sin(theta)], 1)
    if k == 3:
        z = 1 - 2 * (idx + 0.5) / n
        theta = 2 * np.pi * idx * (1 - 1 / GOLDEN)
        s = np.sqrt(1 - z * z)
        return np.stack([s * np.cos(theta), s * np.sin(theta), z], 1)
    phi = generalized_golden(k)
    alpha = 1 / phi ** np.arange(1, k + 1)
    u = np.mod(0.5 + np.outer(idx + 1, alpha), 1.0)
    g = special.ndtri(np.clip(u, 1e-12, 1 - 1e-12))
    return g / np.linalg.norm(g, axis=1, keepdims=True)


def spiral_codebook(dim: int, k: int, n: int) -> np.ndarray:
    """The unrefined Fibonacci codebook: companded radii times low-discrepancy directions."""
    return companded_radii(dim, k, n)[:, None] * directions(k, n)


def _check(dim, k, n):
    dim, k, n = check_int("dim", dim, 2), check_int("k", k, 1), check_int("n_codewords", n, 2)
    if dim % k:
        raise ValueError(f"block size k={k} must divide D={dim}")
    if index_bits(int(n)) > MAX_PACK_BITS:
        raise ValueError(f"n_codewords={n} needs more than {MAX_PACK_BITS} bits per index")


def clear_memory_cache() -> None:
    """Forget the codebooks held in memory (the disk cache stays)."""
    _codebook.cache_clear()
    _built.clear()


# Seconds per (training sample × codeword × (k + 2)) of a build on a 2-core CPU (measured:
# 2.2–4.7e-7 for N = 64…1024); builds estimated beyond MAX_BUILD_SECONDS are refused.
_SECONDS_PER_UNIT = 3e-7
MAX_BUILD_SECONDS = 600.0
_built: set = set()


def _n_train(k: int, n: int) -> int:
    return max(20000, 100 * n) // max(1, k // 8)


def build_seconds(dim: int, k: int, n: int, restarts: int = 4) -> float:
    """Rough seconds to build a codebook of N codewords in blocks of k on this kind of CPU
    (Lloyd iterations over n_train samples for each of ``restarts`` starts)."""
    return _SECONDS_PER_UNIT * _n_train(k, n) * n * (k + 2) * max(1, restarts) / 4


def _path(dim, k, n, seed, restarts) -> Path:
    return cache_root() / "fibquant" / f"v{CODEBOOK_VERSION}_D{dim}_k{k}_N{n}_s{seed}_r{restarts}.npz"


def fibquant_codebook(dim: int, k: int, n: int, seed: int = 0, restarts: int = 4,
                      use_disk: bool = True) -> VectorCodebook:
    """The refined FibQuant codebook for (D, k, N, seed): memory cache, then disk cache
    (``$TURBOQUANT_CACHE`` or ~/.cache/turboquant), then built (and saved). A build longer
    than a couple of seconds shows a progress bar on a terminal (not in notebooks, whose
    stored outputs must reproduce); one estimated beyond
    ``MAX_BUILD_SECONDS`` is refused with the estimate (``ValueError``)."""
    _check(dim, k, n)
    seed, restarts = check_int("seed", seed, 0), check_int("restarts", restarts, 1)
    key = (int(dim), int(k), int(n), seed, restarts, bool(use_disk))
    if key not in _built and not (use_disk and _path(*key[:5]).exists()):
        est = build_seconds(dim, k, n, restarts)
        if est > MAX_BUILD_SECONDS:
            raise ValueError(f"a FibQuant codebook with N={n} codewords in blocks of k={k} would take "
                             f"about {est:,.0f} s to build here (limit {MAX_BUILD_SECONDS:.0f} s, "
                             f"turboquant.codecs.fibquant.MAX_BUILD_SECONDS): use fewer bits per "
                             f"coordinate or a smaller k")
    cb = _codebook(*key)
    _built.add(key)
    return cb


@lru_cache(maxsize=64)
def _codebook(dim, k, n, seed, restarts, use_disk) -> VectorCodebook:
    path = _path(dim, k, n, seed, restarts)
    if use_disk and path.exists():
        try:
            z = np.load(path)
            cb = VectorCodebook(z["codewords"], float(z["mse"]), float(z["init_mse"]), dim, seed,
                                int(z["start"]))
            if cb.codewords.shape == (n, k) and np.all(np.isfinite(cb.codewords)):
                return cb
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache file is rebuilt, never trusted
    cb = _build(dim, k, n, seed, restarts)
    if use_disk:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}.npz")
            np.savez(tmp, codewords=cb.codewords, mse=cb.mse, init_mse=cb.init_mse, start=cb.start)
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache only costs rebuild time
    return cb


def _build(dim, k, n, seed, restarts) -> VectorCodebook:
    import time

    from ..progress import progress
    t0 = time.perf_counter()
    n_train = _n_train(k, n)
    train = sample_block(n_train, dim, k, seed=seed)
    valid = sample_block(n_train, dim, k, seed=seed + 10_000_019)
    init = spiral_codebook(dim, k, n)
    best, best_mse, winner = init, float(nearest(valid, init)[1].mean()), -1
    init_mse = best_mse
    rng = np.random.default_rng([seed, dim, k, n])
    starts = [init] + [kmeans_pp(train, n, rng) for _ in range(max(0, restarts - 1))]
    seconds = build_seconds(dim, k, n, restarts)
    bar = progress(starts, len(starts), f"FibQuant codebook D={dim} k={k} N={n} (~{seconds:.0f} s)",
                   enabled=seconds >= 2.0 and sys.stderr.isatty(), unit="start")
    for r, start in enumerate(bar):
        c, _ = kmeans(train, start)
        m = float(nearest(valid, c)[1].mean())
        if m < best_mse:
            best, best_mse, winner = c, m, r
    return VectorCodebook(best, best_mse, init_mse, dim, seed, winner, time.perf_counter() - t0)


@register
class FibQuant(RotatedTable):
    """``FibQuant(dim, k=2, n_codewords=None, *, bits=None, rotation="haar", seed=0)``.

    Give ``n_codewords`` (N) or ``bits`` (b, then N = 2^(b·k) must be a whole number).
    ``rate`` = log2(N)/k is the nominal rate; ``payload_bits`` = ceil(log2 N)/k what the
    stored indices cost (equal when N is a power of two); ``bits_per_coordinate`` adds the
    fp16 norm.
    Code fields ``idx`` (…, ceil(D/k · ceil(log2 N)/8)) uint8 and ``norm`` (…, 1) fp16.
    """

    @classmethod
    def example(cls, dim: int) -> "FibQuant":
        """One instance for the codec contract tests: k = 2, 16 codewords (2 bits per coordinate)."""
        return cls(dim, 2, 16)

    name = "fibquant"

    def __init__(self, dim: int, k: int = 2, n_codewords: int | None = None, *, bits: float | None = None,
                 rotation: str = "haar", seed: int = 0):
        dim, k, seed = check_int("dim", dim, 2), check_int("k", k, 1), check_int("seed", seed, 0)
        if (n_codewords is None) == (bits is None):
            raise ValueError("give exactly one of n_codewords or bits")
        if bits is not None:
            if not isinstance(bits, (int, float, np.integer, np.floating)) or isinstance(bits, bool) \
                    or not math.isfinite(bits) or not bits > 0:
                raise ValueError(f"bits must be a positive number, got {bits!r}")
            exact = 2 ** (bits * k)
            n_codewords = int(round(exact))
            if abs(exact - n_codewords) > 1e-9 * exact:
                raise ValueError(f"bits={bits} with k={k} gives N = 2^{bits * k:g}, not a whole number")
        n_codewords = check_int("n_codewords", n_codewords, 2)
        _check(dim, k, n_codewords)
        self.dim, self.k, self.seed = dim, k, seed
        self.rotation = Rotation(rotation, dim, seed)
        self.codebook = fibquant_codebook(dim, k, n_codewords, seed)
        self._set_table(mx.array(self.codebook.codewords, dtype=mx.float32), index_bits(n_codewords))  # (N, k)

    @property
    def rate(self) -> float:
        """Nominal rate log2(N)/k bits per coordinate (no side information)."""
        return math.log2(self.n_codewords) / self.k

    @property
    def expected_mse(self) -> float:
        """float: E‖u − û‖² for unit u, the codebook's held-out per-block MSE times D/k."""
        return self.codebook.mse * self.dim / self.k

    def config(self) -> dict:
        return {"codec": self.name, "dim": self.dim, "k": self.k, "n_codewords": self.n_codewords,
                "seed": self.seed, "rotation": self.rotation.kind}

