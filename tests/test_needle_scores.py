"""``needles.needle_scores``: the right answer's scores summarised per cell, from a recorded grid
(no model needed)."""
import pytest

from turboquant.needles import needle_scores


def _trial(depth, margin, code, value="1111", context=1024):
    return {"context": context, "depth": depth, "value": value, "answer": " x", "ok": margin > 0,
            "start_logp": -1.0, "start_margin": margin, "code_logp": code}


def test_scores_are_means_per_cell_over_the_trials_that_record_them():
    cell = lambda d, c=1024: {"context": c, "depth": d, "ok": 0, "n": 3, "lo": 0.0, "hi": 1.0}
    record = {"results": {
        "a": {"cells": [cell(0.9), cell(0.1), cell(0.1, 2048)],
              "trials": [_trial(0.1, 2.0, -0.1), _trial(0.1, -1.0, -0.3), _trial(0.1, 0.5, -0.2),
                         _trial(0.9, -0.5, -1.0), _trial(0.1, 3.0, -0.05, context=2048)]},
        "old": {"cells": [cell(0.1)],                 # recorded before the scores: left out
                "trials": [{"context": 1024, "depth": 0.1, "value": "1111", "answer": " 1111", "ok": True}]}}}
    rows = needle_scores(record)
    assert [(r["configuration"], r["context"], r["depth"], r["n"], r["starts"]) for r in rows] == \
        [("a", 1024, 0.1, 3, 2), ("a", 1024, 0.9, 1, 0), ("a", 2048, 0.1, 1, 1)]
    assert rows[2]["lead"] == pytest.approx(3.0) and rows[2]["code_logp"] == pytest.approx(-0.05)
    assert rows[0]["lead"] == pytest.approx(0.5) and rows[0]["code_logp"] == pytest.approx(-0.2)
    assert rows[1]["lead"] == pytest.approx(-0.5) and rows[1]["code_logp"] == pytest.approx(-1.0)
    assert needle_scores({"results": {"old": record["results"]["old"]}}) == []


def test_the_code_is_read_when_its_probability_given_the_start_is_above_one_half():
    """p(code | start) > 1/2 makes every token of the code the likeliest at its step, so a
    greedy answer that starts right writes it; exactly 1/2 does not count."""
    import math
    cell = {"context": 1024, "depth": 0.5, "ok": 0, "n": 4, "lo": 0.0, "hi": 1.0}
    half = -math.log(2)
    record = {"results": {"a": {"cells": [cell], "trials": [
        _trial(0.5, -1.0, half + 1e-9, "1"), _trial(0.5, -1.0, half, "2"),
        _trial(0.5, 1.0, -0.01, "3"), _trial(0.5, 1.0, -3.0, "4")]}}}
    (row,) = needle_scores(record)
    assert (row["starts"], row["reads"], row["n"]) == (2, 2, 4)


def test_score_lift_weighs_heads_by_the_attention_the_reference_gives_the_code():
    """needles.score_lift: per layer, the codes' mean lift, heads weighted by the reference's
    attention on the code (a head that does not read it does not count); a row read before
    the lift was recorded is refused with the fix."""
    import numpy as np

    from turboquant.needles import score_lift
    record = {"results": {
        "fp32": {"trials": [{"mass": [[0.6, 0.0], [0.1, 0.3]]}, {"mass": [[0.2, 0.0], [0.1, 0.1]]}]},
        "coded": {"trials": [{"score_lift": [[1.0, 9.0], [2.0, 4.0]]}, {"score_lift": [[3.0, -9.0], [0.0, 0.0]]}]},
        "old": {"trials": [{"mass": [[0.1, 0.1]]}]}}}
    # layer 0: only head 0 reads the code, lift (1 + 3)/2; layer 1: weights 0.1 and 0.2 on lifts 1 and 2
    assert np.allclose(score_lift(record, "coded"), [2.0, (0.1 * 1 + 0.2 * 2) / 0.3])
    with pytest.raises(ValueError, match="read before the score lift was recorded"):
        score_lift(record, "old")
    with pytest.raises(ValueError, match="'nope' is not a row"):
        score_lift(record, "nope")
