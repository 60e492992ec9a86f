"""Building, converting, saving and loading TurboQuant prompt caches (Chapter 7)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional, Union

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from .cache import TurboQuantKVCache, TurboQuantRotatingKVCache
from .codecs.base import Codec, from_config
from .codecs.scalar import TurboQuantMSE

__all__ = ["make_prompt_cache", "to_turboquant", "save_prompt_cache", "load_prompt_cache",
           "FORMAT", "FORMAT_VERSION"]

FORMAT = "turboquant-prompt-cache"
FORMAT_VERSION = 1
CodecSpec = Union[Codec, dict, Callable[[int], Codec], None]


def _head_dim(model) -> int:
    a = model.args
    return getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads


def _codec(spec: CodecSpec, dim: int, default_bits: int = 4) -> Codec:
    """A codec for one layer: an instance (copied when it learns from data), a config dict,
    a callable dim → codec, or None (TurboQuant_mse at ``default_bits``)."""
    if spec is None:
        return TurboQuantMSE(dim, default_bits)
    if isinstance(spec, Codec):
        if spec.dim != dim:
            raise ValueError(f"codec has dim {spec.dim}, the model's head size is {dim}")
        return from_config(spec.config()) if hasattr(spec, "fit") else spec
    if isinstance(spec, dict):
        return from_config(spec)
    if callable(spec):
        return spec(dim)
    raise TypeError(f"a codec spec is a Codec, a config dict, a callable or None, got {type(spec).__name__}")


def make_prompt_cache(model, key_codec: CodecSpec = None, value_codec: CodecSpec = None,
                      fp_window: int = 0, max_kv_size: Optional[int] = None, sink_tokens: int = 0,
                      bits: Optional[float] = None) -> list:
    """The right TurboQuant cache for each layer of an mlx-lm model.

    Layers whose mlx-lm cache is a ``RotatingKVCache`` (sliding-window layers, or every layer
    when ``max_kv_size`` is given) get a ``TurboQuantRotatingKVCache`` with the same
    ``max_size`` and ``keep``; ``KVCache`` layers get a ``TurboQuantKVCache``. Other cache
    kinds (SSM states, …) are kept as mlx-lm makes them.

    ``bits`` asks for a memory budget instead of codecs: the best configuration measured in
    Chapter 9 with at most that many bits per coordinate (``turboquant.budget``; e.g. 4.25
    → centered 4-bit keys, 4-bit values, one sink token). It cannot be combined with
    ``key_codec``/``value_codec``/``sink_tokens``.
    """
    if bits is not None:
        from .budget import codecs_for, pick
        if key_codec is not None or value_codec is not None or sink_tokens:
            raise ValueError("give either bits= or key_codec/value_codec/sink_tokens, not both")
        choice = pick(bits, _head_dim(model))
        key_codec, value_codec = codecs_for(choice)
        sink_tokens = choice.sink_tokens
    dim = _head_dim(model)
    reference = mlx_cache.make_prompt_cache(model, max_kv_size=max_kv_size)
    out = []
    for c in reference:
        kc, vc = _codec(key_codec, dim), _codec(value_codec if value_codec is not None else key_codec, dim)
        if isinstance(kc, Codec) and hasattr(kc, "fit") and kc is vc:
            vc = from_config(kc.config())
        if isinstance(c, mlx_cache.RotatingKVCache):
            out.append(TurboQuantRotatingKVCache(c.max_size, kc, vc, keep=c.keep))
        elif isinstance(c, mlx_cache.KVCache):
            out.append(TurboQuantKVCache(kc, vc, fp_window=fp_window, sink_tokens=sink_tokens))
        else:
            out.append(c)
    return out


def to_turboquant(cache: list, key_codec: CodecSpec = None, value_codec: CodecSpec = None,
                  fp_window: int = 0) -> list:
    """Convert filled mlx-lm caches (``KVCache``, ``RotatingKVCache``) into TurboQuant ones,
    encoding what they hold; other entries are returned unchanged."""
    out = []
    for c in cache:
        if not isinstance(c, (mlx_cache.KVCache, mlx_cache.RotatingKVCache)) or c.empty():
            out.append(c)
            continue
        keys, values = c.state[0], c.state[1]
        dim = keys.shape[-1]
        kc, vc = _codec(key_codec, dim), _codec(value_codec if value_codec is not None else key_codec, dim)
        rotating = isinstance(c, mlx_cache.RotatingKVCache)
        new = (TurboQuantRotatingKVCache(c.max_size, kc, vc, keep=c.keep) if rotating
               else TurboQuantKVCache(kc, vc, fp_window=fp_window))
        n = min(c.offset, keys.shape[2])          # slots held (a ring may hold fewer than offset)
        k, v = keys[..., :n, :], values[..., :n, :]
        new._check(k, v)
        new.keys, new.values = new._encode(k, v)
        new.offset = c.offset
        if rotating:
            new._idx = c._idx                     # same ring layout as the source cache
        new._update_recent(k, v)
        out.append(new)
    return out


def save_prompt_cache(path, cache: list, metadata: Optional[dict] = None) -> None:
    """Save TurboQuant caches (codes, codec configurations, offsets) to a safetensors file,
    atomically: the file at ``path`` is replaced only once the new one is complete."""
    if not all(isinstance(c, TurboQuantKVCache) for c in cache):
        raise TypeError("save_prompt_cache saves TurboQuant caches only; use mlx_lm's for others")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise TypeError("metadata must map str to str")
    arrays, layers = {}, []
    for i, c in enumerate(cache):
        k, v, rec = c.state
        for group, fields in (("k", k), ("v", v), ("r", rec)):
            for name, a in fields.items():
                if a is not None:
                    arrays[f"{i}.{group}.{name}"] = a
        layers.append(c.meta_state)
    header = {"format": FORMAT, "version": FORMAT_VERSION, "layers": layers, "user": metadata or {}}
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.safetensors")
    mx.save_safetensors(str(tmp), arrays, {"turboquant": json.dumps(header)})
    os.replace(tmp, path)


def load_prompt_cache(path, return_metadata: bool = False):
    """Load caches written by ``save_prompt_cache``; a truncated, corrupt or incompatible file
    raises ``ValueError`` naming the problem."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no prompt cache at {path}")
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
    except Exception as e:  # mlx raises RuntimeError/ValueError for damaged files
        raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupt?): {e}") from None
    try:
        header = json.loads(meta["turboquant"])
    except (KeyError, json.JSONDecodeError):
        raise ValueError(f"{path} has no TurboQuant header: not written by turboquant.save_prompt_cache") from None
    if header.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown format {header.get('format')!r}")
    if header.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format version {header.get('version')!r}, this turboquant reads {FORMAT_VERSION}")
    classes = {"TurboQuantKVCache": TurboQuantKVCache, "TurboQuantRotatingKVCache": TurboQuantRotatingKVCache}
    cache = []
    for i, m in enumerate(header["layers"]):
        if m.get("class") not in classes:
            raise ValueError(f"{path}: layer {i} has unknown cache class {m.get('class')!r}")
        groups = {g: {} for g in "kvr"}
        for name, a in arrays.items():
            li, g, field = name.split(".", 2)
            if int(li) == i:
                groups[g][field] = a
        try:
            c = classes[m["class"]].from_state((groups["k"], groups["v"], groups["r"]), m)
            _validate(c, i)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: layer {i} is inconsistent: {e}") from None
        cache.append(c)
    return (cache, header["user"]) if return_metadata else cache


