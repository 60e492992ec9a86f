import json
import math

import pytest

from turboquant import cli


def test_memory_command_prints_the_bit_axon_plan(capsys):
    assert cli.main(["memory", "--preset", "bit-axon", "--context", "65536", "--bits", "16", "4",
                     "--side", "none"]) == 0
    out = capsys.readouterr().out
    assert "335.5" in out and "83.9" in out


def test_eval_lists_and_runs_a_small_comparison(tmp_path, capsys):
    import json
    assert cli.main(["eval", "--list"]) == 0
    assert "budget K4/V4" in capsys.readouterr().out
    out = tmp_path / "r.json"
    assert cli.main(["eval", "--configs", "TQ-mse 2", "--tokens", "256", "--window", "256", "--agreement-tokens", "4",
                     "--fidelity-tokens", "32", "--needle-contexts", "256", "--needle-values", "1", "--quiet",
                     "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert set(res) == {"fp32", "TQ-mse 2"}
    assert res["TQ-mse 2"]["ppl"] > res["fp32"]["ppl"] and res["TQ-mse 2"]["bits"] == 2.25
    assert len(res["TQ-mse 2"]["fidelity_cos"]) == 30 and "256" in res["TQ-mse 2"]["needle"]
    cells = res["TQ-mse 2"]["needle_cells"]
    assert [(c["context"], c["depth"], c["n"]) for c in cells] == [(256, 0.1, 1), (256, 0.5, 1), (256, 0.9, 1)]
    assert len(res["TQ-mse 2"]["needle_trials"]) == 3
    printed = capsys.readouterr().out
    assert "TQ-mse 2" in printed and "needle retrieval (successes of 1, 95 % Wilson interval)" in printed
    assert "256@10%" in printed


def test_eval_prints_intervals_seeds_and_a_paired_difference(tmp_path, capsys):
    """#28: every row with its 95 % interval; --seeds scores a seeded codec with several
    rotations (the row pools them); --diff of a configuration with itself is exactly 0."""
    import json
    out = tmp_path / "r.json"
    assert cli.main(["eval", "--configs", "TQ-mse 3", "uniform 3", "--tokens", "768", "--window", "256",
                     "--agreement-tokens", "0", "--fidelity-tokens", "0", "--seeds", "2", "--quiet",
                     "--diff", "TQ-mse 3", "TQ-mse 3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "3 windows of 256 tokens; 95 % intervals: paired block bootstrap" in printed
    assert "TQ-mse 3 − TQ-mse 3: +0.00 points of Δppl, 95 % interval [+0.00, +0.00]: indistinguishable" in printed
    res = json.loads(out.read_text())["results"]
    tq3, uni = res["TQ-mse 3"], res["uniform 3"]
    assert tq3["seeds"] == 2 and len(tq3["per_window"]["nll"]) == 2 and len(tq3["per_window"]["nll"][0]) == 3
    assert uni["seeds"] == 1                                 # no rotation: nothing to reseed
    assert tq3["per_window"]["nll"][0] != tq3["per_window"]["nll"][1]      # another rotation, other codes
    i = tq3["intervals"]["ppl_increase"]
    assert i["lo"] <= 100 * tq3["ppl_increase"] <= i["hi"] and i["lo"] < i["hi"]
    assert res["fp32"]["intervals"]["ppl_increase"] == {"value": 0.0, "lo": 0.0, "hi": 0.0}


def test_eval_on_several_domains_summarises_each_configurations_worst(tmp_path, capsys):
    """#28: --corpus with several domains scores each apart (same configurations, same
    seeds) and prints every configuration's worst domain with its interval."""
    import json
    out = tmp_path / "r.json"
    assert cli.main(["eval", "--configs", "uniform 3", "--corpus", "lee", "code", "--tokens", "512", "--window",
                     "256", "--agreement-tokens", "0", "--fidelity-tokens", "0", "--quiet",
                     "--diff", "uniform 3", "fp32", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    run = json.loads(out.read_text())
    assert run["setup"]["corpora"] == ["lee", "code"] and set(run["domains"]) == {"lee", "code"}
    incs = {c: r["results"]["uniform 3"]["intervals"]["ppl_increase"] for c, r in run["domains"].items()}
    worst = max(incs, key=lambda c: incs[c]["value"])
    w = incs[worst]
    assert "worst domain of each configuration (lee, code):" in printed
    assert f"uniform 3 {'':>22} {worst:>10} {w['value']:>+8.2f}" in printed
    assert "lee: 2 windows of 256 tokens" in printed and "code: 2 windows of 256 tokens" in printed
    for c, r in run["domains"].items():      # the diff against fp32 is the row's own increase
        assert r["diff"]["value"] == pytest.approx(incs[c]["value"], abs=1e-9)


def test_configs_all_leaves_the_diagnoses_out():
    """'all' is every cache a user could choose; the diagnosis rows (one half of a cache in
    float32, 18 bits, the halves of two caches mixed, or a key coder read with exact values)
    are run only when named."""
    from turboquant.suite import ALL_CONFIGS, CONFIGS
    diagnoses = {n for n, c in CONFIGS.items() if c.diagnosis}
    assert diagnoses == {"profile 4.25, exact keys", "profile 4.25, exact values",
                         "profile 4.25 keys, KVQuant-style 4 values", "KVQuant-style 4 keys, profile 4.25 values",
                         "KVQuant-style 4, exact keys", "KVQuant-style 4, exact values",
                         "pre-RoPE KVQuant-style 4, exact values", "channels, water-filling, exact values",
                         "KLT, equal bits, exact values", "KLT, water-filling, exact values"}
    assert set(ALL_CONFIGS) == set(CONFIGS) - diagnoses


def test_eval_configs_all_runs_every_configuration_but_the_diagnoses(monkeypatch, capsys):
    """What `eval --configs all` hands to the run (stopped at its first check, before a model loads)."""
    import turboquant.suite as suite
    seen = []

    def stop(names, *args):
        seen.append(list(names))
        raise ValueError("stopped here")
    monkeypatch.setattr(suite, "calibration_corpus_for", stop)
    with pytest.raises(SystemExit):
        cli.main(["eval", "--configs", "all"])
    assert seen == [list(suite.ALL_CONFIGS)] and "profile 4.25, exact keys" not in seen[0]
    assert "stopped here" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["eval", "--diff", "fp32", "nosuch"], "argument --diff: unknown configuration 'nosuch'"),
    (["eval", "--seeds", "0"], "argument --seeds: must be >= 1"),
    (["eval", "--tokens", "0"], "argument --tokens: must be >= 2, got 0"),
    (["eval", "--tokens", "-5"], "argument --tokens: must be >= 2, got -5"),
    (["eval", "--tokens", "abc"], "argument --tokens: expected an integer"),
    (["eval", "--configs", "nosuch"], "unknown configuration(s) 'nosuch'; valid: 'chapter', 'all' or one of the"),
    (["needle", "--configs", "budget K4/V5"], "unknown configuration(s) 'budget K4/V5' (closest: 'budget K5/V5', 'budget K4/V4'"),
    (["eval", "--tokens", "256"], "256 tokens are fewer than one --window of 512"),
    (["eval", "--corpus", "code", "docs", "--calibration-corpus", "docs", "--configs", "calibrated 4.25"],
     "argument --corpus: 'docs' is the calibration corpus"),
    (["eval", "--corpus", "novels"], "argument --corpus: invalid choice: 'novels'"),
    (["eval", "--configs", "KIVI", "4"], 'a name with spaces is one argument: quote it, e.g. --configs "KIVI 4"'),
    (["eval", "--start", "-1"], "argument --start: must be >= 0, got -1"),
    (["eval", "--corpus", "wikipedia", "lee", "--configs", "calibrated 3.25"],
     "argument --calibration-corpus: wikipedia and lee are both scored"),
    (["generate", "--prompt", "x", "--load-cache", "c.safetensors", "--profile"],
     "--load-cache restores the saved cache with its own codecs: --profile would contradict it"),
    (["generate", "--prompt", "x", "--key-bits", "3", "--profile"],
     "argument --profile: it chooses the configuration for --bits, not for --key-bits"),
    (["longctx", "--context", "100"], "argument --context: must be >= 256, got 100"),
    (["generate", "--prompt", "x", "--bits", "4.25", "--profile", "/nonexistent/p.json"],
     "argument --profile: no file /nonexistent/p.json"),
    (["memory", "--bits", "0"], "argument --bits: bits must be in (0, 32], got 0"),
    (["memory", "--batch", "0"], "argument --batch: must be >= 1, got 0"),
    (["memory", "--context", "-1"], "argument --context: must be >= 1"),
    (["kernels", "--repeats", "0"], "argument --repeats: must be >= 1"),
    (["bench"], "the following arguments are required: {decode,generate}"),
    (["bench", "speed"], "argument {decode,generate}: invalid choice: 'speed'"),
    (["bench", "decode", "--tokens", "0"], "argument --tokens: must be >= 1, got 0"),
    (["bench", "generate", "--context", "x"], "argument --context: expected an integer"),
    (["generate", "--prompt", "x", "--key-bits", "9"], "argument --key-bits: must be <= 8, got 9"),
    (["generate", "--prompt", "x", "--value-bits", "0"], "argument --value-bits: must be >= 1, got 0"),
    (["memory", "--group-size", "32"], "--group-size applies to --side affine only"),
    (["generate", "--prompt", "x", "--turned-mean", "--profile"],
     "argument --turned-mean: it says where the uncalibrated budgets learn their key mean, not a --profile's"),
    (["chat", "--turned-mean", "--key-bits", "4"],
     "--turned-mean says where a budget's centred keys learn their mean (--bits), not for --key-bits"),
    (["chat", "--no-turned-mean", "--codec", '{"codec": "identity"}'],
     "--no-turned-mean says where a budget's centred keys learn their mean (--bits), not for --codec"),
    (["generate", "--prompt", "x", "--no-turned-mean", "--profile"],
     "argument --no-turned-mean: it says where the uncalibrated budgets learn their key mean"),
    (["generate", "--prompt", "x", "--no-turned-mean", "--load-cache", "c.safetensors"],
     "--no-turned-mean would contradict it"),
    (["generate", "--prompt", "x", "--turned-mean", "--max-kv-size", "64"],
     "--turned-mean: --max-kv-size makes every layer a sliding window"),
    (["generate", "--prompt", "x", "--turned-mean", "--load-cache", "c.safetensors"],
     "--turned-mean would contradict it"),
    (["serve", "--plain", "--turned-mean"], "argument --plain: mlx-lm's own uncompressed caches"),
    (["serve", "--turned-mean", "--codec", '{"codec": "identity"}'], "--turned-mean says where a budget's centred"),
    (["serve", "--turned-mean", "--profile"], "argument --turned-mean: it says where the uncalibrated budgets learn"),
    (["serve", "--profile", "/nonexistent/p.json"], "argument --profile: no file /nonexistent/p.json"),
    (["serve", "--bits", "3.25", "--key-bits", "4", "--profile"],
     "argument --profile: it chooses the configuration for --bits, not for --key-bits"),
    (["serve", "--bits", "1"], "argument --bits: no measured configuration fits 1 bits per coordinate at head "
                               "size 64; the smallest is 2.25"),
    (["needle", "--positions", "100"], "argument --positions: at least one 512-token window (and below 2**31), or 0"),
    (["needle", "--attention", "--contexts", "1024", "2048", "--depths", "0.1"],
     "argument --contexts: --attention reads one cell; give one value, got 2"),
    (["needle", "--attention", "--contexts", "1024", "--depths", "1.5"],
     "argument --depths: depth must lie in [0, 1], got 1.5"),
])
def test_bad_arguments_give_a_usage_message_and_status_2(argv, message, capsys):
    import time
    t = time.perf_counter()
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: turboquant" in err and message in err and "Traceback" not in err
    assert time.perf_counter() - t < 5                       # refused before loading any model


def test_eval_list_keeps_every_name_apart_from_its_family(capsys):
    """`eval --list`: one column as wide as the longest name, so no name runs into its family."""
    from turboquant.suite import CONFIGS
    assert cli.main(["eval", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    col = max(map(len, CONFIGS)) + 1
    assert [line[:col].rstrip() for line in lines] == list(CONFIGS)
    assert [line[col:] for line in lines] == [c.family for c in CONFIGS.values()]


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    commands = ("memory", "model", "generate", "chat", "calibrate", "eval", "needle", "longctx", "kernels",
                "bench", "serve", "loadtest")
    for command in commands:                      # listed once, by the subparsers' own help
        assert out.count(f"\n    {command}") == 1
    assert "\n  turboquant " not in out            # no second list (the module's docstring once was one)
    assert "turboquant COMMAND --help" in out


def test_bench_generate_refuses_bad_bits_before_loading(capsys):
    for argv, bad in ((["--bits", "9"], "bits must be an int in 1..8, got 9"),
                      (["--profile-bits", "0"], "profile_bits must be positive budgets")):
        with pytest.raises(SystemExit) as e:               # usage errors, before a model loads
            cli.main(["bench", "generate", *argv])
        assert e.value.code == 2 and bad in capsys.readouterr().err
    for argv, bad in ((["bench", "decode", "--context", "100"], "--context"),
                      (["bench", "generate", "--tokens", "64"], "--tokens")):
        with pytest.raises(SystemExit) as e:               # sub-commands: an option of the other is unknown
            cli.main(argv)
        assert e.value.code == 2 and f"unrecognized arguments: {bad}" in capsys.readouterr().err


def test_a_wrong_model_or_option_is_a_usage_error_of_the_command(capsys, tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{")
    (tmp_path / "alien").mkdir()
    (tmp_path / "alien" / "config.json").write_text('{"model_type": "no-such-architecture"}')
    for command in ("needle", "longctx", "chat", "eval", "calibrate", "serve"):
        for model, why in (("nosuch", "neither an installed model"), (tmp_path, "no config.json"),
                           (tmp_path / "broken", "is not valid JSON"), (tmp_path / "alien", "no model type")):
            with pytest.raises(SystemExit) as e:           # every command alike: status 2, its own usage
                cli.main([command, "--model", str(model)])
            err = capsys.readouterr().err
            assert e.value.code == 2 and f"turboquant {command}: error: argument --model:" in err and why in err
            assert f"usage: turboquant {command}" in err
    with pytest.raises(SystemExit) as e:
        cli.main(["kernels", "--nosuch"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage: turboquant kernels" in err and "unrecognized arguments: --nosuch" in err


def test_model_refusal_opens_nothing(tmp_path):
    from turboquant.models import MODELS, model_refusal
    assert all(model_refusal(name) is None for name in MODELS)
    assert "neither an installed model" in model_refusal("nosuch")
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert model_refusal(tmp_path) is None
    (tmp_path / "config.json").write_text('[1, 2]')
    assert "no model type None" in model_refusal(tmp_path)


def test_model_command_checks_paris(capsys):
    # every installed model is checked by `make model` before the tests; here the command once
    assert cli.main(["model", "--model", "smollm2-135m"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_kernels_command(capsys):
    from turboquant.kernels import emulate
    assert cli.main(["kernels"]) == 0
    out = capsys.readouterr().out
    assert "kernel back-end:" in out and "verified (cuda)" in out
    if emulate.compiler() is None:
        pytest.skip("no C++ compiler for the kernel emulation")
    assert cli.main(["kernels", "--emulated", "--bench", "--tokens", "128", "--repeats", "1", "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert "deprecated: use `turboquant bench decode`" in err
    assert "kernel back-end: cpp" in out and "self-check against the mx path: passed" in out
    assert "from codes (default)" in out and out.count("turboquant_mse") == 3 and out.count("fibquant") == 1


def test_bench_decode_command(capsys, tmp_path):
    out_file = tmp_path / "decode.json"
    assert cli.main(["bench", "decode", "--tokens", "64", "200", "--repeats", "1", "--slow-up-to", "64",
                     "--quiet", "--out", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "speed-up over fp32 SDPA" in out and out.count("turboquant_mse") == 6
    result = json.loads(out_file.read_text())
    assert result["headers"][-1] == "from codes (default)" and len(result["rows"]) == 8
    assert all(r[-1] > 0 for r in result["rows"])
    slow = [r[5] for r in result["rows"]]                      # dequantize column: timed at T = 64 only
    assert all(math.isfinite(v) for v in slow[:4]) and all(v is None for v in slow[4:])   # strict JSON: null
    assert result["bandwidth_gb_s"] > 0


def test_output_paths_are_checked_before_the_work(tmp_path, capsys):
    """Issue #26.7: a bad --out or --save-cache used to fail after the whole run."""
    import time
    t = time.perf_counter()
    assert cli.main(["eval", "--configs", "TQ-mse 2", "--tokens", "512", "--out", str(tmp_path)]) == 1
    assert "is a folder" in capsys.readouterr().err
    assert cli.main(["generate", "--model", "smollm2-135m", "--prompt", "Hi", "--max-tokens", "2",
                     "--save-cache", str(tmp_path / "nodir" / "f.safetensors")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert time.perf_counter() - t < 30                  # refused before loading a model or scoring
    assert list(tmp_path.iterdir()) == []                # and no temporary left behind


def test_save_prompt_cache_refuses_a_folder_and_leaves_no_temporary(tmp_path):
    import pytest as _pytest
    from turboquant.cache import TurboQuantKVCache
    from turboquant.codecs import TurboQuantMSE
    from turboquant.prompt_cache import save_prompt_cache
    import mlx.core as mx
    c = TurboQuantKVCache(TurboQuantMSE(16, 4))
    k = mx.random.normal((1, 2, 5, 16), key=mx.random.key(0))
    c.update_and_fetch(k, k)
    (tmp_path / "d").mkdir()
    with _pytest.raises(ValueError, match="is a folder"):
        save_prompt_cache(tmp_path / "d", [c])
    with _pytest.raises(ValueError, match="does not exist"):
        save_prompt_cache(tmp_path / "nodir" / "c.safetensors", [c])
    assert [p.name for p in tmp_path.iterdir()] == ["d"] and list((tmp_path / "d").iterdir()) == []


def test_overwrite_without_save_cache_is_an_error(capsys):
    import pytest as _pytest
    with _pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", "smollm2-135m", "--prompt", "Hi", "--overwrite"])
    assert e.value.code == 2 and "--overwrite applies to --save-cache" in capsys.readouterr().err


def test_the_report_says_larger_when_the_cache_is_larger():
    """Issue #26.10: the Identity codec's cache was reported as "0.50x smaller"."""
    import mlx.core as mx
    from turboquant import make_prompt_cache
    from turboquant.codecs import Identity, TurboQuantMSE
    from turboquant.generate import report
    from turboquant.models import tiny_model
    model = tiny_model("llama", seed=0)
    for codec, word in ((lambda d: Identity(d), "x larger"), (lambda d: TurboQuantMSE(d, 4), "x smaller")):
        cache = make_prompt_cache(model, key_codec=codec)
        model(mx.array([[1, 2, 3, 4, 5]]), cache=cache)
        assert word in report(model, cache, (5, 1.0), (0, 0.0))


def test_eval_update_adds_rows_to_a_recorded_run_scored_the_same_way(tmp_path, capsys):
    """--update: re-measured rows join a recorded run only when both scored the same tokens
    the same way (its fp32 row bit-identical); intervals are recomputed over all rows."""
    import json
    run = tmp_path / "run.json"
    base = ["eval", "--tokens", "512", "--window", "256", "--agreement-tokens", "0", "--fidelity-tokens", "0",
            "--quiet"]
    assert cli.main(base + ["--configs", "TQ-mse 2", "--out", str(run)]) == 0
    before = json.loads(run.read_text())
    assert cli.main(base + ["--configs", "TQ-mse 3", "--update", str(run)]) == 0
    after = json.loads(run.read_text())
    assert set(after["results"]) == {"fp32", "TQ-mse 2", "TQ-mse 3"}
    assert after["results"]["TQ-mse 2"]["ppl"] == before["results"]["TQ-mse 2"]["ppl"]
    assert after["results"]["TQ-mse 3"]["ppl"] < after["results"]["TQ-mse 2"]["ppl"]
    assert "intervals" in after["results"]["TQ-mse 3"] and after["setup"]["updates"][0]["rows"] == ["TQ-mse 3"]
    capsys.readouterr()
    with pytest.raises(SystemExit):                                    # refused before any work
        cli.main(base[:1] + ["--tokens", "768"] + base[3:] + ["--configs", "TQ-mse 3", "--update", str(run)])
    assert "was scored another way (tokens: 512 there, 768 here)" in capsys.readouterr().err
    assert json.loads(run.read_text()) == after                        # nothing changed
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(SystemExit):
        cli.main(base + ["--configs", "TQ-mse 3", "--update", str(bad)])
    assert "is not a recorded run" in capsys.readouterr().err
    domains = tmp_path / "domains.json"                                   # one domain of a multi-domain run
    del before["setup"]["start"]                                          # as runs recorded before `start`
    domains.write_text(json.dumps({"setup": {}, "domains": {"wikipedia": before}}))
    assert cli.main(base + ["--configs", "TQ-mse 3", "--update", str(domains)]) == 0
    updated = json.loads(domains.read_text())["domains"]["wikipedia"]["results"]
    assert {n: (r["ppl"], r["intervals"]) for n, r in updated.items()} == \
        {n: (r["ppl"], r["intervals"]) for n, r in after["results"].items()}


def test_generate_with_the_turned_mean_saves_and_continues(tmp_path, capsys):
    """--turned-mean (default 4.25 bits): the cache is the turned-mean one, saved and continued
    with --load-cache as any other."""
    path = tmp_path / "t.cache"
    prompt = "Paris, the capital of France, lies on the Seine. Its museums, bridges and cafes draw visitors from"
    assert cli.main(["generate", "--prompt", prompt, "--max-tokens", "3",
                     "--turned-mean", "--save-cache", str(path)]) == 0
    from turboquant import load_prompt_cache
    cache = load_prompt_cache(path)
    assert type(cache[0]).__name__ == "TurnedMeanCache" and cache[0].mean is not None
    assert cli.main(["generate", "--prompt", " It", "--max-tokens", "2", "--load-cache", str(path)]) == 0
    assert "cache saved" in capsys.readouterr().out


def test_needle_prints_the_right_answers_scores_and_counts_cells_recorded_without_them(monkeypatch, capsys):
    """`turboquant needle` prints, under its table, each scored cell's starts, reads (p(code |
    start) > 1/2), mean lead and code log p, and counts the cells recorded before the scores."""
    import turboquant.models
    import turboquant.needles

    def trial(margin, code, value):
        return {"context": 1024, "depth": 0.9, "value": value, "answer": " x", "ok": margin > 0,
                "start_logp": -1.0, "start_margin": margin, "code_logp": code}
    cell = {"context": 1024, "depth": 0.9, "ok": 1, "n": 2, "lo": 0.1, "hi": 1.0}
    record = {"setup": {"haystack": "lee"}, "results": {
        "new": {"family": "x", "bits": 4.25, "cells": [cell],
                "trials": [trial(0.5, -0.1, "1111"), trial(-0.5, -2.0, "2222")]},
        "old": {"family": "x", "bits": 4.25, "cells": [cell],
                "trials": [{"context": 1024, "depth": 0.9, "value": "1111", "answer": " 1111", "ok": True}]}}}
    monkeypatch.setattr(turboquant.models, "load", lambda name: (None, None))
    monkeypatch.setattr(turboquant.needles, "needle_grid", lambda *a, **k: record)
    assert cli.main(["needle", "--configs", "fp32", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "new                          1024@90%: 1/2 start right, 1/2 read the code, lead +0.00, " \
        "log p(code | start) -1.050" in out
    assert "1 cell(s) were recorded before the trials scored the right answer" in out


@pytest.mark.parametrize("command", [["memory"], ["model"], ["generate"], ["chat"], ["calibrate"], ["eval"],
                                     ["needle"], ["longctx"], ["kernels"], ["bench", "decode"],
                                     ["bench", "generate"], ["serve"], ["loadtest"]])
def test_every_commands_help_shows_real_defaults_only(command, capsys):
    """Each option's help ends with its default, quoted as the shell needs it; none prints
    a default that is no value (None, False, an empty list)."""
    with pytest.raises(SystemExit) as e:
        cli.main([*command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for empty in ("(default: None)", "(default: False)", "(default: )", "(default: [])"):
        assert empty not in " ".join(out.split()), (command, empty)
    if command == ["longctx"]:
        assert "(default: fp32 'budget K4/V4'" in " ".join(out.split())
