"""The search that writes a profile (Chapter 10, ``turboquant calibrate``): for each budget a
few candidate configurations are fitted on the calibration windows and scored by
perplexity on held-out tokens of the *calibration* text, and the best is recorded with its
numbers."""
from __future__ import annotations

import math
import time
from dataclasses import asdict
from typing import Optional, Sequence

from .fitting import WINDOW, Choice, capture_statistics, fit_layers, signature
from .profiles import PROFILE_FORMAT, PROFILE_VERSION, ids_digest

__all__ = ["candidates", "calibrate"]


def candidates(budget: float, dim: int) -> list[Choice]:
    """The configurations ``calibrate`` compares at a budget: equal K/V bits with and without
    one outlier per vector, and half a bit moved from values to keys."""
    from ..budget import within
    from ..codecs.transform import TransformCoder
    out = [Choice(budget, budget, 1), Choice(budget, budget, 0), Choice(budget + 0.5, budget - 0.5, 1)]
    return [c for c in out if 24 * c.outliers < TransformCoder.vector_bits(min(c.key_bits, c.value_bits), dim)
            and max(c.key_bits, c.value_bits) <= 8 and within(c.bits(dim), budget)]


def _ppl_factory(model, keys, values, sink):
    from ..prompt_cache import make_prompt_cache
    return lambda: make_prompt_cache(model, key_codec=keys, value_codec=values, sink_tokens=sink,
                                     warn_rotating=False)


def calibrate(model, tokenizer, budgets: Sequence[float], *, name: str, corpus: str = "wikipedia",
              text: Optional[str] = None, windows: int = 8, heldout: int = 2048,
              progress: bool = True) -> dict:
    """A profile: for each budget (bits per coordinate), the candidate with the lowest
    perplexity on ``heldout`` tokens of the calibration text that follow the ``windows``
    calibration windows. ``text`` replaces the corpus (``corpus`` then names it)."""
    from ..data import load_text
    from ..evaluation import bos_id, encode_text, perplexity
    from ..memory import geometry_from_model
    budgets = sorted({float(b) for b in budgets})
    if not budgets or any(not math.isfinite(b) or b <= 0 or b > 8 for b in budgets):
        raise ValueError(f"budgets must be bits per coordinate in (0, 8], got {budgets}")
    dim = geometry_from_model(model).head_dim
    bos = bos_id(tokenizer)
    source = text if text is not None else load_text(corpus)
    ids = encode_text(tokenizer, source, windows * WINDOW + heldout)
    cal, held = ids[:windows * WINDOW], ids[windows * WINDOW:]
    t0 = time.time()
    stats = capture_statistics(model, cal, bos=bos, progress=progress)
    ref = perplexity(model, held, None, bos=bos)["ppl"]
    entries = []
    for budget in budgets:
        tried, cands = [], candidates(budget, dim)
        if not cands:
            raise ValueError(f"no calibrated configuration fits {budget} bits per coordinate at head size {dim}")
        for choice in cands:
            keys, values = fit_layers(stats, choice.key_bits, choice.value_bits, choice.outliers)
            r = perplexity(model, held, _ppl_factory(model, keys, values, choice.sink_tokens), bos=bos,
                           progress=progress)
            tried.append({"choice": asdict(choice), "ppl": r["ppl"], "ppl_increase": r["ppl"] / ref - 1,
                          "bits": choice.bits(dim), "measured_bits": r["bits"]})
            if progress:
                print(f"  {budget:g} bits: {choice} → perplexity {r['ppl']:.3f} "
                      f"({100 * (r['ppl'] / ref - 1):+.2f} %)", flush=True)
        best = min(tried, key=lambda t: t["ppl"])
        entries.append({"budget": budget, **best, "candidates": tried})
    return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "model": name, "signature": signature(model),
            "calibration": {"corpus": corpus, "windows": windows, "window": WINDOW, "bos": bos, "sink": 1,
                            "ids": cal, "sha256": ids_digest(cal)},
            "heldout": {"tokens": len(held), "fp32_ppl": ref},
            "budgets": entries, "seconds": time.time() - t0}


