"""TurboQuant prompt caches in files (Chapter 7): ``save_prompt_cache`` writes a
safetensors file (codes, codec configurations as tensors, offsets, the model's
fingerprint, a SHA-256 of it all), atomically; ``load_prompt_cache`` validates the whole
file before it builds anything. The format (``FORMAT``, ``FORMAT_VERSION``) and every rule
a file must meet live here; a codec's own rules on its code values are its
``validate_code``."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from .cache import TurboQuantKVCache, TurboQuantRotatingKVCache, tag_group
from .checks import check_out_file
from .codec_tensors import PREFIX, content_digest, from_tensors, to_tensors
from .codecs.base import Codec, check_int, from_config
from .memory import check_layers, describe_model, model_fingerprint, model_geometry
from .prerope import PreRopeCache, TurnedMeanCache

WRAPPERS = (TurnedMeanCache, PreRopeCache)     # a TurboQuant cache inside, a setting beside it

__all__ = ["save_prompt_cache", "load_prompt_cache", "FORMAT", "FORMAT_VERSION"]

FORMAT = "turboquant-prompt-cache"
FORMAT_VERSION = 5          # 2 a content checksum, 3 codec arrays as tensors, 4 turned-mean layers, 5 keys before
                            # RoPE; all read


def save_prompt_cache(path, cache: list, metadata: Optional[dict] = None, model=None) -> None:
    """Save TurboQuant caches (codes, codec configurations, offsets, a SHA-256 of it all) to
    a safetensors file at exactly ``path`` (any name: ``.safetensors`` is not appended),
    atomically: the file at ``path`` is replaced only once the new one is complete. With
    ``model``, its ``model_fingerprint`` is saved too, and ``load_prompt_cache(path,
    model=…)`` refuses another model. Load it with ``turboquant.load_prompt_cache``
    (mlx-lm's loader does not know these classes)."""
    if not isinstance(cache, (list, tuple)) or not all(isinstance(c, (TurboQuantKVCache, *WRAPPERS))
                                                       for c in cache):
        kinds = sorted({type(c).__name__ for c in cache}) if isinstance(cache, (list, tuple)) else type(cache).__name__
        raise TypeError("save_prompt_cache saves a list of TurboQuant caches (TurboQuantKVCache, "
                        f"TurboQuantRotatingKVCache, TurnedMeanCache, PreRopeCache) only, got {kinds}; use mlx_lm's "
                        "for others")
    if metadata is not None and (not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise TypeError("metadata must map str to str")
    _check_offsets(cache, "save_prompt_cache: ")          # a file that would not load is not written
    arrays, layers, codec_arrays = {}, [], {}
    for i, c in enumerate(cache):
        turned = before = None
        if isinstance(c, TurnedMeanCache):            # the wrapped cache, and the mean (or exact tokens) beside it
            turned, extra = c.file_state()
            arrays.update({f"{i}.t.{name}": a for name, a in extra.items()})
            c = c.inner
        elif isinstance(c, PreRopeCache):             # the wrapped cache (keys before RoPE), and the RoPE
            before, c = c.file_state(), c.inner
        k, v, rec = c.state[:3]
        for group, fields in (("k", k), ("v", v), ("r", rec)):
            for name, a in fields.items():
                if a is not None:
                    arrays[f"{i}.{group}.{name}"] = a
        layers.append(to_tensors(c.meta_state, codec_arrays))   # fitted coders' arrays: tensors, once each
        if turned is not None:
            layers[-1]["turned_mean"] = turned
        if before is not None:
            layers[-1]["pre_rope"] = before
    arrays.update(codec_arrays)
    # a newer version only where a layer needs it: other files stay readable by turboquant that reads 3 (or 4)
    version = 5 if any("pre_rope" in m for m in layers) else 4 if any("turned_mean" in m for m in layers) else 3
    head = {"format": FORMAT, "version": version, "layers": layers, "user": metadata or {}}
    if model is not None:
        head["model"] = model_fingerprint(model)
    header = json.dumps(head)
    path = check_out_file(path, "cache file")
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.safetensors")
    try:
        mx.save_safetensors(str(tmp), arrays, {"turboquant": header, "turboquant_sha256": content_digest(header, arrays)})
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)              # no temporary left behind, whatever failed
        raise


def load_prompt_cache(path, return_metadata: bool = False, model=None):
    """Load caches written by ``save_prompt_cache`` (or TurboQuant caches written by
    ``mlx_lm.save_prompt_cache``). The whole file is validated before anything is built:
    format and version, the checksum, every layer's settings (the constructors' rules),
    every expected tensor present with the dtype and shape its configuration implies, no
    orphan tensors. With ``model``, its layer count, kv heads and head size must match, and
    the model the file was saved from (``model_fingerprint``, when it was saved with one).
    Every problem raises ``ValueError`` naming the field."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no prompt cache at {path}")
    try:
        arrays, meta = mx.load(str(path), format="safetensors", return_metadata=True)
    except Exception as e:  # mlx raises RuntimeError/ValueError for damaged files
        raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupt?): {e}") from None
    saved_from = None
    if "turboquant" not in meta:
        cache, user = _load_mlx_lm_layout(path, arrays, meta)
    else:
        cache, user = _load_turboquant_layout(path, arrays, meta)
        saved_from = json.loads(meta["turboquant"]).get("model")
    _check_offsets(cache, f"{path}: ")
    if model is not None:
        _check_model(path, cache, model)
        if saved_from is not None and saved_from != model_fingerprint(model):
            raise ValueError(f"{path}: this cache was filled by {describe_model(saved_from)}, not by the model given, "
                             f"{describe_model(model_fingerprint(model))}: its keys and values mean nothing there")
    tag_group(cache)
    return (cache, user) if return_metadata else cache


def _check_offsets(cache, where: str = "") -> None:
    """Every layer of a prompt cache sees every token, so its TurboQuant layers hold the same
    offset; a list whose layers disagree (a forward pass stopped part-way) is refused."""
    held = [(i, c.offset) for i, c in enumerate(cache) if isinstance(c, (TurboQuantKVCache, *WRAPPERS))]
    odd = [(i, o) for i, o in held if o != held[0][1]]
    if odd:
        raise ValueError(f"{where}layer {odd[0][0]} has offset {odd[0][1]}, layer {held[0][0]} {held[0][1]}: the "
                         "layers of a prompt cache hold the same tokens (a forward pass that stopped part-way?)")


def _check_model(path, cache, model) -> None:
    _, kv, d = model_geometry(model)
    try:
        check_layers(cache, model)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    ropes = None
    for i, c in enumerate(cache):
        if isinstance(c, WRAPPERS):                   # its mean turns (its keys turn back) with the RoPE saved
            from .prerope import rope_of
            ropes = rope_of(model) if ropes is None else ropes
            if c.rope != ropes[i]:
                what = "turns its key mean" if isinstance(c, TurnedMeanCache) else "undid RoPE on its keys"
                raise ValueError(f"{path}: layer {i} {what} with {c.rope}, the model's RoPE is {ropes[i]}")
            if isinstance(c, TurnedMeanCache):
                H = None if c.empty() else c.codes()[0].shape[1]   # also the exact tokens held before the mean
                if H is not None and H != kv:
                    raise ValueError(f"{path}: layer {i} holds {H} kv heads, the model has {kv}")
            c = c.inner
        if isinstance(c, TurboQuantKVCache) and c.key_codes is not None:
            B, H = next(iter(c.key_codes.fields.values())).shape[:2]
            if H != kv:
                raise ValueError(f"{path}: layer {i} holds {H} kv heads, the model has {kv}")
        dim = getattr(getattr(c, "key_codec", None), "dim", d)
        if dim != d:
            raise ValueError(f"{path}: layer {i} has head size {dim}, the model has {d}")


def _load_turboquant_layout(path, arrays, meta):
    try:
        header = json.loads(meta["turboquant"])
    except json.JSONDecodeError:
        raise ValueError(f"{path}: the TurboQuant header is not valid JSON") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header must be a JSON object, got {type(header).__name__}")
    if header.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown format {header.get('format')!r}")
    version = header.get("version")
    if type(version) is not int or not 1 <= version <= FORMAT_VERSION:   # not True, 1.0 or "2"
        raise ValueError(f"{path}: format version {version!r}, this turboquant reads the integers 1..{FORMAT_VERSION}")
    if version == 1 and "turboquant_sha256" in meta:
        raise ValueError(f"{path}: says format version 1 but carries a version-2 checksum: the header was changed")
    if version >= 2:
        if "turboquant_sha256" not in meta:
            raise ValueError(f"{path}: the checksum (turboquant_sha256) is missing")
        if content_digest(meta["turboquant"], arrays) != meta["turboquant_sha256"]:
            raise ValueError(f"{path}: checksum mismatch: the header or a tensor was changed or damaged")
    for name, a in arrays.items():              # codes never hold Inf or NaN (encode refuses them)
        if mx.issubdtype(a.dtype, mx.floating) and not mx.all(mx.isfinite(a)).item():
            raise ValueError(f"{path}: tensor {name!r} holds Inf or NaN values: the file is damaged")
    layers, user = header.get("layers"), header.get("user", {})
    if not isinstance(layers, list):
        raise ValueError(f"{path}: 'layers' must be a list of layer settings, got {type(layers).__name__}")
    if not isinstance(user, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in user.items()):
        raise ValueError(f"{path}: 'user' metadata must map str to str")
    codec_arrays = {n: a for n, a in arrays.items() if n.startswith(PREFIX) and version >= 3}
    used: set = set()
    try:
        layers = [from_tensors(m, codec_arrays, used) for m in layers]
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    kinds = "kvrt" if version >= 4 else "kvr"
    groups = [{g: {} for g in kinds} for _ in layers]
    for name, a in arrays.items():
        if name in used:
            continue
        parts = name.split(".", 2)
        if len(parts) != 3 or not parts[0].isdigit() or int(parts[0]) >= len(layers) \
                or parts[1] not in kinds or not parts[2]:
            raise ValueError(f"{path}: orphan tensor {name!r} (expected 'LAYER.{'|'.join(kinds)}.FIELD' with "
                             f"LAYER < {len(layers)})")
        groups[int(parts[0])][parts[1]][parts[2]] = a
    cache = []
    for i, (m, g) in enumerate(zip(layers, groups)):
        try:
            turned = m.pop("turned_mean", None) if isinstance(m, dict) else None
            before = m.pop("pre_rope", None) if isinstance(m, dict) else None
            if turned is not None and version < 4:
                raise ValueError(f"setting 'turned_mean' needs format version 4, the file says {version}")
            if before is not None and version < 5:
                raise ValueError(f"setting 'pre_rope' needs format version 5, the file says {version}")
            if turned is not None and before is not None:
                raise ValueError("a layer is either turned_mean or pre_rope, this one says both")
            layer = _build_layer(m, (g["k"], g["v"], g["r"]))
            if before is not None:
                layer = PreRopeCache.from_file_state(layer, before)
            if turned is not None:
                layer = TurnedMeanCache.from_file_state(layer, turned, g["t"])
            elif g.get("t"):
                raise ValueError(f"turned-mean tensors {sorted(g['t'])} but no 'turned_mean' setting")
            cache.append(layer)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{path}: layer {i}: {e}") from None
    return cache, dict(user)


def _load_mlx_lm_layout(path, arrays, meta):
    """A file written by ``mlx_lm.save_prompt_cache``: class names and scalars in the
    metadata, each cache's ``state`` as a tree (ours carries its meta_state as JSON)."""
    from mlx.utils import tree_unflatten
    try:
        user, classes, scalars = tree_unflatten(list(meta.items()))
        arrays = dict(arrays)
        for pos, kind in scalars[1:]:
            a = arrays[pos]
            arrays[pos] = (a.item() if kind == "scalar" else "".join(chr(c) for c in a.tolist())
                           if kind == "string" else None)
        states = tree_unflatten(list(arrays.items())) if arrays else []
    except Exception:
        raise ValueError(f"{path} has no TurboQuant header and is not a prompt cache written by "
                         "mlx_lm.save_prompt_cache") from None
    cache = []
    for i, name in enumerate(classes):
        state = states[i] if i < len(states) else ()
        try:
            if name in _CLASSES:
                if not isinstance(state, (list, tuple)) or len(state) != 4 or not isinstance(state[3], str):
                    raise ValueError("its state has no meta_state (saved by an older turboquant?)")
                fields = tuple(dict(p) if isinstance(p, dict) else {} for p in state[:3])
                cache.append(_build_layer(json.loads(state[3]), fields))
            elif name in ("TurnedMeanCache", "PreRopeCache"):
                what = "mean's settings" if name == "TurnedMeanCache" else "RoPE settings"
                raise ValueError(f"a {name} saved by mlx_lm.save_prompt_cache, which keeps neither its {what} "
                                 "nor its codecs' configurations; save such caches with turboquant.save_prompt_cache")
            elif hasattr(mlx_cache, name):
                cache.append(getattr(mlx_cache, name).from_state(state))
            else:
                raise ValueError(f"unknown cache class {name!r}")
        except (KeyError, TypeError, ValueError, AttributeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: layer {i}: {e}") from None
    return cache, dict(user) if isinstance(user, dict) else {}


_CLASSES = {"TurboQuantKVCache": TurboQuantKVCache, "TurboQuantRotatingKVCache": TurboQuantRotatingKVCache}
_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def _setting(m: dict, key: str, lo: int = 0, hi: Optional[int] = None, default=None) -> int:
    if key not in m:
        if default is not None:
            return default
        raise ValueError(f"setting {key!r} is missing")
    return check_int(key, m[key], lo, hi)


def _codec_from(config, field: str) -> Codec:
    if not isinstance(config, dict) or not isinstance(config.get("codec"), str):
        raise ValueError(f"{field} must be a codec configuration (a mapping with a 'codec' name), got {config!r}")
    try:
        return from_config(config)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{field}: {e}") from None


def _learning(m: dict, offset: int, kcodec: Codec, vcodec: Codec) -> Optional[dict]:
    """The ``learning`` setting of a cache still fitting its codec, validated (None if absent)."""
    learning = m.get("learning")
    if learning is None:
        return None
    if not isinstance(learning, dict) or set(learning) != {"start", "chunks", "configs", "shared", "fit_from"}:
        raise ValueError(f"setting 'learning' must have start, chunks, configs, shared, fit_from; got {learning!r}")
    start = _setting(learning, "start")
    chunks = learning["chunks"]
    if not isinstance(chunks, list) or not all(isinstance(c, int) and not isinstance(c, bool) and c > 0
                                               for c in chunks) or start + sum(chunks) != offset:
        raise ValueError(f"learning chunks {chunks!r} from {start} do not add up to offset {offset}")
    fit_from, fit_tokens = _setting(learning, "fit_from"), _setting(m, "fit_tokens", 1)
    if sum(chunks) >= fit_from + fit_tokens:
        raise ValueError(f"learning chunks {chunks!r} hold {sum(chunks)} tokens: the fit on {fit_from} + "
                         f"{fit_tokens} tokens would have ended")
    sinks = _setting(m, "sink_tokens", default=0)
    if m.get("class") == "TurboQuantRotatingKVCache" and fit_from:
        raise ValueError(f"a rotating cache has no sinks, but learning starts after {fit_from}")
    if m.get("class") == "TurboQuantKVCache" and (start or sinks != fit_from + fit_tokens):
        raise ValueError(f"a cache still fitting its codec keeps sink_tokens = {fit_from} + {fit_tokens} exact "
                         f"from the start; got sink_tokens={sinks}, start={start}")
    if not isinstance(learning["shared"], bool):
        raise ValueError(f"learning 'shared' must be true or false, got {learning['shared']!r}")
    configs = learning["configs"]
    if not isinstance(configs, list) or len(configs) != 2:
        raise ValueError(f"learning configs must be [key codec, value codec] configurations, got {configs!r}")
    for c, field, fitted in zip(configs, ("key", "value"), (kcodec, vcodec)):
        unfitted = _codec_from(c, f"learning {field} codec")
        if unfitted.dim != fitted.dim or type(unfitted) is not type(fitted):
            raise ValueError(f"learning {field} codec {c!r} is not the unfitted form of {fitted!r}")
    return learning


def _build_layer(m, state) -> TurboQuantKVCache:
    """Validate one layer's settings and tensors, then build its cache."""
    if not isinstance(m, dict):
        raise ValueError(f"layer settings must be a mapping, got {type(m).__name__}")
    cls = _CLASSES.get(m.get("class"))
    if cls is None:
        raise ValueError(f"unknown cache class {m.get('class')!r}")
    offset = _setting(m, "offset")
    fp_window = _setting(m, "fp_window")
    sink = _setting(m, "sink_tokens", default=0)
    if m.get("dtype") not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {m.get('dtype')!r}")
    dtype = _DTYPES[m["dtype"]]
    kcodec, vcodec = _codec_from(m.get("key_codec"), "key_codec"), _codec_from(m.get("value_codec"), "value_codec")
    if cls is TurboQuantRotatingKVCache:
        max_size = _setting(m, "max_size", 1)
        keep = _setting(m, "keep", 0, max_size - 1)
        idx = _setting(m, "idx", 0)
        if fp_window or sink:
            raise ValueError("a rotating cache has no fp_window or sink tokens")
    learning = _learning(m, offset, kcodec, vcodec)
    k, v, rec = state
    if learning is not None:                  # the exact first tokens a learning codec is fitted on
        rec = dict(rec)
        n = min(sum(learning["chunks"]), learning["fit_from"] + _setting(m, "fit_tokens", 1))
        codes = next(iter(k.values())) if k else None
        for name, codec in (("wk", kcodec), ("wv", vcodec)):
            a = rec.pop(name, None)
            ok = a is None if n == 0 else (a is not None and codes is not None and a.dtype == dtype and tuple(
                a.shape) == (*codes.shape[:2], n, codec.dim))
            if not ok:
                raise ValueError(f"exact tensor r.{name} is {None if a is None else (tuple(a.shape), a.dtype)}; "
                                 f"a cache still fitting its codec on {n} tokens needs (B, H, {n}, {codec.dim}) "
                                 f"{dtype}")
    if not offset:
        if k or v or rec:
            raise ValueError("offset 0 but tensors are present")
        return cls.from_state(({}, {}, {}), m)
    B = H = T = None
    for group, codec, fields in (("k", kcodec, k), ("v", vcodec, v)):
        if not fields:
            raise ValueError(f"offset {offset} but no {'key' if group == 'k' else 'value'} codes")
        first = next(iter(fields.values()))
        if first.ndim != 4:
            raise ValueError(f"code fields must be (B, H, T, width), got {tuple(first.shape)}")
        B, H, T = first.shape[:3] if B is None else (B, H, T)
        expected = codec.encode(mx.zeros((1, H, 1, codec.dim))).arrays
        if set(fields) != set(expected):
            raise ValueError(f"{group} code fields {sorted(fields)} do not match {codec!r}: expected {sorted(expected)}")
        for name, a in expected.items():
            f = fields[name]
            want = (B, H, T, a.shape[-1])
            if tuple(f.shape) != want or f.dtype != a.dtype:
                raise ValueError(f"tensor {group}.{name} is {tuple(f.shape)} {f.dtype}; its configuration "
                                 f"implies {want} {a.dtype}")
        try:
            codec.validate_code(fields)
        except ValueError as e:
            raise ValueError(f"tensor {group}.{e}") from None
    if cls is TurboQuantRotatingKVCache:
        if T < min(offset, max_size) or (T > max_size and idx != T) or idx > T or (T > offset and T > max_size):
            raise ValueError(f"{T} stored tokens do not fit offset {offset}, max_size {max_size}, ring index {idx}")
        if rec:
            raise ValueError(f"a rotating cache holds no exact tokens, found {sorted(rec)}")
    else:
        if T != offset:
            raise ValueError(f"{T} stored tokens for offset {offset}")
        want = {}
        if fp_window:
            want.update(k=min(fp_window, offset), v=min(fp_window, offset))
        if sink:
            want.update(sk=min(sink, offset), sv=min(sink, offset))
        if set(rec) != set(want):
            raise ValueError(f"exact-token tensors {sorted(rec)} do not match fp_window={fp_window}, "
                             f"sink_tokens={sink}: expected {sorted(want)}")
        for name, t in want.items():
            a = rec[name]
            if tuple(a.shape) != (B, H, t, kcodec.dim if name in ("k", "sk") else vcodec.dim) or a.dtype != dtype:
                raise ValueError(f"exact tensor r.{name} is {tuple(a.shape)} {a.dtype}; expected "
                                 f"({B}, {H}, {t}, D) {dtype}")
    return cls.from_state(state, m)
