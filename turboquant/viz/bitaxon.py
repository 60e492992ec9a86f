"""Chapter 8 figures: Bit-Axon's cache budget."""
from __future__ import annotations

from .style import COLORS, MB, figure


def plot_swa_budget(rows):
    """Bars of KV-cache MB per setting (8 SWA layers, W = 4096, 32 × 80) with the plan's
    83.9 MB target; ``rows`` = [(label, measured bytes)]."""
    fig, ax = figure(width=6.4, height=3.2)
    labels = [r[0] for r in rows]
    vals = [r[1] / MB for r in rows]
    ax.bar(labels, vals, color=[COLORS[i % len(COLORS)] for i in range(len(rows))])
    for i, v in enumerate(vals):
        ax.text(i, v + 5, f"{v:.1f}", ha="center", fontsize=8)
    ax.axhline(83.9, c="k", ls="--", lw=1, label="plan: 83.9 MB at 4 bits")
    ax.set_ylabel("KV cache, 8 SWA layers (MB)")
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig
