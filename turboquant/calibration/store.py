"""Fitted coders, kept (Chapter 10): ``profile_codecs`` rebuilds a profile's coders from the
model alone — fitted once (about a minute on 2 cores), then kept as tensors under
``$TURBOQUANT_CACHE/coders`` (``coder_store_path``), so a later process loads them in about
a second; memoised within a process (``clear_memo``)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .fitting import WINDOW, Choice, capture_statistics, fit_layers, signature
from .profiles import profile_entry

__all__ = ["profile_codecs", "profile_choice", "coder_store_path", "clear_memo", "CODER_STORE_VERSION"]

_MEMO: dict = {"model": None, "stats": {}, "codecs": {}}


def clear_memo() -> None:
    """Forget the memoised statistics and codecs (e.g. after changing a model's weights in
    place: the memo knows the model object, not its weights)."""
    _MEMO.update(model=None, stats={}, codecs={})


def profile_choice(model, profile: dict, bits: float) -> dict:
    """The entry of ``profile`` that ``profile_codecs(model, profile, bits)`` builds (its
    ``"choice"``: bits, outliers, sinks, ``pre_rope``), read without fitting anything;
    ``ValueError`` for a profile of another model or a budget below its smallest entry."""
    from ..memory import geometry_from_model
    if profile.get("signature") != signature(model):
        raise ValueError(f"the profile is for {profile.get('signature')}, the model is {signature(model)}")
    return profile_entry(profile, bits, geometry_from_model(model).head_dim)


def profile_codecs(model, profile: dict, bits: float, progress: bool = False):
    """(key codecs per layer, value codecs per layer, sink tokens, entry) for the best
    configuration of ``profile`` within ``bits``, fitted on ``model``'s own activations on
    the profile's calibration ids: a profile carries choices and token ids, never codecs.
    Statistics and codecs are memoised for one model object at a time (``clear_memo``).
    An entry whose choice has ``pre_rope`` gives key coders for keys with RoPE undone: its
    caches must be wrapped (``prerope.pre_rope``; ``make_prompt_cache`` does it)."""
    import weakref
    entry = profile_choice(model, profile, bits)
    choice = Choice(**entry["choice"])
    owner = _MEMO["model"]() if _MEMO["model"] is not None else None
    if owner is not model:                      # another model (or a reused id): start afresh
        clear_memo()
        _MEMO["model"] = weakref.ref(model)
    cal = profile["calibration"]
    fields = ("sha256", "bos", "window", "sink") + (("positions", "phase_seed") if cal.get("positions") else ())
    skey = json.dumps({k: cal.get(k) for k in fields}, sort_keys=True)   # a windows-only profile: its old key
    ckey = skey + json.dumps(choice.fields(), sort_keys=True)
    if ckey not in _MEMO["codecs"]:
        stored = coder_store_path(model, ckey)
        coders = _read_coders(stored)
        if coders is None:
            have = _MEMO["stats"].get(skey)
            if have is None or (choice.pre_rope and "k_pre" not in have[0]):   # keys before RoPE: captured too
                _MEMO["stats"][skey] = capture_statistics(model, cal["ids"], bos=cal.get("bos"),
                                                          window=cal.get("window", WINDOW), sink=cal.get("sink", 1),
                                                          positions=cal.get("positions"),
                                                          seed=cal.get("phase_seed", 0), pre_rope=choice.pre_rope,
                                                          progress=progress)
            coders = fit_layers(_MEMO["stats"][skey], choice.key_bits, choice.value_bits, choice.outliers,
                                pre_rope=choice.pre_rope, progress=progress)
            _write_coders(stored, coders)
        _MEMO["codecs"][ckey] = coders
    keys, values = _MEMO["codecs"][ckey]
    return keys, values, choice.sink_tokens, entry


CODER_STORE_VERSION = 2                  # 2: key coders record their positions


def coder_store_path(model, key: str) -> Path:
    """Where the fitted coders of one profile configuration for ``model`` are kept:
    ``$TURBOQUANT_CACHE/coders/<digest>.safetensors``, the digest over the model's
    fingerprint (architecture, sizes, a hash of its weights), the calibration and the
    configuration, so another model or profile never reads them."""
    from .. import __version__
    from ..memory import model_fingerprint
    from ..paths import cache_root
    digest = hashlib.sha256(json.dumps({"model": model_fingerprint(model), "signature": signature(model),
                                        "key": key, "version": CODER_STORE_VERSION, "package": __version__},
                                       sort_keys=True).encode()).hexdigest()[:32]
    return cache_root() / "coders" / f"{digest}.safetensors"


def _write_coders(path: Path, coders) -> None:
    """Save (key coders, value coders) as tensors (``codec_tensors``) with a checksum,
    atomically; a cache that cannot be written only costs the next process a refit."""
    import os
    import warnings
    import mlx.core as mx
    from ..codec_tensors import to_tensors
    from ..codec_tensors import content_digest
    keys, values = coders
    arrays: dict = {}
    header = json.dumps({"version": CODER_STORE_VERSION, "keys": [to_tensors(c.config(), arrays) for c in keys],
                         "values": [to_tensors(c.config(), arrays) for c in values]})
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.safetensors")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(tmp), arrays, {"coders": header, "sha256": content_digest(header, arrays)})
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:                        # mlx raises RuntimeError when it cannot write
        tmp.unlink(missing_ok=True)
        warnings.warn(f"turboquant: could not keep the fitted coders in {path} ({e}); the next process "
                      "fits them again", RuntimeWarning, stacklevel=3)


def _read_coders(path: Path):
    """(key coders, value coders) from ``path``, or None when absent; a damaged file is
    reported and ignored (it is refitted and replaced)."""
    import warnings
    import mlx.core as mx
    from ..codec_tensors import from_tensors
    from ..codecs.base import from_config
    from ..codec_tensors import content_digest
    if not path.is_file():
        return None
    try:
        arrays, meta = mx.load(str(path), format="safetensors", return_metadata=True)
        if content_digest(meta["coders"], arrays) != meta["sha256"]:
            raise ValueError("checksum mismatch")
        head = json.loads(meta["coders"])
        if head.get("version") != CODER_STORE_VERSION:
            raise ValueError(f"version {head.get('version')!r}")
        return ([from_config(from_tensors(c, arrays)) for c in head["keys"]],
                [from_config(from_tensors(c, arrays)) for c in head["values"]])
    except Exception as e:                                      # a cache: never fatal
        warnings.warn(f"turboquant: ignoring the damaged coder file {path} ({type(e).__name__}: {e}); "
                      "fitting again", RuntimeWarning, stacklevel=3)
        return None
