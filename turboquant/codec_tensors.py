"""Codec configurations whose arrays travel as tensors, not as decimal text.

A codec's ``config()`` rebuilds it bit for bit, but a fitted one carries arrays in it
(a ``TransformCoder``'s per-head means, transforms and levels; a ``Centered`` mean): as
JSON text a calibrated 30-layer cache header was 38.5 MB for 18 tokens. ``to_tensors``
replaces every list of at least ``MIN_SIZE`` numbers in a configuration by a reference
``{"$tensor": NAME}`` and puts the array in ``tensors`` under NAME, a digest of its bytes:
equal arrays (the same coder used by several layers, keys and values) are stored once.
``from_tensors`` puts the lists back — the values exactly (float32 and int32 both
round-trip through ``tolist``) — so ``from_config`` rebuilds the same codec.

Used by cache files (``save_prompt_cache``) and by the on-disk store of fitted profile
coders (``turboquant.calibration``).
"""
from __future__ import annotations

import hashlib
from typing import Any, Mapping

import mlx.core as mx
import numpy as np

__all__ = ["MIN_SIZE", "PREFIX", "to_tensors", "from_tensors", "content_digest"]

MIN_SIZE = 16          # smaller lists stay in the JSON
PREFIX = "c."          # tensor names: PREFIX + 16 hex digits of the array's SHA-256


def _as_array(value) -> np.ndarray | None:
    """A numeric list of uniform shape as float32 or int32, else None."""
    try:
        a = np.asarray(value)
    except (ValueError, TypeError):
        return None
    if a.dtype == object or a.size < MIN_SIZE or a.dtype.kind not in "fiu" or a.dtype.kind == "b":
        return None
    if a.dtype.kind in "iu":
        if a.size and (a.min() < -2 ** 31 or a.max() >= 2 ** 31):
            return None
        return a.astype(np.int32)
    f = a.astype(np.float32)
    return f if np.array_equal(f.astype(a.dtype), a) else None   # only what float32 holds exactly


def to_tensors(config: Any, tensors: dict) -> Any:
    """``config`` with large numeric lists replaced by ``{"$tensor": name}``; the arrays are
    added to ``tensors`` (name → mx array), once per distinct content."""
    if isinstance(config, Mapping):
        return {k: to_tensors(v, tensors) for k, v in config.items()}
    if isinstance(config, list):
        a = _as_array(config)
        if a is None:
            return [to_tensors(v, tensors) for v in config]
        h = hashlib.sha256(f"{a.dtype}{a.shape}".encode() + a.tobytes()).hexdigest()[:16]
        name = PREFIX + h
        tensors.setdefault(name, mx.array(a))
        return {"$tensor": name}
    return config


def from_tensors(config: Any, tensors: Mapping, used: set | None = None) -> Any:
    """The inverse of ``to_tensors``: references resolved from ``tensors`` (names recorded in
    ``used``). A reference to a missing tensor, or to one that is not float32/int32, raises
    ``ValueError``."""
    if isinstance(config, Mapping):
        if set(config) == {"$tensor"}:
            name = config["$tensor"]
            a = tensors.get(name) if isinstance(name, str) else None
            if a is None:
                raise ValueError(f"the configuration refers to tensor {name!r}, which the file does not hold")
            if a.dtype not in (mx.float32, mx.int32):
                raise ValueError(f"tensor {name!r} is {a.dtype}; codec arrays are float32 or int32")
            if used is not None:
                used.add(name)
            return np.array(a).tolist()
        return {k: from_tensors(v, tensors, used) for k, v in config.items()}
    if isinstance(config, list):
        return [from_tensors(v, tensors, used) for v in config]
    return config


def content_digest(header_json: str, arrays: dict) -> str:
    """SHA-256 over the header and every tensor (name, dtype, shape, bytes), in name order."""
    h = hashlib.sha256(header_json.encode())
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"\0{name}\0{a.dtype}\0{tuple(a.shape)}\0".encode())
        flat = a.reshape(-1)
        h.update(np.array(flat.view(mx.uint16) if a.dtype == mx.bfloat16 else flat).tobytes())
    return h.hexdigest()
