"""One figure style for the book, and widgets that wrap pure plotting functions.

Every widget wraps a ``plot_*(...)`` function; the book also calls that function once at
the widget's default values, so the static HTML shows the figure (Python callbacks do not
run there).
"""
from __future__ import annotations

import matplotlib.pyplot as plt

__all__ = ["COLORS", "figure", "interact", "table", "GB", "MB"]

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf", "#7f7f7f"]
MB = 1e6
GB = 1e9


def figure(ncols: int = 1, nrows: int = 1, width: float = 6.4, height: float = 3.6, **kw):
    """A figure in the book's style: fixed size and dpi, light grid, no top/right spines,
    the book's colours. The style is set on the figure and its axes, never in matplotlib's
    global rcParams (a user's settings stay as they were)."""
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), dpi=100, **kw)
    for ax in (axes.flat if hasattr(axes, "flat") else [axes]):
        ax.grid(True, alpha=0.3)
        ax.spines[["top", "right"]].set_visible(False)
        ax.set_prop_cycle(color=COLORS)
    return fig, axes


def interact(plot_fn, **controls):
    """``ipywidgets.interact`` over ``plot_fn``; closes each figure after showing it."""
    import ipywidgets as widgets
    from IPython.display import display

    def show(**kw):
        fig = plot_fn(**kw)
        display(fig)
        plt.close(fig)

    return widgets.interact(show, **controls)


def table(rows, headers, floatfmt: str = ".4g") -> str:
    """A plain-text table (monospace columns) for printing measured results."""
    def fmt(v):
        if isinstance(v, bool):
            return str(v)
        if isinstance(v, float):
            return format(v, floatfmt)
        if isinstance(v, int):
            return f"{v:,}"
        return str(v)
    cells = [[fmt(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda r: "  ".join(s.rjust(w) for s, w in zip(r, widths))
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])
