"""Small fixes so every page of the book loads offline without a console error.

- **No Thebe.** Jupyter Book always loads ``sphinx_thebe``, whose inline script is added twice
  under Sphinx 7.4 (``const THEBE_JS_URL`` declared twice: a ``SyntaxError`` on every page)
  and which would fetch Thebe from unpkg.com on demand. This book has no live-code launch
  (it is read offline), so the extension's listeners are removed before any page is read.
- **A colour mode.** pydata-sphinx-theme starts from ``data-mode=""`` when the reader has not
  chosen one and logs "Got invalid theme mode" as a console error before falling back to
  "auto". A one-line script sets "auto" first (sphinx-book-theme accepts no ``default_mode``).

The browser test (``tests/test_browser.py``) checks every page for console errors.
"""
from __future__ import annotations


def _drop_thebe(app):
    for event in ("env-before-read-docs", "doctree-resolved"):
        for listener in list(app.events.listeners.get(event, [])):
            if getattr(listener.handler, "__module__", "").startswith("sphinx_thebe"):
                app.disconnect(listener.id)


def setup(app):
    app.add_js_file(None, body='if (!document.documentElement.dataset.mode) '
                                'document.documentElement.dataset.mode = "auto";')
    _drop_thebe(app)            # sphinx_thebe is set up before local extensions
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
