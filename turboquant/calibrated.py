"""Calibrated codecs and model profiles (Chapter 10): what ``make_prompt_cache(model, bits=…)``
needs to rebuild a model's calibrated cache. The search that writes a profile is
``turboquant.calibrate`` (``turboquant calibrate``).

A profile records, for one model, which calibrated cache to use at each memory budget and
what it measured. It is made in three steps, on text that is never the evaluation text:

1. ``capture_statistics``: run the model on calibration windows (512 tokens each, as the
   evaluation scores them) and keep every layer's keys, values and the second moment of
   the queries that read each kv head — without the first token of each window (the
   attention sink: it is kept exactly by the cache and is far from the other keys);
2. ``fit_layers``: per layer, a ``TransformCoder`` for keys (Karhunen–Loève basis under
   the query metric, so the error measured is the score error) and one for values, at
   the given bits, optionally with exact outliers;
3. ``calibrate``: for each budget, a few candidate splits (keys/values bits, outliers) are
   scored by perplexity on held-out tokens of the *calibration* corpus, and the best one is
   recorded with its numbers.

The profile stores the calibration token ids, so ``profile_codecs(model, profile, bits)``
rebuilds the same codecs from the model alone: fitted once (about a minute on 2 cores),
then kept as tensors under ``$TURBOQUANT_CACHE/coders`` (``coder_store_path``), so a later
process loads them in about a second; memoised within a process.
Profiles for the installed models ship in ``turboquant/profiles``; ``turboquant calibrate``
writes new ones under ``$TURBOQUANT_CACHE/profiles``, where ``find_profile`` looks first.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

__all__ = ["Choice", "capture_statistics", "fit_layers", "signature",
           "profile_path", "shipped_profiles", "find_profile", "load_profile", "save_profile",
           "profile_entry", "profile_codecs", "coder_store_path", "clear_memo", "ids_digest", "PROFILE_FORMAT", "PROFILE_VERSION", "WINDOW"]

PROFILE_FORMAT = "turboquant-profile"
PROFILE_VERSION = 1
WINDOW = 512
SHIPPED = Path(__file__).with_name("profiles")


@dataclass(frozen=True)
class Choice:
    """A calibrated configuration: transform-coder bits per coordinate for keys and values
    (side information included: there is none per vector), exact outliers per vector
    (24 bits each, inside those bits) and exact leading tokens."""

    key_bits: float
    value_bits: float
    outliers: int = 1
    sink_tokens: int = 1

    def bits(self, dim: int) -> float:
        """Average over K and V of the fitted coders' ``bits_per_coordinate``
        (``TransformCoder.bits_for``: ⌊bits·D⌋ bits per vector)."""
        from .codecs.transform import TransformCoder
        return (TransformCoder.bits_for(self.key_bits, dim, self.outliers)
                + TransformCoder.bits_for(self.value_bits, dim, self.outliers)) / 2


def _bos(tokenizer) -> Optional[int]:
    from .eval import bos_id
    return bos_id(tokenizer)


def signature(model) -> dict:
    """What identifies a model for a profile: type, layers, kv heads, head size, vocabulary."""
    from .memory import geometry_from_model
    g = geometry_from_model(model)
    args = getattr(model, "args", None)
    return {"model_type": getattr(args, "model_type", type(model).__module__.split(".")[-1]),
            "layers": len(model.layers), "kv_heads": g.n_kv_heads, "head_dim": g.head_dim,
            "vocab_size": int(getattr(args, "vocab_size", 0) or 0)}


def capture_statistics(model, ids: Sequence[int], bos: Optional[int] = None, window: int = WINDOW,
                       sink: int = 1, progress: bool = False) -> list[dict]:
    """Per layer {"k", "v": (H, N, D) float64, "metric": (H, D, D)} from the model run on
    consecutive windows of ``ids`` (each preceded by ``bos`` if given), the first ``sink``
    positions of each window (and the BOS) left out. "metric" is E[q qᵀ] over the query
    heads that read each kv head (grouped-query attention)."""
    from .eval import _progress, capture_qkv
    ids = [int(i) for i in ids]
    n_win = len(ids) // window
    if n_win < 1:
        raise ValueError(f"calibration needs at least one window of {window} tokens, got {len(ids)}")
    head = [] if bos is None else [int(bos)]
    skip = len(head) + sink
    acc = None
    for w in _progress(range(n_win), n_win, "capture", progress):
        cap = capture_qkv(model, head + ids[w * window:(w + 1) * window])
        part = [{n: np.array(layer[n][0, :, skip:]).astype(np.float64) for n in "qkv"} for layer in cap]
        acc = [[p] for p in part] if acc is None else [a + [p] for a, p in zip(acc, part)]
    stats = []
    for parts in acc:
        k = np.concatenate([p["k"] for p in parts], axis=1)
        v = np.concatenate([p["v"] for p in parts], axis=1)
        q = np.concatenate([p["q"] for p in parts], axis=1)
        H, g = k.shape[0], q.shape[0] // k.shape[0]
        metric = np.stack([np.einsum("gnd,gne->de", q[h * g:(h + 1) * g], q[h * g:(h + 1) * g])
                           / (g * q.shape[1]) for h in range(H)])
        stats.append({"k": k, "v": v, "metric": metric})
    return stats


def fit_layers(stats: list[dict], key_bits: float, value_bits: float, outliers: int = 1,
               transform: str = "klt", query_metric: bool = True, uniform: bool = False,
               progress: bool = False) -> tuple[list, list]:
    """(key codecs, value codecs), one ``TransformCoder`` per layer of ``stats``."""
    from .codecs.transform import TransformCoder
    from .eval import _progress
    keys, values = [], []
    for s in _progress(stats, len(stats), "fit", progress):
        metric = s["metric"] if query_metric and transform == "klt" else None
        keys.append(TransformCoder.calibrate(s["k"], key_bits, metric=metric, transform=transform,
                                             outliers=outliers, uniform=uniform))
        values.append(TransformCoder.calibrate(s["v"], value_bits, transform=transform, outliers=outliers,
                                               uniform=uniform))
    return keys, values


# ------------------------------------------------------------------ files
def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(str(name)).name) or "model"


def profile_path(name: str) -> Path:
    """Where ``turboquant calibrate`` writes the profile of ``name``: $TURBOQUANT_CACHE/profiles."""
    from .paths import cache_root
    return cache_root() / "profiles" / f"{_slug(name)}.json"


def shipped_profiles() -> list[Path]:
    return sorted(SHIPPED.glob("*.json"))


def save_profile(profile: dict, path) -> Path:
    """Write atomically (a half-written profile never replaces a good one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(profile))
    tmp.replace(path)
    return path


