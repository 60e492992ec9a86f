"""Chapter 1 figures: KV-cache memory against context."""
from __future__ import annotations

import matplotlib
import numpy as np

from ..memory import PRESETS, kv_cache_bytes
from .style import GB, MB, figure

MACBOOK_AIR_BYTES = 16 * 2**30  # a 16 GB MacBook Air: 16 GiB of unified memory


def _contexts(lo: int = 512, hi: int = 1 << 20, n: int = 64):
    return np.unique(np.geomspace(lo, hi, n).astype(int))


def plot_kv_memory(presets=None, bit_widths=(16, 8, 4, 3, 2), max_context: int = 1 << 20):
    """KV-cache bytes against context, one panel per preset, one line per bit-width.

    Payload bits only (no side information), batch 1; the dashed line is 16 GB.
    """
    names = list(presets or PRESETS)
    ncols = 3
    nrows = -(-len(names) // ncols)
    fig, axes = figure(ncols, nrows, width=3.4, height=2.8, squeeze=False)
    ctx = _contexts(hi=max_context)
    for ax, name in zip(axes.flat, names):
        for b in bit_widths:
            ax.loglog(ctx, [kv_cache_bytes(name, int(t), bits=b) / GB for t in ctx], label=f"{b} bits")
        ax.axhline(MACBOOK_AIR_BYTES / GB, ls="--", c="k", lw=1)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("context T (tokens)")
        ax.set_ylabel("KV cache (GB)")
    for ax in axes.flat[len(names):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    handles.append(matplotlib.lines.Line2D([], [], ls="--", c="k", lw=1))
    labels.append("16 GiB MacBook Air")
    (axes.flat[-1] if len(names) % ncols else fig).legend(handles, labels, loc="center", frameon=False)
    fig.tight_layout()
    return fig


def plot_kv_calculator(preset: str = "llama-3.1-8b", context: int = 32768, bits: float = 4,
                       side_bits_per_vector: float = 16):
    """One preset's KV memory against context at ``bits`` (+ side bits) and at fp16,
    with the chosen context marked and its size written on the figure."""
    g = PRESETS[preset]
    fig, ax = figure(width=6.4, height=3.4)
    ctx = _contexts(hi=max(1 << 20, context))
    fp16 = [kv_cache_bytes(g, int(t), 16) / GB for t in ctx]
    q = [kv_cache_bytes(g, int(t), bits, side_bits_per_vector) / GB for t in ctx]
    ax.loglog(ctx, fp16, label="fp16")
    ax.loglog(ctx, q, label=f"{bits:g} bits + {side_bits_per_vector:g} side bits/vector")
    ax.axhline(MACBOOK_AIR_BYTES / GB, ls="--", c="k", lw=1, label="16 GiB MacBook Air")
    at16 = kv_cache_bytes(g, context, 16)
    atq = kv_cache_bytes(g, context, bits, side_bits_per_vector)
    ax.plot([context, context], [atq / GB, at16 / GB], "o", c="k")
    ax.set_title(f"{preset} at T={context:,}: {at16 / MB:,.1f} MB fp16 -> {atq / MB:,.1f} MB "
                 f"({at16 / atq:.2f}x)", fontsize=10)
    ax.set_xlabel("context T (tokens)")
    ax.set_ylabel("KV cache (GB)")
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


