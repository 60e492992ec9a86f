"""Widgets with a static figure, the figures added for Chapters 7–9, and the book's own
Sphinx extensions (execution status, offline fixes)."""
import base64
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from turboquant import memory  # noqa: E402
from turboquant.viz import (best_within, interact, lower_edge, plot_cache_tradeoff,  # noqa: E402
                            plot_ppl_frontier, plot_window_memory)
from turboquant.viz.style import figure  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "book" / "_ext"))
from exec_status import chapter_status  # noqa: E402


def _line(a=1, label="x"):
    fig, ax = figure()
    ax.plot([0, a])
    ax.set_title(label)
    return fig


def _shown(monkeypatch):
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda *objs, **kw: shown.extend(objs))
    return shown


def test_interact_displays_one_output_with_the_widget_and_the_start_figure(monkeypatch):
    shown = _shown(monkeypatch)
    calls = []

    def plot(a=1, label="x"):
        calls.append((a, label))
        return _line(a, label)

    open_before = set(plt.get_fignums())
    w = interact(plot, a=(1, 5), label=["x", "y"], initial={"a": 3, "label": "y"})
    assert calls == [(3, "y")]                       # drawn once, at the starting values
    assert w.kwargs == {"a": 3, "label": "y"}
    bundle = shown[-1]._repr_mimebundle_()
    assert {"application/vnd.jupyter.widget-view+json", "image/png", "text/plain"} <= set(bundle)
    png = base64.b64decode(bundle["image/png"])
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert all(getattr(c, "continuous_update", False) is False for c in w.children
               if hasattr(c, "continuous_update"))
    assert set(plt.get_fignums()) == open_before     # every figure closed after it was shown


def test_interact_starts_where_ipywidgets_would_without_initial(monkeypatch):
    _shown(monkeypatch)
    w = interact(_line, a=(1, 5), label=["x", "y"])
    assert w.kwargs == {"a": 3, "label": "x"}


@pytest.mark.parametrize("initial, match", [({"b": 1}, "unknown controls"), ({"a": 9}, "a=9"),
                                            ({"label": "z"}, "label='z'")])
def test_interact_refuses_a_start_its_controls_cannot_show(monkeypatch, initial, match):
    _shown(monkeypatch)
    with pytest.raises(ValueError, match=match):
        interact(_line, a=(1, 5), label=["x", "y"], initial=initial)


def test_interact_refuses_a_slider_start_between_its_steps(monkeypatch):
    _shown(monkeypatch)
    with pytest.raises(ValueError, match="steps are 1.0"):
        interact(lambda budget: _line(budget), budget=(1.0, 9.0, 0.125), initial={"budget": 4.3})
    interact(lambda budget: _line(budget), budget=(1.0, 9.0, 0.125), initial={"budget": 4.25})


def test_interact_names_the_plot_that_failed_and_keeps_its_error(monkeypatch):
    _shown(monkeypatch)

    def broken(a=1):
        raise ZeroDivisionError("no figure")

    open_before = set(plt.get_fignums())
    with pytest.raises(RuntimeError, match="broken failed to draw") as info:
        interact(broken, a=(1, 5))
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert set(plt.get_fignums()) == open_before


ROWS = [("tq 1", 1.1, 0.7), ("tq 2", 2.1, 0.45), ("fib 2.6", 2.6, 0.33), ("prod 2.2", 2.2, 1.3),
        ("tq 3", 3.1, 0.26), ("polar 3.9", 3.9, 0.25), ("tq 4", 4.1, 0.14), ("aff 4.5", 4.5, 0.13)]


def test_best_within_a_budget():
    assert best_within(ROWS, 4.25)[0] == "tq 4"
    assert best_within(ROWS, 2.5)[0] == "tq 2"
    assert best_within(ROWS, 1.0) is None


def test_lower_edge_drops_every_dominated_cache_and_keeps_the_rest():
    edge = [r[0] for r in lower_edge(ROWS)]
    assert edge == ["tq 1", "tq 2", "fib 2.6", "tq 3", "polar 3.9", "tq 4", "aff 4.5"]
    assert "prod 2.2" not in edge
    assert lower_edge([("a", 1, 1), ("b", 1, 1)]) == [("a", 1, 1), ("b", 1, 1)]   # ties both stay


