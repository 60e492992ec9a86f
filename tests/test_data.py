"""Offline corpora from the gensim wheel."""
import pytest

from turboquant.data import clean_wiki, load_articles, load_text


def test_wikipedia_is_clean_text():
    text = load_text("wikipedia")
    assert len(text) > 1_000_000 and text.startswith("Anarchism is a political philosophy")
    assert "'''" not in text and "[[" not in text and "\n==" not in text and "{{" not in text
    titles = [t for t, _ in load_articles("wikipedia")]
    assert len(titles) > 90 and len(set(titles)) == len(titles)
    assert load_text("wikipedia") is text               # cached


def test_lee_corpus():
    arts = load_articles("lee")
    assert len(arts) == 300 and "bushfire" in arts[0][1]


def test_clean_wiki_rules():
    out = clean_wiki("'''Bold''' and ''it''\n\n\n\n== Head ==\nx  y")
    assert out.startswith("Bold and it\n") and "\nHead\n" in out and out.endswith("x y")
    assert "\n\n\n" not in out and "'" not in out and "=" not in out


def test_unknown_corpus():
    with pytest.raises(ValueError, match="unknown corpus"):
        load_text("imdb")


def test_the_other_domains_are_what_they_say():
    """#28: held-out domains besides prose and news — review sentences (gensim), Python
    source and documentation (the running Python's standard library)."""
    import sys
    from turboquant.data import CODE_MODULES, DOC_MODULES, DOMAINS, corpus_info
    assert set(DOMAINS) == {"wikipedia", "lee", "reviews", "code", "docs"}
    reviews = load_articles("reviews")
    assert len(reviews) == 200 and not any(t.startswith("__label__") for _, t in reviews)
    assert reviews[0][1] == "simplistic , silly and tedious ."
    code = load_text("code")
    assert code.startswith('"""Implementation of JSONDecoder') and "\ndef " in code and "class ArgumentParser" in code
    assert [t for t, _ in load_articles("code")] == list(CODE_MODULES)
    docs = load_text("docs")
    assert docs.startswith("pathlib\n\npathlib.PurePath\n\nBase class for manipulating paths")
    assert [t for t, _ in load_articles("docs")] == list(DOC_MODULES)
    assert f"Python {sys.version.split()[0]}" in corpus_info("code") and "gensim" in corpus_info("reviews")
    with pytest.raises(ValueError, match="choose one of .'code', 'docs', 'lee', 'reviews', 'wikipedia'"):
        load_text("verse")


def test_the_calibration_mixture_interleaves_prose_and_code_no_domain_draws_on():
    """#29: a code model's profile is calibrated on Wikipedia and Python source in alternating
    blocks; the source comes from modules that the held-out "code" and "docs" domains do not use,
    so they stay held out."""
    from turboquant.data import CALIBRATION, CODE_MODULES, DOC_MODULES, DOMAINS, MIX_BLOCK, MIX_MODULES, corpus_info
    assert not set(MIX_MODULES) & (set(CODE_MODULES) | set(DOC_MODULES)) and "mixture" not in DOMAINS
    mix = load_text("mixture")
    blocks = mix.split("\n\n")
    assert mix.startswith(load_text("wikipedia")[:MIX_BLOCK])                     # prose first
    code = load_text("code")
    assert not any(len(b) > 200 and b in code for b in blocks)                     # no held-out source
    assert '"""Configuration file parser.' in mix and "class HTTPConnection" in mix
    first = mix[:20 * MIX_BLOCK]
    assert "def " in first and "Anarchism" in first                               # both, early on
    assert "mixture" in CALIBRATION and "configparser" in corpus_info("mixture")


def test_eval_does_not_offer_the_calibration_mixture(capsys):
    from turboquant import cli
    with pytest.raises(SystemExit):
        cli.main(["eval", "--corpus", "mixture"])
    assert "invalid choice: 'mixture'" in capsys.readouterr().err
