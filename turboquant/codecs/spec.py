"""One place that turns a codec specification into codecs for a head size.

A specification is a codec instance, its configuration dict, a callable head_dim → codec,
or None (TurboQuant_mse at the default bits). Caches (``make_prompt_cache``,
``to_turboquant``), Bit-Axon's facade and the budgets all go through ``codec_for`` and
``codec_pair``.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional, Union

from .base import Codec, from_config
from .scalar import TurboQuantMSE

__all__ = ["CodecSpec", "codec_for", "codec_pair"]

CodecSpec = Union[Codec, Mapping, Callable[[int], Codec], None]


def codec_for(spec: CodecSpec, dim: int, default_bits: int = 4) -> Codec:
    """A codec for head size ``dim`` from ``spec``. An instance that learns from data
    (``fit``: ``Centered``, ``OutlierSplit``) is copied, so caches never share what one of
    them learns."""
    if spec is None:
        return TurboQuantMSE(dim, default_bits)
    if isinstance(spec, Codec):
        if spec.dim != dim:
            raise ValueError(f"codec has dim {spec.dim}, the head size is {dim}")
        return from_config(spec.config()) if hasattr(spec, "fit") else spec
    if isinstance(spec, Mapping):
        codec = from_config(spec)
    elif callable(spec):
        codec = spec(dim)
    else:
        raise TypeError(f"a codec spec is a Codec, a config dict, a callable or None, got {type(spec).__name__}")
    if not isinstance(codec, Codec) or codec.dim != dim:
        raise ValueError(f"the codec spec gave {codec!r}, not a codec of head size {dim}")
    return codec


def codec_pair(key_spec: CodecSpec, value_spec: Optional[CodecSpec], dim: int,
               default_bits: int = 4) -> tuple[Codec, Codec]:
    """(key codec, value codec); ``value_spec`` None means the key's specification. A
    learning codec is never shared between keys and values."""
    kc = codec_for(key_spec, dim, default_bits)
    vc = codec_for(key_spec if value_spec is None else value_spec, dim, default_bits)
    if vc is kc and hasattr(kc, "fit"):
        vc = from_config(kc.config())
    return kc, vc