def test_cache_tradeoff_titles_the_best_cache_or_says_none_fits():
    fig = plot_cache_tradeoff(ROWS, 4.25)
    assert "tq 4" in fig.axes[0].get_title() and "3.9×" in fig.axes[0].get_title()
    plt.close(fig)
    fig = plot_cache_tradeoff(ROWS, 0.5)
    assert "no cache fits" in fig.axes[0].get_title()
    plt.close(fig)
    with pytest.raises(ValueError, match="empty"):
        plot_cache_tradeoff([], 4)


def test_window_memory_labels_are_the_memory_model():
    fig = plot_window_memory(65536, 4, 16, 4096)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    plt.close(fig)
    g = memory.PRESETS["bit-axon"]
    assert f"{memory.kv_cache_bytes(g, 65536, 4, 16) / 1e6:,.1f} MB" in labels[2]   # the preset's own ring
    assert f"{memory.kv_cache_bytes(g, 65536) / 1e6:,.1f} MB" in labels[1]
    assert labels[0].startswith("full cache") and "5,368.7 MB" in labels[0]


def test_frontier_with_a_budget_circles_and_names_the_best():
    rows = [("fp32", "reference", 32, 20.0, 0.0), ("a", "f", 4.25, 20.5, 2.5), ("b", "f", 4.5, 20.2, 1.0),
            ("c", "g", 3.25, 23.0, 15.0)]
    fig = plot_ppl_frontier(rows, "t", budget=4.25)
    assert "within 4.25 bits: a" in fig.axes[0].get_title()
    plt.close(fig)
    fig = plot_ppl_frontier(rows, "t", budget=2)
    assert "no configuration within 2 bits" in fig.axes[0].get_title()
    plt.close(fig)


def test_frontier_draws_intervals_goals_and_negative_changes():
    from turboquant.budget import GOALS
    rows = [("fp32", "reference", 32, 20.0, 0.0), ("a", "f", 4.25, 19.9, -0.5), ("b", "g", 3.25, 23.0, 15.0)]
    fig = plot_ppl_frontier(rows, "t", intervals={"a": (-1.5, 0.7), "b": (11.0, 18.0)}, goals=GOALS)
    ax = fig.axes[0]
    assert ax.get_yscale() == "symlog" and ax.get_ylim()[0] < -0.5          # the negative change is on the axis
    bars = [c for c in ax.collections if type(c).__name__ == "LineCollection" and len(c.get_segments()) == 1
            and c.get_segments()[0][0][0] == c.get_segments()[0][1][0]]
    spans = sorted(tuple(sorted((s[0][1], s[1][1]))) for c in bars for s in c.get_segments())
    assert (-1.5, 0.7) in [tuple(round(v, 6) for v in s) for s in spans]   # a's error bar is its interval
    labels = [t.get_text() for t in ax.texts]
    assert all(any(f"within {b:g} bits" in t for t in labels) for b in GOALS)
    assert len({tuple(c.get_facecolor()[0]) for c in ax.collections if type(c).__name__ == "PathCollection"}) == 2
    plt.close(fig)


def _nb(tmp_path, cells):
    p = tmp_path / "nb.ipynb"
    p.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return p


def _code(start, end, outputs=(), count=1):
    return {"cell_type": "code", "execution_count": count, "outputs": list(outputs), "source": "x",
            "metadata": {"execution": {"iopub.execute_input": start, "shell.execute_reply": end}}}


def test_chapter_status_reads_execution_stamps(tmp_path):
    st = chapter_status(_nb(tmp_path, [{"cell_type": "markdown", "source": "# t", "metadata": {}},
                                       _code("2026-01-01T10:00:00.000Z", "2026-01-01T10:00:01.500Z"),
                                       _code("2026-01-01T10:00:02.000Z", "2026-01-01T10:00:04.000Z")]))
    assert st["status"] == "ok" and st["cells"] == 2
    assert st["seconds"] == pytest.approx(3.5)
    assert st["last"].isoformat() == "2026-01-01T10:00:04+00:00"


