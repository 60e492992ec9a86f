"""The real-model comparison (Chapter 9 and ``turboquant eval``): named cache
configurations, each scored on the same tokens.

``CONFIGS`` maps a name to a ``Config`` (how to build its cache for a model, what it costs,
which family it belongs to): one small class per kind (``Reference``, ``MlxQuantized``,
``Kivi``, ``Codecs``, ``Calibrated``, ``Profile``). The CLI's names are ``CONFIGS``' keys. ``evaluate(model, tokenizer, names, …)`` runs perplexity through the cache,
greedy top-1 agreement, per-layer attention fidelity and, optionally, needle retrieval, and
returns plain JSON-able results.
"""
from __future__ import annotations

import math
import platform
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence, Union

import mlx.core as mx

from . import evaluation as tqeval
from .budget import BUDGETS, GOALS, best_within, codecs_for
from .codecs import AffineCodec, FibQuant, OutlierSplit, PolarQuant, TurboQuantProd
from .data import load_text
from .machine import arithmetic, arithmetic_differences
from .prompt_cache import make_prompt_cache

__all__ = ["mse_config", "best_under", "add_intervals", "diff", "Config", "Reference", "MlxQuantized", "Kivi", "Codecs", "Calibrated", "Profile",
           "Mixed", "KEY_PROBES", "CONFIGS", "ALL_CONFIGS", "CHAPTER_CONFIGS", "calibration_corpus_for", "calibration_statistics", "evaluate", "frontier_rows",
           "intervals_of", "evaluate_domains", "worst_domain", "goal_on_worst", "domain_diffs", "never_worse", "PUBLISHED",
           "best_published", "standing"]


class _LegacyConstructor(type):
    """``Config(family, key, value, …)`` as before #27 (one class for every kind) builds the
    matching subclass, with a deprecation warning; subclasses construct normally."""

    def __call__(cls, *args, **kwargs):
        if cls is not Config:
            return super().__call__(*args, **kwargs)
        from .checks import deprecated
        deprecated("suite.Config(family, …)", "a kind: Reference, MlxQuantized, Kivi, Codecs, Calibrated or Profile")
        return _legacy_config(*args, **kwargs)


def _legacy_config(family, key=None, value=None, fp_window=0, sink_tokens=0, mlx_bits=None, note="", extra=None,
                   kivi=None, calibrated=None, profile_bits=None) -> "Config":
    if kivi is not None:
        return Kivi(*kivi, family=family, note=note)
    if calibrated is not None:
        return Calibrated(family, fit=dict(calibrated), sink_tokens=sink_tokens, note=note)
    if profile_bits is not None:
        return Profile(profile_bits, family=family, note=note)
    if mlx_bits is not None:
        return MlxQuantized(mlx_bits, family=family, note=note)
    if key is None:
        return Reference(family=family, note=note)
    return Codecs(family, key, value, fp_window=fp_window, sink_tokens=sink_tokens, note=note)


class Config(metaclass=_LegacyConstructor):
    """A named cache configuration of the comparison: how to build its cache for a model
    (``make_cache``) and what it costs (``bits``). One subclass per kind: ``Reference``,
    ``MlxQuantized``, ``Kivi``, ``Codecs``, ``Calibrated``, ``Profile``, ``Mixed``."""

    family: str
    note: str
    needs_calibration = False       # fitted on calibration statistics (``make_cache(model, stats)``)
    needs_profile = False           # uses the model's shipped profile
    diagnosis = False               # a measurement instrument, not a cache to choose: left out of "all"

    def make_cache(self, model, stats=None) -> Optional[Callable[[], list]]:
        """A zero-argument cache factory for ``turboquant.evaluation`` (None: fp32 KVCache).
        ``stats``: ``turboquant.calibration.capture_statistics`` of the calibration text, for
        calibrated configurations."""
        raise NotImplementedError

    def bits(self, dim: int) -> float:
        """Average over K and V of the bits per coordinate, side information included."""
        raise NotImplementedError

    def nominal_bits(self, dim: int) -> float:
        """Deprecated name of ``bits``."""
        from .checks import deprecated
        deprecated("suite.Config.nominal_bits(dim)", "Config.bits(dim)")
        return self.bits(dim)

    def fidelity_codecs(self) -> Optional[tuple]:
        """(key factory, value factory, sink tokens) for per-layer attention fidelity, or None
        when the configuration has no codec factories (mlx-lm, KIVI, calibrated, fp32)."""
        return None

    def seeded(self, offset: int, dim: int) -> Optional["Config"]:
        """The same configuration with every random rotation or projection drawn from seed +
        ``offset``, or None when nothing in it is random (``evaluate(seeds=…)``)."""
        return None


@dataclass(frozen=True)
class Reference(Config):
    """The full-precision cache (mlx-lm's ``KVCache``, float32)."""

    family: str = "reference"
    note: str = ""

    def make_cache(self, model, stats=None):
        return None

    def bits(self, dim):
        return 32.0


@dataclass(frozen=True)
class MlxQuantized(Config):
    """mlx-lm's ``QuantizedKVCache(group_size=64, bits)``. It stores each group's scale and
    bias in the dtype of the keys it quantizes: float32 for this package's models (converted
    to float32), so 2·32 bits per group of 64 coordinates, one bit per coordinate (half a
    bit in an fp16 model)."""

    quant_bits: int
    family: str = "mlx-lm affine"
    note: str = "QuantizedKVCache g=64"

    def make_cache(self, model, stats=None):
        from mlx_lm.models.cache import QuantizedKVCache
        n = len(model.layers)
        return lambda: [QuantizedKVCache(group_size=64, bits=self.quant_bits) for _ in range(n)]

    def bits(self, dim, side_dtype_bits: int = 32):
        return self.quant_bits + 2 * side_dtype_bits / 64


@dataclass(frozen=True)
class Kivi(Config):
    """``KIVICache(bits, group, residual)``."""

    kivi_bits: int
    group: int = 32
    residual: int = 32
    family: str = "KIVI-style"
    note: str = ""

    def make_cache(self, model, stats=None):
        from .kivi import KIVICache
        n = len(model.layers)
        return lambda: [KIVICache(self.kivi_bits, self.group, self.residual) for _ in range(n)]

    def bits(self, dim):
        return self.kivi_bits + (32 / self.group + 32 / 64) / 2   # without the float16 recent window: see measured_bits


