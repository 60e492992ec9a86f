"""Chapter 5 figures: PolarQuant's angle laws and codebooks."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..codecs.polar import angle_codebook, angle_pdf, polar_transform
from ..rotation import Rotation
from ..sphere import sample_sphere
from .style import COLORS, figure


def plot_polar_angles(level_bits=(4, 2, 2, 2), dim: int = 128, n: int = 4000, seed: int = 0):
    """Histogram of each level's angles for rotated unit vectors, their exact law, and the
    level's Lloyd–Max levels (dots) and thresholds (lines)."""
    levels = len(level_bits)
    y = Rotation("haar", dim, seed).apply(mx.array(sample_sphere(n, dim, seed), dtype=mx.float32))
    angles, _ = polar_transform(y, levels)
    fig, axes = figure(levels, 1, width=2.6, height=2.6, squeeze=False)
    for l, (ax, psi, b) in enumerate(zip(axes[0], angles, level_bits)):
        pdf, lo, hi = angle_pdf(l + 1)
        ax.hist(np.array(psi).ravel(), bins=48, range=(lo, hi), density=True, alpha=0.5, color=COLORS[0])
        t = np.linspace(lo, hi, 400)
        ax.plot(t, pdf(t), c=COLORS[1])
        book = angle_codebook(l + 1, b)
        for th in book.thresholds:
            ax.axvline(th, c="k", lw=0.5, alpha=0.5)
        ax.plot(book.centroids, pdf(book.centroids), "o", c=COLORS[1], ms=3)
        ax.set_title(f"level {l + 1}: {b} bits", fontsize=10)
        ax.set_xlabel("angle (rad)")
    fig.tight_layout()
    return fig
