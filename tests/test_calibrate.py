"""Calibrated caches and profiles (``turboquant.calibration``), on a tiny random model."""
import json

import mlx.core as mx
import numpy as np
import pytest

import turboquant as tq
from turboquant.prerope import TurnedMeanCache
from turboquant import calibration as cal
from turboquant.codecs import Centered
from turboquant.codecs.transform import TransformCoder
from turboquant.models import ByteTokenizer, tiny_model

TEXT = " ".join(f"word{(7 * i) % 97} and then some text number {i}." for i in range(400))


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def profile(model):
    return cal.calibrate(model, ByteTokenizer(), [3.25, 4.25], name="tiny", corpus="test text", text=TEXT,
                         windows=1, heldout=1024, progress=False)


def test_statistics_leave_out_the_sink_and_group_the_queries(model):
    ids = ByteTokenizer().encode(TEXT)[:1024]
    stats = cal.capture_statistics(model, ids, sink=1)
    assert len(stats) == 2
    s = stats[0]
    assert s["k"].shape == (2, 2 * 511, 16) and s["v"].shape == (2, 2 * 511, 16)
    m = s["metric"]
    assert m.shape == (2, 16, 16) and np.allclose(m, np.swapaxes(m, 1, 2))
    assert np.linalg.eigvalsh(m).min() > -1e-9
    # kv head h is read by query heads 2h and 2h+1 (grouped-query attention: contiguous groups)
    from turboquant.evaluation import capture_qkv
    q = np.concatenate([np.array(capture_qkv(model, ids[w * 512:(w + 1) * 512])[0]["q"][0, :, 1:])
                        for w in range(2)], axis=1).astype(np.float64)             # (4, N, 16)
    for h in range(2):
        g = q[2 * h:2 * h + 2].reshape(-1, 16)
        assert np.allclose(m[h], g.T @ g / len(g), rtol=1e-4, atol=1e-8)


def test_the_value_metric_is_what_the_output_projection_makes_of_a_value_error(model):
    """output_metric: eᵀ M_h e equals the mean over the query heads reading kv head h of
    |W_j e|², W_j head j's columns of o_proj (measured on random errors); values fitted under
    it lose less of that weighted error than values fitted without it."""
    ids = ByteTokenizer().encode(TEXT)[:1024]
    stats = cal.capture_statistics(model, ids, sink=1)
    w = np.array(model.layers[1].self_attn.o_proj.weight, dtype=np.float64)       # (64, 4·16)
    m = stats[1]["value_metric"]
    assert m.shape == (2, 16, 16) and np.array_equal(m, cal.output_metric(model, 1, 2, 16))
    e = np.random.default_rng(0).standard_normal((100, 16))
    for h in range(2):
        through = np.mean([np.sum((e @ w[:, 16 * j:16 * (j + 1)].T) ** 2, axis=1) for j in (2 * h, 2 * h + 1)], axis=0)
        assert np.allclose(np.einsum("nd,de,ne->n", e, m[h], e), through, rtol=1e-9)
    x = mx.array(stats[1]["v"].astype(np.float32))
    err = {}
    for on in (False, True):
        _, values = cal.fit_layers(stats, 3.0, 3.0, outliers=0, value_metric=on)
        d = np.array(values[1].decode(values[1].encode(x)), dtype=np.float64) - stats[1]["v"]
        err[on] = np.mean(np.einsum("hnd,hde,hne->hn", d, m, d))
    assert err[True] < err[False], err
    with pytest.raises(ValueError, match="value metric"):
        cal.fit_layers([{**stats[0], "value_metric": None}], 3.0, 3.0, value_metric=True)
    with pytest.raises(ValueError, match="not a multiple"):
        cal.output_metric(model, 0, 3, 16)


def test_a_profile_records_the_candidate_the_interval_rule_chooses(profile):
    assert [e["budget"] for e in profile["budgets"]] == [3.25, 4.25]
    for e in profile["budgets"]:
        assert e["bits"] <= e["budget"] + 1e-9 and len(e["candidates"]) >= 2
        better = [c for c in e["candidates"][1:] if c["vs_default"]["hi"] < 0]
        want = min(better, key=lambda c: c["ppl"]) if better else e["candidates"][0]
        assert e["choice"] == want["choice"] and e["ppl"] == want["ppl"]
        assert e["candidates"][0]["vs_default"] == {"value": 0.0, "lo": 0.0, "hi": 0.0}
    assert profile["signature"]["head_dim"] == 16 and profile["calibration"]["corpus"] == "test text"
    # the held-out numbers' low bits depend on the CPU and BLAS: the profile says which computed them
    from turboquant.machine import arithmetic
    assert profile["heldout"]["arithmetic"] == arithmetic()


