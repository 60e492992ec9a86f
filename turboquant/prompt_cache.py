"""Building and converting TurboQuant prompt caches (Chapter 7): ``make_prompt_cache``,
``to_turboquant``. Saving and loading them is ``turboquant.cache_files`` (re-exported
here)."""
from __future__ import annotations

import os
import warnings
from typing import Optional

from mlx_lm.models import cache as mlx_cache

from .cache import TurboQuantKVCache, TurboQuantRotatingKVCache, tag_group
from .cache_files import FORMAT, FORMAT_VERSION, load_prompt_cache, save_prompt_cache
from .codec_tensors import content_digest
from .codecs.base import check_int
from .codecs.spec import CodecSpec, codec_pair
from .memory import cache_count, check_layers, geometry_from_model, model_fingerprint, model_geometry

__all__ = ["make_prompt_cache", "to_turboquant", "save_prompt_cache", "load_prompt_cache", "model_geometry",
           "check_layers", "cache_count", "content_digest", "model_fingerprint",
           "FORMAT", "FORMAT_VERSION", "pre_rope_refusal", "turned_mean_refusal", "window_refusal",
           "codes_keys_before_rope"]

def _ring_layout(c) -> tuple[int, int, int, int]:
    """(offset, keep, max_size, write position) of an mlx-lm ``RotatingKVCache`` through its
    public state (mlx-lm 0.32: keys, values, offset, keep, max_size, idx); a layout this
    package does not know is refused, not guessed."""
    st = c.state
    if len(st) != 6:
        raise ValueError(f"this mlx-lm's RotatingKVCache.state has {len(st)} entries; turboquant reads the "
                         "6 of mlx-lm 0.32 (keys, values, offset, keep, max_size, idx)")
    return tuple(int(x) for x in st[2:])


def _head_dim(model) -> int:
    return geometry_from_model(model).head_dim


def _check_bits(bits) -> None:
    if isinstance(bits, bool) or not isinstance(bits, (int, float)):
        raise TypeError(f"bits must be a number, got {bits!r}")
    if bits != bits or bits <= 0:
        raise ValueError(f"bits must be a positive number of bits per coordinate, got {bits!r}")


def _budget(bits: float, dim: int, key_codec, value_codec, sink_tokens: int, model=None, profile=None):
    """(key codec spec(s), value codec spec(s), sink tokens, keys before RoPE) for a budget of
    ``bits``: the best uncalibrated configuration measured in Chapter 9 (``turboquant.budget``),
    or with ``profile`` (True: the model's own, a dict or a path) the profile's calibrated
    choice (``turboquant.calibration``: one codec per layer; keys before RoPE when the choice
    says so: the caches are then wrapped by ``prerope.pre_rope``). ``bits`` excludes explicit
    codecs and sinks. (A profile's key coders carry the positions they were fitted for:
    ``TransformCoder.positions``.)"""
    from .budget import codecs_for, pick
    if key_codec is not None or value_codec is not None or sink_tokens:
        raise ValueError("give either bits= or key_codec/value_codec/sink_tokens, not both")
    _check_bits(bits)
    if model is not None and profile is not None and profile is not False:
        from .calibration.profiles import resolve_profile
        from .calibration.store import profile_codecs
        keys, values, sinks, entry = profile_codecs(model, resolve_profile(model, profile), bits)
        return keys, values, sinks, bool(entry["choice"].get("pre_rope", False))
    choice = pick(bits, dim)
    return (*codecs_for(choice), choice.sink_tokens, False)


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


def _mlx_reference(model, max_kv_size: Optional[int]) -> list:
    """mlx-lm's caches for ``model``: its own layout, even when ``turboquant.serve.install_caches``
    has made ``model.make_cache`` return TurboQuant caches."""
    factory = getattr(model, "make_cache", None)
    if hasattr(factory, "mlx_layout"):
        with factory.mlx_layout():
            return mlx_cache.make_prompt_cache(model, max_kv_size=max_kv_size)
    return mlx_cache.make_prompt_cache(model, max_kv_size=max_kv_size)


def _rope_refusal(model) -> "str | None":
    """Why ``prerope`` cannot read ``model``'s RoPE (``prerope.rope_of``'s error), or None."""
    from .prerope import rope_of
    try:
        rope_of(model)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def pre_rope_refusal(model) -> "str | None":
    """Why ``model``'s keys cannot be coded before RoPE (a RoPE variant other than ``nn.RoPE``,
    sliding-window layers), or None when every layer's can."""
    refusal = _rope_refusal(model)
    if refusal:
        return refusal
    if any(isinstance(c, mlx_cache.RotatingKVCache) for c in _mlx_reference(model, None)):   # even under serve
        return "the model has sliding-window layers, whose ring of slots does not hold positions in order"
    return None


