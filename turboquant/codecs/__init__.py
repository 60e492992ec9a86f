"""Codecs: one file each, one interface (``base.Codec``).

Every module of this package is imported here, so a new codec is one file: a class
decorated with ``base.register`` (and, for the contract tests, an ``example(dim)``
classmethod) is found by ``from_config``, the caches and the tests without further edits.
"""
import importlib as _importlib
import pkgutil as _pkgutil

from .base import CODECS, Code, Codec, from_config, mse
from .affine import AffineCodec
from .center import Centered
from .fibquant import FibQuant
from .identity import Identity
from .polar import PolarQuant
from .qjl import QJL, TurboQuantProd
from .scalar import TurboQuantMSE
from .split import OutlierSplit

__all__ = ["CODECS", "Code", "Codec", "from_config", "mse", "TurboQuantMSE", "AffineCodec", "QJL", "TurboQuantProd", "PolarQuant", "FibQuant", "Identity", "OutlierSplit", "Centered"]

for _module in _pkgutil.iter_modules(__path__):
    _importlib.import_module(f"{__name__}.{_module.name}")       # a new codec file registers itself