def test_chapter_status_flags_errors_and_unexecuted_cells(tmp_path):
    err = _code("2026-01-01T10:00:00Z", "2026-01-01T10:00:01Z", outputs=[{"output_type": "error"}])
    assert chapter_status(_nb(tmp_path, [err]))["status"] == "error"
    fresh = {"cell_type": "code", "execution_count": None, "outputs": [], "source": "x", "metadata": {}}
    st = chapter_status(_nb(tmp_path, [_code("2026-01-01T10:00:00Z", "2026-01-01T10:00:01Z"), fresh]))
    assert st["status"] == "not executed"


def test_chapter_status_names_a_file_that_is_not_a_notebook(tmp_path):
    bad = tmp_path / "bad.ipynb"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.ipynb"):
        chapter_status(bad)
    stamps = _nb(tmp_path, [_code("yesterday", "2026-01-01T10:00:01Z")])
    with pytest.raises(ValueError, match="nb.ipynb"):
        chapter_status(stamps)


def test_chapter_status_reads_stamps_without_a_time_zone_as_utc(tmp_path):
    st = chapter_status(_nb(tmp_path, [_code("2026-01-01T10:00:00", "2026-01-01T10:00:02Z")]))
    assert st["seconds"] == pytest.approx(2.0) and st["last"].tzinfo is not None


def test_every_committed_chapter_ran_cleanly():
    """What the status page shows for the committed chapters: every one executed, no errors."""
    for nb in sorted((ROOT / "book").glob("ch*.ipynb")):
        st = chapter_status(nb)
        assert st["status"] == "ok", (nb.name, st)


def test_the_book_config_loads_nothing_from_a_cdn():
    """Widgets render as their PNG (no widget manager), MathJax is served locally, Thebe is off."""
    cfg = (ROOT / "_config.yml").read_text()
    assert "nb_ipywidgets_js: {}" in cfg
    assert '["html", "application/vnd.jupyter.widget-view+json", null]' in cfg
    assert "sphinx-mathjax-offline" in cfg and "offline_book" in cfg
    assert "references.bib" in cfg and (ROOT / "references.bib").is_file()


def test_window_increases_plot_one_line_per_configuration_at_each_windows_increase():
    import numpy as np
    from turboquant.viz import plot_window_increases
    n = [100.0, 100.0, 50.0]
    ref = [300.0, 310.0, 150.0]
    result = {"results": {"fp32": {"per_window": {"nll": ref, "n": n}},
                          "a": {"per_window": {"nll": [[301.0, 312.0, 150.5], [303.0, 312.0, 150.5]], "n": n}}}}
    fig = plot_window_increases(result, ["a"])
    (line,) = fig.axes[0].get_lines()[:1]
    want = 100 * (np.exp((np.array([302.0, 312.0, 150.5]) - ref) / n) - 1)   # seeds averaged first
    assert np.allclose(line.get_ydata(), want)
    plt.close(fig)


def test_frontier_legend_words_and_points_that_share_an_abscissa_side_by_side():
    rows = [("fp32", "reference", 32, 20.0, 0.0), ("a", "f", 4.125, 20.5, 2.5), ("b", "g", 4.125, 20.2, 1.0),
            ("c", "g", 3.125, 23.0, 15.0), ("d", "h", 4.125, 20.1, 0.5)]
    fig = plot_ppl_frontier(rows, labels={"g": "words for g"}, dodge=0.04)
    ax = fig.axes[0]
    handles, labels = ax.get_legend_handles_labels()
    assert sorted(labels) == ["f", "h", "words for g"]
    shared = [min(h.get_offsets()[:, 0].round(6), key=lambda x: abs(x - 4.125)) for h in handles]
    assert shared == [4.085, 4.125, 4.165]                        # in the legend's order, 0.04 bits apart
    assert 3.125 in handles[labels.index("words for g")].get_offsets()[:, 0]    # alone at 3.125: not moved
    plt.close(fig)
    fig = plot_ppl_frontier(rows)
    assert sorted(fig.axes[0].get_legend_handles_labels()[1]) == ["f", "g", "h"]
    assert {x for h in fig.axes[0].get_legend_handles_labels()[0] for x in h.get_offsets()[:, 0]} == {4.125, 3.125}
    plt.close(fig)
    with pytest.raises(ValueError, match="dodge must be ≥ 0 bits, got -1"):
        plot_ppl_frontier(rows, dodge=-1)


