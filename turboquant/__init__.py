"""turboquant: KV-cache compression for long-context inference in MLX.

The chapters of the accompanying book derive each piece; the modules are small and hold
one idea each (see the README's layout section).
"""
from . import memory
from .memory import PRESETS, AttentionGeometry, Layer, kv_cache_bytes

__version__ = "0.1.0"
__all__ = ["memory", "PRESETS", "AttentionGeometry", "Layer", "kv_cache_bytes", "__version__"]
