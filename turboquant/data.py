"""Real English text that installs offline (Chapter 9).

Two corpora ship as test data inside the ``gensim`` wheel:

* ``"wikipedia"``: a shortened English Wikipedia XML dump (~100 articles after redirects
  are dropped; CC BY-SA), markup stripped with gensim's own ``filter_wiki`` and a few
  rules for what it leaves (bold/italic quotes, ``== headings ==``, blank-line runs);
* ``"lee"``: the Lee news corpus (``lee_background.cor``, 300 short news articles).

``load_text(name)`` returns one string, articles separated by blank lines, and keeps it in
memory after the first call. Nothing is downloaded.
"""
from __future__ import annotations

import bz2
import functools
import importlib.util
import re
from pathlib import Path

__all__ = ["CORPORA", "corpus_path", "load_text", "load_articles", "clean_wiki"]

CORPORA = {
    "wikipedia": "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
    "lee": "lee_background.cor",
}


def corpus_path(name: str) -> Path:
    """Path of corpus ``name`` inside the installed gensim wheel (gensim is not imported)."""
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; choose one of {sorted(CORPORA)}")
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the gensim package is not installed: `pip install gensim` provides the corpora")
    path = Path(spec.submodule_search_locations[0]) / "test" / "test_data" / CORPORA[name]
    if not path.is_file():
        raise ValueError(f"corpus file missing from the gensim wheel: {path}")
    return path


_HEADING = re.compile(r"^\s*=+\s*(.*?)\s*=+\s*$", re.M)
_QUOTES = re.compile(r"'{2,}")
_BLANKS = re.compile(r"\n\s*\n(\s*\n)+")
_SPACES = re.compile(r"[ \t]+")


def clean_wiki(markup: str) -> str:
    """Plain text from one article's wiki markup (gensim's ``filter_wiki`` plus tidying)."""
    from gensim.corpora.wikicorpus import filter_wiki
    text = filter_wiki(markup)
    text = _HEADING.sub(r"\1", text)
    text = _QUOTES.sub("", text)
    text = _SPACES.sub(" ", text)
    text = "\n".join(line.strip() for line in text.split("\n"))
    return _BLANKS.sub("\n\n", text).strip()


@functools.lru_cache(maxsize=None)
def load_articles(name: str) -> tuple[tuple[str, str], ...]:
    """((title, text), …) for corpus ``name`` in file order; empty articles and redirects dropped."""
    path = corpus_path(name)
    if name == "lee":
        lines = path.read_text(encoding="utf-8").splitlines()
        return tuple((f"lee-{i}", ln.strip()) for i, ln in enumerate(lines) if ln.strip())
    from gensim.corpora.wikicorpus import extract_pages
    out = []
    with bz2.open(path, "rb") as f:
        for title, markup, _ in extract_pages(f, filter_namespaces=("0",)):
            if markup.lstrip()[:9].upper() == "#REDIRECT":
                continue
            text = clean_wiki(markup)
            if text:
                out.append((title, text))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def load_text(name: str = "wikipedia") -> str:
    """Corpus ``name`` ("wikipedia" or "lee") as one clean string, articles separated by a
    blank line; cached after the first call."""
    return "\n\n".join(text for _, text in load_articles(name))
