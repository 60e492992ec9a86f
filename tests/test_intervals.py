"""The paired block bootstrap of ``turboquant.evaluation.intervals`` against cases with a
known answer."""
import numpy as np
import pytest

from turboquant.evaluation.intervals import Interval, difference, mean_rate, ppl_increase, resample


def _windows(W=400, n=511, delta=0.01, sigma=0.02, hard=0.5, seed=0):
    """Per-window NLL sums: the reference 3 nats per token plus a per-window difficulty
    (shared by every cache: ``hard``), a configuration ``delta`` nats worse per token with
    per-window noise ``sigma``."""
    rng = np.random.default_rng(seed)
    counts = np.full(W, n, dtype=float)
    difficulty = hard * rng.standard_normal(W)
    ref = counts * (3.0 + difficulty)
    cfg = ref + counts * (delta + sigma * rng.standard_normal(W))
    return ref, cfg, counts


def test_identical_configurations_differ_by_exactly_zero():
    ref, cfg, n = _windows()
    d = difference(cfg, cfg, ref, n)
    assert d == Interval(0.0, 0.0, 0.0) and d.holds_zero
    both = np.stack([cfg, cfg + n * 0.05])                    # two seeds, also identical on both sides
    assert difference(both, both, ref, n) == Interval(0.0, 0.0, 0.0)


def test_the_interval_has_the_width_the_variance_implies():
    """Per-window noise σ per token over W windows: the mean's standard error is σ/√W, so the
    95 % interval of Δppl is about 100·(±1.96 σ/√W) around 100·(e^δ − 1)."""
    W, sigma, delta = 400, 0.02, 0.01
    ref, cfg, n = _windows(W=W, sigma=sigma, delta=delta)
    r = ppl_increase(cfg, ref, n)
    assert r.lo < r.value < r.hi
    half = (r.hi - r.lo) / 2
    assert half == pytest.approx(100 * 1.96 * sigma / np.sqrt(W), rel=0.15)
    assert r.lo < 100 * (np.exp(delta) - 1) < r.hi


def test_pairing_removes_what_every_cache_shares():
    """Hard windows are hard for every cache: with pairing their spread (here 25 times the
    noise) leaves the interval of Δppl unchanged."""
    narrow = ppl_increase(*[_windows(hard=0.0)[i] for i in (1, 0, 2)])
    wide = ppl_increase(*[_windows(hard=0.5)[i] for i in (1, 0, 2)])
    assert (wide.hi - wide.lo) == pytest.approx(narrow.hi - narrow.lo, rel=0.05)


def test_a_difference_inside_the_noise_holds_zero_and_one_outside_does_not():
    ref, a, n = _windows(delta=0.010, seed=1)
    _, b, _ = _windows(delta=0.011, seed=2)                   # 0.1 % apart, noise ±0.28 %
    assert difference(a, b, ref, n).holds_zero
    _, c, _ = _windows(delta=0.03, seed=3)                    # 2 % apart
    d = difference(c, a, ref, n)
    assert not d.holds_zero and d.lo > 1.0


def test_seeds_widen_the_interval_by_their_spread():
    ref, cfg, n = _windows(sigma=0.005)
    one = ppl_increase(cfg, ref, n)
    seeds = np.stack([cfg + n * s for s in (-0.01, 0.0, 0.01)])   # rotations ±1 % apart
    three = ppl_increase(seeds, ref, n)
    assert three.value == pytest.approx(one.value, abs=1e-9)      # the mean over seeds
    assert (three.hi - three.lo) > 2 * (one.hi - one.lo)


def test_rates_and_resamples():
    n = np.full(50, 100.0)
    top1 = np.full(50, 90.0)
    r = mean_rate(top1, n)
    assert r == Interval(0.9, 0.9, 0.9)
    idx = resample(50, n_boot=10, seed=3)
    assert idx.shape == (10, 50) and idx.min() >= 0 and idx.max() < 50
    assert np.array_equal(idx, resample(50, n_boot=10, seed=3))       # seeded
    with pytest.raises(ValueError, match="windows"):
        ppl_increase(np.zeros(3), np.zeros(4), np.ones(4))
    with pytest.raises(ValueError, match="NaN"):
        ppl_increase(np.array([np.nan, 0.0]), np.zeros(2), np.ones(2))
    with pytest.raises(ValueError, match="at least one window"):
        resample(0)


