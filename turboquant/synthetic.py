"""Synthetic keys and values with the structure real attention keys show.

Keys of trained LLMs have a few "outlier" channels whose magnitude is many times the
others, the same channels for every token (a per-channel offset plus a larger spread).
``outlier_keys`` draws such vectors; it is a stand-in for chapters that come before real
models, and it is labelled synthetic wherever it is used.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

__all__ = ["outlier_keys"]


def outlier_keys(n: int, dim: int, n_outliers: int = 4, outlier_scale: float = 8.0,
                 offset_scale: float = 4.0, seed: int = 0, batch_shape: tuple = (),
                 noise_seed: int | None = None) -> mx.array:
    """(…batch_shape, n, D) float32 vectors: N(0, 1) channels, except ``n_outliers`` fixed
    channels with standard deviation ``outlier_scale`` and a fixed offset of size
    ``offset_scale`` (signs random). Channels and offsets depend on ``seed`` only; the
    per-token noise on ``noise_seed`` (default: ``seed``), so queries that share the keys'
    outlier channels are ``outlier_keys(…, seed=s, noise_seed=s + 1)``."""
    if not 0 <= n_outliers <= dim:
        raise ValueError(f"n_outliers must be in [0, {dim}], got {n_outliers!r}")
    rng = np.random.default_rng(seed)
    channels = rng.choice(dim, size=n_outliers, replace=False)
    scale = np.ones(dim)
    scale[channels] = outlier_scale
    offset = np.zeros(dim)
    offset[channels] = offset_scale * rng.choice([-1.0, 1.0], size=n_outliers)
    noise = rng if noise_seed is None else np.random.default_rng([int(noise_seed), 1])
    x = noise.standard_normal((*batch_shape, n, dim)) * scale + offset
    return mx.array(x, dtype=mx.float32)
