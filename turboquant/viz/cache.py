"""Chapter 7 figure: what a cache costs against what it keeps, as the budget moves."""
from __future__ import annotations

from .style import COLORS, figure


def best_within(rows, budget: float):
    """The row with the smallest error among ``rows`` = [(label, bits, error)] whose bits are
    at most ``budget`` (up to float rounding); ``None`` if no row fits."""
    from ..budget import best_within as best
    return best(rows, budget, bits=lambda r: r[1], score=lambda r: r[2])


def lower_edge(rows):
    """The rows no other row beats on both bits and error (the Pareto frontier), by bits."""
    return sorted((r for r in rows if not any(o[1] <= r[1] and o[2] < r[2] or o[1] < r[1] and o[2] <= r[2]
                                              for o in rows)), key=lambda r: r[1])


def plot_cache_tradeoff(rows, budget: float = 4.25, fp16_bits: float = 16.0):
    """Attention-output error against bits per coordinate, one point per cache; the budget as
    a vertical line, the best cache within it circled. ``rows`` = [(label, bits per coordinate
    measured from the cache's bytes, relative error of the attention output)]; points share a
    colour when their labels agree up to the last space ("turboquant_mse 4.12" → family
    "turboquant_mse")."""
    if not rows:
        raise ValueError("rows is empty: nothing to plot")
    fig, ax = figure(width=6.8, height=3.8)
    families = sorted({r[0].rsplit(" ", 1)[0] for r in rows})
    for i, fam in enumerate(families):
        pts = [r for r in rows if r[0].rsplit(" ", 1)[0] == fam]
        ax.scatter([r[1] for r in pts], [r[2] for r in pts], s=26, color=COLORS[i % len(COLORS)],
                   label=fam, zorder=3)
    ax.axvline(budget, c="k", lw=0.8, ls="--")
    best = best_within(rows, budget)
    if best is None:
        title = f"no cache fits in {budget:g} bits per coordinate"
    else:
        ax.scatter([best[1]], [best[2]], s=160, facecolors="none", edgecolors="k", lw=1.2, zorder=4)
        title = (f"within {budget:g} bits: {best[0]} ({best[1]:.3g} bits, {fp16_bits / best[1]:.1f}× "
                 f"smaller than fp16), error {best[2]:.3f}")
    ax.set_yscale("log")
    ax.set_xlabel("bits per coordinate (measured cache bytes)")
    ax.set_ylabel("relative error of attention output")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, frameon=False, loc="upper right")
    fig.tight_layout()
    return fig


def plot_loadtest(record: dict):
    """Chapter 7's serving figure from a ``turboquant loadtest`` record: left, conversations
    the prompt-cache LRU keeps against ``--prompt-cache-bytes``, per server; right, generated
    tokens/s against client threads, per server."""
    servers = record.get("servers") or {}
    if not servers:
        raise ValueError("the record has no servers: nothing to plot")
    fig, (left, right) = figure(ncols=2, width=3.6, height=3.2)
    for i, (kind, s) in enumerate(sorted(servers.items())):
        caps = s.get("capacity", [])
        if caps:
            from ..serve import size_in_bytes
            mb = [size_in_bytes(c["budget"]) / 1e6 for c in caps]
            left.plot(mb, [c["kept"] for c in caps], "o-", color=COLORS[i], label=s["label"])
        thr = s.get("throughput", [])
        if thr:
            right.plot([t["clients"] for t in thr], [t["tokens_per_s"] for t in thr], "o-", color=COLORS[i],
                       label=s["label"])
    left.set_xlabel("--prompt-cache-bytes (MB, 10⁶ bytes)")
    left.set_ylabel("conversations kept")
    left.axhline(record["setup"]["conversations"], c="k", lw=0.8, ls=":")
    right.set_xlabel("client threads")
    right.set_ylabel("generated tokens/s")
    left.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig
