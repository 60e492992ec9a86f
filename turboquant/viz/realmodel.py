"""Chapter 9 figures: the memory–quality frontier and per-layer fidelity on a real model."""
from __future__ import annotations

import numpy as np

from .cache import best_within
from .style import COLORS, figure


# One colour per family of ``FAMILY_ORDER`` (no two share one), in that order; a family the
# suite does not know repeats a colour, with another marker.
FAMILY_COLORS = COLORS + ["#e377c2", "#bcbd22", "#393b79", "#ad494a", "#637939", "#843c39",
                          "#6baed6", "#7b4173", "#8ca252", "#e7ba52", "#ce6dbd", "#00796b",
                          "#3f51b5", "#252525", "#fd8d3c", "#9e0142"]

MARKERS = "os^Dv<>p"            # a family's marker: MARKERS[family_index(family) % 8]
REFERENCE_COLOR = "#b0b0b0"     # the exact cache where a figure draws it beside the families

# The families of ``suite.CONFIGS`` in the order that fixes their colours and markers: sorted
# as they were when the figures were first drawn, newer families appended (so that a new
# family changes no existing family's colour).
FAMILY_ORDER = (
    "FibQuant", "KIVI-style", "KVQuant-style", "PolarQuant", "TurboQuant_mse", "TurboQuant_prod", "asymmetric",
    "budget (centered keys + sink)", "calibrated transform coding", "calibrated transform coding (ablation)",
    "calibrated transform coding (levers)", "centered", "mlx-lm affine", "outlier split", "per-vector uniform",
    "profile (make_prompt_cache(bits=…, profile=True))", "recent window", "rotated affine", "split channels",
    "budget, keys before RoPE (lever)", "budget, key mean before RoPE (lever)", "KVQuant-style, keys before RoPE",
    "profile, one half exact (diagnosis)", "one half from each of two caches (diagnosis)",
)


def family_index(family: str) -> int:
    """A family's fixed place in ``FAMILY_ORDER``, so that one family keeps its colour and
    marker in every figure, whichever families a figure shows. A family the suite does not
    know goes after them, in a place fixed by its name."""
    if family in FAMILY_ORDER:
        return FAMILY_ORDER.index(family)
    return len(FAMILY_ORDER) + sum(map(ord, family)) % 8


def plot_ppl_frontier(rows, title: str = "", budget: float | None = None, intervals: dict | None = None,
                      goals: dict | None = None, labels: dict | None = None, dodge: float = 0.0):
    """Perplexity increase (%) against bits per coordinate (side information included);
    ``rows`` = [(name, family, bits, ppl, increase %)] as ``suite.frontier_rows`` returns.
    One colour and marker per family, the same in every figure (``family_index``). ``intervals`` maps a name to the
    (lo, hi) 95 % interval of its increase (``suite.intervals_of``): drawn as error bars.
    ``goals`` maps a budget in bits to the largest increase allowed within it
    (``budget.GOALS``): drawn as labelled steps. The y axis is linear within ±1 % and
    logarithmic beyond, so negative changes show. With ``budget``, a line at that many bits
    and the best configuration within it circled and named in the title. ``labels`` maps a
    family to the legend's words for it (default: the family's name). ``dodge`` > 0 draws the
    points of families that share an abscissa side by side, ``dodge`` bits apart, in the
    legend's order (the bits the axis reads are then those of the group's centre)."""
    if dodge < 0:
        raise ValueError(f"dodge must be ≥ 0 bits, got {dodge}")
    fig, ax = figure(width=7.0, height=5.0)
    fams = sorted({r[1] for r in rows if r[1] != "reference"}, key=family_index)
    shift = {}
    if dodge:
        at: dict = {}
        for fam in fams:
            for x in sorted({round(r[2], 6) for r in rows if r[1] == fam}):
                at.setdefault(x, []).append(fam)
        shift = {(fam, x): (j - (len(group) - 1) / 2) * dodge for x, group in at.items()
                 for j, fam in enumerate(group)}
    for fam in fams:
        i = family_index(fam)
        mine = [r for r in rows if r[1] == fam]
        x = [r[2] + shift.get((fam, round(r[2], 6)), 0.0) for r in mine]
        y = [r[4] for r in mine]
        color = FAMILY_COLORS[i % len(FAMILY_COLORS)]
        marker = MARKERS[i % len(MARKERS)]
        if intervals:
            lo = [max(r[4] - intervals[r[0]][0], 0.0) if r[0] in intervals else 0.0 for r in mine]
            hi = [max(intervals[r[0]][1] - r[4], 0.0) if r[0] in intervals else 0.0 for r in mine]
            ax.errorbar(x, y, yerr=[lo, hi], fmt="none", ecolor=color, elinewidth=1.0, capsize=2.5, alpha=0.8)
        ax.scatter(x, y, s=30, color=color, label=(labels or {}).get(fam, fam), marker=marker, zorder=3)
    ax.set_yscale("symlog", linthresh=1.0)
    ax.axhline(0, c="k", lw=0.6)
    for bits, limit in sorted((goals or {}).items()):
        ax.hlines(limit, min(r[2] for r in rows) - 0.25, bits, colors="k",
                  lw=0.9, ls="--")
        ax.vlines(bits, 0, limit, colors="k", lw=0.6, ls=":")
        ax.annotate(f"goal: ≤ {limit:+g} % within {bits:g} bits", (bits, limit), xytext=(3, 3),
                    textcoords="offset points", fontsize=7)
    ax.set_xlabel("bits per coordinate (K and V averaged, side information included)")
    ax.set_ylabel("perplexity increase over fp32 (%)")
    if budget is not None:
        best = best_within([(r[0], r[2], r[4]) for r in rows if r[1] != "reference"], budget)
        ax.axvline(budget, c="k", lw=1.0, ls="--")
        if best:
            ax.scatter([best[1]], [best[2]], s=170, facecolors="none", edgecolors="k", lw=1.2, zorder=4)
            title = f"{title}\nwithin {budget:g} bits: {best[0]} ({best[1]:.3g} bits) at {best[2]:+.2f} %"
        else:
            title = f"{title}\nno configuration within {budget:g} bits"
    if title:
        ax.set_title(title.strip(), fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, frameon=False)
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


def plot_window_increases(result: dict, names, title: str = ""):
    """Per-window perplexity increase (%) of each configuration in ``names`` (rows of
    ``suite.evaluate``'s ``result`` with their "per_window" sums; seeds averaged), one line
    each, against the scoring window: windows that are hard for one cache are hard for the
    others, which is why a paired difference is narrower than two intervals side by side."""
    from ..evaluation.intervals import increase
    rows = result["results"]
    lacking = [x for x in ("fp32", *names) if "per_window" not in rows.get(x, {})]
    if lacking:
        raise ValueError(f"{lacking} have no per-window sums in this result (missing, or recorded before them)")
    n = np.asarray(rows["fp32"]["per_window"]["n"], dtype=np.float64)
    ref = np.asarray(rows["fp32"]["per_window"]["nll"], dtype=np.float64).reshape(-1, len(n))
    fig, ax = figure(width=7.0, height=3.4)
    for i, name in enumerate(names):
        nll = np.asarray(rows[name]["per_window"]["nll"], dtype=np.float64).reshape(-1, len(n))
        inc = increase(nll.mean(0), ref.mean(0), n)
        ax.plot(np.arange(len(n)), inc, "o-", ms=3.5, color=COLORS[i % len(COLORS)], label=name)
    ax.axhline(0, c="k", lw=0.6)
    window = result.get("setup", {}).get("window")
    ax.set_xlabel(f"scoring window ({window} tokens each)" if window else "scoring window")
    ax.set_ylabel("perplexity increase in the window (%)")
    if title:
        ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def plot_needle_grid(record: dict, names=None, groups: dict | None = None, reference: str = "fp32",
                     labels: dict | None = None):
    """Needle retrieval from a recorded grid (``needles.needle_grid``): one panel per context
    length, the success rate against the needle's depth for each configuration (``names``,
    in that order; default every row of the grid), with its
    95 % Wilson interval as an error bar (points shifted sideways a little so they do not
    hide one another). A panel shows the configurations measured at every depth of its
    context (each keeps its colour across panels); contexts with fewer than two such are left out.

    ``groups`` (instead of ``names``) maps a title to the rows to draw together, e.g. one
    budget: one row of panels per group, ``reference`` (when the grid has it) drawn in every
    row as a wide light-grey band (``REFERENCE_COLOR``), each configuration in its family's
    colour and marker (``family_index``), so that one legend of families, below the panels,
    serves every row; ``labels`` maps a family to the legend's words for it."""
    results = record["results"]
    if groups is not None:
        if names is not None:
            raise ValueError("give names or groups, not both")
        if not groups or not all(groups.values()):
            raise ValueError(f"groups must map each title to at least one row of the grid, got {groups!r}")
        names = [n for ns in groups.values() for n in ns]
    if names is not None:
        missing = [n for n in names if n not in results]
        if missing or not names:
            raise ValueError(f"names must be rows of the grid ({sorted(results)}), got {missing or names}")
    rows = ([(None, list(names or results))] if groups is None else
            [(title, ([reference] if reference in results and reference not in ns else []) + list(ns))
             for title, ns in groups.items()])
    shown = {n for _, ns in rows for n in ns}
    results = {n: r for n, r in results.items() if n in shown}
    depths = sorted({c["depth"] for r in results.values() for c in r["cells"]})

    def measured(name, context):
        return {c["depth"] for c in results[name]["cells"] if c["context"] == context} >= set(depths)
    contexts = sorted({c["context"] for r in results.values() for c in r["cells"]})
    contexts = [x for x in contexts if sum(measured(n, x) for n in results) >= 2]
    if not contexts:
        raise ValueError("the grid has no context measured at every depth for two configurations")
    grouped = groups is not None
    fig, axes = figure(ncols=len(contexts), nrows=len(rows), squeeze=False,
                       width=2.5 if grouped else 3.4, height=2.2 if grouped else 4.4)
    for r, (title, ns) in enumerate(rows):
        for ax, context in zip(axes[r], contexts):
            for i, name in enumerate(ns):
                if not measured(name, context):
                    continue
                cells = sorted((c for c in results[name]["cells"] if c["context"] == context),
                               key=lambda c: c["depth"])
                x = np.array([100 * c["depth"] for c in cells]) + (i - (len(ns) - 1) / 2) * 1.6
                y = np.array([c["ok"] / c["n"] for c in cells])
                err = [y - [c["lo"] for c in cells], [c["hi"] for c in cells] - y]
                family = results[name].get("family", name)
                look = dict(fmt="o-", ms=4, lw=1, color=FAMILY_COLORS[i % len(FAMILY_COLORS)])
                if grouped and name == reference:            # a wide light band under the others
                    look = dict(fmt="-", lw=4, elinewidth=1, alpha=0.6, color=REFERENCE_COLOR, zorder=0)
                elif grouped:
                    at = family_index(family)
                    look.update(fmt=MARKERS[at % len(MARKERS)] + "-", color=FAMILY_COLORS[at % len(FAMILY_COLORS)])
                label = (name if name == reference else (labels or {}).get(family, family) if grouped
                         else f"{name} ({results[name]['bits']:.3g} b)")
                ax.errorbar(x, y, yerr=err, capsize=2, **look, label=label)
            if r == 0:
                ax.set_title(f"{context:,} tokens", fontsize=9)
            if r == len(rows) - 1:
                ax.set_xlabel("needle depth (%)" if grouped else "needle depth (% of the context)")
            ax.set_ylim(-0.03, 1.03)
            ax.set_xticks(sorted({100 * c["depth"] for v in results.values() for c in v["cells"]}))
            if grouped and not any(measured(n, context) for n in ns if n != reference):
                ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", va="center",
                        fontsize=8, color="0.4")
        axes[r][0].set_ylabel(f"{title}\nneedles found" if grouped else "needles found (95 % Wilson interval)")
    legend = {}                                     # one legend for the panels, below them, off the data
    for ax in axes.flat:                            # ungrouped: one row of panels
        for h, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, h)
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=min(3, len(legend)),
               fontsize=8 if grouped else 7, frameon=False)
    rows_of_legend = -(-len(legend) // 3)
    fig.tight_layout(rect=(0, (0.02 + 0.028 * rows_of_legend) if grouped else 0.08 + 0.035 * rows_of_legend, 1, 1))
    return fig


def _reading_rows(record: dict, names) -> list:
    """``names`` as a list, each a row of a needle reading ``record`` (else ``ValueError``)."""
    results, names = record["results"], list(names)
    missing = [n for n in names if n not in results]
    if missing or not names:
        raise ValueError(f"names must be rows of the record ({sorted(results)}), got {missing or names}")
    return names


def plot_needle_reading(record: dict, names=None):
    """Where the answer reads the needle (``needles.needle_reading``): per layer, the attention
    the answer's queries give the code's tokens, summed over query heads and averaged over the
    recorded codes, one line per configuration (``names``, in that order; default every row)."""
    names = _reading_rows(record, list(record["results"]) if names is None else names)
    from ..needles import reading_mass
    fig, ax = figure(width=7.0, height=3.4)
    for i, name in enumerate(names):
        mass = reading_mass(record, name)
        ax.plot(np.arange(len(mass)), mass, "o-" if name == "fp32" else ".-", ms=4, lw=1.6 if name == "fp32" else 1,
                color="black" if name == "fp32" else FAMILY_COLORS[i % len(FAMILY_COLORS)], label=name)
    ax.set_xlabel("layer")
    ax.set_ylabel("attention on the code's tokens\n(summed over heads)")
    s = record["setup"]
    ax.set_title(f"{s['context']:,} tokens, needle at {s['depth']:.0%} depth, {s['values']} codes", fontsize=9)
    ax.legend(fontsize=7, frameon=False, loc="upper left")
    fig.tight_layout()
    return fig


def plot_value_noise(record: dict, names=None):
    """What each configuration's value coding changes in the answer's attention output, layer by
    layer, in a needle reading (``needles.value_noise``): measured (solid) and what independent,
    mean-zero errors of the same size would give (dashed). One colour per configuration
    (``names``, in that order; default every row whose values are coded)."""
    from ..needles import value_noise
    results = record["results"]
    if names is None:                  # rows that recorded the value measures and whose values are coded
        names = [n for n, r in results.items() if all("value_noise" in t and "value_incoherent" in t
                                                         for t in r["trials"]) and np.any(value_noise(record, n)[0] > 0)]
        if not names:
            raise ValueError("no row of the record has coded values with the value measures recorded; "
                             f"rows: {sorted(results)}")
    names = _reading_rows(record, names)
    fig, ax = figure(width=7.0, height=3.4)
    for i, name in enumerate(names):
        measured, independent = value_noise(record, name)
        colour = FAMILY_COLORS[i % len(FAMILY_COLORS)]
        layers = np.arange(len(measured))
        ax.plot(layers, measured, ".-", ms=4, lw=1.2, color=colour, label=f"{name}: measured")
        ax.plot(layers, independent, "--", lw=1, color=colour, label=f"{name}: were the errors independent")
    ax.set_xlabel("layer")
    ax.set_ylabel("change of the attention output\n÷ its size")
    s = record["setup"]
    ax.set_title(f"value error in the answer's attention output: {s['context']:,} tokens, "
                 f"needle at {s['depth']:.0%} depth, {s['values']} codes", fontsize=9)
    ax.legend(fontsize=7, frameon=False, loc="upper right")
    fig.tight_layout()
    return fig


def plot_key_channels(raw: list, rotated: list, layer: int = 0, title: str = ""):
    """One layer's key channels (``evaluation.channel_profile`` per layer, ``raw`` and
    ``rotated``): each channel's RMS of the unit key's coordinate, before and after the
    rotation, on a log axis with 1/√D marked (every channel's RMS when the directions are
    spread evenly)."""
    if not 0 <= layer < len(raw) or len(raw) != len(rotated):
        raise ValueError(f"layer must lie in [0, {len(raw) - 1}] and raw/rotated have one profile per layer, "
                         f"got layer {layer}, {len(raw)} and {len(rotated)} profiles")
    D = len(raw[layer]["rms"])
    fig, ax = figure(width=7.0, height=3.2)
    ax.semilogy(raw[layer]["rms"], ".", label="raw channels")
    ax.semilogy(rotated[layer]["rms"], ".", label="after a random rotation")
    ax.axhline(1 / np.sqrt(D), color="0.4", lw=1, ls="--", label="1/√D")
    ax.set_xlabel("channel")
    ax.set_ylabel("RMS of the unit key's coordinate")
    ax.set_title(f"{title}layer {layer}: peak/median {raw[layer]['peak_to_median']:.0f} raw, "
                 f"{rotated[layer]['peak_to_median']:.1f} rotated", fontsize=9)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
    fig.tight_layout()                                      # the axis label and the legend inside the figure
    return fig