def _validate(c: TurboQuantKVCache, i: int) -> None:
    """Check a loaded cache against its codecs: field names, widths, dtypes, lengths."""
    if c.keys is None:
        if c.offset:
            raise ValueError(f"offset {c.offset} but no codes")
        return
    for codec, buf in ((c.key_codec, c.keys), (c.value_codec, c.values)):
        B, H = next(iter(buf.fields.values())).shape[:2]
        ref = codec.encode(mx.ones((1, H, 1, codec.dim))).arrays
        if set(buf.fields) != set(ref):
            raise ValueError(f"code fields {sorted(buf.fields)} do not match {codec!r}")
        for name, a in ref.items():
            f = buf.fields[name]
            if f.ndim != 4 or f.shape[3] != a.shape[-1] or f.dtype != a.dtype:
                raise ValueError(f"field {name!r} has shape {f.shape} / {f.dtype}, {codec!r} "
                                 f"writes width {a.shape[-1]} / {a.dtype}")
    shapes = {f.shape[:3] for f in (*c.keys.fields.values(), *c.values.fields.values())}
    if len(shapes) != 1:
        raise ValueError(f"code fields disagree in (B, H, T): {sorted(shapes)}")
    n = shapes.pop()[2]
    if isinstance(c, TurboQuantRotatingKVCache):
        if not (0 < n <= max(c.offset, c.max_size) and 0 <= c._idx <= n):
            raise ValueError(f"{n} stored tokens, offset {c.offset}, ring index {c._idx}, max_size {c.max_size}")
    elif n != c.offset:
        raise ValueError(f"{n} stored tokens for offset {c.offset}")
    if c.recent_keys is not None and c.recent_keys.shape[2] > min(c.fp_window, c.offset):
        raise ValueError("full-precision window longer than fp_window or offset")
    if c.sink_keys is not None and (c.sink_keys.shape[2] > min(c.sink_tokens, c.offset)
                                    or c.sink_values is None or c.sink_values.shape != c.sink_keys.shape):
        raise ValueError("sink tokens inconsistent with sink_tokens, offset or each other")
