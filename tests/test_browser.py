"""The built book as a reader's browser shows it, offline (``make test-browser``).

Every page of ``_build/html`` is loaded in headless Chromium with the network blocked
(``tests/browser.py``) and must show: every equation typeset by MathJax and no raw TeX in
the visible text, every image decoded, every widget cell with its static figure, no code
or printed output wider than the reading column at a 1,200-px window, no console errors, no
failed and no external requests. Screenshots and a JSON report go to
``_build/browser/`` (git-ignored) for a person to look at.

``make test`` runs this after the ``-W`` book build. Where Chromium is missing the tests skip
with a message (``.ci/run`` installs it on CI); without a built book they skip and say how
to build one. ``TURBOQUANT_BOOK_HTML`` points them at another build folder.
"""
import json
import os
import re
from pathlib import Path

import pytest

from browser import Book, Chromium, check_page, find_chromium

ROOT = Path(__file__).resolve().parents[1]
HTML = Path(os.environ.get("TURBOQUANT_BOOK_HTML", ROOT / "_build" / "html"))
OUT = HTML.parent / "browser"
PAGES = Book(HTML).pages() if (HTML / "index.html").is_file() else []
is_chapter = re.compile(r"ch\d\d_").match          # ch01_memory_wall.html …, not cheatsheet.html

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def session():
    exe = find_chromium()
    if exe is None:
        pytest.skip("Chromium not found: install it (Debian: apt-get install chromium) or set "
                    "TURBOQUANT_CHROMIUM, then run `make test-browser`")
    if not PAGES:
        pytest.skip(f"no built book in {HTML}: run `make test-book` (or `make book`) first")
    reports = []
    with Book(HTML) as book, Chromium(exe) as browser:
        yield book, browser, reports
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "report.json").write_text(json.dumps(reports, indent=1))


def test_the_book_has_pages():
    if not PAGES:
        pytest.skip(f"no built book in {HTML}: run `make test-book` (or `make book`) first")
    names = {Path(p).name for p in PAGES}
    assert {"index.html", "ch01_memory_wall.html", "references.html", "api.html", "status.html"} <= names


@pytest.mark.parametrize("page", PAGES)
def test_page_renders_offline(session, page):
    book, browser, reports = session
    r = check_page(browser, book.base, page, shots=OUT / "screenshots")
    reports.append(r)
    problems = []
    if r["external_requests"]:
        problems.append(f"requests leaving the book: {r['external_requests']}")
    if r["failed_requests"]:
        problems.append(f"failed requests: {r['failed_requests']}")
    if r["console_errors"]:
        problems.append(f"console errors: {r['console_errors']}")
    if r["typeset"] != r["math"]:
        problems.append(f"{r['math'] - r['typeset']} of {r['math']} equations not typeset by MathJax")
    if r["raw_tex"]:
        problems.append(f"raw TeX in the visible text: {r['raw_tex']}")
    if r["broken_images"]:
        problems.append(f"images that did not decode: {r['broken_images']}")
    if r["sideways"]:
        problems.append(f"{len(r['sideways'])} code cells or outputs wider than the "
                        f"column (they scroll sideways): {r['sideways'][:3]}")
    bad_widgets = [w["code"] for w in r["widgets"] if not w["ok"]]
    if bad_widgets:
        problems.append(f"widget cells without a figure: {bad_widgets}")
    if r["widget_views"]:
        problems.append(f"{r['widget_views']} widget views that need a widget manager from the network")
    assert not problems, f"{page}: " + "; ".join(problems)


def test_chapters_are_shaped_like_a_textbook(session):
    """Every chapter opens with its objectives ("In this chapter you will"), captions every
    figure, and closes with a summary and exercises; every exercise has a solution a reader
    can open (sphinx-exercise's admonitions), and no figure elsewhere lacks a caption."""
    _, _, reports = session
    if len(reports) < len(PAGES):
        pytest.skip("run the whole module: this test reads the reports of every page test")
    problems = []
    for r in reports:
        s, name = r["structure"], Path(r["page"]).name
        if s["uncaptioned"]:
            problems.append(f"{name}: {s['uncaptioned']} figures without a caption")
        if not is_chapter(name):
            continue
        missing = [h for h in ("Summary", "Exercises") if h not in s["headings"]]
        if missing or not s["objectives"]:
            problems.append(f"{name}: missing {missing + ([] if s['objectives'] else ['objectives'])}")
        if s["exercises"] and s["solutions"] < s["exercises"]:
            problems.append(f"{name}: {s['exercises']} exercises, {s['solutions']} solutions")
    assert not problems, "; ".join(problems)


def test_widget_chapters_show_their_figures(session):
    """Every chapter shows at least one widget, as its figure (from the page reports above)."""
    _, _, reports = session
    chapters = {Path(r["page"]).stem: r for r in reports if is_chapter(Path(r["page"]).name)}
    if len(chapters) < sum(bool(is_chapter(Path(p).name)) for p in PAGES):
        pytest.skip("run the whole module: this test reads the reports of every chapter's page test")
    missing = [c for c, r in sorted(chapters.items()) if not any(w["ok"] for w in r["widgets"])]
    assert not missing, f"chapters without a widget figure: {missing}"