def test_a_family_keeps_its_colour_whichever_families_a_figure_shows():
    from turboquant.viz.realmodel import plot_ppl_frontier
    def colour_of(rows, family):
        fig = plot_ppl_frontier(rows)
        handles, labels = fig.axes[0].get_legend_handles_labels()
        colour = tuple(handles[labels.index(family)].get_facecolor()[0])
        plt.close(fig)
        return colour
    kivi = ("KIVI 4", "KIVI-style", 4.75, 10.0, 1.4)
    both = [kivi, ("TQ-mse 4", "TurboQuant_mse", 4.25, 10.0, 4.3)]
    assert colour_of([kivi], "KIVI-style") == colour_of(both, "KIVI-style")
    assert colour_of(both, "KIVI-style") != colour_of(both, "TurboQuant_mse")


def test_book_diagrams_match_the_table_of_contents():
    """The chapter map's chapters are the book's chapters, every reading path and dependency
    names one of them, and a dependency points backwards."""
    from turboquant.viz.diagrams import CHAPTERS, DEPENDS, READING_PATHS, plot_chapter_map, plot_nibble_lookup, \
        plot_pipeline, plot_polar_tree
    toc = (Path(__file__).resolve().parents[1] / "_toc.yml").read_text()
    stems = {stem for _, stem in CHAPTERS.values()}
    import re
    assert stems == set(re.findall(r"file: book/(ch\d\d_\w+)", toc))
    assert set(DEPENDS) == set(CHAPTERS)
    assert all(d < c for c, deps in DEPENDS.items() for d in deps)
    assert all(set(p) <= set(CHAPTERS) for p in READING_PATHS.values())
    for fig in (plot_chapter_map(), plot_pipeline(), plot_polar_tree(16)):
        assert fig.axes and fig.get_size_inches()[0] > 5
        plt.close(fig)
    with pytest.raises(ValueError, match="dim = 4, 8 or 16"):
        plot_polar_tree(12)
    # the nibble figure draws the package's own packing: byte j holds indices 2j (low), 2j + 1 (high)
    import mlx.core as mx
    from turboquant.packing import pack
    idx = (10, 3, 1, 15, 7, 0, 4, 12)
    fig = plot_nibble_lookup(idx)
    shown = [t.get_text() for t in fig.axes[0].texts if t.get_text().startswith("0x")]
    assert shown == [f"0x{b:02X}" for b in pack(mx.array(idx), 4).tolist()]
    plt.close(fig)
    with pytest.raises(ValueError, match="4-bit indices"):
        plot_nibble_lookup((16, 1))


def test_a_table_prints_as_columns_and_displays_as_an_html_table():
    from IPython.lib.pretty import pretty
    from turboquant.viz import table
    t = table([("a|b", 1.5, 3, True), ("x_y <1", 2.0, 4000, False)], ["name", "v", "n", "ok"])
    text = ("  name    v      n     ok\n"
            "------  ---  -----  -----\n"
            "   a|b  1.5      3   True\n"
            "x_y <1    2  4,000  False")
    assert t == text and str(t) == text and pretty(t) == text   # print / CLI / text/plain
    md = t._repr_markdown_().split("\n")
    assert md[1] == "|:---|---:|---:|:---|"                      # numbers right, bools/text left
    assert md[2] == r"| a\|b | 1.5 | 3 | True |"                 # a '|' in a cell stays one cell
    assert md[3] == r"| x\_y \<1 | 2 | 4,000 | False |"
    assert table([("", 1)], ["gap", "x"])._repr_markdown_().split("\n")[2] == "| \u00a0 | 1 |"
    with pytest.raises(ValueError, match="row 1 has 1 cells, the headers 2"):
        table([(1, 2), (3,)], ["a", "b"])


