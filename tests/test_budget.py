"""``make_prompt_cache(bits=)``: the measured configurations and the choice among them."""
import json
from pathlib import Path

import pytest

from turboquant.budget import BUDGETS, RECORDED_RUN, pick

ROOT = Path(__file__).resolve().parents[1]


def test_measured_increases_are_the_recorded_runs():
    results = json.loads((ROOT / RECORDED_RUN).read_text())["results"]
    fp32 = results["fp32"]["ppl"]
    for b in BUDGETS:
        r = results[f"budget K{b.key_bits}/V{b.value_bits}"]
        assert b.measured_increase == pytest.approx(100 * (r["ppl"] / fp32 - 1), abs=0.005)
        assert r["bits"] == pytest.approx(b.bits(64))


def test_pick_returns_the_best_measured_within_the_budget():
    for bits in (2.25, 3.0, 4.25, 4.75, 5.25, 6.25, 8.25, 100.0):
        fits = [b for b in BUDGETS if b.bits(64) <= bits + 1e-9]
        chosen = pick(bits, 64)
        assert chosen in fits
        assert chosen.measured_increase == min(b.measured_increase for b in fits)
    assert (pick(4.75, 64).key_bits, pick(4.75, 64).value_bits) == (5, 4)    # not K4/V4: it measured worse
    with pytest.raises(ValueError, match="smallest is 2.25"):
        pick(2.0, 64)


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_a_budgets_bits_are_its_codecs_own(dim):
    """One rule for bits per coordinate (#27): a budget's bits are the average of what its key
    and value codecs say they cost, not a second formula."""
    from turboquant.budget import codecs_for
    for b in BUDGETS:
        key, value = codecs_for(b)
        assert b.bits(dim) == (key(dim).bits_per_coordinate + value(dim).bits_per_coordinate) / 2


@pytest.mark.parametrize("bits, outliers, uniform", [(4.25, 1, False), (3.3, 0, False), (3, 1, True)])
def test_calibrated_bits_are_the_fitted_coders_own(bits, outliers, uniform):
    """A calibrated configuration's bits (profiles' ``Choice.bits``, the suite's calibrated
    rows) are known before fitting, and equal what the fitted coder reports."""
    import numpy as np
    from turboquant.calibration import Choice
    from turboquant.codecs.transform import TransformCoder
    from turboquant.suite import Calibrated
    x = np.random.default_rng(0).standard_normal((2, 256, 16))
    fitted = TransformCoder.calibrate(x, bits, outliers=outliers, uniform=uniform)
    assert TransformCoder.bits_for(bits, 16, outliers, uniform) == fitted.bits_per_coordinate
    cfg = Calibrated("t", fit=dict(key_bits=bits, value_bits=bits, outliers=outliers, uniform=uniform))
    assert cfg.bits(16) == fitted.bits_per_coordinate
    if not uniform:
        assert Choice(bits, bits, outliers).bits(16) == fitted.bits_per_coordinate


def test_best_within_is_one_rule():
    """Smallest score within the budget (float rounding tolerated), fewer bits on a tie, None
    when nothing fits — for budgets, profiles, the suite and the figures alike."""
    from turboquant.budget import best_within
    rows = [("a", 4.25, 2.0), ("b", 4.0, 2.0), ("c", 3.0, 5.0), ("d", 4.250000000001, 1.0), ("e", 4.3, 0.1)]
    pick_ = lambda budget: best_within(rows, budget, bits=lambda r: r[1], score=lambda r: r[2])
    assert pick_(4.25)[0] == "d"          # 4.25 + 1e-12 fits: float rounding
    assert pick_(4.2)[0] == "b"           # a tie on score: fewer bits
    assert pick_(3.5)[0] == "c" and pick_(2.0) is None
    from turboquant.suite import best_under
    result = {"results": {n: {"family": "x", "bits": b, "ppl": 10 * (1 + e / 100), "ppl_increase": e / 100}
                          for n, b, e in rows}}
    assert best_under(result, 4.2)[1] == "b"
    from turboquant.viz import best_within as viz_best
    assert viz_best(rows, 4.2)[0] == "b"


def test_one_seed_convention_for_keys_and_values():
    """Every TurboQuant_mse configuration rotates values with the key seed + 1 (#27: two
    Chapter 9 tables disagreed because one factory used seed 0 for both)."""
    from turboquant.budget import codecs_for
    from turboquant.suite import CONFIGS, mse_config
    for cfg in (CONFIGS["TQ-mse 4"], CONFIGS["budget K4/V4"], CONFIGS["K4/V3"], mse_config(4, 4, True, 1)):
        k, v = cfg.key(64), cfg.value(64)
        k = getattr(k, "inner", k)
        assert (k.rotation.seed, v.rotation.seed) == (0, 1)
    k, v = codecs_for(4, 4, seed=7)
    assert (k(64).rotation.seed, v(64).rotation.seed) == (7, 8)
