"""Building, converting, saving and loading TurboQuant prompt caches (Chapter 7)."""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from .cache import TurboQuantKVCache, TurboQuantRotatingKVCache
from .checks import check_out_file
from .codec_tensors import PREFIX, content_digest, from_tensors, to_tensors
from .codecs.base import Codec, check_int, from_config
from .codecs.spec import CodecSpec, codec_pair
from .memory import cache_count, describe_model, geometry_from_model, model_fingerprint, model_geometry

__all__ = ["make_prompt_cache", "to_turboquant", "save_prompt_cache", "load_prompt_cache", "model_geometry",
           "check_layers", "cache_count", "content_digest", "model_fingerprint",
           "FORMAT", "FORMAT_VERSION"]

FORMAT = "turboquant-prompt-cache"
FORMAT_VERSION = 3          # 2 adds a content checksum, 3 codec arrays as tensors; 1 and 2 are still read


def _head_dim(model) -> int:
    return geometry_from_model(model).head_dim


def _tag(cache: list) -> list:
    """Tell each TurboQuant cache the length of its list (``codes_attention`` checks it
    against the model's layers) and the group it belongs to (a failed forward pass marks the
    whole group unusable: ``TurboQuantKVCache.update_and_fetch``)."""
    group = {"caches": [c for c in cache if isinstance(c, TurboQuantKVCache)], "broken": None}
    for i, c in enumerate(group["caches"]):
        c.n_layers, c.group, c.group_index = len(cache), group, i
    return cache


def check_layers(cache: list, model) -> None:
    """Raise unless ``cache`` has one entry per cache ``model`` takes (mlx-lm zips layers and
    caches, so a shorter list silently runs the model without its last layers)."""
    n = cache_count(model)
    if len(cache) != n:
        raise ValueError(f"the prompt cache has {len(cache)} layers, the model has {n}")


def _budget(bits: float, dim: int, key_codec, value_codec, sink_tokens: int, model=None, profile=None):
    """(key codec spec(s), value codec spec(s), sink tokens) for a budget of ``bits``: from the
    model's calibrated profile when there is one (``turboquant.calibrate``: one codec per
    layer), else the best uncalibrated configuration measured in Chapter 9
    (``turboquant.budget``). ``bits`` excludes explicit codecs and sinks."""
    from .budget import codecs_for, pick
    if key_codec is not None or value_codec is not None or sink_tokens:
        raise ValueError("give either bits= or key_codec/value_codec/sink_tokens, not both")
    if isinstance(bits, bool) or not isinstance(bits, (int, float)):
        raise TypeError(f"bits must be a number, got {bits!r}")
    if bits != bits or bits <= 0:
        raise ValueError(f"bits must be a positive number of bits per coordinate, got {bits!r}")
    if model is not None and profile is not False:
        from . import calibrated as calibrate
        prof = profile
        if isinstance(prof, (str, os.PathLike)):
            prof = calibrate.load_profile(prof)
        elif prof is None:
            prof = calibrate.find_profile(model)
        if prof is not None:
            keys, values, sinks, _ = calibrate.profile_codecs(model, prof, bits)
            return keys, values, sinks
    choice = pick(bits, dim)
    return (*codecs_for(choice), choice.sink_tokens)


def _per_layer(spec, i: int, n: int):
    """Layer i's entry of a per-layer list of codec specs (one per cache), else ``spec``."""
    if isinstance(spec, (list, tuple)):
        if len(spec) != n:
            raise ValueError(f"a per-layer codec list needs one entry per cache ({n}), got {len(spec)}")
        return spec[i]
    return spec


def _warn_rotating(cache: list, fp_window: int, sink_tokens: int) -> None:
    """fp_window and sink_tokens apply to plain layers only: say so when rotating ones exist."""
    rotating = sum(isinstance(c, TurboQuantRotatingKVCache) for c in cache)
    if rotating and (fp_window or sink_tokens):
        warnings.warn(f"fp_window={fp_window} and sink_tokens={sink_tokens} apply to plain (global) "
                      f"layers only; the {rotating} rotating (sliding-window) layers of this cache hold "
                      "every token as codes", UserWarning, stacklevel=3)