@dataclass(frozen=True)
class Codecs(Config):
    """Codec factories dim → codec for keys and values (``value`` None: the key factory),
    built by ``make_prompt_cache``."""

    family: str
    key: Callable
    value: Optional[Callable] = None
    fp_window: int = 0
    sink_tokens: int = 0
    note: str = ""
    pre_rope: bool = False          # keys coded before RoPE (``turboquant.prerope.pre_rope``)
    turned_mean: bool = False       # the key mean learned before RoPE (``turboquant.prerope.turned_mean``)

    def make_cache(self, model, stats=None):
        # on models with sliding-window layers fp_window and sinks apply to the global layers
        # only; make_prompt_cache would warn once per cache, i.e. per scoring window here
        make = lambda: make_prompt_cache(model, key_codec=self.key, value_codec=self.value or self.key,
                                         fp_window=self.fp_window, sink_tokens=self.sink_tokens,
                                         warn_rotating=False, pre_rope=self.pre_rope,
                                         turned_mean=self.turned_mean)
        if self.pre_rope or self.turned_mean:
            make()                              # an unsupported model fails here, not in the first window
        return make

    def bits(self, dim):
        kc, vc = self.key(dim), (self.value or self.key)(dim)
        return (kc.bits_per_coordinate + vc.bits_per_coordinate) / 2

    def fidelity_codecs(self):
        if self.pre_rope or self.turned_mean:   # the per-layer fidelity centres keys after RoPE
            return None
        return self.key, self.value or self.key, self.sink_tokens

    def seeded(self, offset: int, dim: int):
        value = self.value or self.key
        if not (_random(self.key(dim).config()) or _random(value(dim).config())):
            return None
        return replace(self, key=_reseeded(self.key, offset), value=_reseeded(value, offset))


def _random(config) -> bool:
    """Whether a codec configuration draws something from its seed (a rotation or a projection;
    an affine codec without a rotation has a seed but draws nothing)."""
    if isinstance(config, dict):
        if "seed" in config and config.get("rotation", "drawn") not in (None, "none"):
            return True
        return any(_random(v) for v in config.values())
    return isinstance(config, list) and any(_random(v) for v in config)


def _shift_seeds(config, offset: int):
    if isinstance(config, dict):
        return {k: (v + offset if k == "seed" else _shift_seeds(v, offset)) for k, v in config.items()}
    return [_shift_seeds(v, offset) for v in config] if isinstance(config, list) else config


def _reseeded(factory, offset: int):
    """``factory`` (dim → codec) with every seed of the codecs it makes moved by ``offset``."""
    from .codecs import from_config
    return lambda d: from_config(_shift_seeds(factory(d).config(), offset))


@dataclass(frozen=True)
class Calibrated(Config):
    """Transform coders fitted per layer on calibration statistics (``fit`` holds
    ``calibration.fit_layers``' arguments)."""

    family: str
    fit: dict = field(default_factory=dict)
    sink_tokens: int = 1
    note: str = ""
    fp_window: int = 0
    needs_calibration = True

    def coders(self, model, stats=None) -> tuple:
        """(key coders, value coders, exact sink tokens, keys coded before RoPE), one coder per
        layer, as ``make_cache`` builds its caches from them."""
        from .calibration import fit_layers
        if stats is None:
            raise ValueError("a calibrated configuration needs calibration statistics")
        keys, values = fit_layers(stats, **self.fit)
        return keys, values, self.sink_tokens, bool(self.fit.get("pre_rope"))   # keys as they were fitted

    def make_cache(self, model, stats=None):
        keys, values, _, before_rope = self.coders(model, stats)
        make = lambda: make_prompt_cache(model, key_codec=keys, value_codec=values, fp_window=self.fp_window,
                                         sink_tokens=self.sink_tokens, warn_rotating=False, pre_rope=before_rope)
        if before_rope:
            make()                                  # an unsupported model fails here, not in the first window
        return make

    def bits(self, dim):
        """What the coders fitted from these arguments cost, plus the exact recent window
        (``fp_window`` copies, counted as float16) spread over a 512-token window: the
        suite's windows, where it costs most. The copies are in the cache's dtype: a float32
        model's cost twice that, as its measured bits show."""
        from .calibration import WINDOW
        from .codecs.transform import TransformCoder
        c = self.fit
        per = lambda b: TransformCoder.bits_for(b, dim, c.get("outliers", 0), c.get("uniform", False))
        return (per(c["key_bits"]) + per(c["value_bits"])) / 2 + 16 * self.fp_window / WINDOW


@dataclass(frozen=True)
class Profile(Config):
    """``make_prompt_cache(model, bits=…, profile=True)``: the model's shipped profile."""

    profile_bits: float
    family: str = "profile (make_prompt_cache(bits=…, profile=True))"
    note: str = "the model's shipped profile: the configuration calibrate chose"
    needs_profile = True

    def make_cache(self, model, stats=None):
        make_prompt_cache(model, bits=self.profile_bits, warn_rotating=False, profile=True)   # fit once, untimed
        return lambda: make_prompt_cache(model, bits=self.profile_bits, warn_rotating=False, profile=True)

    def coders(self, model, stats=None) -> tuple:
        """(key coders, value coders, exact sink tokens, keys coded before RoPE) of the model's
        profile at ``profile_bits``, one coder per layer (``Calibrated.coders``' shape)."""
        from .calibration.profiles import resolve_profile
        from .calibration.store import profile_codecs
        keys, values, sinks, entry = profile_codecs(model, resolve_profile(model, True), self.profile_bits)
        return keys, values, sinks, bool(entry["choice"].get("pre_rope", False))

    def bits(self, dim):
        return self.profile_bits