def test_every_suite_family_has_a_fixed_colour():
    """A family added to the suite must be appended to ``FAMILY_ORDER`` (else it would take a
    place by its name's hash, and could share a colour and marker with a known family); no two
    families of the order share a colour."""
    from turboquant.suite import CONFIGS
    from turboquant.viz.realmodel import FAMILY_COLORS, FAMILY_ORDER, family_index
    families = {c.family for c in CONFIGS.values()} - {"reference"}
    assert families <= set(FAMILY_ORDER), sorted(families - set(FAMILY_ORDER))
    assert len(set(FAMILY_COLORS[:len(FAMILY_ORDER)])) == len(FAMILY_ORDER) <= len(FAMILY_COLORS)
    assert len(set(FAMILY_ORDER)) == len(FAMILY_ORDER)
    assert [family_index(f) for f in FAMILY_ORDER] == list(range(len(FAMILY_ORDER)))
    assert family_index("a family of someone else's") >= len(FAMILY_ORDER)


def test_the_needle_figure_draws_the_contexts_two_configurations_measured():
    from turboquant.viz import plot_needle_grid

    def cells(contexts):
        return [{"context": x, "depth": d, "ok": 10, "n": 20, "lo": 0.3, "hi": 0.7}
                for x in contexts for d in (0.1, 0.9)]
    grid = {"results": {"fp32": {"bits": 32, "cells": cells((1024, 2048))},
                        "a": {"bits": 4, "cells": cells((1024,))},
                        "b": {"bits": 3, "cells": cells((2048,))[:1]}}}      # 2,048: one depth only
    fig = plot_needle_grid(grid)
    assert [ax.get_title() for ax in fig.axes] == ["1,024 tokens"]          # 2,048: fp32 alone at every depth
    grid["results"]["b"]["cells"] = cells((2048,))
    fig = plot_needle_grid(grid)
    assert [ax.get_title() for ax in fig.axes] == ["1,024 tokens", "2,048 tokens"]
    assert [len(ax.lines) > 0 for ax in fig.axes] == [True, True]
    fig = plot_needle_grid(grid, ["b", "fp32"])                               # the rows named, in that order
    assert [ax.get_title() for ax in fig.axes] == ["2,048 tokens"]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["b (3 b)", "fp32"]
    with pytest.raises(ValueError, match="names must be rows of the grid .* got \\['c'\\]"):
        plot_needle_grid(grid, ["fp32", "c"])
    grid["results"] = {"fp32": grid["results"]["fp32"]}
    with pytest.raises(ValueError, match="two configurations"):
        plot_needle_grid(grid)


def test_the_needle_reading_figure_draws_each_rows_mass_per_layer():
    import numpy as np

    from turboquant.viz import plot_needle_reading
    trial = lambda m: {"mass": [[m, 0.0], [0.0, 2 * m], [m, m]]}       # 3 layers × 2 heads
    record = {"setup": {"context": 4096, "depth": 0.1, "values": 2},
              "results": {"fp32": {"trials": [trial(0.2), trial(0.4)]}, "a": {"trials": [trial(0.1)]}}}
    fig = plot_needle_reading(record, ["a", "fp32"])
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.lines] == ["a", "fp32"]
    assert np.allclose(ax.lines[1].get_ydata(), [0.3, 0.6, 0.6])       # summed over heads, mean over codes
    assert ax.get_title() == "4,096 tokens, needle at 10% depth, 2 codes"
    with pytest.raises(ValueError, match="names must be rows of the record .* got \\['c'\\]"):
        plot_needle_reading(record, ["fp32", "c"])


