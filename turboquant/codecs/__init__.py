"""Codecs: one file each, one interface (``base.Codec``)."""
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