def window_refusal(max_kv_size: Optional[int], name: str = "max_kv_size") -> "str | None":
    """Why neither the turned key mean nor keys coded before RoPE can go with ``max_kv_size``
    (every layer then a sliding window), or None when ``max_kv_size`` is None: the part of
    ``turned_mean_refusal`` that needs no model, so a command line can refuse the pair before a
    model loads. ``name`` is what the caller calls the option (``--max-kv-size`` on a command
    line)."""
    if max_kv_size is None:
        return None
    return f"{name} makes every layer a sliding window, whose ring of slots does not hold positions in order"


def codes_keys_before_rope(model, bits: float, profile=True) -> bool:
    """Whether ``make_prompt_cache(model, bits=bits, profile=profile)`` codes the keys before
    RoPE (the profile's choice at that budget says so), so that a caller can refuse what cannot
    go with it — a sliding window (``window_refusal``) — before a cache is built. Raises what
    ``make_prompt_cache`` raises for a model without a profile or a budget the profile lacks.
    Nothing is fitted: the profile's choice is read (``calibration.store.profile_choice``)."""
    from .calibration.profiles import resolve_profile
    from .calibration.store import profile_choice
    _check_bits(bits)
    if profile is None or profile is False:             # no profile: the uncalibrated budgets, after RoPE
        return False
    return bool(profile_choice(model, resolve_profile(model, profile), bits)["choice"].get("pre_rope", False))


def turned_mean_refusal(model, max_kv_size: Optional[int] = None) -> "str | None":
    """Why ``model`` cannot take the turned key mean (``prerope.turned_mean``): a RoPE variant
    other than ``nn.RoPE``, or no plain (global) layer — every layer a sliding window, or every
    layer made one by ``max_kv_size`` — or None when it can."""
    refusal = window_refusal(max_kv_size) or _rope_refusal(model)
    if refusal:
        return refusal
    if all(isinstance(c, mlx_cache.RotatingKVCache) for c in _mlx_reference(model, None)):
        return "every layer of this model is a sliding window, whose ring of slots does not hold positions in order"
    return None