def test_the_default_candidate_gives_way_only_to_one_established_better():
    """``choose``: a candidate better on every window replaces the default; one better on
    average but not beyond its paired interval does not; among established ones the best."""
    rng = np.random.default_rng(0)
    n = [511] * 16
    ref = list(rng.normal(1500, 30, 16))
    default = [r + 10 for r in ref]
    noisy = [d - 1 + 40 * rng.standard_normal() for d in default]         # better on average? not shown
    clear = [d - 5 for d in default]                                       # better on every window
    clearer = [d - 8 for d in default]
    ppl = lambda nll: float(np.exp(sum(nll) / sum(n)))
    tried = lambda *cols: [{"per_window": c, "ppl": ppl(c)} for c in cols]
    assert cal.choose(tried(default, noisy), ref, n) == 0
    assert cal.choose(tried(default, noisy, clear), ref, n) == 2
    assert cal.choose(tried(default, clear, noisy, clearer), ref, n) == 3
    t = tried(default, clear)
    cal.choose(t, ref, n)
    assert t[1]["vs_default"]["hi"] < 0 and t[0]["vs_default"]["value"] == 0.0


def test_a_candidate_that_cannot_code_the_heldout_text_is_refused_not_fatal(model, monkeypatch):
    """A candidate whose coders meet a held-out vector beyond their range (``OutOfRangeError``,
    as Qwen2.5's keys did without an exact outlier) is recorded as refused and left out of the
    choice; the others are still scored. ``choose`` skips refused entries and will not go on
    without the default."""
    from turboquant import evaluation
    from turboquant.calibration import search
    from turboquant.codecs.transform import OutOfRangeError
    fitted, real = [], evaluation.perplexity
    monkeypatch.setattr(search, "fit_layers", lambda stats, kb, vb, outliers, **kw: fitted.append(outliers)
                        or cal.fit_layers(stats, kb, vb, outliers, **kw))

    def perplexity(model, ids, factory, **kw):
        if factory is not None and fitted[-1] == 0:
            raise OutOfRangeError("a vector has 1 coefficient(s) beyond 16x the range")
        return real(model, ids, factory, **kw)
    monkeypatch.setattr(evaluation, "perplexity", perplexity)
    prof = cal.calibrate(model, ByteTokenizer(), [4.25], name="tiny", corpus="test text", text=TEXT,
                         windows=1, heldout=1024, progress=False)
    (entry,) = prof["budgets"]
    refused = [c for c in entry["candidates"] if "refused" in c]
    assert [c["choice"]["outliers"] for c in refused] == [0] and "beyond 16x" in refused[0]["refused"]
    assert entry["choice"]["outliers"] == 1 and len(entry["candidates"]) == len(cal.candidates(4.25, 16, pre_rope=True))
    assert all("vs_default" in c for c in entry["candidates"] if "refused" not in c)
    with pytest.raises(ValueError, match="the default candidate .* cannot be calibrated"):
        cal.choose([{"choice": {}, "refused": "beyond"}, {"per_window": [1.0], "ppl": 1.0}], [1.0], [1])


def test_make_prompt_cache_uses_the_profile(model, profile, tmp_path, monkeypatch):
    monkeypatch.setenv("TURBOQUANT_CACHE", str(tmp_path))
    path = cal.save_profile(profile, cal.profile_path("tiny"))
    assert cal.load_profile(path) == json.loads(json.dumps(profile))
    cache = tq.make_prompt_cache(model, bits=4.25, profile=True)
    assert all(isinstance(c.key_codec, TransformCoder) and c.sink_tokens == 1 for c in cache)
    assert cache[0].key_codec is not cache[1].key_codec              # one fitted codec per layer
    best = cal.profile_entry(profile, 4.25, 16)
    assert cache[0].key_codec.bits_per_coordinate == round(best["choice"]["key_bits"] * 16) / 16
    # the cache works: the model runs through it
    logits = model(mx.array([[5, 6, 7, 8]]), cache=cache)
    assert mx.all(mx.isfinite(logits)).item()
    # by default, and with profile=False: the uncalibrated budgets of Chapter 9, whose loss
    # varies little across the domains Chapter 10 measures (the profile's does), their key
    # mean turned with each position (Chapter 10); turned_mean=False: the centred rule
    for plain in (tq.make_prompt_cache(model, bits=4.25), tq.make_prompt_cache(model, bits=4.25, profile=False)):
        assert isinstance(plain[0], TurnedMeanCache) and not isinstance(plain[0].inner.key_codec, TransformCoder)
    assert isinstance(tq.make_prompt_cache(model, bits=4.25, turned_mean=False)[0].key_codec, Centered)
    # an explicit profile path works too, and a too-small budget is refused with the smallest
    assert isinstance(tq.make_prompt_cache(model, bits=4.25, profile=str(path))[0].key_codec, TransformCoder)
    with pytest.raises(ValueError, match="no configuration within 2.0 bits"):
        tq.make_prompt_cache(model, bits=2.0, profile=True)
    with pytest.raises(TypeError, match="profile must be"):
        tq.make_prompt_cache(model, bits=4.25, profile=5)
    with pytest.raises(ValueError, match="give bits too"):
        tq.make_prompt_cache(model, profile=str(path))
    with pytest.raises(ValueError, match="positive number"):
        tq.make_prompt_cache(model, bits=float("nan"))
    # the memo: the same codec objects until clear_memo
    again = tq.make_prompt_cache(model, bits=4.25, profile=True)
    assert again[0].key_codec is cache[0].key_codec
    cal.clear_memo()
    assert tq.make_prompt_cache(model, bits=4.25, profile=True)[0].key_codec is not cache[0].key_codec


