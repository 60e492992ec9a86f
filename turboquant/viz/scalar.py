"""Chapter 3 figures: Lloyd–Max codebooks and rate–distortion."""
from __future__ import annotations

import numpy as np

from .. import sphere
from ..lloyd import beta_codebook
from .style import COLORS, figure


def plot_codebook(dim: int = 128, bits: int = 2):
    """The Beta coordinate law with its Lloyd–Max thresholds (lines) and centroids (dots)."""
    book = beta_codebook(dim, bits)
    fig, ax = figure(width=6.4, height=3.0)
    lim = min(1.0, 5 / np.sqrt(dim))
    x = np.linspace(-lim, lim, 1001)
    f = sphere.coordinate_pdf(x, dim)
    ax.plot(x, f, c=COLORS[0])
    for t in book.thresholds:
        if abs(t) <= lim:
            ax.axvline(t, c="k", lw=0.6, alpha=0.5)
    c = book.centroids[np.abs(book.centroids) <= lim]
    ax.plot(c, sphere.coordinate_pdf(c, dim), "o", c=COLORS[1], ms=4)
    ax.set_xlim(-lim, lim)
    ax.set_title(f"D = {dim}, b = {bits}: {2**bits} levels, "
                 f"D·C(f, b) = {dim * book.mse:.4f}", fontsize=10)
    ax.set_xlabel("rotated coordinate y")
    fig.tight_layout()
    return fig


def plot_rate_distortion(curves: dict, bits=np.arange(1, 9)):
    """E‖u − û‖² against bits per coordinate (side information included), with the
    bounds 4^−b and (√3π/2)·4^−b. ``curves`` maps a label to (bits_list, mse_list)."""
    fig, ax = figure(width=6.4, height=3.6)
    b = np.linspace(min(bits) - 0.2, max(bits) + 0.2, 100)
    ax.fill_between(b, 4.0 ** -b, np.sqrt(3) * np.pi / 2 * 4.0 ** -b, color="0.85",
                    label=r"bounds $4^{-b}$ … $\frac{\sqrt{3}\pi}{2}4^{-b}$")
    for (label, (x, y)), marker in zip(curves.items(), "os^vD"):
        ax.semilogy(x, y, marker=marker, label=label, ms=4)
    ax.set_xlabel("bits per coordinate (side information included)")
    ax.set_ylabel(r"$E\|u-\hat u\|^2$")
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig
