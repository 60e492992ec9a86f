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
