"""The book's execution status page: when each chapter last ran, how long, and how it ended.

``make book`` executes every chapter with nbclient, which stamps each code cell's metadata
with the times it started and finished (``metadata.execution``); the notebooks are committed
with those stamps. The ``{exec-status}`` directive reads them from the notebooks themselves
(no cache, no network) and renders one row per chapter, in table-of-contents order:
last execution (UTC), the summed run time of its cells, the number of code cells, and a
status — ``ok``, ``error`` (a stored error output) or ``not executed`` (a code cell without
stamps or outputs from a run).
"""
from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.util.docutils import SphinxDirective

__all__ = ["chapter_status", "setup"]


def _stamp(text: str) -> datetime:
    """An nbclient timestamp ("2026-11-30T17:18:13.421970Z") as an aware UTC datetime."""
    t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def chapter_status(path: str | Path) -> dict:
    """Execution summary of one notebook: ``{"last": datetime | None, "seconds": float,
    "cells": int, "status": "ok" | "error" | "not executed"}``.

    Raises ``ValueError`` naming the file when it is not a readable notebook.
    """
    path = Path(path)
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
        cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
        last, seconds, status = None, 0.0, "ok"
        for c in cells:
            ex = c.get("metadata", {}).get("execution", {})
            start, end = ex.get("iopub.execute_input"), ex.get("shell.execute_reply")
            if not (start and end) or c.get("execution_count") is None:
                status = "not executed" if status == "ok" else status
                continue
            t0, t1 = _stamp(start), _stamp(end)
            seconds += max((t1 - t0).total_seconds(), 0.0)
            last = t1 if last is None or t1 > last else last
            if any(o.get("output_type") == "error" for o in c.get("outputs", [])):
                status = "error"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a readable notebook ({type(e).__name__}: {e})") from e
    return {"last": last, "seconds": seconds, "cells": len(cells), "status": status}


class ExecStatus(SphinxDirective):
    """``{exec-status}``: a table of every notebook chapter in the table of contents."""

    has_content = False

    def run(self):
        env = self.env
        src = Path(env.srcdir)
        docs = [d for d in env.found_docs if (src / f"{d}.ipynb").is_file()]
        order = {d: i for i, d in enumerate(_toc_order(env))}
        docs.sort(key=lambda d: (order.get(d, len(order)), d))
        table, tbody = _table(["chapter", "last executed (UTC)", "run time", "code cells", "status"])
        for d in docs:
            path = src / f"{d}.ipynb"
            env.note_dependency(str(path))
            st = chapter_status(path)
            link = addnodes.pending_xref("", nodes.inline(text=d.rsplit("/", 1)[-1]), refdomain="std",
                                         reftype="doc", reftarget="/" + d, refexplicit=False,
                                         refdoc=env.docname)
            when = st["last"].strftime("%Y-%m-%d %H:%M") if st["last"] else "—"
            _row(tbody, [link, when, f"{st['seconds']:.1f} s", str(st["cells"]), st["status"]])
        return [table]


def _toc_order(env) -> list[str]:
    """Documents in the order of the table of contents (root first)."""
    seen, out = set(), []

    def walk(doc):
        if doc in seen:
            return
        seen.add(doc)
        out.append(doc)
        for child in env.toctree_includes.get(doc, []):
            walk(child)
    walk(env.config.root_doc)
    return out


def _table(headers):
    table = nodes.table(classes=["exec-status"])
    group = nodes.tgroup(cols=len(headers))
    table += group
    for _ in headers:
        group += nodes.colspec(colwidth=1)
    head = nodes.thead()
    group += head
    _row(head, headers)
    body = nodes.tbody()
    group += body
    return table, body


def _row(parent, cells):
    row = nodes.row()
    for c in cells:
        entry = nodes.entry()
        entry += nodes.paragraph("", "", c) if isinstance(c, nodes.Node) else nodes.paragraph(text=c)
        row += entry
    parent += row


def setup(app):
    app.add_directive("exec-status", ExecStatus)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
