"""Chapter 9 figures: the memory–quality frontier and per-layer fidelity on a real model."""
from __future__ import annotations

import numpy as np

from .cache import best_within
from .style import COLORS, figure


def plot_ppl_frontier(rows, title: str = "", budget: float | None = None):
    """Perplexity increase (%) against bits per coordinate (side information included);
    ``rows`` = [(name, family, bits, ppl, increase %)] as ``suite.frontier_rows`` returns.
    One colour per family; the y axis is logarithmic. With ``budget``, a line at that many
    bits and the best configuration within it circled and named in the title."""
    fig, ax = figure(width=7.0, height=4.2)
    fams = sorted({r[1] for r in rows if r[1] != "reference"})
    for i, fam in enumerate(fams):
        pts = [(r[2], max(r[4], 0.01)) for r in rows if r[1] == fam]
        ax.scatter(*zip(*pts), s=28, color=COLORS[i % len(COLORS)], label=fam,
                   marker="os^Dv<>p"[i // len(COLORS) % 8])
    ax.set_yscale("log")
    ax.axhline(1, c="k", lw=0.8, ls="--")
    ax.axhline(4, c="k", lw=0.8, ls=":")
    ax.axvline(4.25, c="gray", lw=0.6)
    ax.axvline(3.25, c="gray", lw=0.6)
    ax.set_xlabel("bits per coordinate (K and V averaged, side information included)")
    ax.set_ylabel("perplexity increase over fp32 (%)")
    if budget is not None:
        best = best_within([(r[0], r[2], r[4]) for r in rows if r[1] != "reference"], budget)
        ax.axvline(budget, c="k", lw=1.0, ls="--")
        if best:
            ax.scatter([best[1]], [max(best[2], 0.01)], s=170, facecolors="none", edgecolors="k", lw=1.2)
            title = f"{title}\nwithin {budget:g} bits: {best[0]} ({best[1]:.3g} bits) at {best[2]:+.2f} %"
        else:
            title = f"{title}\nno configuration within {budget:g} bits"
    if title:
        ax.set_title(title.strip(), fontsize=10)
    ax.legend(fontsize=7, loc="upper right", ncol=2, frameon=False)
    fig.tight_layout()
    return fig


def plot_layer_heatmap(names, cos_rows):
    """Heat map of 1 − cosine similarity (log scale) of attention outputs, configuration ×
    layer; ``cos_rows`` is one list of per-layer cosines per name."""
    import matplotlib.colors as mcolors
    err = np.maximum(1 - np.asarray(cos_rows, dtype=float), 1e-6)
    fig, ax = figure(width=7.6, height=0.38 * len(names) + 1.4)
    ax.grid(False)
    im = ax.imshow(err, aspect="auto", cmap="magma_r", norm=mcolors.LogNorm(vmin=err.min(), vmax=err.max()))
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_xticks(range(0, err.shape[1], 2))
    ax.set_xlabel("layer")
    fig.colorbar(im, ax=ax, label="1 − cos(attention output)")
    fig.tight_layout()
    return fig


def plot_sink_mass(mass, energy):
    """Per layer: mean attention mass on the first token, and the fraction of key energy
    left after removing the per-head mean."""
    fig, ax = figure(width=6.8, height=3.2)
    layers = np.arange(len(mass))
    ax.plot(layers, mass, "o-", ms=3, label="attention mass on token 0 (sink)")
    ax.plot(layers, energy, "s-", ms=3, label="key energy left after centering")
    ax.set_xlabel("layer")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig
