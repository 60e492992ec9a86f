"""Chapter 8 figures: Bit-Axon's cache budget."""
from __future__ import annotations

import numpy as np

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


def plot_window_memory(context: int = 65536, bits: float = 4, side_bits_per_vector: float = 16,
                       window: int = 4096):
    """Bit-Axon's KV memory (8 attention layers, 32 kv heads of 80) against context: a full
    fp16 cache, an fp16 ring of ``window`` tokens, and a ring of ``bits``-bit codes (+ side
    bits per vector), from ``memory.kv_cache_bytes``; the values at ``context`` are marked."""
    from .. import memory
    g = memory.PRESETS["bit-axon"]
    n = len(g.attention_layers)
    full = memory.AttentionGeometry("full", (memory.Layer("global"),) * n, g.n_kv_heads, g.head_dim)
    ring = memory.AttentionGeometry("ring", (memory.Layer("sliding", window),) * n, g.n_kv_heads, g.head_dim)
    ts = np.unique(np.geomspace(256, max(4 * context, 131072), 200).astype(int))
    curves = [("full cache, fp16", full, 16, 0), (f"ring of {window:,}, fp16", ring, 16, 0),
              (f"ring of {window:,}, {bits:g} bits + {side_bits_per_vector:g}/vector", ring, bits,
               side_bits_per_vector)]
    fig, ax = figure(width=6.8, height=3.6)
    for i, (label, geom, b, s) in enumerate(curves):
        ys = [memory.kv_cache_bytes(geom, int(t), b, s) / MB for t in ts]
        at = memory.kv_cache_bytes(geom, context, b, s) / MB
        ax.plot(ts, ys, color=COLORS[i], label=f"{label}: {at:,.1f} MB at {context:,}")
        ax.plot([context], [at], "o", color=COLORS[i], ms=5)
    ax.axvline(context, c="gray", lw=0.6)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("KV cache, 8 attention layers (MB)")
    ax.legend(fontsize=7, frameon=False, loc="upper left")
    fig.tight_layout()
    return fig