def test_domains_worst_and_never_worse_read_the_paired_differences():
    """suite.worst_domain picks the largest increase; never_worse fails only where a
    difference is established (its interval wholly above 0)."""
    from turboquant.suite import add_intervals, domain_diffs, never_worse, worst_domain

    def domain(delta_a, delta_b, seed):
        ref, a, n = _windows(W=40, delta=delta_a, sigma=0.002, seed=seed)
        b = ref + n * delta_b
        rows = {name: {"per_window": {"nll": list(x), "n": list(n)}} for name, x in
                (("fp32", ref), ("a", a), ("b", b))}
        add_intervals(rows, n_boot=500)
        return {"results": rows}

    run = {"domains": {"prose": domain(0.010, 0.010, 0), "code": domain(0.050, 0.010, 1)}}
    w = worst_domain(run, "a")
    assert w["corpus"] == "code" and w["lo"] <= w["value"] <= w["hi"]
    assert w["value"] == pytest.approx(100 * (np.exp(0.050 + 0.002 * 0) - 1), abs=0.2)
    diffs = {d["corpus"]: d for d in domain_diffs(run, "a", "b")}
    assert diffs["prose"]["verdict"] == "indistinguishable" and diffs["code"]["verdict"] == "b better"
    assert not never_worse(diffs.values()) and never_worse([diffs["prose"]])
    with pytest.raises(ValueError, match="'c' was not scored on 'prose'"):
        worst_domain(run, "c")
    with pytest.raises(ValueError, match="expected evaluate_domains' output"):
        worst_domain(run["domains"]["prose"], "a")
    with pytest.raises(ValueError, match="at least one domain"):
        never_worse([])


def test_the_best_published_method_within_a_budget_and_where_a_cache_stands_against_it():
    """suite.best_published takes only published families within the budget; standing words
    the paired difference (ahead / behind / indistinguishable) and will not rank a row
    without per-window sums."""
    from turboquant.suite import add_intervals, best_published, standing
    ref, a, n = _windows(W=40, delta=0.010, sigma=0.002, seed=0)
    rows = {"fp32": ("reference", 32.0, ref), "ours": ("profile", 4.25, a),
            "KIVI 4": ("KIVI-style", 4.75, ref + n * 0.005), "KVQ 4": ("KVQuant-style", 4.25, ref + n * 0.020),
            "KVQ 3": ("KVQuant-style", 3.25, ref + n * 0.010), "mine": ("budget", 4.0, ref)}
    res = {name: {"family": f, "bits": b, "per_window": {"nll": list(x), "n": list(n)},
                  "ppl": float(np.exp(x.sum() / n.sum()))} for name, (f, b, x) in rows.items()}
    for r in res.values():
        r["ppl_increase"] = r["ppl"] / res["fp32"]["ppl"] - 1
    add_intervals(res, n_boot=500)
    run = {"results": res}
    assert best_published(run, 4.25) == "KVQ 3" and best_published(run, 5.0) == "KIVI 4"
    assert best_published(run, 3.0) is None
    assert standing(run, "ours", "KVQ 4").startswith("ahead of KVQ 4 (-")
    assert standing(run, "ours", "KIVI 4").startswith("behind KIVI 4 (+")
    assert standing(run, "ours", "KVQ 3").startswith("indistinguishable from KVQ 3")
    assert standing(run, "ours", "KIVI 4", numbers=False) == "behind KIVI 4"
    assert standing(run, "ours", None) == "none within the budget"
    del res["KVQ 3"]["per_window"]
    assert standing(run, "ours", "KVQ 3") == "KVQ 3: one seed, not ranked"


def test_pairing_narrows_the_interval_of_a_difference():
    """Windows where every cache loses more (a shared fragility) cancel in a paired
    difference; resampled apart they do not, and the interval widens."""
    ref, _, n = _windows(W=60, sigma=0.0)
    fragile = 0.02 * np.abs(np.random.default_rng(5).standard_normal(60))
    noise = np.random.default_rng(6).standard_normal((2, 60))
    a = ref + n * (0.010 + fragile + 0.0005 * noise[0])
    b = ref + n * (0.005 + fragile + 0.0005 * noise[1])
    paired = difference(a, b, ref, n)
    apart = difference(a, b, ref, n, paired=False)
    assert paired.value == apart.value
    assert not paired.holds_zero and apart.lo < paired.lo and apart.hi > paired.hi
    assert (apart.hi - apart.lo) > 5 * (paired.hi - paired.lo)


def test_intervals_print_as_value_and_bounds():
    from turboquant.evaluation.intervals import as_text
    assert Interval(4.2912, 3.1234, 5.9111).text() == "+4.29 [+3.12, +5.91]"
    assert as_text({"value": 0.0316, "lo": 0.03, "hi": 0.034}, ".3f") == "0.032 [0.030, 0.034]"


