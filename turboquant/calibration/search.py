"""The search that writes a profile (Chapter 10, ``turboquant calibrate``): for each budget a
few candidate configurations are fitted on the calibration windows and scored by
perplexity on held-out tokens of the *calibration* text. The first candidate (equal key and
value bits, one exact outlier per vector) is the default (the others: no outlier, half a bit
moved from values to keys, and — where the model allows it — the keys coded before RoPE);
another replaces it only when it is *established* better — its paired 95 % interval of Δppl
difference from the default lies below 0 (``evaluation.intervals.difference``, windows
resampled together) — so a choice never rests on a difference the held-out text cannot tell from noise. A candidate whose
coders cannot represent a held-out key or value (``OutOfRangeError``: a vector with more
coefficients far beyond the fitted range than it stores exactly) is recorded as refused and
left out of the choice."""
from __future__ import annotations

import math
import time
from typing import Optional, Sequence, Union

from ..machine import arithmetic
from .phases import context_length
from .fitting import WINDOW, Choice, capture_statistics, fit_layers, signature
from .profiles import PROFILE_FORMAT, PROFILE_VERSION, ids_digest

__all__ = ["candidates", "candidate_caches", "choose", "calibrate"]


def candidates(budget: float, dim: int, pre_rope: bool = False) -> list[Choice]:
    """The configurations ``calibrate`` compares at a budget, the default first: equal K/V
    bits with one outlier per vector, then without it, half a bit moved from values to keys,
    and with ``pre_rope`` the default with its keys coded before RoPE (those that do not fit
    the budget or the head size are left out)."""
    from ..budget import within
    from ..codecs.transform import TransformCoder
    out = [Choice(budget, budget, 1), Choice(budget, budget, 0), Choice(budget + 0.5, budget - 0.5, 1)]
    if pre_rope:
        out.append(Choice(budget, budget, 1, pre_rope=True))
    return [c for c in out if 24 * c.outliers < TransformCoder.vector_bits(min(c.key_bits, c.value_bits), dim)
            and max(c.key_bits, c.value_bits) <= 8 and within(c.bits(dim), budget)]


def candidate_caches(model, keys, values, choice: Choice):
    """The prompt-cache factory a candidate ``choice`` is scored with: its fitted ``keys`` and
    ``values`` coders (one per layer), its sinks, and its keys before RoPE when it says so."""
    from ..prompt_cache import make_prompt_cache
    return lambda: make_prompt_cache(model, key_codec=keys, value_codec=values, sink_tokens=choice.sink_tokens,
                                     warn_rotating=False, pre_rope=bool(choice.pre_rope))


def choose(tried: list[dict], ref_nll: list[float], n: list[int], n_boot: int = 2000, seed: int = 0) -> int:
    """Index of the candidate a profile takes among ``tried`` (each with "per_window" NLL
    sums on the same windows, or "refused"; the first is the default): the default unless
    others are established better than it (paired interval of the difference wholly below 0),
    then the best of those by point estimate. Adds "vs_default" (the difference and its
    interval, percentage points of Δppl) to every candidate that was scored."""
    from ..evaluation import intervals as iv
    if "refused" in tried[0]:
        raise ValueError(f"the default candidate {tried[0]['choice']} cannot be calibrated: {tried[0]['refused']}")
    windows = iv.resample(len(n), n_boot, seed)
    best, default = 0, tried[0]["per_window"]
    for i, t in enumerate(tried):
        if "refused" in t:
            continue
        d = iv.difference(t["per_window"], default, ref_nll, n, windows)
        t["vs_default"] = d.as_dict()
        if i and d.hi < 0 and (best == 0 or t["ppl"] < tried[best]["ppl"]):
            best = i
    return best


