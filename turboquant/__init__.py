"""turboquant: KV-cache compression for long-context inference in MLX.

The chapters of the accompanying book derive each piece; the modules are small and hold
one idea each (see the README's layout section).
"""
from . import memory, sphere
from .codecs import QJL, AffineCodec, Code, Codec, FibQuant, PolarQuant, TurboQuantMSE, TurboQuantProd, from_config
from .memory import PRESETS, AttentionGeometry, Layer, kv_cache_bytes
from .rotation import Rotation

__version__ = "0.1.0"
__all__ = ["memory", "sphere", "PRESETS", "AttentionGeometry", "Layer", "kv_cache_bytes",
           "Rotation", "Code", "Codec", "TurboQuantMSE", "AffineCodec", "QJL", "TurboQuantProd", "PolarQuant", "FibQuant", "from_config", "__version__"]