def test_wilson_interval_matches_its_formula_and_covers():
    """Wilson's interval: 10/20 → [0.299, 0.701] (the textbook value), exact ends at 0/n and
    n/n, inside [0, 1], and ~95 % coverage of a known success rate over many experiments."""
    from turboquant.evaluation.intervals import wilson
    iv = wilson(10, 20)
    assert iv.value == 0.5 and abs(iv.lo - 0.2993) < 1e-4 and abs(iv.hi - 0.7007) < 1e-4
    assert wilson(20, 20).hi == 1.0 and abs(wilson(20, 20).lo - 0.8389) < 1e-4
    assert wilson(0, 20).lo == 0.0 and abs(wilson(0, 20).hi - 0.1611) < 1e-4
    assert wilson(3, 20, level=0.99).lo < wilson(3, 20).lo < 0.15 < wilson(3, 20).hi < wilson(3, 20, level=0.99).hi
    rng = np.random.default_rng(0)
    for p in (0.2, 0.5, 0.9):
        k = rng.binomial(20, p, size=4000)
        cover = np.mean([wilson(int(x), 20).lo <= p <= wilson(int(x), 20).hi for x in k])
        assert 0.92 < cover < 0.99, (p, cover)
    for bad in ((21, 20), (-1, 20), (0, 0)):
        with pytest.raises(ValueError, match="successes"):
            wilson(*bad)
    with pytest.raises(TypeError, match="trials"):
        wilson(1, 2.0)


def test_the_sign_test_on_paired_answers_has_its_exact_binomial_values():
    from turboquant.evaluation.intervals import sign_test
    assert sign_test(0, 0) == 1.0 and sign_test(3, 3) == 1.0               # nothing separates them
    assert sign_test(0, 4) == sign_test(4, 0) == 2 / 16                    # 2·(1/2)^4
    assert sign_test(1, 9) == 2 * (1 + 10) / 2 ** 10
    assert sign_test(0, 6) < 0.05 < sign_test(0, 5)                        # six one-sided ones are needed
    rng = np.random.default_rng(0)                                         # under the null it rejects ≤ 5 % of the time
    draws = rng.binomial(12, 0.5, size=4000)
    assert np.mean([sign_test(int(k), 12 - int(k)) < 0.05 for k in draws]) <= 0.05
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ValueError, match="only_a"):
            sign_test(bad, 2)


def test_goal_on_worst_checks_the_point_estimate_of_the_worst_text_and_says_if_it_is_settled():
    """suite.goal_on_worst: the worst text that scored the row decides the verdict, on its point
    estimate; a miss is settled when some text's interval lies wholly above the goal, a goal
    met when every text's lies wholly below it."""
    from turboquant.budget import GOALS
    from turboquant.suite import goal_on_worst

    def text(value, lo, hi, name="a"):
        return {"results": {name: {"intervals": {"ppl_increase": {"value": value, "lo": lo, "hi": hi}}}}}

    texts = {"news": text(0.5, 0.2, 0.8), "code": text(1.3, 0.9, 1.7), "docs": text(9.0, 8.0, 10.0, "b")}
    g = goal_on_worst(texts, "a", 4.25)
    assert g["corpus"] == "code" and g["texts"] == ["news", "code"] and g["goal"] == GOALS[4.25]
    assert not g["met"] and not g["settled"] and g["by"] == pytest.approx(0.3)
    # another text whose interval lies above the goal settles the miss
    g = goal_on_worst({**texts, "verse": text(1.2, 1.1, 1.3)}, "a", 4.25)
    assert g["corpus"] == "code" and not g["met"] and g["settled"]
    g = goal_on_worst(texts, "a", 3.25)             # +4 % allowed: met, every interval below it
    assert g["met"] and g["settled"] and g["by"] == 0.0
    g = goal_on_worst({"news": text(0.9, 0.5, 1.3)}, "a", 4.25)         # met, but not settled
    assert g["met"] and not g["settled"]
    g = goal_on_worst({"news": text(1.0, 0.8, 1.2)}, "a", 4.25)         # on the goal: met
    assert g["met"] and not g["settled"] and g["by"] == 0.0
    g = goal_on_worst({"news": text(1.5, 1.0, 2.0)}, "a", 4.25)         # touching it: not settled
    assert not g["met"] and not g["settled"]
    g = goal_on_worst(texts, "b", 2.25)             # only docs scored it
    assert g["corpus"] == "docs" and g["texts"] == ["docs"] and g["met"] and g["settled"]
    with pytest.raises(ValueError, match="no goal for a budget of 4.0 bits"):
        goal_on_worst(texts, "a", 4.0)
    with pytest.raises(ValueError, match="'c' was not scored on any of"):
        goal_on_worst(texts, "c", 4.25)
    with pytest.raises(ValueError, match="expected {text: evaluate's output}"):
        goal_on_worst({"news": [1.0]}, "a", 4.25)