def test_the_value_noise_figure_draws_measured_and_independent_per_layer():
    import numpy as np

    from turboquant.needles import value_noise
    from turboquant.viz import plot_value_noise
    trial = lambda n, i: {"value_noise": [n, 2 * n], "value_incoherent": [i, i]}        # 2 layers
    record = {"setup": {"context": 4096, "depth": 0.1, "values": 2},
              "results": {"fp32": {"trials": [trial(0.0, 0.0)] * 2},
                          "a": {"trials": [trial(0.1, 0.05), trial(0.3, 0.05)]},
                          "old": {"trials": [{"mass": [[0.1]]}]}}}
    measured, independent = value_noise(record, "a")
    assert np.allclose(measured, [0.2, 0.4]) and np.allclose(independent, [0.05, 0.05])   # mean over codes
    with pytest.raises(ValueError, match="'old' was read before the value measures"):
        value_noise(record, "old")
    with pytest.raises(ValueError, match="'b' is not a row"):
        value_noise(record, "b")
    fig = plot_value_noise(record, ["a"])
    labels = [line.get_label() for line in fig.axes[0].lines]
    assert labels == ["a: measured", "a: were the errors independent"]
    assert np.allclose(fig.axes[0].lines[0].get_ydata(), [0.2, 0.4])
    # by default: the rows with coded values and the measures (not fp32's exact ones, not the old row)
    assert [line.get_label() for line in plot_value_noise(record).axes[0].lines] == [
        "a: measured", "a: were the errors independent"]
    del record["results"]["a"]
    with pytest.raises(ValueError, match="no row of the record has coded values"):
        plot_value_noise(record)


def test_the_needle_figure_draws_one_row_of_panels_per_group_with_the_reference_in_each():
    from turboquant.viz import plot_needle_grid
    from matplotlib.colors import to_hex

    from turboquant.viz.realmodel import FAMILY_COLORS, REFERENCE_COLOR, family_index

    def cells(contexts):
        return [{"context": x, "depth": d, "ok": 10, "n": 20, "lo": 0.3, "hi": 0.7}
                for x in contexts for d in (0.1, 0.9)]
    grid = {"results": {"fp32": {"bits": 32, "family": "reference", "cells": cells((1024, 2048))},
                        "KVQuant-style 4": {"bits": 4.375, "family": "KVQuant-style", "cells": cells((1024, 2048))},
                        "KVQuant-style 2": {"bits": 2.375, "family": "KVQuant-style", "cells": cells((1024,))},
                        "profile 2.25": {"bits": 2.25, "family": "profile (make_prompt_cache(bits=…, profile=True))",
                                         "cells": cells((1024,))}}}
    fig = plot_needle_grid(grid, groups={"4 bits": ["KVQuant-style 4"],
                                         "2 bits": ["KVQuant-style 2", "profile 2.25"]})
    assert len(fig.axes) == 4                                                  # 2 groups x 2 contexts
    assert [ax.get_title() for ax in fig.axes] == ["1,024 tokens", "2,048 tokens", "", ""]
    # one legend of families for every row, in the legend's words where given
    assert [t.get_text() for t in fig.legends[0].get_texts()] == \
        ["fp32", "KVQuant-style", "profile (make_prompt_cache(bits=…, profile=True))"]
    fig = plot_needle_grid(grid, groups={"4 bits": ["KVQuant-style 4"],
                                         "2 bits": ["KVQuant-style 2", "profile 2.25"]},
                           labels={"KVQuant-style": "KVQuant-style levels"})
    assert [t.get_text() for t in fig.legends[0].get_texts()][:2] == ["fp32", "KVQuant-style levels"]
    assert [ax.get_ylabel() for ax in fig.axes[::2]] == ["4 bits\nneedles found", "2 bits\nneedles found"]
    # a family keeps its colour from row to row; the reference has its own
    colour = lambda ax, label: next(to_hex(c.lines[0].get_color()) for c in ax.containers if c.get_label() == label)
    kvq = FAMILY_COLORS[family_index("KVQuant-style")]
    assert colour(fig.axes[0], "KVQuant-style levels") == colour(fig.axes[2], "KVQuant-style levels") == kvq
    assert colour(fig.axes[2], "fp32") == REFERENCE_COLOR
    # the 2-bit rows were not measured at 2,048 tokens: that panel says so
    assert [t.get_text() for t in fig.axes[3].texts] == ["not measured"]
    with pytest.raises(ValueError, match="names or groups"):
        plot_needle_grid(grid, ["fp32"], groups={"x": ["fp32"]})
    with pytest.raises(ValueError, match="at least one row"):
        plot_needle_grid(grid, groups={"x": []})
    with pytest.raises(ValueError, match="got \\['nope'\\]"):
        plot_needle_grid(grid, groups={"x": ["nope"]})
