"""Monte-Carlo checks of inner-product estimators (Chapter 4).

Unbiasedness of QJL and TurboQuant_prod is a statement over the random draw of the sketch
S (and rotation Π): for one fixed draw the estimator can carry a small systematic error.
These helpers therefore re-draw the codec (a new seed) for every group of pairs.
"""
from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from .sphere import sample_sphere

__all__ = ["spread_pairs", "estimates_over_seeds", "bias_summary"]


def spread_pairs(n: int, dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` unit pairs (q, k), each (n, D) float64, with ⟨q, k⟩ uniform on [−1, 1]."""
    rng = np.random.default_rng([seed, 17])
    k = sample_sphere(n, dim, seed + 1)
    p = sample_sphere(n, dim, seed + 2)
    p -= np.sum(p * k, 1, keepdims=True) * k
    p /= np.linalg.norm(p, axis=1, keepdims=True)
    cos = rng.uniform(-1, 1, (n, 1))
    return cos * k + np.sqrt(1 - cos ** 2) * p, k


def estimates_over_seeds(make_codec, dim: int, n_seeds: int = 200, per_seed: int = 50,
                         seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(estimates, truths), each (n_seeds·per_seed,): ⟨q, decode(encode(k))⟩ with codec
    ``make_codec(s)`` for the s-th group of ``per_seed`` pairs."""
    q, k = spread_pairs(n_seeds * per_seed, dim, seed)
    est = np.empty(len(q))
    for s in range(n_seeds):
        sl = slice(s * per_seed, (s + 1) * per_seed)
        codec = make_codec(s)
        k_hat = np.array(codec.decode(codec.encode(mx.array(k[sl], dtype=mx.float32))), dtype=np.float64)
        est[sl] = np.sum(q[sl] * k_hat, 1)
    return est, np.sum(q * k, 1)


def bias_summary(est: np.ndarray, truth: np.ndarray) -> dict:
    """Mean error with its standard error and z-score; regression slope with its SE."""
    err = est - truth
    se = err.std() / math.sqrt(len(err))
    slope = float(np.polyfit(truth, est, 1)[0])
    resid = est - slope * truth - (est.mean() - slope * truth.mean())
    slope_se = resid.std() / (truth.std() * math.sqrt(len(err)))
    return {"mean_error": float(err.mean()), "se": float(se), "z": float(err.mean() / se),
            "slope": slope, "slope_se": float(slope_se), "mse": float(np.mean(err ** 2))}
