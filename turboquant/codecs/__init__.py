"""Codecs: one file each, one interface (``base.Codec``)."""
from .base import CODECS, Code, Codec, from_config
from .affine import AffineCodec
from .fibquant import FibQuant
from .polar import PolarQuant
from .qjl import QJL, TurboQuantProd
from .scalar import TurboQuantMSE

__all__ = ["CODECS", "Code", "Codec", "from_config", "TurboQuantMSE", "AffineCodec", "QJL", "TurboQuantProd", "PolarQuant", "FibQuant"]
