"""turboquant: KV-cache compression for long-context inference in MLX.

The chapters of the accompanying book derive each piece; the modules are small and hold
one idea each (see the README's layout section).
"""
from . import blas

blas.enable()   # before anything imports mlx: fast CPU matmuls on Linux (see blas.py)

from . import attention, kernels, memory, sphere  # noqa: E402
from .attention import attention_from_codes, codes_attention
from .cache import TurboQuantKVCache, TurboQuantRotatingKVCache
from .codecs import (QJL, AffineCodec, Centered, Code, Codec, FibQuant, Identity, OutlierSplit, PolarQuant,
                     TurboQuantMSE, TurboQuantProd, from_config)
from .memory import PRESETS, AttentionGeometry, Layer, kv_cache_bytes
from .prompt_cache import load_prompt_cache, make_prompt_cache, save_prompt_cache, to_turboquant
from .rotation import Rotation

__version__ = "0.1.0"
__all__ = ["attention", "kernels", "memory", "sphere", "PRESETS", "AttentionGeometry", "Layer", "kv_cache_bytes",
           "Rotation", "Code", "Codec", "TurboQuantMSE", "TurboQuantProd", "QJL", "PolarQuant",
           "FibQuant", "AffineCodec", "Centered", "Identity", "OutlierSplit", "from_config",
           "TurboQuantKVCache", "TurboQuantRotatingKVCache", "make_prompt_cache", "to_turboquant",
           "save_prompt_cache", "load_prompt_cache", "attention_from_codes", "codes_attention",
           "__version__"]
