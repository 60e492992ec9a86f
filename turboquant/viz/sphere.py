"""Chapter 2 figures: rotations and the spherical-Beta source."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import sphere
from ..rotation import Rotation, coordinate_over_rotations, hadamard_sizes_ok
from ..synthetic import outlier_keys
from .style import COLORS, figure


def unit(x: mx.array) -> mx.array:
    """Rows scaled to unit norm: (..., D) → (..., D)."""
    return x / mx.linalg.norm(x, axis=-1, keepdims=True)


def plot_rotation_effect(dim: int = 128, n: int = 2048, rotation: str = "hadamard", seed: int = 0):
    """Per-channel RMS of synthetic outlier keys, normalized, before and after a rotation."""
    u = unit(outlier_keys(n, dim, seed=seed))
    y = Rotation(rotation, dim, seed).apply(u)
    fig, axes = figure(2, 1, width=3.6, height=2.8, sharey=True)
    for ax, data, title in ((axes[0], u, "before: a few outlier channels"),
                            (axes[1], y, f"after a {rotation} rotation")):
        rms = np.sqrt(np.mean(np.array(data) ** 2, axis=0))
        ax.bar(np.arange(dim), rms, width=1.0, color=COLORS[0])
        ax.axhline(1 / np.sqrt(dim), c="k", ls="--", lw=1)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("channel")
    axes[0].set_ylabel("RMS of unit-vector coordinate")
    fig.tight_layout()
    return fig


def _law_axes(ax, dim):
    lim = 1.0 if dim < 32 else min(1.0, 5 / np.sqrt(dim))
    x = np.linspace(-lim, lim, 801)
    ax.plot(x, sphere.coordinate_pdf(x, dim), c=COLORS[1], label=r"Beta law $f_D$")
    ax.plot(x, sphere.gaussian_limit_pdf(x, dim), c="k", ls="--", lw=1, label=r"$N(0,1/D)$")
    ax.set_xlim(-lim, lim)
    return np.linspace(-lim, lim, 61)


def plot_coordinate_law(dim: int = 32, n_rotations: int = 1500, n_tokens: int = 20000, seed: int = 0):
    """Left: one outlier key, y_1 over many Haar and Hadamard rotations. Right: one Haar
    rotation applied to many outlier keys: coordinate 1 alone, and all coordinates pooled
    (about ``n_tokens`` values). Both against f_D and its Gaussian limit."""
    keys = outlier_keys(n_tokens, dim, n_outliers=min(4, dim), seed=seed)
    fig, axes = figure(2, 1, width=3.8, height=3.0, sharey=True)
    bins = _law_axes(axes[0], dim)
    key = np.array(keys[0])
    for kind, color in (("haar", COLORS[0]), ("hadamard", COLORS[2])):
        if kind == "hadamard" and not hadamard_sizes_ok(dim):
            continue
        y = coordinate_over_rotations(key, kind, n_rotations, seed0=seed)
        axes[0].hist(y, bins=bins, density=True, alpha=0.45, color=color, label=f"{kind}, one key")
    axes[0].set_title(f"one key, {n_rotations} rotations (D = {dim})", fontsize=10)
    bins = _law_axes(axes[1], dim)
    y = np.array(Rotation("haar", dim, seed).apply(unit(keys)))
    pooled = y[: max(1, n_tokens // dim)].ravel()
    for data, label, color in ((y[:, 0], "coordinate 1 only", COLORS[3]),
                               (pooled, "all D coordinates pooled", COLORS[0])):
        axes[1].hist(data, bins=bins, density=True, alpha=0.45, color=color, label=label)
    axes[1].set_title("one Haar rotation, many keys", fontsize=10)
    for ax in axes:
        ax.set_xlabel(r"$y_1$")
        ax.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    return fig


def plot_block_law(dim: int = 16, n: int = 3000, seed: int = 0):
    """The 2-D block law f_{D,2}: density image, and samples from a rotated sphere."""
    fig, axes = figure(2, 1, width=3.4, height=3.2)
    g = np.linspace(-1, 1, 301)
    xx, yy = np.meshgrid(g, g)
    dens = sphere.block_pdf(np.stack([xx, yy], -1), dim, 2)
    axes[0].imshow(dens, extent=(-1, 1, -1, 1), origin="lower", cmap="viridis")
    axes[0].set_title(rf"$f_{{D,2}}$, D = {dim}", fontsize=10)
    pts = sphere.sample_sphere(n, dim, seed)[:, :2]
    axes[1].scatter(pts[:, 0], pts[:, 1], s=2, alpha=0.4, color=COLORS[0])
    t = np.linspace(0, 2 * np.pi, 200)
    axes[1].plot(np.cos(t), np.sin(t), c="k", lw=0.8)
    axes[1].set_aspect("equal")
    axes[1].set_title("first two coordinates of uniform points", fontsize=10)
    for ax in axes:
        ax.set_xlim(-1, 1)
        ax.set_ylim(-1, 1)
    fig.tight_layout()
    return fig
