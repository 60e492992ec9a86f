"""Chapter 10 figures: key spectra, bit allocations, and the frontier of a recorded run."""
from __future__ import annotations

import numpy as np

from .cache import best_within
from .style import COLORS, figure


def plot_spectra(spectra: dict, title: str = ""):
    """Eigenvalues of the key covariance, largest first, normalised by their mean (what a
    random rotation gives every coordinate: the dashed line). ``spectra`` maps a label to
    a 1-D array of eigenvalues."""
    fig, ax = figure(width=6.4, height=3.6)
    for i, (label, lam) in enumerate(spectra.items()):
        lam = np.sort(np.asarray(lam))[::-1]
        ax.plot(np.arange(1, len(lam) + 1), lam / lam.mean(), color=COLORS[i % len(COLORS)], label=label)
    ax.axhline(1, c="k", lw=0.8, ls="--", label="after a random rotation")
    ax.set_yscale("log")
    ax.set_xlabel("KLT coordinate (largest variance first)")
    ax.set_ylabel("variance / mean variance")
    if title:
        ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    return fig


def plot_allocation(allocs: dict):
    """Bits per transformed coordinate (reverse water-filling); ``allocs`` maps a label to
    a list of D ints."""
    fig, ax = figure(width=6.4, height=3.0)
    for i, (label, a) in enumerate(allocs.items()):
        ax.step(np.arange(len(a)), a, where="mid", color=COLORS[i % len(COLORS)],
                label=f"{label} (mean {np.mean(a):.3g})")
    ax.set_xlabel("transformed coordinate")
    ax.set_ylabel("bits")
    ax.legend(fontsize=7, frameon=False)
    fig.tight_layout()
    return fig


def plot_budget_choice(rows, budget: float = 4.25, title: str = ""):
    """The frontier of a recorded run (``suite.frontier_rows``) with the configurations
    within ``budget`` bits highlighted and the best of them marked."""
    fig, ax = figure(width=7.0, height=4.0)
    pts = [(r[0], r[1], r[2], max(r[4], 0.01)) for r in rows if r[1] != "reference"]
    from ..budget import within
    inside = [p for p in pts if within(p[2], budget)]
    out = [p for p in pts if not within(p[2], budget)]
    if out:
        ax.scatter([p[2] for p in out], [p[3] for p in out], s=18, color="#bbbbbb", label="over budget")
    if inside:
        ax.scatter([p[2] for p in inside], [p[3] for p in inside], s=24, color=COLORS[0], label="within budget")
        name, bits, inc = best_within([(p[0], p[2], p[3]) for p in inside], budget)
        ax.scatter([bits], [inc], s=120, facecolors="none", edgecolors=COLORS[1], lw=2)
        ax.axvline(budget, c="k", lw=0.8, ls="--")
        ax.set_yscale("log")
        x, y = ax.transAxes.inverted().transform(ax.transData.transform((bits, inc)))
        right, low = x > 0.5, y < 0.15              # the label on the sides with room, over a white ground
        ax.annotate(f"best: {name} ({inc:+.2f} %)", (bits, inc), textcoords="offset points",
                    xytext=(-10 if right else 10, 8 if low else -14), ha="right" if right else "left", fontsize=8,
                    color=COLORS[1], bbox=dict(boxstyle="round,pad=0.2", fc="white", ec="none", alpha=0.9))
    else:
        ax.axvline(budget, c="k", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.set_xlabel("bits per coordinate (side information included)")
    ax.set_ylabel("perplexity increase (%)")
    ax.set_title(title or f"budget {budget:g} bits", fontsize=10)
    ax.legend(fontsize=7, frameon=False, loc="upper right")
    fig.tight_layout()
    return fig