def test_profile_true_without_a_profile_says_how_to_make_one(model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TURBOQUANT_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="no calibrated profile; run `turboquant calibrate`"):
        tq.make_prompt_cache(model, bits=4.25, profile=True)
    # the command line gives the same refusal, naming its own option
    import turboquant.models
    from turboquant.cli import main
    from turboquant.calibration import no_profile_refusal
    monkeypatch.setattr(turboquant.models, "load", lambda name: (model, ByteTokenizer()))
    monkeypatch.setattr(turboquant.models, "wheel_refusal", lambda name: None)   # whatever is installed
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "x", "--bits", "4.25", "--profile"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument --profile: {no_profile_refusal('--profile')}" in err, err


def test_a_profile_for_another_model_is_refused(profile):
    other = tiny_model("llama", num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="the profile is for"):
        cal.profile_codecs(other, profile, 4.25)


def test_damaged_profiles_are_refused(profile, tmp_path):
    p = tmp_path / "p.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="invalid JSON"):
        cal.load_profile(p)
    p.write_text(json.dumps({**profile, "format": "other"}))
    with pytest.raises(ValueError, match="not a turboquant profile"):
        cal.load_profile(p)
    bad = json.loads(json.dumps(profile))
    bad["calibration"]["ids"][3] += 1
    p.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="checksum"):
        cal.load_profile(p)
    with pytest.raises(FileNotFoundError):
        cal.load_profile(tmp_path / "missing.json")
    bad = json.loads(json.dumps(profile))
    bad["budgets"][0]["choice"]["extra"] = 1
    p.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="malformed budget entry"):
        cal.load_profile(p)


def test_calibrated_configurations_need_another_evaluation_text():
    from turboquant.suite import evaluate
    with pytest.raises(ValueError, match="calibration corpus .* other text, or on its held-out part"):
        evaluate(None, None, ["calibrated 4.25"], corpus="wikipedia", calibration_corpus="wikipedia")


@pytest.mark.parametrize("argv, message", [
    (["calibrate", "--budgets", "abc"], "argument --budgets: invalid float value"),
    (["calibrate", "--windows", "0"], "argument --windows: must be >= 1"),
    (["calibrate", "--heldout", "600"], "argument --heldout: must be >= 1024"),
    (["calibrate", "--text", "/no/such/file.txt"], "argument --text: no file /no/such/file.txt"),
    (["calibrate", "--corpus", "books"], "argument --corpus: invalid choice"),
    (["calibrate", "--positions", "100"], "argument --positions: at least one 512-token window"),
    (["calibrate", "--positions", "-1"], "argument --positions: must be >= 0"),
    (["calibrate", "--pre-rope", "maybe"], "argument --pre-rope: invalid choice"),
])
def test_calibrate_cli_refuses_bad_arguments(argv, message, capsys):
    from turboquant import cli
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_calibrate_cli_refuses_a_budget_out_of_range_before_loading_a_model(capsys):
    from turboquant import cli
    with pytest.raises(SystemExit) as e:
        cli.main(["calibrate", "--model", "smollm2-135m", "--budgets", "4", "9"])
    assert e.value.code == 2 and "argument --budgets: bits per coordinate must be in (0, 8], got 9" \
        in capsys.readouterr().err