def make_prompt_cache(model, key_codec: CodecSpec = None, value_codec: CodecSpec = None,
                      fp_window: int = 0, max_kv_size: Optional[int] = None, sink_tokens: int = 0,
                      bits: Optional[float] = None, warn_rotating: bool = True, profile=None) -> list:
    """The right TurboQuant cache for each layer of an mlx-lm model.

    Layers whose mlx-lm cache is a ``RotatingKVCache`` (sliding-window layers) get a
    ``TurboQuantRotatingKVCache`` with the same ``max_size`` and ``keep``; ``KVCache`` layers
    get a ``TurboQuantKVCache``. With ``max_kv_size`` every layer gets a rotating cache of at
    most that many tokens (``keep=4`` as in mlx-lm; a sliding-window layer keeps its own
    window if it is smaller) — for every model, including those whose ``make_cache`` makes
    mlx-lm ignore ``max_kv_size``. Other cache kinds (SSM states, …) are kept as mlx-lm
    makes them.

    ``fp_window`` and ``sink_tokens`` apply to the plain (global) layers only: a rotating
    cache holds every token as codes, so with rotating layers present they are ignored there
    with a warning (``warn_rotating=False``: silently, for callers that build many caches).

    ``key_codec``/``value_codec`` may also be lists with one specification per cache (per
    layer), e.g. codecs calibrated per layer.

    ``bits`` asks for a memory budget instead of codecs. With a calibrated profile for this
    model (``profile``: a profile dict or path; None: the one ``turboquant.calibrate.find_profile``
    finds — the installed models ship one; False: do not use profiles), the profile's best
    measured configuration within ``bits`` (transform coders per layer, fitted on the
    profile's calibration text; Chapter 10). Without one, the best uncalibrated configuration
    measured in Chapter 9 (``turboquant.budget``; e.g. 4.25 → centered 4-bit keys, 4-bit
    values, one sink token). ``bits`` cannot be combined with
    ``key_codec``/``value_codec``/``sink_tokens``.
    """
    if max_kv_size is not None:
        max_kv_size = check_int("max_kv_size", max_kv_size, 1)
    fp_window, sink_tokens = check_int("fp_window", fp_window, 0), check_int("sink_tokens", sink_tokens, 0)
    if profile is not None and profile is not False:
        if isinstance(profile, bool) or not isinstance(profile, (dict, str, os.PathLike)):
            raise TypeError(f"profile must be a profile dict, a path, None or False, got {profile!r}")
        if bits is None:
            raise ValueError("profile= chooses the configuration for bits=: give bits too")
    dim = _head_dim(model)
    if bits is not None:
        key_codec, value_codec, sink_tokens = _budget(bits, dim, key_codec, value_codec, sink_tokens,
                                                      model, profile)
    reference = mlx_cache.make_prompt_cache(model, max_kv_size=max_kv_size)
    out = []
    for i, c in enumerate(reference):
        n = len(reference)
        kc, vc = codec_pair(_per_layer(key_codec, i, n), _per_layer(value_codec, i, n), dim)
        if isinstance(c, mlx_cache.RotatingKVCache):
            size = c.max_size if max_kv_size is None else min(c.max_size, max_kv_size)
            out.append(TurboQuantRotatingKVCache(size, kc, vc, keep=min(c.keep, size - 1)))
        elif isinstance(c, mlx_cache.KVCache) and max_kv_size is not None:
            out.append(TurboQuantRotatingKVCache(max_kv_size, kc, vc, keep=min(4, max_kv_size - 1)))
        elif isinstance(c, mlx_cache.KVCache):
            out.append(TurboQuantKVCache(kc, vc, fp_window=fp_window, sink_tokens=sink_tokens))
        else:
            out.append(c)
    if warn_rotating:
        _warn_rotating(out, fp_window, sink_tokens)
    return _tag(out)


def to_turboquant(cache: list, key_codec: CodecSpec = None, value_codec: CodecSpec = None,
                  fp_window: int = 0, model=None, sink_tokens: int = 0, bits: Optional[float] = None) -> list:
    """Convert filled mlx-lm caches (``KVCache``, ``RotatingKVCache``) into TurboQuant ones,
    encoding what they hold; other entries are returned unchanged. The options mean what
    they mean for ``make_prompt_cache`` (``fp_window`` and ``sink_tokens`` on plain layers;
    ``bits`` a measured budget). With ``model``, the number of caches is checked against
    its layers."""
    if model is not None:
        check_layers(cache, model)
    fp_window, sink_tokens = check_int("fp_window", fp_window, 0), check_int("sink_tokens", sink_tokens, 0)
    if bits is not None:
        filled = [c for c in cache if isinstance(c, (mlx_cache.KVCache, mlx_cache.RotatingKVCache)) and not c.empty()]
        if filled:
            key_codec, value_codec, sink_tokens = _budget(bits, filled[0].state[0].shape[-1], key_codec,
                                                          value_codec, sink_tokens)
    out = []
    for c in cache:
        if not isinstance(c, (mlx_cache.KVCache, mlx_cache.RotatingKVCache)) or c.empty():
            out.append(c)
            continue
        keys, values = c.state[0], c.state[1]
        dim = keys.shape[-1]
        kc, vc = codec_pair(key_codec, value_codec, dim)
        rotating = isinstance(c, mlx_cache.RotatingKVCache)
        new = (TurboQuantRotatingKVCache(c.max_size, kc, vc, keep=c.keep) if rotating
               else TurboQuantKVCache(kc, vc, fp_window=fp_window, sink_tokens=sink_tokens))
        n = min(c.offset, keys.shape[2])          # slots held (a ring may hold fewer than offset)
        k, v = keys[..., :n, :], values[..., :n, :]
        if not rotating:                          # as if the tokens came in one update
            new.offset = c.offset - n
            new.update_and_fetch(k, v)
            out.append(new)
            continue
        new._check(k, v)
        for codec, x in ((new.key_codec, k), (new.value_codec, v)):
            if hasattr(codec, "fit") and not getattr(codec, "fitted", True):
                codec.fit(x[..., :new.fit_tokens, :])   # a ring's first held tokens, in ring order
        new.key_codes, new.value_codes = new._encode(k, v)
        new.offset = c.offset
        new._idx = c._idx                         # same ring layout as the source cache
        out.append(new)
    _warn_rotating(out, fp_window, sink_tokens)
    return _tag(out)