@dataclass(frozen=True)
class Mixed(Config):
    """A diagnosis: the key coders of the configuration named ``keys`` with the value coders
    of the one named ``values`` (each a ``Calibrated`` or ``Profile`` row of ``CONFIGS``, or
    "exact": that half in float32, ``Identity``), so that a difference between two caches can
    be traced to one half (Chapter 10, "Where the early needle is lost"). Either half may also
    be an unnamed ``Calibrated`` configuration: a coder built only to be read in one half
    (``KEY_PROBES``). The keys decide whether they are coded before RoPE; two coded halves
    must keep the same exact sink tokens."""

    keys: Union[str, Calibrated]
    values: Union[str, Calibrated]
    family: str = "one half from each of two caches (diagnosis)"
    note: str = ""
    diagnosis = True

    def _parts(self) -> tuple:
        """The rows the two halves come from (None for an exact half)."""
        parts = tuple(n if isinstance(n, Config) else None if n == "exact" else CONFIGS.get(n)
                      for n in (self.keys, self.values))
        bad = [n for n, c in zip((self.keys, self.values), parts) if (c is not None or n != "exact") and (
            not isinstance(c, (Calibrated, Profile)) or getattr(c, "fp_window", 0))]
        if bad or parts == (None, None):
            raise ValueError(f"a mixed cache takes its halves from calibrated or profile rows without exact "
                             f"windows, or one half 'exact'; not {bad or ['exact', 'exact']}")
        return parts

    def _coded(self) -> list:
        return [c for c in self._parts() if c is not None]

    @property
    def needs_calibration(self) -> bool:
        return any(c.needs_calibration for c in self._coded())

    @property
    def needs_profile(self) -> bool:
        return any(c.needs_profile for c in self._coded())

    @property
    def fit(self) -> dict:
        """What calibration statistics the calibrated halves need (``calibration_statistics``)."""
        return {k: True for c in self._coded() for k in ("pre_rope", "allocate") if getattr(c, "fit", {}).get(k)}

    def make_cache(self, model, stats=None):
        from .codecs.identity import Identity
        k, v = (None if c is None else c.coders(model, stats) for c in self._parts())
        if k is not None and v is not None and k[2] != v[2]:
            names = [n if isinstance(n, str) else n.note or n.family for n in (self.keys, self.values)]
            raise ValueError(f"{names[0]!r} keeps {k[2]} exact sink tokens and {names[1]!r} {v[2]}: "
                             "a mixed cache needs the same")
        exact = [Identity(_dims(model)) for _ in model.layers]
        keys, before_rope = (exact, False) if k is None else (k[0], k[3])
        values = exact if v is None else v[1]
        sinks = (k or v)[2]
        return lambda: make_prompt_cache(model, key_codec=keys, value_codec=values, sink_tokens=sinks,
                                         warn_rotating=False, pre_rope=before_rope)

    def bits(self, dim):
        """The mean of the two rows' bits (32 for an exact half): exact when each row spends
        the same on keys and values (the rows ``CONFIGS`` mixes do)."""
        return sum(32.0 if c is None else c.bits(dim) for c in self._parts()) / 2


# Key coders read in one half of a ``Mixed`` row, values exact: (name, keys, what they are).
# Each spends KVQuant-style 4's 280 bits per 64-coordinate key (256 payload bits and one exact
# outlier) after RoPE, unless it says otherwise; "equal bits" gives every axis 4 bits (as
# KVQuant-style does), "water-filling" spreads the 256 by each axis's variance (as the profile does).
KEY_PROBES = (
    ("pre-RoPE KVQuant-style 4", "pre-RoPE KVQuant-style 4",
     "KVQuant-style 4's key coder fitted and applied before RoPE"),
    ("channels, water-filling", Calibrated(
        "key coder (diagnosis)", fit=dict(key_bits=4.375, value_bits=4.375, outliers=1, transform="channels"),
        note="per-channel levels, 256 bits spread over the channels by their variance"),
     "per-channel levels with the bits spread by variance"),
    ("KLT, equal bits", Calibrated(
        "key coder (diagnosis)", fit=dict(key_bits=4, value_bits=4, outliers=1, uniform=True),
        note="per-head KLT under the query metric, 4 bits on every axis"),
     "the per-head KLT under the query metric with 4 bits on every axis"),
    ("KLT, water-filling", Calibrated(
        "key coder (diagnosis)", fit=dict(key_bits=4.375, value_bits=4.375, outliers=1),
        note="per-head KLT under the query metric, 256 bits spread by reverse water-filling"),
     "the per-head KLT under the query metric with the bits spread by variance (the profile's coder, "
     "after RoPE)"),
)


def _mse(family, key_bits, value_bits=None, center_keys=False, center_values=False, **kw) -> Config:
    """A TurboQuant_mse configuration through ``budget.codecs_for`` (its one seed convention)."""
    k, v = codecs_for(key_bits, key_bits if value_bits is None else value_bits, center_keys,
                      center_values=center_values)
    return Codecs(family, k, v, **kw)


_ROPE_LEVERS = {   # Chapter 10's levers on the keys' RoPE: row prefix, family, note
    None: ("", "budget (centered keys + sink)", ""),
    "pre_rope": ("pre-RoPE ", "budget, keys before RoPE (lever)",
                 "; keys coded before RoPE, decoded and turned back at each step (no attention from codes)"),
    "turned_mean": ("turned-mean ", "budget, key mean before RoPE (lever)",
                    "; key mean learned before RoPE and turned with each position; attention from codes "
                    "adds q·R_t μ to each score"),
}


def _budget_configs(lever: Optional[str] = None):
    """The uncalibrated budgets as rows; ``lever`` "pre_rope": the same codecs, seeds and sinks
    with the keys coded before RoPE (Chapter 10's lever), the key mean then learned where it
    does not turn with the position; "turned_mean": keys coded after RoPE, centred by that
    pre-RoPE mean turned to each position."""
    prefix, family, note = _ROPE_LEVERS[lever]
    return {f"{prefix}budget K{b.key_bits}/V{b.value_bits}": _mse(
        family, b.key_bits, b.value_bits, b.center_keys, sink_tokens=b.sink_tokens,
        pre_rope=lever == "pre_rope", turned_mean=lever == "turned_mean", note=b.name + note) for b in BUDGETS}