def calibrate(model, tokenizer, budgets: Sequence[float], *, name: str, corpus: str = "wikipedia",
              text: Optional[str] = None, windows: int = 8, heldout: int = 8192,
              positions: Union[int, str, None] = "context", pre_rope: Optional[bool] = None,
              progress: bool = True) -> dict:
    """A profile: for each budget (bits per coordinate), the candidate ``choose`` takes on
    ``heldout`` tokens of the calibration text that follow the ``windows`` calibration
    windows (scored in 512-token windows: the unit of the paired bootstrap). ``text``
    replaces the corpus (``corpus`` then names it). ``positions``: the keys and queries
    are fitted as if spread over that many positions (``phases``; "context": the model's
    own context length), so the profile holds at every position below it; None fits them
    where the windows put them, and the profile then holds only within one window.
    ``pre_rope``: whether to offer the candidates with keys coded before RoPE (None: where the
    model allows it, ``prompt_cache.pre_rope_refusal``; True on a model that does not: ValueError).
    A profile that takes one makes ``make_prompt_cache`` wrap its caches (``PreRopeCache``)."""
    from ..data import load_text
    from ..evaluation import bos_id, encode_text, perplexity
    from ..codecs.transform import OutOfRangeError
    from ..memory import geometry_from_model
    budgets = sorted({float(b) for b in budgets})
    if not budgets or any(not math.isfinite(b) or b <= 0 or b > 8 for b in budgets):
        raise ValueError(f"budgets must be bits per coordinate in (0, 8], got {budgets}")
    from ..prompt_cache import pre_rope_refusal
    if pre_rope is not None and not isinstance(pre_rope, bool):
        raise TypeError(f"pre_rope must be True, False or None (where the model allows it), got {pre_rope!r}")
    refusal = pre_rope_refusal(model) if pre_rope is not False else None
    if pre_rope and refusal:
        raise ValueError(f"pre_rope=True: this model's keys cannot be coded before RoPE: {refusal}")
    pre_rope = pre_rope is not False and refusal is None
    dim = geometry_from_model(model).head_dim
    bos = bos_id(tokenizer)
    source = text if text is not None else load_text(corpus)
    ids = encode_text(tokenizer, source, windows * WINDOW + heldout)
    cal, held = ids[:windows * WINDOW], ids[windows * WINDOW:]
    if positions == "context":
        positions = context_length(model)
    t0 = time.time()
    stats = capture_statistics(model, cal, bos=bos, positions=positions, pre_rope=pre_rope, progress=progress)
    if len(held) < heldout or heldout < 2 * WINDOW:
        raise ValueError(f"the calibration text has {len(ids)} tokens: {windows} windows of {WINDOW} and "
                         f"{heldout} held-out tokens (at least two windows, for an interval) are needed")
    fp32 = perplexity(model, held, None, bos=bos, window=WINDOW)
    ref, ref_nll, n = fp32["ppl"], fp32["per_window"]["nll"], fp32["per_window"]["n"]
    entries = []
    for budget in budgets:
        tried, cands = [], candidates(budget, dim, pre_rope)
        if not cands:
            raise ValueError(f"no calibrated configuration fits {budget} bits per coordinate at head size {dim}")
        for choice in cands:
            keys, values = fit_layers(stats, choice.key_bits, choice.value_bits, choice.outliers,
                                      pre_rope=choice.pre_rope)
            try:
                r = perplexity(model, held, candidate_caches(model, keys, values, choice), bos=bos,
                               window=WINDOW, progress=progress)
            except OutOfRangeError as e:        # cannot code the held-out text: not a candidate
                tried.append({"choice": choice.fields(), "bits": choice.bits(dim), "refused": str(e)})
                continue
            tried.append({"choice": choice.fields(), "ppl": r["ppl"], "ppl_increase": r["ppl"] / ref - 1,
                          "bits": choice.bits(dim), "measured_bits": r["bits"],
                          "per_window": r["per_window"]["nll"]})
        pick = choose(tried, ref_nll, n)
        if progress:
            for i, t in enumerate(tried):
                if "refused" in t:
                    print(f"  {budget:g} bits: {Choice(**t['choice'])} → refused: {t['refused']}", flush=True)
                    continue
                d = t["vs_default"]
                print(f"  {budget:g} bits: {Choice(**t['choice'])} → perplexity {t['ppl']:.3f} "
                      f"({100 * t['ppl_increase']:+.2f} %; vs the default {d['value']:+.2f} "
                      f"[{d['lo']:+.2f}, {d['hi']:+.2f}]){'  ← chosen' if i == pick else ''}", flush=True)
        entries.append({"budget": budget, **{k: v for k, v in tried[pick].items() if k != "per_window"},
                        "candidates": tried})
    return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "model": name, "signature": signature(model),
            "calibration": {"corpus": corpus, "windows": windows, "window": WINDOW, "bos": bos, "sink": 1,
                            "positions": positions, "phase_seed": 0, "ids": cal, "sha256": ids_digest(cal)},
            "heldout": {"tokens": len(held), "fp32_ppl": ref, "window": WINDOW, "fp32_per_window": ref_nll,
                        "n_per_window": n,
                        "rule": "the default (first candidate) unless another's paired 95 % interval of "
                                "Δppl difference lies below 0",
                        "arithmetic": arithmetic()},     # what the low bits of its numbers depend on
            "budgets": entries, "seconds": time.time() - t0}


