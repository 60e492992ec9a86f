"""turboquant: KV-cache compression for long-context inference in MLX.

The chapters of the accompanying book derive each piece; the modules are small and hold
one idea each (``ARCHITECTURE.md`` at the repository root maps them). The names here are
what a researcher reaches for: ``tq.load`` a model, ``tq.make_prompt_cache`` a compressed
cache, ``tq.perplexity`` through it, and every shipped codec and cache class.
"""
from . import blas

blas.enable()   # before anything imports mlx: fast CPU matmuls on Linux (see blas.py)

from . import kernels  # noqa: E402,F401 - registers the fused kernels with the codecs
from .attention import attention_from_codes, codes_attention  # noqa: E402
from .batch import BatchCodesCache  # noqa: E402
from .cache import FittedPositionsWarning, TurboQuantKVCache, TurboQuantRotatingKVCache  # noqa: E402
from .codecs import (QJL, AffineCodec, Centered, Code, Codec, FibQuant, Identity, OutlierSplit,  # noqa: E402
                     PolarQuant, TurboQuantMSE, TurboQuantProd, from_config)
from .codecs.transform import OutOfRangeError, TransformCoder  # noqa: E402
from .data import load_text  # noqa: E402
from .evaluation import encode_text, perplexity  # noqa: E402
from .kivi import KIVICache  # noqa: E402
from .memory import PRESETS, AttentionGeometry, Layer, kv_cache_bytes  # noqa: E402
from .models import load  # noqa: E402
from .prerope import PreRopeCache, TurnedMeanCache, pre_rope, turned_mean  # noqa: E402
from .prompt_cache import load_prompt_cache, make_prompt_cache, save_prompt_cache, to_turboquant  # noqa: E402
from .rotation import Rotation  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    # a model, text and a measurement (README, Chapter 9)
    "load", "load_text", "encode_text", "perplexity",
    # caches for mlx-lm (Chapter 7)
    "make_prompt_cache", "to_turboquant", "save_prompt_cache", "load_prompt_cache",
    "TurboQuantKVCache", "TurboQuantRotatingKVCache", "KIVICache", "codes_attention",
    "BatchCodesCache", "FittedPositionsWarning", "pre_rope", "PreRopeCache", "turned_mean", "TurnedMeanCache",
    # every shipped codec (Chapters 3–6, 10) and the codec interface
    "Codec", "Code", "from_config", "TurboQuantMSE", "TurboQuantProd", "QJL", "PolarQuant", "FibQuant",
    "AffineCodec", "Centered", "Identity", "OutlierSplit", "TransformCoder", "OutOfRangeError", "Rotation",
    # attention from codes and the memory model (Chapters 1 and 7)
    "attention_from_codes", "kv_cache_bytes", "AttentionGeometry", "Layer", "PRESETS",
    "__version__",
]
