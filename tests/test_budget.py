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
        assert r["bits"] == pytest.approx(b.bits_per_coordinate(64))


def test_pick_returns_the_best_measured_within_the_budget():
    for bits in (2.25, 3.0, 4.25, 4.75, 5.25, 6.25, 8.25, 100.0):
        fits = [b for b in BUDGETS if b.bits_per_coordinate(64) <= bits + 1e-9]
        chosen = pick(bits, 64)
        assert chosen in fits
        assert chosen.measured_increase == min(b.measured_increase for b in fits)
    assert (pick(5.25, 64).key_bits, pick(5.25, 64).value_bits) == (5, 4)    # not K5/V5: it measured worse
    with pytest.raises(ValueError, match="smallest is 2.25"):
        pick(2.0, 64)


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_a_budgets_bits_are_its_codecs_own(dim):
    """One rule for bits per coordinate (#27): a budget's bits are the average of what its key
    and value codecs say they cost, not a second formula."""
    from turboquant.budget import codecs_for
    for b in BUDGETS:
        key, value = codecs_for(b)
        assert b.bits_per_coordinate(dim) == (key(dim).bits_per_coordinate + value(dim).bits_per_coordinate) / 2
