"""Model profiles (Chapter 10): which calibrated cache to use at each budget, what it
measured, and the calibration token ids that rebuild it. Shipped profiles live in
``turboquant/profiles``; ``turboquant calibrate`` writes new ones under
``$TURBOQUANT_CACHE/profiles``, where ``find_profile`` looks first."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional, Sequence

from .fitting import WINDOW, Choice, positions_seen, signature
from .phases import valid_positions

__all__ = ["fitted_positions", "profile_path", "shipped_profiles", "find_profile", "load_profile", "save_profile", "profile_entry",
           "resolve_profile", "no_profile_refusal",
           "ids_digest", "PROFILE_FORMAT", "PROFILE_VERSION", "SHIPPED"]

PROFILE_FORMAT = "turboquant-profile"
PROFILE_VERSION = 1
SHIPPED = Path(__file__).resolve().parent.parent / "profiles"


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(str(name)).name) or "model"


def profile_path(name: str) -> Path:
    """Where ``turboquant calibrate`` writes the profile of ``name``: $TURBOQUANT_CACHE/profiles."""
    from ..paths import cache_root
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
    window = cal.get("window", WINDOW)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{path}: calibration window {window!r} is not a positive integer")
    pos = cal.get("positions")
    if pos is not None and not valid_positions(pos, window):
        raise ValueError(f"{path}: calibration positions {pos!r} is not a context length of at least the window")
    seed = cal.get("phase_seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"{path}: calibration phase_seed {seed!r} is not a non-negative integer")
    if not isinstance(p.get("budgets"), list) or not p["budgets"]:
        raise ValueError(f"{path}: no budgets")
    fields = {"key_bits": (int, float), "value_bits": (int, float), "outliers": (int,), "sink_tokens": (int,)}
    for e in p["budgets"]:
        c = e.get("choice") if isinstance(e, dict) else None
        if not isinstance(c, dict) or set(c) - {"pre_rope"} != set(fields) or any(
                isinstance(c[k], bool) or not isinstance(c[k], t) or c[k] < 0 for k, t in fields.items()) \
                or not isinstance(c.get("pre_rope", False), bool) or not isinstance(e.get("ppl"), (int, float)):
            raise ValueError(f"{path}: malformed budget entry {e!r:.200}")
    if not isinstance(p.get("signature"), dict):
        raise ValueError(f"{path}: no model signature")
    return p


def fitted_positions(profile: dict) -> int:
    """Positions below which the profile's coders saw keys (``fitting.positions_seen`` of its
    calibration): its ``positions``, else one window (plus one with a BOS)."""
    cal = profile["calibration"]
    return positions_seen(cal.get("positions"), cal.get("window", WINDOW), cal.get("bos"))


def find_profile(model) -> Optional[dict]:
    """The profile whose signature matches ``model``: the user's ($TURBOQUANT_CACHE/profiles)
    first, then those shipped with the package; None if there is none."""
    from ..paths import cache_root
    sig = signature(model)
    for path in sorted((cache_root() / "profiles").glob("*.json")) + shipped_profiles():
        try:
            p = load_profile(path)
        except ValueError:
            continue
        if p.get("signature") == sig:
            return p
    return None


def no_profile_refusal(name: str = "profile") -> str:
    """What a model without a calibrated profile is told when one was asked for; ``name`` is
    what the caller calls the option (``--profile`` on a command line)."""
    return (f"this model has no calibrated profile; run `turboquant calibrate` first, or leave {name} out "
            "for the uncalibrated budgets")


def resolve_profile(model, profile) -> dict:
    """The profile ``profile`` names, as ``make_prompt_cache(profile=…)`` takes it: True, the
    model's own (``find_profile``; ``ValueError`` when it has none); a path, read and checked
    (``load_profile``); a dict, itself."""
    if isinstance(profile, (str, os.PathLike)):
        return load_profile(profile)
    if profile is True:
        found = find_profile(model)
        if found is None:
            raise ValueError(f"profile=True: {no_profile_refusal()}")
        return found
    if not isinstance(profile, dict):
        raise TypeError(f"profile must be True, a path or a profile dict, got {profile!r}")
    return profile


def profile_entry(profile: dict, bits: float, dim: int) -> dict:
    """The budget entry with the lowest measured perplexity among those within ``bits``."""
    from ..budget import best_within
    size = lambda e: Choice(**e["choice"]).bits(dim)
    best = best_within(profile["budgets"], bits, bits=size, score=lambda e: e["ppl"])
    if best is None:
        lo = min(size(e) for e in profile["budgets"])
        raise ValueError(f"the profile of {profile.get('model')} has no configuration within {bits} bits "
                         f"per coordinate; the smallest is {lo:g}")
    return best