def test_calibrate_cli_reports_a_missing_model_in_one_line(capsys):
    from turboquant import cli
    with pytest.raises(SystemExit) as e:                  # a usage error, as for every command
        cli.main(["calibrate", "--model", "/no/such/model", "--budgets", "4"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "turboquant calibrate: error: argument --model:" in err \
        and "/no/such/model" in err and "Traceback" not in err


def test_a_budget_without_candidates_is_refused(model):
    with pytest.raises(ValueError, match="no calibrated configuration fits 0.05 bits"):
        cal.calibrate(model, ByteTokenizer(), [0.05], name="t", text=TEXT, windows=1, heldout=1024, progress=False)


def test_fitted_coders_are_kept_on_disk_and_a_damaged_file_is_refitted(model, profile, tmp_path, monkeypatch):
    """Issue #26.8: every process refitted the profile (minutes on the real models)."""
    import turboquant.calibration.store as fitted
    monkeypatch.setenv("TURBOQUANT_CACHE", str(tmp_path))
    cal.clear_memo()
    keys, values, _, _ = cal.profile_codecs(model, profile, 4.25)
    (stored,) = (tmp_path / "coders").glob("*.safetensors")
    cal.clear_memo()

    def no_fitting(*a, **k):
        raise AssertionError("refitted although the coders were on disk")
    monkeypatch.setattr(fitted, "fit_layers", no_fitting)
    k2, v2, _, _ = cal.profile_codecs(model, profile, 4.25)               # read back: the same codecs
    assert [c.config() for c in k2 + v2] == [c.config() for c in keys + values]
    monkeypatch.undo()
    monkeypatch.setenv("TURBOQUANT_CACHE", str(tmp_path))
    stored.write_bytes(stored.read_bytes()[:-10])                         # damaged: reported, refitted
    cal.clear_memo()
    with pytest.warns(RuntimeWarning, match="damaged coder file"):
        k3, _, _, _ = cal.profile_codecs(model, profile, 4.25)
    assert [c.config() for c in k3] == [c.config() for c in keys]
    cal.clear_memo()
    assert [c.config() for c in cal.profile_codecs(model, profile, 4.25)[0]] == [c.config() for c in keys]


def test_a_calibrated_cache_file_carries_its_coders_as_tensors(model, profile, tmp_path, monkeypatch):
    """Issue #26.8: each layer's TransformCoder was written into the JSON header as decimal
    text (38.5 MB for 18 tokens on SmolLM2). Now the arrays are tensors, each stored once."""
    monkeypatch.setenv("TURBOQUANT_CACHE", str(tmp_path))
    cal.save_profile(profile, cal.profile_path("tiny"))
    cache = tq.make_prompt_cache(model, bits=4.25, profile=True)
    model(mx.array([list(range(5, 23))]), cache=cache)
    path = tmp_path / "c.safetensors"
    tq.save_prompt_cache(path, cache)
    arrays, meta = mx.load(str(path), return_metadata=True)
    coder_bytes = sum(a.nbytes for n, a in arrays.items() if n.startswith("c."))
    assert len(meta["turboquant"]) < 4000                 # the header: settings and references only
    assert path.stat().st_size < 1.2 * (coder_bytes + sum(a.nbytes for a in arrays.values()))
    loaded = tq.load_prompt_cache(path, model=model)
    assert [c.key_codec.config() for c in loaded] == [c.key_codec.config() for c in cache]
    nxt = mx.array([[40, 41]])
    assert mx.array_equal(model(nxt, cache=loaded), model(nxt, cache=cache)).item()
    # two layers with one coder store it once: the same arrays under one name
    twin = tq.make_prompt_cache(model, key_codec=[cache[0].key_codec] * 2, value_codec=[cache[0].value_codec] * 2)
    model(mx.array([list(range(5, 23))]), cache=twin)
    tq.save_prompt_cache(tmp_path / "twin.safetensors", twin)
    once = {n for n in mx.load(str(tmp_path / "twin.safetensors")) if n.startswith("c.")}
    from turboquant.codec_tensors import to_tensors
    layer0: dict = {}
    to_tensors([cache[0].key_codec.config(), cache[0].value_codec.config()], layer0)
    assert once == set(layer0)


def test_bits_across_layers_follow_the_high_rate_law():
    """allocate_layers: the mean rate is met exactly on the 1/D grid; equal sensitivities
    give every layer the same rate; a layer 4× as sensitive gets one bit more (½·log2 4),
    as reverse water-filling across layers says; floors and errors."""
    from turboquant.calibration import allocate_layers
    assert allocate_layers([0.3] * 5, 3.25, 64) == [3.25] * 5
    assert allocate_layers([1.0, 4.0], 3.25, 64) == [2.75, 3.75]
    s = np.random.default_rng(1).uniform(0.2, 1.0, 30)              # no layer reaches the spread
    b = np.array(allocate_layers(s, 4.25, 64))
    assert np.all(b * 64 == np.round(b * 64)) and b.mean() == 4.25
    closed = 4.25 + 0.5 * np.log2(s / np.exp(np.log(s).mean()))
    assert np.all(np.abs(b - closed) <= 1 / 64 + 1e-9)
    wide = np.array(allocate_layers(np.geomspace(1e-4, 1, 30), 4.25, 64))
    assert wide.min() >= 2.75 and wide.max() <= 5.75 and wide.mean() == 4.25     # within the spread
    assert allocate_layers([-0.1, 1.0], 3.0, 16)[0] == allocate_layers([0.02, 1.0], 3.0, 16)[0]   # floored
    for bad, match in (([], "non-empty"), ([np.nan], "finite"), ([-1.0, 0.0], "positive")):
        with pytest.raises(ValueError, match=match):
            allocate_layers(bad, 3.0, 16)
    with pytest.raises(ValueError, match="bits must lie"):
        allocate_layers([1.0], 0.5, 16)


def test_layer_sensitivity_feeds_the_allocation(model):
    """layer_sensitivity codes one layer at a time (the rest exact); fit_layers(allocate=True)
    then fits each layer at its own rate, keeping the mean."""
    ids = ByteTokenizer().encode(TEXT)[:1024]
    stats = cal.capture_statistics(model, ids, sink=1)
    coarse = cal.layer_sensitivity(model, stats, ids, bits=2.0)
    fine = cal.layer_sensitivity(model, stats, ids, bits=8.0, outliers=0)
    assert coarse.shape == fine.shape == (2,) and np.all(np.isfinite(coarse))
    assert np.all(np.abs(fine) < 1e-3) and np.all(np.abs(coarse) > 10 * np.abs(fine))   # a random model: any sign
    sens = np.array([0.1, 0.4])
    with pytest.raises(ValueError, match="sensitivity"):
        cal.fit_layers(stats, 3.0, 3.0, allocate=True)
    for s, v in zip(stats, sens):
        s["sensitivity"] = float(v)
    keys, values = cal.fit_layers(stats, 3.0, 3.0, allocate=True)
    rates = [k.bits_per_coordinate for k in keys]
    assert np.mean(rates) == 3.0 and rates == [v.bits_per_coordinate for v in values]
    assert rates == cal.allocate_layers(sens, 3.0, 16, floor_bits=2.5) == [2.5, 3.5]   # 4× as sensitive: +1 bit
    with pytest.raises(ValueError, match="2 layers"):
        cal.fit_layers(stats, [3.0], 3.0)


def test_a_profile_cache_warns_once_it_codes_keys_past_its_calibrated_positions(model, profile, tmp_path,
                                                                                monkeypatch):
    import copy
    import warnings

    from turboquant.cache import FittedPositionsWarning
    monkeypatch.setenv("TURBOQUANT_CACHE", str(tmp_path))
    window = profile["calibration"]["window"]
    prof = {**profile, "calibration": {**profile["calibration"], "window": 64, "positions": 64}}   # short: cheap
    cache = tq.make_prompt_cache(model, bits=4.25, profile=prof)
    assert window == 512 and {c.fitted_positions for c in cache} == {64}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FittedPositionsWarning)
        model(mx.array([list(range(5, 69))]), cache=cache)       # positions 0 … 63: within
    twin = copy.deepcopy(cache)                                   # copies keep the limit (a server's prompt cache)
    assert {c.fitted_positions for c in twin} == {64}
    with pytest.warns(FittedPositionsWarning, match="positions below 64"):
        model(mx.array([[70]]), cache=twin)                       # position 64: past it
    assert {c.fitted_positions for c in twin} == {None}           # said once, then quiet
    # a failed update stores nothing and keeps the warning for the update that does
    past = copy.deepcopy(cache)
    with pytest.raises(ValueError):
        past[0].update_and_fetch(mx.zeros((1, 2, 1, 8)), mx.zeros((1, 2, 1, 8)))    # wrong head size
    assert past[0].fitted_positions == 64
    # the limit is kept in cache files: a saved conversation continued later still warns
    path = str(tmp_path / "conversation.safetensors")
    tq.save_prompt_cache(path, cache)
    assert {c.fitted_positions for c in tq.load_prompt_cache(path)} == {64}
    # the uncalibrated budgets carry no limit: nothing to warn about
    assert {c.fitted_positions for c in tq.make_prompt_cache(model, bits=4.25)} == {None}
    # a profile fitted within its windows only (no positions): with a BOS before every
    # calibration window, the coders saw one position more than the window
    windowed = {k: v for k, v in prof["calibration"].items() if k != "positions"}
    with_bos = {**prof, "calibration": {**windowed, "window": 64, "bos": 1}}
    assert {c.fitted_positions for c in tq.make_prompt_cache(model, bits=4.25, profile=with_bos)} == {65}


def test_key_coders_carry_the_positions_they_were_fitted_for_wherever_they_are_used(model, tmp_path):
    """The limit lives in the key coder (``TransformCoder.positions``), not in the profile:
    coders fitted by hand from windows-only statistics carry one window (one more with a
    BOS), spread statistics their context; values carry none; a cache built by hand from
    them warns past it, copies and files keep it, and the configuration rebuilds it."""
    import warnings

    from turboquant.cache import FittedPositionsWarning, TurboQuantKVCache, tag_group
    from turboquant.codecs.base import from_config
    ids = ByteTokenizer().encode(TEXT)[:128]
    plain = cal.capture_statistics(model, ids, window=64)
    assert {s["positions"] for s in plain} == {64}
    assert {s["positions"] for s in cal.capture_statistics(model, ids, window=64, bos=1)} == {65}
    assert {s["positions"] for s in cal.capture_statistics(model, ids, window=64, positions=4096)} == {4096}
    keys, values = cal.fit_layers(plain, 4.0, 4.0)
    assert {k.positions for k in keys} == {64} and {v.positions for v in values} == {None}
    assert "positions=64" in repr(keys[0]) and "positions" not in values[0].config()
    again = from_config(keys[0].config())
    assert again == keys[0] and again.positions == 64
    legacy = {k: v for k, v in keys[0].config().items() if k != "positions"}    # written before positions
    assert from_config(legacy).positions is None and from_config(legacy) != keys[0]
    with pytest.raises(ValueError, match="positions"):
        from_config({**keys[0].config(), "positions": 0})
    cache = tag_group([TurboQuantKVCache(k, v, sink_tokens=1) for k, v in zip(keys, values)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FittedPositionsWarning)
        model(mx.array([list(range(5, 69))]), cache=cache)       # positions 0 … 63
    path = str(tmp_path / "hand.safetensors")
    tq.save_prompt_cache(path, cache)
    with pytest.warns(FittedPositionsWarning, match="positions below 64"):
        model(mx.array([[70]]), cache=tq.load_prompt_cache(path))
    with pytest.warns(FittedPositionsWarning):
        model(mx.array([[70]]), cache=cache)
    tq.save_prompt_cache(path, cache)                            # warned: the file says so, no repeat
    assert {c.fitted_positions for c in tq.load_prompt_cache(path)} == {None}


def test_moving_a_key_by_rope_is_the_model_computing_it_at_another_position(model):
    """phases.move turns a captured key as RoPE would at a later position: layer 0's keys
    depend on the token and the position only, so the keys of tokens behind a prefix of s
    tokens equal the same tokens' keys at the start, moved by s. Norms are kept, a move
    undoes, and a query and key moved together keep their product (relative positions)."""
    from turboquant.calibration.phases import layer_rope, move
    from turboquant.evaluation import capture_qkv
    rope = layer_rope(model, 0)
    tokens, s = [11, 42, 7, 99, 3], 37
    k0 = np.array(capture_qkv(model, tokens)[0]["k"][0]).astype(np.float64)            # (2, 5, 16)
    k_late = np.array(capture_qkv(model, [5] * s + tokens)[0]["k"][0, :, s:]).astype(np.float64)
    moved = move(k0, np.full(5, s), rope)
    assert np.abs(moved - k_late).max() < 1e-5 * np.abs(k_late).max()
    assert not np.allclose(k0, k_late, atol=1e-3)                  # the test can see a position change
    assert np.allclose(np.linalg.norm(moved, axis=-1), np.linalg.norm(k0, axis=-1), rtol=1e-5)
    shift = np.array([-3000, 5, 900, -1, 2047])
    assert np.allclose(move(move(k0, shift, rope), -shift, rope), k0, atol=1e-5)
    # one shift per vector: each vector turned by its own, as RoPE alone would turn it
    each = move(k0, shift, rope)
    for n, d in enumerate(shift):
        alone = np.array(rope(mx.array(k0[None, :, n:n + 1].astype(np.float32)), offset=int(d)))[0, :, 0]
        assert np.allclose(each[:, n], alone, atol=1e-5)
    q = np.random.default_rng(1).standard_normal(k0.shape)
    assert np.allclose(np.sum(move(q, shift, rope) * move(k0, shift, rope), -1), np.sum(q * k0, -1), atol=1e-4)
    with pytest.raises(ValueError, match="one shift per vector"):
        move(k0, shift[:3], rope)


def test_a_rope_that_is_not_a_rotation_is_refused(model):
    from turboquant.calibration.phases import layer_rope

    class Scaled:
        dims = 16

        def __call__(self, x, offset=0):
            return 2.0 * x
    attn = model.layers[0].self_attn
    original = attn.rope
    try:
        attn.rope = Scaled()
        with pytest.raises(ValueError, match="not a rotation linear in the position"):
            layer_rope(model, 0)
    finally:
        attn.rope = original
    with pytest.raises(ValueError, match="layer 5"):
        layer_rope(model, 5)


def test_phase_complete_statistics_spread_keys_over_the_context(model):
    """capture_statistics(positions=C): the same keys (norms kept), each turned by the
    layer's RoPE from its position in the window to the one drawn for its token; values
    untouched; the query metric changes; the same seed gives the same statistics, another
    seed others."""
    ids = ByteTokenizer().encode(TEXT)[:1024]
    plain = cal.capture_statistics(model, ids, sink=1)
    spread = cal.capture_statistics(model, ids, sink=1, positions=4096)
    assert np.array_equal(spread[1]["v"], plain[1]["v"])
    assert np.allclose(np.linalg.norm(spread[1]["k"], axis=-1), np.linalg.norm(plain[1]["k"], axis=-1), rtol=1e-5)
    from turboquant.calibration.phases import layer_rope, move
    n = 511                                       # window 0: tokens at positions 1 … 511 (the sink left out)
    drawn = np.random.default_rng([0, 0]).integers(0, 4096, size=n)
    expect = move(plain[1]["k"][:, :n], drawn - np.arange(1, n + 1), layer_rope(model, 1))
    assert np.allclose(spread[1]["k"][:, :n], expect, atol=1e-6)
    assert not np.allclose(spread[1]["metric"], plain[1]["metric"], rtol=1e-2)
    again = cal.capture_statistics(model, ids, sink=1, positions=4096)
    assert all(np.array_equal(a[n], b[n]) for a, b in zip(spread, again) for n in ("k", "metric"))
    other = cal.capture_statistics(model, ids, sink=1, positions=4096, seed=1)
    assert not np.allclose(other[1]["k"], spread[1]["k"])
    # the queries: moved with their token's draw, then the metric of the moved ones
    from turboquant.evaluation import capture_qkv
    one = ids[:512]
    q = np.array(capture_qkv(model, [3] + one)[1]["q"][0, :, 2:]).astype(np.float64)     # BOS and sink left out
    moved = move(q, np.random.default_rng([0, 0]).integers(0, 4096, size=511) - np.arange(2, 513),
                 layer_rope(model, 1))
    with_bos = cal.capture_statistics(model, one, bos=3, sink=1, positions=4096)
    for h in range(2):
        g = moved[2 * h:2 * h + 2].reshape(-1, 16)
        assert np.allclose(with_bos[1]["metric"][h], g.T @ g / len(g), rtol=1e-4, atol=1e-8)
    with pytest.raises(ValueError, match="positions must be a context length"):
        cal.capture_statistics(model, ids, positions=100)


def test_a_profile_fitted_over_the_context_holds_past_its_windows(model, tmp_path, monkeypatch):
    """calibrate spreads the keys over the model's context by default and records it; the
    profile's caches then claim every position below it (no warning within), an old
    profile without positions claims one window; a damaged positions field is refused."""
    monkeypatch.setenv("TURBOQUANT_CACHE", str(tmp_path))
    prof = cal.calibrate(model, ByteTokenizer(), [4.25], name="tiny", corpus="test text", text=TEXT,
                         windows=1, heldout=1024, progress=False)
    assert prof["calibration"]["positions"] == cal.context_length(model) == 4096
    assert cal.fitted_positions(prof) == 4096
    assert {c.fitted_positions for c in tq.make_prompt_cache(model, bits=4.25, profile=prof)} == {4096}
    old = {**prof, "calibration": {k: v for k, v in prof["calibration"].items() if k != "positions"}}
    assert cal.fitted_positions(old) == 512
    # the same choice fitted within the windows: other coders (never the spread ones, kept on disk)
    spread_keys, _, _, _ = cal.profile_codecs(model, prof, 4.25)
    cal.clear_memo()
    window_keys, _, _, _ = cal.profile_codecs(model, old, 4.25)
    assert not np.allclose(np.array(spread_keys[0].config()["transform"]), np.array(window_keys[0].config()["transform"]))
    path = tmp_path / "p.json"
    for field, bad in (("positions", 100), ("positions", True), ("positions", "4096"), ("positions", 2 ** 31),
                       ("phase_seed", -1), ("phase_seed", 1.5), ("window", "512")):
        cal.save_profile({**prof, "calibration": {**prof["calibration"], field: bad}}, path)
        with pytest.raises(ValueError, match=f"calibration {field}"):
            cal.load_profile(path)


def test_statistics_before_rope_are_what_a_pre_rope_cache_codes(model):
    """capture_statistics(pre_rope=True) adds "k_pre": the keys a ``PreRopeCache`` hands its
    codec (RoPE undone, checked against the cache's own inverse RoPE), and "metric_pre": the
    metric of the queries moved to drawn positions (the distances at which they read a key
    before RoPE); the other statistics are unchanged. fit_layers(pre_rope=True) fits the key
    coders on them, with no positions (such keys have none), and refuses statistics without
    them; the suite's pre-RoPE KVQuant-style row builds PreRopeCaches that follow fp32."""
    from turboquant import suite
    from turboquant.calibration.phases import layer_rope, move
    from turboquant.evaluation import capture_qkv
    from turboquant.prerope import PreRopeCache, rope_of
    ids = ByteTokenizer().encode(TEXT)[:512]
    plain = cal.capture_statistics(model, ids, sink=1)
    pre = cal.capture_statistics(model, ids, sink=1, pre_rope=True)
    assert all(np.array_equal(a[n], b[n]) for a, b in zip(plain, pre) for n in ("k", "v", "metric"))
    k = mx.array(plain[1]["k"][None].astype(np.float32))          # positions 1 … 511 (the sink left out)
    assert np.allclose(np.array(rope_of(model)[1].apply(k, 1, inverse=True)[0]), pre[1]["k_pre"], atol=1e-5)
    q = np.array(capture_qkv(model, ids)[1]["q"][0, :, 1:]).astype(np.float64)
    to = np.random.default_rng([0, 0, 1]).integers(0, 512, size=511)
    moved = move(q, to - np.arange(1, 512), layer_rope(model, 1))
    for h in range(2):
        g = moved[2 * h:2 * h + 2].reshape(-1, 16)
        assert np.allclose(pre[1]["metric_pre"][h], g.T @ g / len(g), rtol=1e-4, atol=1e-8)
    keys, values = cal.fit_layers(pre, 4.0, 4.0, pre_rope=True)
    assert {c.positions for c in keys} == {None}
    assert keys[1] == TransformCoder.calibrate(pre[1]["k_pre"], 4.0, metric=pre[1]["metric_pre"], outliers=1)
    assert values[1] == cal.fit_layers(plain, 4.0, 4.0)[1][1]       # values carry no RoPE: fitted as before
    with pytest.raises(ValueError, match="pre_rope=True needs statistics captured with pre_rope=True"):
        cal.fit_layers(plain, 4.0, 4.0, pre_rope=True)
    with pytest.raises(TypeError, match="pre_rope must be True or False, got 1"):
        cal.capture_statistics(model, ids, pre_rope=1)
    make = suite.CONFIGS["pre-RoPE KVQuant-style 4"].make_cache(model, pre)
    cache = make()
    assert all(isinstance(c, PreRopeCache) for c in cache)
    x = mx.array(ids[:96])[None]
    exact, coded = model(x), model(x, cache=cache)
    cos = (exact * coded).sum(-1) / (mx.linalg.norm(exact, axis=-1) * mx.linalg.norm(coded, axis=-1))
    assert float(cos.min()) > 0.99


def test_a_profile_may_code_keys_before_rope_and_its_caches_say_so(model, profile, tmp_path, monkeypatch):
    """The search offers the default with keys before RoPE where the model allows it (not on
    a model with sliding-window layers; pre_rope=True there is refused); a profile entry that
    takes it makes ``make_prompt_cache`` wrap every layer in a ``PreRopeCache`` whose key
    coders were fitted before RoPE — the same coders ``fit_layers(pre_rope=True)`` gives —
    and the cache saves, loads and continues bit for bit."""
    from turboquant.calibration.fitting import Choice
    from turboquant.prerope import PreRopeCache
    monkeypatch.setenv("TURBOQUANT_CACHE", str(tmp_path))
    for e in profile["budgets"]:                           # offered, scored, recorded with the field
        pre = [c for c in e["candidates"] if c["choice"].get("pre_rope")]
        assert len(pre) == 1 and "vs_default" in pre[0]
    assert Choice(4.25, 4.25).fields() == {"key_bits": 4.25, "value_bits": 4.25, "outliers": 1, "sink_tokens": 1}
    forced = json.loads(json.dumps(profile))               # an entry that took it (the rule decides on real text)
    entry = forced["budgets"][-1]
    entry["choice"] = {**entry["choice"], "pre_rope": True}
    entry["ppl"] = forced["budgets"][0]["ppl"] - 1          # the best within 4.25 bits (profile_entry)
    path = cal.save_profile(forced, tmp_path / "pre.json")
    cache = tq.make_prompt_cache(model, bits=4.25, profile=str(path))
    assert all(isinstance(c, PreRopeCache) for c in cache)
    stats = cal.capture_statistics(model, forced["calibration"]["ids"], bos=forced["calibration"]["bos"],
                                   positions=forced["calibration"]["positions"], pre_rope=True)
    c = Choice(**entry["choice"])
    keys, _ = cal.fit_layers(stats, c.key_bits, c.value_bits, c.outliers, pre_rope=True)
    assert [k.config() == w.config() for k, w in zip((x.key_codec for x in cache), keys)] == [True, True]
    x = mx.array([[5, 6, 7, 8, 9, 10]])
    model(x, cache=cache)
    tq.save_prompt_cache(tmp_path / "c.bin", cache, model=model)
    loaded = tq.load_prompt_cache(tmp_path / "c.bin", model=model)
    assert all(isinstance(c, PreRopeCache) for c in loaded) and loaded[0].rope == cache[0].rope
    nxt = mx.array([[11, 12]])
    assert mx.array_equal(model(nxt, cache=cache), model(nxt, cache=loaded)).item()
    with pytest.raises(ValueError, match="codes keys before RoPE, which this cache cannot hold: max_kv_size makes"):
        tq.make_prompt_cache(model, bits=4.25, profile=str(path), max_kv_size=64)
    # the 3.25-bit entry stays after RoPE: a plain cache
    assert not isinstance(tq.make_prompt_cache(model, bits=3.3, profile=str(path))[0], PreRopeCache)
    from turboquant.calibration import store
    from turboquant.prompt_cache import codes_keys_before_rope          # the question asked ahead of a cache
    with monkeypatch.context() as m:                                    # answered without fitting a coder
        m.setattr(store, "fit_layers", lambda *a, **k: pytest.fail("codes_keys_before_rope fitted coders"))
        m.setattr(store, "capture_statistics", lambda *a, **k: pytest.fail("codes_keys_before_rope captured"))
        m.setenv("TURBOQUANT_CACHE", str(tmp_path / "empty"))           # no coders kept on disk
        cal.clear_memo()
        assert codes_keys_before_rope(model, 4.25, str(path)) and not codes_keys_before_rope(model, 3.3, str(path))
    bad = json.loads(json.dumps(forced))
    bad["budgets"][0]["choice"]["pre_rope"] = 1
    cal.save_profile(bad, tmp_path / "bad.json")
    with pytest.raises(ValueError, match="malformed budget entry"):
        cal.load_profile(tmp_path / "bad.json")
    gemma = tiny_model("gemma3", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=1)
    from turboquant.prompt_cache import pre_rope_refusal
    assert "sliding-window" in pre_rope_refusal(gemma) and pre_rope_refusal(model) is None
    from turboquant.serve import install_caches
    install_caches(gemma, bits=4.25)                        # model.make_cache now makes TurboQuant caches
    assert "sliding-window" in pre_rope_refusal(gemma)
    with pytest.raises(ValueError, match="pre_rope=True: this model's keys cannot be coded before RoPE"):
        cal.calibrate(gemma, ByteTokenizer(), [4.25], name="g", text=TEXT, windows=1, heldout=1024,
                      pre_rope=True, progress=False)
    with pytest.raises(TypeError, match="pre_rope must be True, False or None"):
        cal.calibrate(model, ByteTokenizer(), [4.25], name="g", text=TEXT, pre_rope="yes", progress=False)


def test_the_generation_benchmark_times_the_profile(monkeypatch, model, profile, tmp_path):
    """``bench generate --profile-bits`` adds the profile's caches at each budget, named by
    where their keys are coded; a model without a profile, or a bad budget, is a ValueError."""
    import types
    from turboquant import bench, models
    monkeypatch.setattr(models, "load", lambda name: (model, types.SimpleNamespace(
        encode=lambda text, **kw: [int(c) % 250 + 1 for c in text.encode()[:4000]])))
    monkeypatch.setattr(bench, "memory_bandwidth", lambda: 1.0)
    path = cal.save_profile(profile, tmp_path / "p.json")
    out = bench.generation_run("tiny", context=48, new_tokens=2, profile_bits=[4.25], profile=str(path))
    assert out["profile_bits"] == [4.25] and len(out["runs"]) == 3
    label = next(n for n in out["runs"] if n.startswith("profile 4.25 bits"))
    from turboquant.prerope import PreRopeCache
    pre = isinstance(tq.make_prompt_cache(model, bits=4.25, profile=str(path))[0], PreRopeCache)
    assert ("keys before RoPE" in label) == pre and out["runs"][label]["tokens_per_s"] > 0
    with pytest.raises(ValueError, match="no calibrated profile"):
        bench.generation_run("tiny", context=48, new_tokens=2, profile_bits=[4.25])
    with pytest.raises(ValueError, match="profile_bits must be positive"):
        bench.generation_run("tiny", context=48, new_tokens=2, profile_bits=[0])