def ids_digest(ids: Sequence[int]) -> str:
    """SHA-256 of calibration token ids, as a profile records them."""
    return hashlib.sha256(json.dumps([int(i) for i in ids]).encode()).hexdigest()


def load_profile(path) -> dict:
    """Read and validate a profile; ``ValueError`` naming what is wrong."""
    path = Path(path)
    try:
        p = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no profile at {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a profile (invalid JSON: {e})") from None
    if not isinstance(p, dict) or p.get("format") != PROFILE_FORMAT:
        raise ValueError(f"{path} is not a turboquant profile (format {p.get('format') if isinstance(p, dict) else None!r})")
    if p.get("version") != PROFILE_VERSION:
        raise ValueError(f"{path}: profile version {p.get('version')!r}, this turboquant reads {PROFILE_VERSION}")
    cal = p.get("calibration", {})
    ids = cal.get("ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids) or len(ids) < WINDOW:
        raise ValueError(f"{path}: calibration ids missing or malformed")
    if ids_digest(ids) != cal.get("sha256"):
        raise ValueError(f"{path}: calibration ids do not match their checksum (damaged file?)")
    if not isinstance(p.get("budgets"), list) or not p["budgets"]:
        raise ValueError(f"{path}: no budgets")
    fields = {"key_bits": (int, float), "value_bits": (int, float), "outliers": (int,), "sink_tokens": (int,)}
    for e in p["budgets"]:
        c = e.get("choice") if isinstance(e, dict) else None
        if not isinstance(c, dict) or set(c) != set(fields) or any(
                isinstance(c[k], bool) or not isinstance(c[k], t) or c[k] < 0 for k, t in fields.items()) \
                or not isinstance(e.get("ppl"), (int, float)):
            raise ValueError(f"{path}: malformed budget entry {e!r:.200}")
    if not isinstance(p.get("signature"), dict):
        raise ValueError(f"{path}: no model signature")
    return p


def find_profile(model) -> Optional[dict]:
    """The profile whose signature matches ``model``: the user's ($TURBOQUANT_CACHE/profiles)
    first, then those shipped with the package; None if there is none."""
    from .paths import cache_root
    sig = signature(model)
    for path in sorted((cache_root() / "profiles").glob("*.json")) + shipped_profiles():
        try:
            p = load_profile(path)
        except ValueError:
            continue
        if p.get("signature") == sig:
            return p
    return None


def profile_entry(profile: dict, bits: float, dim: int) -> dict:
    """The budget entry with the lowest measured perplexity among those within ``bits``."""
    from .budget import best_within
    size = lambda e: Choice(**e["choice"]).bits(dim)
    best = best_within(profile["budgets"], bits, bits=size, score=lambda e: e["ppl"])
    if best is None:
        lo = min(size(e) for e in profile["budgets"])
        raise ValueError(f"the profile of {profile.get('model')} has no configuration within {bits} bits "
                         f"per coordinate; the smallest is {lo:g}")
    return best


_MEMO: dict = {"model": None, "stats": {}, "codecs": {}}


def clear_memo() -> None:
    """Forget the memoised statistics and codecs (e.g. after changing a model's weights in
    place: the memo knows the model object, not its weights)."""
    _MEMO.update(model=None, stats={}, codecs={})


def profile_codecs(model, profile: dict, bits: float, progress: bool = False):
    """(key codecs per layer, value codecs per layer, sink tokens, entry) for the best
    configuration of ``profile`` within ``bits``, fitted on ``model``'s own activations on
    the profile's calibration ids: a profile carries choices and token ids, never codecs.
    Statistics and codecs are memoised for one model object at a time (``clear_memo``)."""
    import weakref
    from .memory import geometry_from_model
    if profile.get("signature") != signature(model):
        raise ValueError(f"the profile is for {profile.get('signature')}, the model is {signature(model)}")
    entry = profile_entry(profile, bits, geometry_from_model(model).head_dim)
    choice = Choice(**entry["choice"])
    owner = _MEMO["model"]() if _MEMO["model"] is not None else None
    if owner is not model:                      # another model (or a reused id): start afresh
        clear_memo()
        _MEMO["model"] = weakref.ref(model)
    cal = profile["calibration"]
    skey = json.dumps({k: cal.get(k) for k in ("sha256", "bos", "window", "sink")}, sort_keys=True)
    ckey = skey + json.dumps(asdict(choice), sort_keys=True)
    if ckey not in _MEMO["codecs"]:
        stored = coder_store_path(model, ckey)
        coders = _read_coders(stored)
        if coders is None:
            if skey not in _MEMO["stats"]:
                _MEMO["stats"][skey] = capture_statistics(model, cal["ids"], bos=cal.get("bos"),
                                                          window=cal.get("window", WINDOW), sink=cal.get("sink", 1),
                                                          progress=progress)
            coders = fit_layers(_MEMO["stats"][skey], choice.key_bits, choice.value_bits, choice.outliers,
                                progress=progress)
            _write_coders(stored, coders)
        _MEMO["codecs"][ckey] = coders
    keys, values = _MEMO["codecs"][ckey]
    return keys, values, choice.sink_tokens, entry


CODER_STORE_VERSION = 1


def coder_store_path(model, key: str) -> Path:
    """Where the fitted coders of one profile configuration for ``model`` are kept:
    ``$TURBOQUANT_CACHE/coders/<digest>.safetensors``, the digest over the model's
    fingerprint (architecture, sizes, a hash of its weights), the calibration and the
    configuration, so another model or profile never reads them."""
    from .paths import cache_root
    from .memory import model_fingerprint
    from . import __version__
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
    from .codec_tensors import to_tensors
    from .codec_tensors import content_digest
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
    from .codec_tensors import from_tensors
    from .codecs.base import from_config
    from .codec_tensors import content_digest
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
