"""Shared test fixtures.

Import turboquant before any test module imports mlx, so the fast BLAS is in place
(turboquant/blas.py) exactly as for a user who imports turboquant first.

``CODEC_EXAMPLES`` holds one example per registered codec, each codec's own
``example(dim)`` classmethod: a new codec is one file (``register`` + ``example``) and every
codec test runs on it. ``any_codec`` runs a test over all of them — the codec contract of
``tests/test_codec_contract.py``; ``codec_examples(dim)`` gives instances, fitted on fixed
random vectors where the codec learns from data.
"""
import pytest

import turboquant  # noqa: F401
import mlx.core as mx
from turboquant.codecs import CODECS

CODEC_EXAMPLES = {name: cls.example for name, cls in CODECS.items()}


def codec_examples(dim: int = 64, fitted: bool = True) -> list:
    """One instance of every registered codec at head size ``dim``, in name order; those that
    learn from data fitted on 64 fixed random vectors (no heads: they apply to any)."""
    out = []
    for name in sorted(CODECS):
        codec = CODECS[name].example(dim)
        if fitted and hasattr(codec, "fit") and not codec.fitted:
            codec.fit(mx.random.normal((64, dim), key=mx.random.key(9)))
        out.append(codec)
    return out


@pytest.fixture(params=sorted(CODEC_EXAMPLES))
def any_codec(request):
    """(name, factory head_dim → codec) for every registered codec."""
    return request.param, CODEC_EXAMPLES[request.param]


def registered_codecs():
    return dict(CODECS)