CONFIGS: dict[str, Config] = {
    "fp32": Reference(),
    "mlx-lm affine 8": MlxQuantized(8),
    "mlx-lm affine 4": MlxQuantized(4),
    "uniform 4": Codecs("per-vector uniform", lambda d: AffineCodec(d, 4, 64), note="naive min-max per vector"),
    "uniform 3": Codecs("per-vector uniform", lambda d: AffineCodec(d, 3, 64), note="naive min-max per vector"),
    "uniform 2": Codecs("per-vector uniform", lambda d: AffineCodec(d, 2, 64), note="naive min-max per vector"),
    "TQ-mse 4": _mse("TurboQuant_mse", 4),
    "TQ-mse 3": _mse("TurboQuant_mse", 3),
    "TQ-mse 2": _mse("TurboQuant_mse", 2),
    "TQ-prod 4": Codecs("TurboQuant_prod", lambda d: TurboQuantProd(d, 4)),
    "TQ-prod 3": Codecs("TurboQuant_prod", lambda d: TurboQuantProd(d, 3)),
    "PolarQuant": Codecs("PolarQuant", lambda d: PolarQuant(d)),
    "FibQuant 3.5": Codecs("FibQuant", lambda d: FibQuant(d, 2, 128)),
    "FibQuant 2.5": Codecs("FibQuant", lambda d: FibQuant(d, 2, 32)),
    "K4/V2": _mse("asymmetric", 4, 2),
    "K4/V3": _mse("asymmetric", 4, 3),
    "K3/V4": _mse("asymmetric", 3, 4),
    "TQ-mse 3 + 64 fp recent": _mse("recent window", 3, fp_window=64),
    "outlier split 16@3 + 48@2": Codecs("outlier split", lambda d: OutlierSplit(d, n_outliers=d // 4,
                                                                               outlier_bits=3, bits=2)),
    "centered TQ-mse 4": _mse("centered", 4, center_keys=True, center_values=True),   # both centred, as recorded
    "centered TQ-mse 3": _mse("centered", 3, center_keys=True, center_values=True),
    **_budget_configs(),
    **_budget_configs("pre_rope"),
    **_budget_configs("turned_mean"),
    # ---- published methods, reproduced on the same tokens (Chapter 10)
    **{f"rotated affine {b}": Codecs("rotated affine", lambda d, b=b: AffineCodec(d, b, 64, rotation="hadamard"),
                                     note="randomized Hadamard, then mx.quantize g=64 (mlx-lm #1555, "
                                          "llama.cpp rotated q4_0)") for b in (4, 3, 2)},
    **{f"split channels {b + 1}/{b}": Codecs(
        "split channels", lambda d, b=b: OutlierSplit(d, n_outliers=d // 2, outlier_bits=b + 1, bits=b),
        note="half the channels (highest RMS) at b+1 bits, each half rotated (sharpner's fractional rates)")
       for b in (3, 2)},
    **{f"KIVI {b}": Kivi(b, 32, 32, note="keys per channel in groups of 32 tokens, values per token (g=64), "
                                        "32–63 newest tokens in float16 (counted in measured bits)")
       for b in (4, 2)},
    **{f"KVQuant-style {b}": Calibrated(
        "KVQuant-style", fit=dict(key_bits=b, value_bits=b, outliers=1, transform="channels", uniform=True),
        note="per-channel non-uniform levels fitted on calibration text, 1 exact outlier per vector, "
             "exact first token; after RoPE (mlx-lm applies it before the cache)") for b in (4, 3, 2)},
    **{f"pre-RoPE KVQuant-style {b}": Calibrated(
        "KVQuant-style, keys before RoPE", fit=dict(key_bits=b, value_bits=b, outliers=1, transform="channels",
                                                    uniform=True, pre_rope=True),
        note="as KVQuant-style b, the keys' levels fitted and coded before RoPE (KVQuant's choice; "
             "prerope.PreRopeCache: decoded at each step)") for b in (4, 3, 2)},
    # ---- ours: transform coding calibrated on another text (Chapter 10)
    **{f"calibrated {b}": Calibrated(
        "calibrated transform coding", fit=dict(key_bits=b, value_bits=b, outliers=1),
        note="per-head KLT under the query metric (keys), KLT (values), reverse water-filling, "
             "1 exact outlier, exact first token") for b in (4.25, 3.25, 2.25)},
    **{f"ablation {b}: {label}": Calibrated("calibrated transform coding (ablation)",
                                            fit=dict(key_bits=b, value_bits=b, **kw), note=label)
       for b in (4.25, 3.25, 2.25) for label, kw in (
           ("channels + water-filling", dict(outliers=0, transform="channels")),
           ("KLT", dict(outliers=0, query_metric=False)),
           ("KLT + query metric", dict(outliers=0)),
           ("KLT + query metric + value metric", dict(outliers=0, value_metric=True)))},
    # ---- levers tried on top of "calibrated b" (Chapter 10's ablation)
    **{f"calibrated {b}, value metric": Calibrated(
        "calibrated transform coding (levers)", fit=dict(key_bits=b, value_bits=b, outliers=1, value_metric=True),
        note="as calibrated b, values coded under the output projection's metric W_oᵀW_o")
       for b in (4.25, 3.25, 2.25)},
    **{f"calibrated {b}, layers by sensitivity": Calibrated(
        "calibrated transform coding (levers)", fit=dict(key_bits=b, value_bits=b, outliers=1, allocate=True),
        note="as calibrated b, the bits spread across layers by each layer's measured perplexity "
             "sensitivity (calibration.allocate_layers), same mean") for b in (4.25, 3.25, 2.25)},
    **{f"calibrated {b}, keys before RoPE": Calibrated(
        "calibrated transform coding (levers)", fit=dict(key_bits=b, value_bits=b, outliers=1, pre_rope=True),
        note="as calibrated b, the keys fitted and coded before RoPE, under the query metric averaged over "
             "query-key distances (prerope.PreRopeCache: decoded at each step)") for b in (4.25, 3.25, 2.25)},
    **{f"calibrated {b}, recent 16": Calibrated(
        "calibrated transform coding (levers)", fit=dict(key_bits=b - 0.5, value_bits=b - 0.5, outliers=1),
        fp_window=16, note="calibrated b − 0.5 plus the 16 newest tokens exact (float16): 0.5 bits "
                           "at a 512-token window") for b in (4.25, 3.25, 2.25)},
    **{f"profile {b}": Profile(b) for b in (4.25, 3.25, 2.25)},
    **{f"profile 4.25, exact {half}": Mixed(
        *(("exact", "profile 4.25") if half == "keys" else ("profile 4.25", "exact")),
        family="profile, one half exact (diagnosis)",
        note=f"the shipped profile's coders at 4.25 bits, the {half} held exactly (float32)")
       for half in ("keys", "values")},
    "profile 4.25 keys, KVQuant-style 4 values": Mixed(
        "profile 4.25", "KVQuant-style 4", note="the profile's key coders at 4.25 bits with KVQuant-style 4's "
                                              "value coders"),
    "KVQuant-style 4 keys, profile 4.25 values": Mixed(
        "KVQuant-style 4", "profile 4.25", note="KVQuant-style 4's key coders with the profile's value coders "
                                              "at 4.25 bits"),
    **{f"KVQuant-style 4, exact {half}": Mixed(
        *(("exact", "KVQuant-style 4") if half == "keys" else ("KVQuant-style 4", "exact")),
        note=f"KVQuant-style 4's coders with the {half} held exactly (float32)") for half in ("keys", "values")},
    # which part of KVQuant-style 4's key coder keeps the early needle (Chapter 10): its keys
    # coded before RoPE, and key coders between it and the profile's, at its 280 bits per key
    **{f"{name}, exact values": Mixed(keys, "exact", note=f"{what}; values held exactly (float32)")
       for name, keys, what in KEY_PROBES},
}

# ``turboquant eval --configs all``: every configuration a user could choose (the diagnosis rows,
# one half of a cache held in float32, are named explicitly when wanted)
ALL_CONFIGS = tuple(name for name, config in CONFIGS.items() if not config.diagnosis)

CHAPTER_CONFIGS = ("fp32", "mlx-lm affine 4", "uniform 4", "uniform 3", "TQ-mse 4", "TQ-mse 3",
                   "TQ-mse 2", "TQ-prod 4", "FibQuant 3.5", "K4/V3", "centered TQ-mse 4",
                   "budget K4/V4", "budget K3/V3")


def _dims(model):
    from .memory import geometry_from_model
    return geometry_from_model(model).head_dim


def calibration_corpus_for(names: Sequence[str], corpora: Sequence[str],
                           calibration_corpus: Optional[str] = None, start: int = 0,
                           calibration_windows: int = 8) -> Optional[str]:
    """The text the calibrated configurations among ``names`` are fitted on when they are
    scored on ``corpora``: ``calibration_corpus``, or by default wikipedia (lee when
    wikipedia is scored). ``ValueError`` when it is one of ``corpora`` (a calibrated row is
    never scored on its own calibration tokens) or when both defaults are scored and none
    was named. Scoring from token ``start`` on, past the ``calibration_windows`` windows the
    rows are fitted on, is scoring *held-out* calibration text: allowed. Needs no model: the
    CLI checks before loading one."""
    from .calibration import WINDOW
    if start >= calibration_windows * WINDOW and calibration_corpus is not None:
        return calibration_corpus                # disjoint tokens of the calibration text
    calibrated = [n for n in names if CONFIGS[n].needs_calibration]
    if calibration_corpus is None:
        calibration_corpus = next((c for c in ("wikipedia", "lee") if c not in corpora), None)
        if calibration_corpus is None and calibrated:
            raise ValueError("wikipedia and lee are both scored: name the calibration text (calibration_corpus, "
                             "one the scored corpora do not include)")
    if calibrated and calibration_corpus in corpora:
        raise ValueError(f"{calibration_corpus!r} is the calibration corpus of {calibrated}: score calibrated "
                         f"configurations on other text, or on its held-out part (start ≥ "
                         f"{calibration_windows * WINDOW})")
    return calibration_corpus


def _refuse_tuned_on(model, names, corpus: str, calibration_corpus: str, start: int = 0,
                     calibration_windows: int = 8) -> None:
    """Calibrated rows and profiles are scored only on tokens they were not fitted or
    chosen on (a profile: its calibration windows and the held-out tokens its search
    scored)."""
    calibration_corpus_for(names, [corpus], calibration_corpus, start, calibration_windows)
    profiled = [n for n in names if CONFIGS[n].needs_profile]
    if profiled:
        from .calibration import find_profile
        prof = find_profile(model)
        if prof is None:
            raise ValueError(f"{profiled} need a profile for this model: run `turboquant calibrate` first")
        used = len(prof["calibration"]["ids"]) + int(prof.get("heldout", {}).get("tokens", 0))
        if prof["calibration"]["corpus"] == corpus and start < used:
            raise ValueError(f"{profiled} use a profile calibrated on {corpus!r} (its first {used} tokens): "
                             f"evaluate them on another corpus, or from start ≥ {used}")


def calibration_statistics(model, tokenizer, names: Sequence[str], corpus: str, windows: int = 8,
                           progress: bool = False, positions: Optional[int] = None) -> list[dict]:
    """What the calibrated configurations among ``names`` are fitted on: per-layer
    statistics of ``windows`` windows of ``corpus`` (``calibration.capture_statistics``; with
    ``positions`` the keys and queries spread over [0, positions) by RoPE, else where the
    windows put them: the suite's perplexities are scored in such windows; with the keys
    before RoPE too when a configuration codes them there),
    with each layer's measured "sensitivity" on the first four windows when a
    configuration allocates bits across layers (``calibration.layer_sensitivity``)."""
    from .calibration import WINDOW, capture_statistics, layer_sensitivity
    bos = tqeval.bos_id(tokenizer)
    cal = tqeval.encode_text(tokenizer, load_text(corpus), windows * WINDOW)
    pre = any(getattr(CONFIGS[n], "fit", {}).get("pre_rope") for n in names)
    stats = capture_statistics(model, cal, bos=bos, positions=positions, pre_rope=pre)
    if any(getattr(CONFIGS[n], "fit", {}).get("allocate") for n in names):
        for s, v in zip(stats, layer_sensitivity(model, stats, cal[:4 * WINDOW], bos=bos, progress=progress)):
            s["sensitivity"] = float(v)
    return stats


def evaluate(model, tokenizer, names: Sequence[str], tokens: int = 2048, window: int = 512,
             chunk: int = 128, agreement_tokens: int = 32, fidelity_tokens: int = 512,
             needle_contexts: Sequence[int] = (), needle_depths: Sequence[float] = (0.1, 0.5, 0.9),
             corpus: str = "wikipedia", progress: bool = True,
             model_name: str = "SmolLM2-135M-Instruct (GGUF Q4_1 → float32)",
             calibration_corpus: Optional[str] = None, calibration_windows: int = 8,
             compare: bool = False, needle_values: int = 4, seeds: int = 1,
             statistics: Optional[list] = None, start: int = 0) -> dict:
    """Score each named configuration on the same tokens; returns a JSON-able dict:
    {"setup": …, "results": {name: {ppl, ppl_increase, bits, measured_bits, agreement,
    fidelity: [per-layer cos], needle: {context: accuracy}, needle_cells: [per context × depth: ok, n,
    Wilson interval], needle_trials, kl, top1}}}.

    Calibrated configurations are fitted on ``calibration_windows`` windows of 512 tokens of
    ``calibration_corpus`` (default: wikipedia, or lee when ``corpus`` is wikipedia), which
    must differ from ``corpus`` unless ``start`` (tokens of ``corpus`` skipped before
    scoring) puts the scored tokens past the calibration windows (``statistics``: ``calibration_statistics`` already
    captured on ``calibration_corpus``, as ``evaluate_domains`` passes to every domain);
    profile configurations need a profile calibrated on another text than ``corpus``. ``compare`` adds the mean KL
    divergence from fp32 and the teacher-forced top-1 agreement on every scored token.
    The needle test runs ``needle_values`` secret codes at each depth (trials per context:
    values × depths).

    Every row keeps its per-window sums ("per_window": NLL, scored tokens and, with
    ``compare``, KL and top-1 — one list per rotation seed) and, when fp32 is among the
    names, 95 % intervals ("intervals") of the perplexity increase, KL and top-1 from a
    paired block bootstrap over windows (``evaluation.intervals``; all rows share the same
    resamples). With ``seeds`` > 1, configurations that draw a random rotation or
    projection are scored with ``seeds`` seeds (seed, seed + 1, …: ``Config.seeded``) and
    their numbers pool the seeds; agreement, fidelity and needles use the first."""
    from .checks import check_int
    seeds = check_int("seeds", seeds, 1)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; known: {sorted(CONFIGS)}")
    if calibration_corpus is None:
        calibration_corpus = "lee" if corpus == "wikipedia" else "wikipedia"
    calibrated = [n for n in names if CONFIGS[n].needs_calibration]
    start = check_int("start", start, 0)
    _refuse_tuned_on(model, names, corpus, calibration_corpus, start, calibration_windows)
    text = load_text(corpus)
    ids = tqeval.encode_text(tokenizer, text, start + tokens)[start:]
    if len(ids) < tokens:
        raise ValueError(f"{corpus!r} has {start + len(ids)} tokens: too few for start={start} + tokens={tokens}")
    prompt = ids[:256]
    bos = tqeval.bos_id(tokenizer)
    captured = tqeval.capture_qkv(model, ids[:fidelity_tokens]) if fidelity_tokens else None
    hay = tqeval.encode_text(tokenizer, load_text("lee"), max(needle_contexts)) if needle_contexts else None
    D = _dims(model)
    stats = (statistics if statistics is not None
             else calibration_statistics(model, tokenizer, calibrated, calibration_corpus, calibration_windows,
                                         progress) if calibrated else None)
    sens = [s["sensitivity"] for s in stats] if stats and "sensitivity" in stats[0] else None
    results, began = {}, time.time()
    from .progress import progress as progress_bar
    for name in progress_bar(names, len(names), "configurations", progress):
        cfg = CONFIGS[name]
        mk = cfg.make_cache(model, stats)
        t0 = time.time()
        r = tqeval.perplexity(model, ids, mk, window=window, chunk=chunk, bos=bos,
                              compare=compare and mk is not None)
        runs = [r]
        for offset in range(1, seeds):
            other = cfg.seeded(offset, D)
            if other is None:
                break
            runs.append(tqeval.perplexity(model, ids, other.make_cache(model, stats), window=window, chunk=chunk,
                                          bos=bos, compare=compare and mk is not None))
        per = {k: [run["per_window"][k] for run in runs] for k in r["per_window"] if k != "n"}
        per["n"] = r["per_window"]["n"]
        nll = sum(sum(x) for x in per["nll"]) / (len(runs) * sum(per["n"]))
        row = {"family": cfg.family, "note": cfg.note, "bits": cfg.bits(D),
               "measured_bits": r["bits"], "ppl": math.exp(nll), "nll": nll, "seeds": len(runs),
               "per_window": per}
        if compare:
            n_all = len(runs) * sum(per["n"])
            row["kl"] = sum(sum(x) for x in per["kl"]) / n_all if "kl" in per else 0.0
            row["top1"] = sum(sum(x) for x in per["top1"]) / n_all if "top1" in per else 1.0
        if agreement_tokens and mk is not None:
            row["agreement"] = tqeval.greedy_agreement(model, prompt, agreement_tokens, mk)
        elif agreement_tokens:
            row["agreement"] = 1.0
        if captured is not None and cfg.fidelity_codecs() is not None:
            key, value, sinks = cfg.fidelity_codecs()
            fid = tqeval.layer_fidelity(captured, key, value, sink_tokens=sinks)
            row["fidelity_cos"] = [f["cos_mean"] for f in fid]
        if needle_contexts:
            n = tqeval.needle_accuracy(model, tokenizer, hay, needle_contexts, needle_depths, mk,
                                       values=tqeval.needle_values(needle_values))
            row["needle"] = {str(c): a for c, a in n["accuracy"].items()}
            row["needle_cells"] = n["cells"]
            row["needle_trials"] = n["trials"]
        row["seconds"] = time.time() - t0
        results[name] = row
    ref = results.get("fp32", {}).get("ppl")
    for row in results.values():
        row["ppl_increase"] = (row["ppl"] / ref - 1) if ref else None
    if "fp32" in results:
        add_intervals(results)
    from .data import corpus_info
    return {"setup": {"model": model_name, "corpus": corpus, "corpus_info": corpus_info(corpus), "bos": bos,
                      "start": start,
                      "calibration": {"corpus": calibration_corpus, "windows": calibration_windows,
                                      **({"layer_sensitivity": [float(v) for v in sens]} if sens is not None else {})}
                      if calibrated else None, "compare": compare,
                      "tokens": tokens, "window": window, "chunk": chunk,
                      "agreement_tokens": agreement_tokens, "fidelity_tokens": fidelity_tokens,
                      "needle_contexts": list(needle_contexts), "needle_depths": list(needle_depths),
                      "needle_values": needle_values, "seeds": seeds,
                      "machine": platform.machine(), "mlx": mx.__version__, "arithmetic": arithmetic(),
                      "seconds": time.time() - began},
            "results": results}


def frontier_rows(result: dict) -> list[tuple]:
    """(name, family, bits, ppl, increase %) sorted by bits, for tables and the frontier plot.
    mlx-lm's affine rows take the suite's current ``MlxQuantized.bits`` (5.0 at 4 bits):
    runs recorded before it counted the float32 scales and biases carry 0.5 bits per
    coordinate too few (4.5), and their measured bits can hold mlx-lm's 256-token allocation
    steps as well (513 tokens in 768 slots: 7.49 bits), which is not the codes' rate."""
    rows = []
    for name, r in result["results"].items():
        inc = r.get("ppl_increase")
        cfg = CONFIGS.get(name)
        bits = cfg.bits(None) if isinstance(cfg, MlxQuantized) else r["bits"]
        rows.append((name, r["family"], bits, r["ppl"],
                     float("nan") if inc is None else 100 * inc))
    return sorted(rows, key=lambda t: (t[2], t[3] if not math.isnan(t[3]) else 0))


def add_intervals(results: dict, n_boot: int = 2000, seed: int = 0) -> None:
    """Add "intervals" to every row of ``results`` (``evaluate``'s "results", fp32 among them):
    95 % intervals of the perplexity increase (%), and with ``compare`` of the mean KL and
    the top-1 agreement, from one paired block bootstrap over windows shared by all rows."""
    from .evaluation import intervals as iv
    ref = results["fp32"]["per_window"]
    n = ref["n"]
    windows = iv.resample(len(n), n_boot, seed)
    for row in results.values():
        per = row["per_window"]
        out = {"ppl_increase": iv.ppl_increase(per["nll"], ref["nll"], n, windows).as_dict()}
        if "kl" in per:
            out["kl"] = iv.mean_rate(per["kl"], n, windows).as_dict()
            out["top1"] = iv.mean_rate(per["top1"], n, windows).as_dict()
        row["intervals"] = out


def diff(result: dict, a: str, b: str, n_boot: int = 2000, seed: int = 0) -> dict:
    """The perplexity increase of ``a`` minus that of ``b`` (percentage points) with its 95 %
    interval from the paired block bootstrap, and a verdict: "indistinguishable" when the
    interval holds 0, else which is better."""
    from .evaluation import intervals as iv
    rows = result["results"]
    missing = [x for x in (a, b, "fp32") if x not in rows]
    if missing:
        raise ValueError(f"--diff needs {missing} among the scored configurations")
    old = [x for x in (a, b, "fp32") if "per_window" not in rows[x]]
    if old:
        raise ValueError(f"{old} have no per-window sums (recorded before intervals): re-run them to compare")
    n = rows["fp32"]["per_window"]["n"]
    d = iv.difference(rows[a]["per_window"]["nll"], rows[b]["per_window"]["nll"], rows["fp32"]["per_window"]["nll"],
                      n, iv.resample(len(n), n_boot, seed))
    verdict = "indistinguishable" if d.holds_zero else (f"{a} better" if d.value < 0 else f"{b} better")
    return {"a": a, "b": b, **d.as_dict(), "verdict": verdict}


UPDATE_KEYS = ("model", "corpus", "start", "bos", "tokens", "window", "chunk", "seeds", "compare", "calibration")


def setup_differences(recorded: dict, setup: dict) -> list[str]:
    """How ``setup`` (an ``evaluate`` setup, or the part of one a caller knows before scoring)
    differs from ``recorded`` on the keys that decide what was scored (``UPDATE_KEYS``
    present in ``setup``, calibration aside): one "key: X there, Y here" per difference.
    A recorded setup without "start" scored from token 0."""
    get = lambda s, k: s.get(k, 0 if k == "start" else None)
    return [f"{k}: {get(recorded, k)!r} there, {get(setup, k)!r} here" for k in UPDATE_KEYS
            if k != "calibration" and k in setup and get(recorded, k) != get(setup, k)]


def update_run(recorded: dict, new: dict) -> dict:
    """``recorded`` (an ``evaluate`` result) with the rows of ``new`` added or replacing its
    own — e.g. profile rows re-measured after a re-calibration — without re-running the
    rest. Refused (``ValueError``) unless both runs scored the same tokens the same way
    (``UPDATE_KEYS`` of their setups) and their fp32 rows' per-window sums are identical,
    bit for bit: only then are old and new rows paired. Intervals (and a recorded "diff")
    are recomputed over all rows; the setup lists every update in "updates"."""
    import copy
    for name, run in (("the recorded run", recorded), ("the new run", new)):
        if "fp32" not in run.get("results", {}) or "per_window" not in run["results"]["fp32"]:
            raise ValueError(f"{name} has no fp32 row with per-window sums: rows cannot be paired")
    differ = setup_differences(recorded["setup"], new["setup"])
    cal = lambda r: {k: v for k, v in (r["setup"].get("calibration") or {}).items() if k != "layer_sensitivity"}
    if cal(recorded) and cal(new) and cal(recorded) != cal(new):
        differ.append(f"calibration: {cal(recorded)!r} there, {cal(new)!r} here")
    if differ:
        raise ValueError(f"the runs were not scored the same way: {'; '.join(differ)}")
    if recorded["results"]["fp32"]["per_window"] != new["results"]["fp32"]["per_window"]:
        here = new["setup"].get("arithmetic") or {}
        why = arithmetic_differences(recorded["setup"].get("arithmetic"), here) if here else []
        if recorded["setup"].get("mlx") != new["setup"].get("mlx"):
            why.insert(0, f"mlx: {recorded['setup'].get('mlx')!r} there, {new['setup'].get('mlx')!r} here")
        raise ValueError("the fp32 rows differ in their per-window sums, so old and new rows would not be "
                         f"paired; re-record the whole run ({'; '.join(why) or 'the same recorded arithmetic'})")
    out = copy.deepcopy(recorded)
    rows = [n for n in new["results"] if n != "fp32"]
    out["results"].update(copy.deepcopy({n: new["results"][n] for n in rows}))
    ref = out["results"]["fp32"]["ppl"]
    for row in out["results"].values():
        row["ppl_increase"] = row["ppl"] / ref - 1
    add_intervals(out["results"])
    if "diff" in out:
        out["diff"] = diff(out, out["diff"]["a"], out["diff"]["b"])
    out["setup"].setdefault("updates", []).append({"rows": rows, "seconds": new["setup"].get("seconds"),
                                                   "date": time.strftime("%Y-%m-%d")})
    return out


def intervals_of(result: dict, metric: str = "ppl_increase") -> dict:
    """{name: (lo, hi)}: the 95 % interval of ``metric`` for every row of ``result``
    (``evaluate``'s output) that has one — e.g. the error bars of ``plot_ppl_frontier``."""
    return {name: (r["intervals"][metric]["lo"], r["intervals"][metric]["hi"])
            for name, r in result["results"].items() if metric in r.get("intervals", {})}


def evaluate_domains(model, tokenizer, names: Sequence[str], corpora: Sequence[str], **kw) -> dict:
    """``evaluate`` the same configurations on each corpus of ``corpora`` (held-out domains:
    ``data.DOMAINS``), with the same keyword arguments (seeds, calibration corpus, …):
    {"setup": {"corpora": […], …}, "domains": {corpus: evaluate(…)}}. Calibrated rows are
    fitted on one calibration corpus for every domain (default: wikipedia, or lee when
    wikipedia is scored), and a corpus they were fitted on — or a profile's calibration
    corpus — is refused before anything is scored. Include "fp32" in ``names`` for intervals."""
    corpora = list(dict.fromkeys(corpora))
    if not corpora:
        raise ValueError("evaluate_domains needs at least one corpus")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; known: {sorted(CONFIGS)}")
    cw, start = kw.get("calibration_windows", 8), kw.get("start", 0)
    kw["calibration_corpus"] = calibration_corpus_for(names, corpora, kw.get("calibration_corpus"), start, cw)
    for corpus in corpora:                     # refuse before hours of scoring, not after
        _refuse_tuned_on(model, names, corpus, kw["calibration_corpus"] or "wikipedia", start, cw)
    runs = {}
    calibrated = [n for n in names if CONFIGS[n].needs_calibration]
    if calibrated and kw.get("statistics") is None:       # captured once, for every domain
        kw["statistics"] = calibration_statistics(model, tokenizer, calibrated, kw["calibration_corpus"],
                                                  kw.get("calibration_windows", 8), kw.get("progress", True))
    for corpus in corpora:
        runs[corpus] = evaluate(model, tokenizer, names, corpus=corpus, **kw)
    setup = {k: v for k, v in next(iter(runs.values()))["setup"].items()
             if k not in ("corpus", "corpus_info", "seconds")}
    setup.update(corpora=corpora, corpus_info={c: r["setup"].get("corpus_info") for c, r in runs.items()},
                 seconds=sum(r["setup"]["seconds"] for r in runs.values()))
    return {"setup": setup, "domains": runs}


def worst_domain(run: dict, name: str) -> dict:
    """The held-out domain on which ``name`` loses most perplexity in ``run``
    (``evaluate_domains``'s output): {"corpus", "value", "lo", "hi"} (Δppl %, 95 % interval)."""
    rows = []
    for corpus, result in _domains(run).items():
        if name not in result["results"]:
            raise ValueError(f"{name!r} was not scored on {corpus!r}")
        if "intervals" not in result["results"][name]:
            raise ValueError(f"{name!r} on {corpus!r} has no interval: score it with 'fp32' among the names")
        rows.append({"corpus": corpus, **result["results"][name]["intervals"]["ppl_increase"]})
    return max(rows, key=lambda r: r["value"])


def goal_on_worst(texts: dict, name: str, budget: float) -> dict:
    """The quality goal of ``budget`` (``budget.GOALS``: the largest Δppl % allowed within it)
    checked for ``name`` on the worst of ``texts`` ({text: ``evaluate``'s output}, each held
    out; texts that did not score ``name`` are skipped): ``worst_domain``'s {"corpus", "value",
    "lo", "hi"} and "goal", "texts" (those that scored ``name``), "met" (the worst point
    estimate within the goal: the goals are defined on it), "by" (points above the goal; 0 when
    met) and "settled": whether the 95 % intervals establish that verdict — a miss, when some
    text's interval lies wholly above the goal; a goal met, when every text's lies wholly
    below it. Otherwise the verdict is not established either way."""
    if budget not in GOALS:
        raise ValueError(f"no goal for a budget of {budget!r} bits; the goals: {GOALS}")
    if not isinstance(texts, dict) or not all(isinstance(r, dict) and "results" in r for r in texts.values()):
        raise ValueError("expected {text: evaluate's output} for the texts")
    scored = {t: r for t, r in texts.items() if name in r["results"]}
    if not scored:
        raise ValueError(f"{name!r} was not scored on any of {sorted(texts)}")
    run = {"domains": scored}
    worst = worst_domain(run, name)
    goal = GOALS[budget]
    met = worst["value"] <= goal
    ivs = [r["results"][name]["intervals"]["ppl_increase"] for r in scored.values()]
    settled = all(iv["hi"] < goal for iv in ivs) if met else any(iv["lo"] > goal for iv in ivs)
    return {**worst, "goal": goal, "texts": list(scored), "met": met, "settled": settled,
            "by": max(0.0, worst["value"] - goal)}


def _domains(run: dict) -> dict:
    if not isinstance(run, dict) or "domains" not in run:
        raise ValueError("expected evaluate_domains' output ({'setup': …, 'domains': {corpus: result}}); "
                         "for one corpus use diff / the result's 'intervals'")
    return run["domains"]


def domain_diffs(run: dict, a: str, b: str) -> list:
    """``diff(a, b)`` on every domain of ``run`` (``evaluate_domains``'s output), each with
    its "corpus". ``a`` is *never worse than* ``b`` when no interval lies wholly above 0
    (``never_worse``)."""
    return [{"corpus": corpus, **diff(result, a, b)} for corpus, result in _domains(run).items()]


def never_worse(diffs: Sequence[dict]) -> bool:
    """True when no difference of ``domain_diffs`` is established as a loss (lo > 0)."""
    diffs = list(diffs)
    if not diffs:
        raise ValueError("never_worse needs at least one domain's difference")
    return all(d["lo"] <= 0 for d in diffs)


def mse_config(key_bits: Optional[int] = None, value_bits: Optional[int] = None, center_keys: bool = False,
               sink_tokens: int = 0) -> Config:
    """A TurboQuant_mse configuration: ``key_bits``/``value_bits`` (None: kept exactly, the
    ``Identity`` codec), keys optionally ``Centered``, ``sink_tokens`` exact leading tokens.
    ``mse_config(4, 4, True, 1).make_cache(model)`` is a cache factory for ``turboquant.evaluation``.
    Codecs from ``budget.codecs_for`` (values rotated with seed 1, keys with seed 0)."""
    k, v = codecs_for(key_bits, value_bits, center_keys)
    return Codecs("TQ-mse", key=k, value=v, sink_tokens=sink_tokens)


PUBLISHED = ("mlx-lm affine", "rotated affine", "split channels", "KIVI-style", "KVQuant-style",
             "KVQuant-style, keys before RoPE")
"""The families of published methods (the goals ask to be ahead of each within its budget)."""


def best_published(result: dict, bits: float) -> Optional[str]:
    """Name of the published configuration (a ``PUBLISHED`` family) of ``result`` with the
    smallest perplexity increase within ``bits`` bits per coordinate; None if none fits."""
    rows = [(inc, n, b) for n, fam, b, ppl, inc in frontier_rows(result) if fam in PUBLISHED]
    best = best_within(rows, bits, bits=lambda r: r[2], score=lambda r: r[0])
    return None if best is None else best[1]


def standing(result: dict, ours: str, theirs: Optional[str], numbers: bool = True) -> str:
    """``ours`` against a published row in words, from their paired difference (``diff``):
    "ahead of" / "behind" / "indistinguishable from" ``theirs`` with the difference and its
    interval (points of Δppl; ``numbers=False``: the words alone); rows recorded without
    per-window sums are not ranked."""
    if theirs is None:
        return "none within the budget"
    if any("per_window" not in result["results"][n] for n in (ours, theirs)):
        return f"{theirs}: one seed, not ranked"
    d = diff(result, ours, theirs)
    word = "indistinguishable from" if d["verdict"] == "indistinguishable" else (
        "ahead of" if d["value"] < 0 else "behind")
    return f"{word} {theirs}" + (f" ({d['value']:+.2f} [{d['lo']:+.2f}, {d['hi']:+.2f}])" if numbers else "")


def best_under(result: dict, bits: float, exclude=("reference", "recent window")) -> tuple:
    """(increase %, name, bits) of the configuration of ``result`` (``evaluate``'s output)
    with the smallest perplexity increase within ``bits`` bits per coordinate; families in
    ``exclude`` are left out."""
    rows = [(inc, n, b) for n, fam, b, ppl, inc in frontier_rows(result) if fam not in exclude]
    best = best_within(rows, bits, bits=lambda r: r[2], score=lambda r: r[0])
    if best is None:
        raise ValueError(f"no configuration within {bits} bits per coordinate")
    return best