def make_prompt_cache(model, key_codec: CodecSpec = None, value_codec: CodecSpec = None,
                      fp_window: int = 0, max_kv_size: Optional[int] = None, sink_tokens: int = 0,
                      bits: Optional[float] = None, warn_rotating: bool = True, profile=None,
                      turned_mean: Optional[bool] = None, pre_rope: bool = False) -> list:
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

    ``bits`` asks for a memory budget instead of codecs: the best uncalibrated configuration
    measured in Chapter 9 (``turboquant.budget``; e.g. 4.25 → centered 4-bit keys, 4-bit
    values, one sink token), with the key mean learned before RoPE and turned with each
    position wherever the model allows it (``turned_mean``, below: the default since Chapter
    10 measured it against the centred rule on the three installed models and five kinds of
    text — better beyond the paired 95 % interval in 14 of 18 comparisons, indistinguishable
    in the other 4, worse in none). It depends on no training text. With
    ``profile`` (True: the model's own calibrated profile, ``turboquant.calibration.find_profile``
    — the installed models ship one; or a profile dict or path), the profile's best
    configuration within ``bits`` instead (transform coders per layer, fitted on the
    profile's calibration text). Calibration pays on text like its calibration text and can
    lose on other domains (Chapter 10 measures how much), so it is not the default. A
    profile's key coders fitted after RoPE are fitted for positions below
    ``TransformCoder.positions`` (spread over the model's whole context; profiles written
    before that, one 512-token window); past it their key error grows many-fold (RoPE turns
    keys with their position) and the cache raises a ``FittedPositionsWarning``. A profile
    configuration fitted on keys before RoPE (``Choice.pre_rope``: ``turboquant calibrate``
    offers it, its interval rule decides; SmolLM2's shipped profile takes it) gives
    ``prerope.PreRopeCache`` layers: the keys' RoPE undone on the way in and applied again to
    the decoded keys on the way out. Such key coders record no positions (a key before RoPE
    does not depend on its position) and never warn; the caches save, load and batch, and
    refuse ``max_kv_size``.
    ``bits`` cannot be combined with ``key_codec``/``value_codec``/``sink_tokens``.

    ``turned_mean`` learns the key mean of the plain layers before RoPE and turns it with each
    position (``prerope.turned_mean``: the same codes, bits and sinks, the codes still read by
    attention from codes; Chapter 10's lever). ``None`` (the default): on for ``bits`` without
    ``profile`` or ``pre_rope`` wherever the model allows it (``turned_mean_refusal``: mlx's
    ``nn.RoPE``, at least one plain layer, no ``max_kv_size``), else the centred rule.
    ``True`` asks for it (a model that does not allow it gets a ``ValueError`` saying why): it
    needs centred keys that learn nothing else, ``bits`` without ``profile`` or a ``Centered``
    key codec. ``False`` keeps the centred rule (the mean learned after RoPE; Chapter 9's
    measured rows). Sliding-window layers keep their mean learned after RoPE either way.

    ``pre_rope=True`` codes every plain layer's keys before RoPE (``prerope.PreRopeCache``):
    for key codecs fitted on keys before RoPE, or to try the budgets' codecs there (Chapter
    10's lever). A profile says this itself, per budget, so ``pre_rope`` is not combined with
    ``profile``; this is the one place where a choice of keys before RoPE becomes wrapped
    caches (the calibration search and the suite build theirs here too).
    """
    if turned_mean is not None and not isinstance(turned_mean, bool):
        raise TypeError(f"turned_mean must be None (the default: where it applies), True or False, got {turned_mean!r}")
    if not isinstance(pre_rope, bool):
        raise TypeError(f"pre_rope must be True or False, got {pre_rope!r}")
    if pre_rope and turned_mean:
        raise ValueError("pre_rope=True codes the keys before RoPE and turned_mean=True centres them after RoPE: "
                         "choose one")
    if pre_rope and profile is not None and profile is not False:
        raise ValueError("pre_rope=True with a profile: the profile records, per budget, whether its key coders "
                         "were fitted before RoPE; leave pre_rope out")
    if turned_mean and bits is None and key_codec is None:
        raise ValueError("turned_mean=True wraps centred keys: give bits= (the budgets centre keys) or a Centered "
                         "key_codec")
    if turned_mean and profile is not None and profile is not False:
        raise ValueError("turned_mean=True wraps the uncalibrated budgets' centred keys; a calibrated profile's "
                         "key coders learn more than a mean: leave profile out")
    if max_kv_size is not None:
        max_kv_size = check_int("max_kv_size", max_kv_size, 1)
    fp_window, sink_tokens = check_int("fp_window", fp_window, 0), check_int("sink_tokens", sink_tokens, 0)
    if profile is not None and profile is not False:
        if not (profile is True or isinstance(profile, (dict, str, os.PathLike))):
            raise TypeError(f"profile must be True (the model's own), a profile dict, a path, None or False, "
                            f"got {profile!r}")
        if bits is None:
            raise ValueError("profile= chooses the configuration for bits=: give bits too")
    calibrated = profile is not None and profile is not False
    if turned_mean is None:                        # the default: a budget's keys around the turned mean
        turned_mean = bits is not None and not calibrated and not pre_rope \
            and turned_mean_refusal(model, max_kv_size) is None
    elif turned_mean:                              # asked for: refused before any cache is built
        refusal = turned_mean_refusal(model, max_kv_size)
        if refusal:
            raise ValueError(f"turned_mean=True needs RoPE positions in order, which this cache cannot have: "
                             f"{refusal}")
    dim = _head_dim(model)
    before_rope = pre_rope
    if bits is not None:
        key_codec, value_codec, sink_tokens, before_rope = _budget(bits, dim, key_codec, value_codec, sink_tokens,
                                                                   model, profile)
        before_rope = before_rope or pre_rope
    if before_rope:                                # refused before any cache is built
        what = "pre_rope=True" if pre_rope else f"the profile's configuration at {bits:g} bits"
        refusal = pre_rope_refusal(model)
        if refusal:
            raise ValueError(f"{what} codes keys before RoPE, which this model does not allow: {refusal}")
        refusal = window_refusal(max_kv_size)
        if refusal:
            raise ValueError(f"{what} codes keys before RoPE, which this cache cannot hold: {refusal}")
    reference = _mlx_reference(model, max_kv_size)
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
    if before_rope:                                # key coders fitted (or tried) before RoPE
        from .prerope import pre_rope as wrap
        return wrap(model, out)                    # it tags the list it returns
    if turned_mean:
        from .prerope import turned_mean as wrap
        return wrap(model, out)                    # it tags the list it returns
    return tag_group(out)


def to_turboquant(cache: list, key_codec: CodecSpec = None, value_codec: CodecSpec = None,
                  fp_window: int = 0, model=None, sink_tokens: int = 0, bits: Optional[float] = None,
                  turned_mean: Optional[bool] = None) -> list:
    """Convert filled mlx-lm caches (``KVCache``, ``RotatingKVCache``) into TurboQuant ones,
    encoding what they hold, as if the tokens had come in one update; other entries and empty
    caches are returned unchanged. The options mean what they mean for ``make_prompt_cache``
    (``fp_window`` and ``sink_tokens`` on plain layers; ``bits`` a measured budget). With
    ``model``, the number of caches is checked against its layers.

    ``turned_mean`` as in ``make_prompt_cache``: ``None`` (the default) converts ``bits`` to
    what ``make_prompt_cache(model, bits=…)`` builds — the key mean learned before RoPE and
    turned with each position in the plain layers — wherever the model allows it
    (``turned_mean_refusal``); it needs ``model`` for the RoPE, so without ``model`` (or with
    ``turned_mean=False``) the key mean is learned after RoPE, the centred rule. ``True`` asks
    for it and is refused (``ValueError``, saying why) without ``bits`` and ``model`` or where
    the model does not allow it or no plain layer holds tokens. Sliding-window layers (of the
    cache or of the model) keep the centred rule either way, as in ``make_prompt_cache``. A
    batch's rows share one key mean, as they do in the default cache fed the batch."""
    if turned_mean is not None and not isinstance(turned_mean, bool):
        raise TypeError(f"turned_mean must be None (the default: where it applies), True or False, got {turned_mean!r}")
    if turned_mean and (bits is None or model is None):
        missing = " and ".join(n for n, v in (("bits=", bits), ("model=", model)) if v is None)
        raise ValueError(f"turned_mean=True converts to the budgets' keys around the turned mean: give {missing} "
                         "(bits the budget, model the RoPE it turns the mean with)")
    if model is not None:
        check_layers(cache, model)
    fp_window, sink_tokens = check_int("fp_window", fp_window, 0), check_int("sink_tokens", sink_tokens, 0)
    from .prerope import TurnedMeanCache
    turned = None
    if bits is not None:
        filled = [c for c in cache if isinstance(c, (mlx_cache.KVCache, mlx_cache.RotatingKVCache)) and not c.empty()]
        if filled:
            key_codec, value_codec, sink_tokens, _ = _budget(bits, filled[0].state[0].shape[-1], key_codec,
                                                             value_codec, sink_tokens)
        if model is not None and turned_mean is not False:
            refusal = turned_mean_refusal(model)
            if refusal and turned_mean:
                raise ValueError(f"turned_mean=True needs RoPE positions in order, which this model's cache cannot "
                                 f"have: {refusal}")
            if not refusal and filled:            # the default's caches, filled below
                dim, want = filled[0].state[0].shape[-1], _head_dim(model)
                if dim != want:
                    raise ValueError(f"the cache holds keys of head size {dim}, the model's are {want}: "
                                     "is the cache from another model?")
                turned = make_prompt_cache(model, bits=bits, fp_window=fp_window, turned_mean=True,
                                           warn_rotating=False)
    out, fill = [], []
    for i, c in enumerate(cache):
        if not isinstance(c, (mlx_cache.KVCache, mlx_cache.RotatingKVCache)) or c.empty():
            out.append(c)
            continue
        keys, values = c.state[0], c.state[1]
        kc, vc = codec_pair(key_codec, value_codec, keys.shape[-1])
        n = min(c.offset, keys.shape[2])          # slots held (a ring may hold fewer than offset)
        k, v = keys[..., :n, :], values[..., :n, :]
        if isinstance(c, mlx_cache.RotatingKVCache):   # the same ring layout as the source cache
            offset, keep, max_size, idx = _ring_layout(c)
            out.append(TurboQuantRotatingKVCache.from_ring(k, v, kc, vc, max_size=max_size, keep=keep,
                                                           offset=offset, idx=idx))
        elif turned is not None and isinstance(turned[i], TurnedMeanCache):   # the default's wrapper takes them
            out.append(turned[i])
            fill.append((turned[i], k, v))
        else:                                     # as if the tokens came in one update
            out.append(TurboQuantKVCache.from_kv(k, v, kc, vc, offset=c.offset, fp_window=fp_window,
                                                 sink_tokens=sink_tokens))
    if turned_mean and not fill:
        raise ValueError("turned_mean=True turns the key mean of plain (global) layers, and no plain layer of this "
                         "cache holds tokens (its filled layers are sliding windows, RotatingKVCache, or the model's "
                         "sliding-window layers)")
    for layer, k, v in fill:                      # each alone: the source's layers may hold different counts
        tag_group([layer])
        layer.update_and_fetch(k, v)
    _warn_rotating(out, fp_window, sink_tokens)
    return tag_group(out)
