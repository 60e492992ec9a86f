"""One figure style for the book, and widgets that wrap pure plotting functions.

Every widget wraps a ``plot_*(...)`` function and is displayed together with the figure at
its starting values, so the static HTML book (where no Python runs) shows that figure.
"""
from __future__ import annotations

import matplotlib.pyplot as plt

__all__ = ["COLORS", "figure", "interact", "table", "Table", "below", "GB", "MB"]

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


class _FigureWidget:
    """One output with two renderings: the live widget (JupyterLab, a running kernel) and the
    figure at the widget's current setting as a PNG (static HTML, where no Python runs).

    A front-end shows the richest type it can render: JupyterLab the widget view, the book
    (``nb_mime_priority_overrides`` in ``_config.yml``) the PNG. Nothing needs the network.
    """

    def __init__(self, widget, png: bytes):
        self.widget, self.png = widget, png

    def _repr_mimebundle_(self, include=None, exclude=None):
        import base64
        bundle = dict(self.widget._repr_mimebundle_(include=include, exclude=exclude) or {})
        bundle["image/png"] = base64.b64encode(self.png).decode("ascii")
        bundle.setdefault("text/plain", f"<figure widget over {', '.join(self.widget.kwargs)}>")
        return bundle


def interact(plot_fn, /, *, initial: dict | None = None, **controls):
    """``ipywidgets.interactive`` over ``plot_fn``, displayed with a static fallback.

    ``controls`` are ipywidgets abbreviations (``(lo, hi, step)`` for a slider, a list for a
    drop-down). ``initial`` sets the starting values (default: ipywidgets' own choice) — the
    static figure the book shows is the one at these values; a slider's starting value must lie
    on its steps. Each figure is closed after it is shown. Returns the ``interactive`` widget
    (its ``.kwargs`` are the current values): end the notebook line with ``;``, or the widget
    is displayed a second time. An error while drawing the starting figure is raised as
    ``RuntimeError`` from the plot function's own exception.
    """
    import io

    import ipywidgets as widgets
    from IPython.display import Image, display

    unknown = sorted(set(initial or {}) - set(controls))
    if unknown:
        raise ValueError(f"initial values for unknown controls {unknown}; controls are {sorted(controls)}")
    last: dict = {}

    def show(**kw):
        try:
            fig = plot_fn(**kw)
        except Exception as e:          # ipywidgets would only print or log it
            last["error"] = e
            raise
        try:
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=fig.dpi)
        finally:
            plt.close(fig)
        last["png"] = buf.getvalue()
        display(Image(data=last["png"]))

    controls = {name: (widgets.interactive.widget_from_abbrev(abbrev, initial[name])
                       if name in (initial or {}) else abbrev) for name, abbrev in controls.items()}
    for name, value in (initial or {}).items():
        c = controls[name]
        off_grid = (hasattr(c, "step") and isinstance(c.step, (int, float)) and c.step > 0
                    and abs((value - c.min) / c.step - round((value - c.min) / c.step)) > 1e-9)
        if c.value != value or off_grid:
            raise ValueError(f"initial value {name}={value!r} is not a setting of its control "
                             f"(it would start at {c.value!r}"
                             + (f"; its steps are {c.min} + k·{c.step})" if off_grid else ")"))
    w = widgets.interactive(show, **controls)      # draws once: last["png"] is the start figure
    if "png" not in last:
        raise RuntimeError(f"{getattr(plot_fn, '__name__', plot_fn)!s} failed to draw its starting "
                           f"figure at {w.kwargs}") from last.get("error")
    for control in w.children:                      # redraw when a slider is released
        if hasattr(control, "continuous_update"):
            control.continuous_update = False
    display(_FigureWidget(w, last["png"]))
    return w


def below(value: float, bound: float = 1e-6) -> str:
    """A measured difference as what it guarantees: ``"< 1e-06"`` when it is under
    ``bound``, else the value (2 significant digits). Float32 round-off differences below
    the bound change with the CPU, BLAS path and summation order; the verdict does not."""
    value = float(value)
    if value != value:                                   # NaN: never "below"
        return "nan"
    return f"< {bound:.0e}" if abs(value) < bound else f"{value:.2g}"


class Table(str):
    """A measured-results table: the plain-text columns (it *is* that string, so ``print``,
    f-strings and the CLI see monospace columns) that a notebook renders as an HTML table
    (``display(table(...))`` or a cell's last expression: ``_repr_markdown_``).

    ``rows`` are the formatted cells (lists of str), ``headers`` the column names and
    ``numeric`` which columns hold only numbers (right-aligned in both renderings)."""

    def __new__(cls, text: str, headers, rows, numeric):
        self = super().__new__(cls, text)
        self.headers, self.rows, self.numeric = list(headers), [list(r) for r in rows], list(numeric)
        return self

    def _repr_pretty_(self, p, cycle):            # text/plain: the columns, not a quoted repr
        p.text(str(self))

    def _repr_markdown_(self) -> str:
        line = lambda cells: "| " + " | ".join(_md_cell(c) for c in cells) + " |"
        rule = "|" + "|".join("---:" if n else ":---" for n in self.numeric) + "|"
        return "\n".join([line(self.headers), rule, *map(line, self.rows)])


_MD_SPECIAL = str.maketrans({c: "\\" + c for c in "\\|*_[]<>`#"})


def _md_cell(text: str) -> str:
    """One table cell as Markdown source that renders as the literal text (an empty cell as
    a non-breaking space, so the row keeps its shape)."""
    text = str(text).replace("\n", " ").translate(_MD_SPECIAL)
    return text if text.strip() else "\u00a0"


def table(rows, headers, floatfmt: str = ".4g") -> Table:
    """Measured results as a :class:`Table`: printed, monospace columns; displayed in a
    notebook, an HTML table (so a wide table wraps to the page instead of scrolling).

    ``rows``: sequences of cells, one per header; floats are formatted with ``floatfmt``,
    ints with thousands separators, bools and everything else with ``str``."""
    headers = [str(h) for h in headers]
    rows = [tuple(r) for r in rows]
    bad = [i for i, r in enumerate(rows) if len(r) != len(headers)]
    if bad:
        raise ValueError(f"row {bad[0]} has {len(rows[bad[0]])} cells, the headers "
                         f"{len(headers)} ({headers})")

    def fmt(v):
        if isinstance(v, bool):
            return str(v)
        if isinstance(v, float):
            return format(v, floatfmt)
        if isinstance(v, int):
            return f"{v:,}"
        return str(v)
    cells = [[fmt(v) for v in r] for r in rows]
    numeric = [bool(rows) and all(isinstance(r[i], (int, float)) and not isinstance(r[i], bool)
                                  for r in rows) for i in range(len(headers))]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda r: "  ".join(s.rjust(w) for s, w in zip(r, widths))
    text = "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])
    return Table(text, headers, cells, numeric)
