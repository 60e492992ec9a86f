"""Performance chapter figures: bytes per decode step, the roofline, measured speed-ups."""
from __future__ import annotations

import numpy as np

from ..roofline import bound_speedup, crossover_context, decode_step_bytes
from .style import COLORS, MB, figure

__all__ = ["plot_step_bytes", "plot_roofline", "plot_decode_speedups"]


def plot_step_bytes(geometry: str, weight_bytes: float, context: int = 8192,
                    widths=((32, 0, "fp32"), (16, 0, "bf16"), (4, 16, "4-bit + norm"), (2, 16, "2-bit + norm"))):
    """Bytes one decode step reads at ``context``: weights and cache, one bar per cache
    width (bits, side bits per vector, label), with the bound on the speed-up over the
    first width written above each bar."""
    fig, ax = figure(width=6.4, height=3.4)
    x = np.arange(len(widths))
    steps = [decode_step_bytes(geometry, weight_bytes, context, b, s) for b, s, _ in widths]
    ax.bar(x, [s["weights"] / MB for s in steps], color=COLORS[7], label="weights")
    ax.bar(x, [s["cache"] / MB for s in steps], bottom=[s["weights"] / MB for s in steps], color=COLORS[0],
           label="KV cache")
    base_bits = widths[0][0]
    for i, (b, s, _) in enumerate(widths):
        up = bound_speedup(geometry, weight_bytes, context, b, s, base_bits=base_bits)
        ax.text(i, steps[i]["total"] / MB, f"≤{up:.2f}x", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(x, [w[2] for w in widths])
    ax.set_ylabel("MB read per decode step")
    t_star = crossover_context(geometry, weight_bytes, widths[0][0])
    ax.set_title(f"{geometry}, T = {context:,}: the {widths[0][2]} cache outweighs the weights "
                 f"from T ≈ {t_star:,.0f}", fontsize=10)
    ax.legend(frameon=False, loc="upper right")
    fig.tight_layout()
    return fig


def plot_roofline(peak_gflops: float, bandwidth_gb_s: float, points: dict):
    """The roofline min(peak, β·I) and measured kernels as points: ``points`` maps a name
    to (FLOPs per byte read, measured GFLOP/s)."""
    fig, ax = figure(width=6.4, height=3.6)
    lo = min([0.05] + [p[0] / 2 for p in points.values()])
    hi = max([4 * peak_gflops / bandwidth_gb_s] + [2 * p[0] for p in points.values()])
    i = np.geomspace(lo, hi, 200)
    ax.loglog(i, np.minimum(peak_gflops, bandwidth_gb_s * i), c="k", lw=1.5, label="roofline (measured β, peak)")
    for n, (name, (intensity, gflops)) in enumerate(points.items()):
        ax.loglog([intensity], [gflops], "o", c=COLORS[n % len(COLORS)], label=name)
    ax.set_xlabel("arithmetic intensity (FLOPs per byte read)")
    ax.set_ylabel("GFLOP/s")
    ax.legend(frameon=False, fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def plot_decode_speedups(rows, headers):
    """Speed-up over fp32 SDPA against T, one line per codec of the default path, and
    mlx-lm's 4-bit cache dashed (rows and headers of ``bench.decode_attention_rows``)."""
    h = {name: i for i, name in enumerate(headers)}
    fig, ax = figure(width=6.4, height=3.6)
    codecs = []
    for r in rows:
        label = f"{r[h['codec']]} {r[h['bits']]:.3g}b"
        if label not in codecs:
            codecs.append(label)
    for n, label in enumerate(codecs):
        pts = [(r[h["T"]], r[h["from codes (default)"]]) for r in rows if f"{r[h['codec']]} {r[h['bits']]:.3g}b" == label]
        ax.semilogx(*zip(*pts), "o-", c=COLORS[n], label=f"from codes: {label}")
    q4 = {}
    for r in rows:
        q4.setdefault(r[h["T"]], []).append(r[h["mlx-lm q4"]])
    ax.semilogx(list(q4), [float(np.median(v)) for v in q4.values()], "s--", c=COLORS[7], label="mlx-lm q4")
    ax.axhline(1.0, c="k", lw=1)
    ax.set_xlabel("cached tokens T")
    ax.set_ylabel("speed-up over fp32 SDPA")
    ax.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    return fig
