"""Key outliers by channel, before and after a rotation (the realistic-model chapter).

A model's keys are not isotropic: a few of the D channels carry much of the energy (large
pre-RoPE biases, as in Qwen2, show up as channels with a large mean). A scalar quantizer
with one scale per vector spends its range on those channels; a random rotation spreads
them, so that every rotated coordinate of a unit vector follows the same Beta law
(Chapter 2) whatever the input. ``channel_profile`` measures both sides of that claim on
captured keys."""
from __future__ import annotations

import numpy as np

__all__ = ["channel_profile"]


def channel_profile(keys, rotation=None) -> dict:
    """Per-channel statistics of key vectors ``keys`` (…, D), any leading shape (e.g.
    (1, H_kv, T, D) from ``capture_qkv``), each vector first divided by its norm so that
    only the direction counts (the norm is stored apart by every codec here).

    ``rotation``: a ``turboquant.rotation.Rotation`` applied to every vector first (None:
    the raw channels). Returns {"rms": (D,) root-mean-square of each coordinate,
    "peak_to_median": max/median of ``rms``, "top_share": share of the energy in the
    top 1 % of channels (at least one), "fourth_moment": mean of y⁴ over coordinates and
    vectors — the Beta law's is ``sphere.coordinate_moment(D, 4)`` = 3/(D(D+2))}.
    Zero vectors are refused (they have no direction)."""
    import mlx.core as mx
    x = np.asarray(keys, dtype=np.float64)
    if x.ndim < 2 or x.shape[-1] < 2:
        raise ValueError(f"keys must have shape (..., D) with D >= 2, got {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError("keys hold NaN or Inf")
    x = x.reshape(-1, x.shape[-1])
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    if np.any(norms == 0):
        raise ValueError(f"{int(np.sum(norms == 0))} key vector(s) are zero: a direction is undefined")
    y = x / norms
    if rotation is not None:
        if rotation.dim != y.shape[1]:
            raise ValueError(f"rotation of dim {rotation.dim} for keys of D = {y.shape[1]}")
        y = np.asarray(rotation.apply(mx.array(y.astype(np.float32))), dtype=np.float64)
    rms = np.sqrt(np.mean(y * y, axis=0))
    if np.median(rms) == 0:
        raise ValueError("more than half of the channels are zero in every key: a peak-to-median ratio is undefined")
    energy = np.sort(rms ** 2)[::-1]
    top = max(1, int(round(0.01 * len(rms))))
    return {"rms": rms, "peak_to_median": float(rms.max() / np.median(rms)),
            "top_share": float(energy[:top].sum() / energy.sum()), "fourth_moment": float(np.mean(y ** 4))}