def save_prompt_cache(path, cache: list, metadata: Optional[dict] = None, model=None) -> None:
    """Save TurboQuant caches (codes, codec configurations, offsets, a SHA-256 of it all) to
    a safetensors file at exactly ``path`` (any name: ``.safetensors`` is not appended),
    atomically: the file at ``path`` is replaced only once the new one is complete. With
    ``model``, its ``model_fingerprint`` is saved too, and ``load_prompt_cache(path,
    model=…)`` refuses another model. Load it with ``turboquant.load_prompt_cache``
    (mlx-lm's loader does not know these classes)."""
    if not isinstance(cache, (list, tuple)) or not all(isinstance(c, TurboQuantKVCache) for c in cache):
        raise TypeError("save_prompt_cache saves a list of TurboQuant caches only; use mlx_lm's for others")
    if metadata is not None and (not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise TypeError("metadata must map str to str")
    arrays, layers, codec_arrays = {}, [], {}
    for i, c in enumerate(cache):
        k, v, rec = c.state[:3]
        for group, fields in (("k", k), ("v", v), ("r", rec)):
            for name, a in fields.items():
                if a is not None:
                    arrays[f"{i}.{group}.{name}"] = a
        layers.append(to_tensors(c.meta_state, codec_arrays))   # fitted coders' arrays: tensors, once each
    arrays.update(codec_arrays)
    head = {"format": FORMAT, "version": FORMAT_VERSION, "layers": layers, "user": metadata or {}}
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
    if model is not None:
        _check_model(path, cache, model)
        if saved_from is not None and saved_from != model_fingerprint(model):
            raise ValueError(f"{path}: this cache was filled by {describe_model(saved_from)}, not by the model given, "
                             f"{describe_model(model_fingerprint(model))}: its keys and values mean nothing there")
    _tag(cache)
    return (cache, user) if return_metadata else cache


def _check_model(path, cache, model) -> None:
    _, kv, d = model_geometry(model)
    try:
        check_layers(cache, model)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    for i, c in enumerate(cache):
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
    groups = [{g: {} for g in "kvr"} for _ in layers]
    for name, a in arrays.items():
        if name in used:
            continue
        parts = name.split(".", 2)
        if len(parts) != 3 or not parts[0].isdigit() or int(parts[0]) >= len(layers) \
                or parts[1] not in ("k", "v", "r") or not parts[2]:
            raise ValueError(f"{path}: orphan tensor {name!r} (expected 'LAYER.k|v|r.FIELD' with LAYER < {len(layers)})")
        groups[int(parts[0])][parts[1]][parts[2]] = a
    cache = []
    for i, (m, g) in enumerate(zip(layers, groups)):
        try:
            cache.append(_build_layer(m, (g["k"], g["v"], g["r"])))
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


def _check_indices(codec: Codec, fields: dict, group: str) -> None:
    """Vector codebooks whose size is not a power of two leave index values unused: a code
    that names one would index past the codebook."""
    inner = getattr(codec, "inner", codec)
    n = getattr(inner, "n_codewords", None)
    if n is None or n == 1 << inner.index_bits or "idx" not in fields:
        return
    from .packing import unpack
    idx = unpack(fields["idx"], inner.index_bits, inner.dim // inner.k)
    top = mx.max(idx).item() if idx.size else 0
    if top >= n:
        raise ValueError(f"tensor {group}.idx names codeword {top}, the codebook has {n}")


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
        _check_indices(codec, fields, group)
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
