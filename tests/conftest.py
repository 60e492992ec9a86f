"""Shared test fixtures.

Import turboquant before any test module imports mlx, so the fast BLAS is in place
(turboquant/blas.py) exactly as for a user who imports turboquant first.

``CODEC_EXAMPLES`` holds one example per registered codec (a factory head_dim → codec);
``any_codec`` runs a test over all of them — the codec contract of
``tests/test_codec_contract.py``. A codec file may instead carry its own ``example(dim)``
classmethod; a new codec registered with neither fails
``test_every_registered_codec_has_an_example``.
"""
import pytest

import turboquant  # noqa: F401
from turboquant.codecs import (CODECS, AffineCodec, Centered, FibQuant, Identity, OutlierSplit, PolarQuant,
                               QJL, TurboQuantMSE, TurboQuantProd)

CODEC_EXAMPLES = {
    "turboquant_mse": lambda d: TurboQuantMSE(d, 4),
    "turboquant_prod": lambda d: TurboQuantProd(d, 3),
    "qjl": lambda d: QJL(d),
    "polarquant": lambda d: PolarQuant(d, rotation="haar"),
    "fibquant": lambda d: FibQuant(d, 2, 16),
    "affine": lambda d: AffineCodec(d, 4, 32),
    "identity": lambda d: Identity(d),
    "outlier_split": lambda d: OutlierSplit(d, n_outliers=4, outlier_bits=4, bits=2, rotation="haar"),
    "centered": lambda d: Centered(TurboQuantMSE(d, 4)),
}
# a codec file may carry its own example (``example(dim)`` classmethod): one file, nothing else
CODEC_EXAMPLES.update({name: cls.example for name, cls in CODECS.items()
                       if name not in CODEC_EXAMPLES and hasattr(cls, "example")})


@pytest.fixture(params=sorted(CODEC_EXAMPLES))
def any_codec(request):
    """(name, factory head_dim → codec) for every registered codec."""
    return request.param, CODEC_EXAMPLES[request.param]


def registered_codecs():
    return dict(CODECS)
