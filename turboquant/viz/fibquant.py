"""Chapter 6 figures: the spherical-Beta radius law, Fibonacci codebooks, the frontier."""
from __future__ import annotations

import numpy as np
from scipy import stats

from ..codecs.fibquant import fibquant_codebook, spiral_codebook
from ..sphere import sample_block
from .style import COLORS, figure


def plot_radius_law(dim: int = 64, k: int = 2, n: int = 40000, seed: int = 0):
    """‖u‖² of k-blocks: samples against Beta(k/2, (D−k)/2), and the companded law
    Beta(k/2, β) that sets the codeword radii (it puts more radii in the tail)."""
    r2 = np.sum(sample_block(n, dim, k, seed) ** 2, axis=1)
    beta = 1 + (k / (k + 2)) * (dim - k - 2) / 2
    fig, ax = figure(width=6.4, height=3.0)
    hi = np.quantile(r2, 0.999) * 1.3
    ax.hist(r2, bins=80, range=(0, hi), density=True, alpha=0.5, color=COLORS[0], label="samples of |u|^2")
    t = np.linspace(1e-6, hi, 400)
    ax.plot(t, stats.beta(k / 2, (dim - k) / 2).pdf(t), c=COLORS[1], label=f"Beta({k}/2, {dim - k}/2)")
    ax.plot(t, stats.beta(k / 2, beta).pdf(t), c="k", ls="--", label=f"companded Beta({k}/2, {beta:.2f})")
    ax.set_xlabel(r"$\|u\|^2$ of a block")
    ax.set_title(f"radius law, D = {dim}, k = {k}", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def plot_fibquant_codebook(n_codewords: int = 16, dim: int = 64, seed: int = 0):
    """k = 2: the golden-angle spiral with companded radii, and the codebook after Lloyd
    refinement (from whichever start won), over samples of f_{D,2}; titles give each
    one's held-out E‖u − c‖²·D/2."""
    cb = fibquant_codebook(dim, 2, n_codewords, seed)
    init = spiral_codebook(dim, 2, n_codewords)
    pts = sample_block(3000, dim, 2, seed + 1)
    lim = np.quantile(np.abs(pts), 0.999) * 1.25
    fig, axes = figure(2, 1, width=3.4, height=3.4)
    origin = {-1: "spiral kept", 0: "from the spiral"}.get(cb.start, f"from k-means++ start {cb.start}")
    for ax, c, title in ((axes[0], init, f"spiral: {cb.init_mse * dim / 2:.4f}"),
                         (axes[1], cb.codewords, f"refined ({origin}): {cb.mse * dim / 2:.4f}")):
        ax.scatter(pts[:, 0], pts[:, 1], s=1, alpha=0.25, color="0.5")
        ax.scatter(c[:, 0], c[:, 1], s=18, color=COLORS[1], zorder=3)
        ax.set_xlim(-lim, lim)
        ax.set_ylim(-lim, lim)
        ax.set_aspect("equal")
        ax.set_title(f"N = {n_codewords}, D = {dim}, {title}", fontsize=9)
    fig.tight_layout()
    return fig


def plot_frontier(curves: dict, max_rate: float = 4.5):
    """Distortion E‖u − û‖² against rate, log scale, with the Shannon bound 4^−b.
    ``curves`` maps a label to (rates, distortions); rates exclude the fp16 norm."""
    fig, ax = figure(width=6.8, height=4.0)
    b = np.linspace(0.03, max_rate, 200)
    ax.semilogy(b, 4.0 ** -b, c="k", ls="--", lw=1, label=r"Shannon bound $4^{-b}$")
    for (label, (x, y)), marker in zip(curves.items(), "osD^v<>p"):
        order = np.argsort(x)
        ax.semilogy(np.asarray(x)[order], np.asarray(y)[order], marker=marker, ms=4, label=label)
    ax.axhline(1.0, c="0.6", lw=0.8)
    ax.set_xlabel("rate b = log2(N)/k bits per coordinate (norm not included)")
    ax.set_ylabel(r"$E\|u-\hat u\|^2$")
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig
