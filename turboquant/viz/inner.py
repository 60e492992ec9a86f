"""Chapter 4 figures: QJL estimates against their theory."""
from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ..codecs.qjl import QJL
from .style import COLORS, figure


def qjl_estimates(m: int, dim: int = 128, inner: float = 0.5, n_draws: int = 2000,
                  orthogonal: bool = False) -> np.ndarray:
    """Estimates of ⟨q, k⟩ for one unit pair with ⟨q, k⟩ = ``inner`` over ``n_draws``
    sketches (seeds 0 … n_draws−1): (n_draws,) float64."""
    k = np.zeros(dim); k[0] = 1
    q = np.zeros(dim); q[0], q[1] = inner, math.sqrt(1 - inner * inner)
    kk, qq = mx.array(k[None], dtype=mx.float32), mx.array(q[None, None], dtype=mx.float32)
    out = []
    for s in range(n_draws):
        c = QJL(dim, m=m, orthogonal=orthogonal, seed=s)
        out.append(c.inner(qq, c.encode(kk)).item())
    return np.array(out)


def plot_qjl_estimates(m: int = 128, dim: int = 128, inner: float = 0.5, n_draws: int = 2000):
    """Histogram of QJL estimates (Gaussian and orthogonal rows) with the Gaussian-row
    theory N(⟨q,k⟩, (π/2 − ⟨q,k⟩²)/m)."""
    fig, ax = figure(width=6.4, height=3.2)
    sd = math.sqrt(QJL.variance(1, 1, inner, m))
    bins = np.linspace(inner - 4.5 * sd, inner + 4.5 * sd, 60)
    for orth, color, label in ((False, COLORS[0], "Gaussian S"), (True, COLORS[2], "orthogonal rows")):
        est = qjl_estimates(m, dim, inner, n_draws, orth)
        ax.hist(est, bins=bins, density=True, alpha=0.45, color=color,
                label=f"{label}: mean {est.mean():.3f}, var·m {est.var() * m:.2f}")
    x = np.linspace(bins[0], bins[-1], 300)
    ax.plot(x, np.exp(-(x - inner) ** 2 / (2 * sd * sd)) / (sd * math.sqrt(2 * math.pi)), c="k",
            label=f"theory (Gaussian S): var·m = {sd * sd * m:.2f}")
    ax.axvline(inner, c="k", ls=":", lw=1)
    ax.set_title(f"QJL estimates of <q,k> = {inner}, D = {dim}, m = {m}, {n_draws} sketches", fontsize=10)
    ax.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    return fig
