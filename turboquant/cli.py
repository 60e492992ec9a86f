"""turboquant: KV-cache compression for long-context inference in MLX.

The command line: ``turboquant COMMAND …``; ``turboquant --help`` lists the commands (one
home: each subparser's help), ``turboquant COMMAND --help`` the options of each.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import memory
from .data import CALIBRATION, DOMAINS
from .checks import check_out_file


def _int_at_least(lo: int):
    """An argparse type: an int >= lo (argparse turns the ValueError into a usage error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return value
    parse.__name__ = f"int >= {lo}"
    return parse


def _int_in(lo: int, hi: int):
    """An argparse type: an int in lo..hi."""
    at_least = _int_at_least(lo)

    def parse(text: str) -> int:
        value = at_least(text)
        if value > hi:
            raise argparse.ArgumentTypeError(f"must be <= {hi}, got {value}")
        return value
    parse.__name__ = f"int in {lo}..{hi}"
    return parse


def _bits(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of bits, got {text!r}") from None
    if not 0 < value <= 32:
        raise argparse.ArgumentTypeError(f"bits must be in (0, 32], got {text}")
    return value


def _memory(args) -> int:
    if args.side != "affine" and args.group_size is not None:
        args.parser.error("--group-size applies to --side affine only")
    group = 64 if args.group_size is None else args.group_size
    geometry = memory.PRESETS[args.preset]
    side = {"none": 0, "norm": memory.NORM_SIDE_BITS,
            "affine": memory.affine_side_bits(geometry.head_dim, group)}[args.side]
    print(geometry.describe())
    print(f"{'context':>10} {'bits':>6} {'side bits':>9} {'KV MB':>12}")
    for t in args.context:
        for b in args.bits:
            nbytes = memory.kv_cache_bytes(geometry, t, b, side if b < 16 else 0, batch=args.batch)
            print(f"{t:>10,} {b:>6g} {side if b < 16 else 0:>9g} {nbytes / 1e6:>12,.1f}")
    return 0


def _model(args) -> int:
    from . import blas
    from .models import MODELS, check
    names = sorted(MODELS) if args.model == "all" else [args.model]
    if args.folder is not None and len(names) > 1:
        args.parser.error("--folder needs one --model")
    print(f"fast BLAS: {blas.status()}")
    failed = False
    for name in names:
        r = check(name, args.folder, args.prompt, args.max_tokens, args.expect)
        print(f"{name}: {r['folder']} (licence: {r['license']})")
        print(f"  greedy: {args.prompt!r} → {r['text']!r}")
        if args.expect:
            print(f"  next token {r['expected_token']!r}: rank {r['rank']}, probability {r['probability']:.3f}")
            if r["rank"] > args.top:
                print(f"error: {name}: {args.expect!r} is not among the {args.top} most likely next tokens",
                      file=sys.stderr)
                failed = True
    return 1 if failed else 0


def _check_profile_flags(args) -> None:
    """--profile's rules, one home for generate, chat and serve: it chooses the configuration
    for --bits (default: the default budget), so it refuses --key-bits/--value-bits/--codec and
    --turned-mean/--no-turned-mean (which say where the uncalibrated budgets learn their key
    mean), and a profile path must be a file."""
    if args.profile is None:
        return
    if args.key_bits or args.value_bits or args.codec:
        args.parser.error("argument --profile: it chooses the configuration for --bits, not for "
                          "--key-bits/--value-bits/--codec")
    if args.turned_mean is not None:
        flag = "--turned-mean" if args.turned_mean else "--no-turned-mean"
        args.parser.error(f"argument {flag}: it says where the uncalibrated budgets learn their key mean, not "
                          "a --profile's")
    if args.bits is None:
        from .generate import DEFAULT_BITS
        args.bits = DEFAULT_BITS                          # the default budget, from the profile
    if args.profile is not True:
        try:
            found = Path(args.profile).is_file()
        except OSError:                                   # e.g. a name too long for the file system
            found = False
        if not found:
            args.parser.error(f"argument --profile: no file {args.profile}")


def _load_for_generation(args):
    from .generate import cache_options, new_cache
    from .models import load
    set_ = [f"--{n.replace('_', '-')}" for n in ("bits", "key_bits", "value_bits", "codec", "max_kv_size", "profile")
            if getattr(args, n) is not None] + ([] if args.turned_mean is None else
                                                ["--turned-mean" if args.turned_mean else "--no-turned-mean"])
    if getattr(args, "load_cache", None) and set_:
        args.parser.error(f"--load-cache restores the saved cache with its own codecs: {', '.join(set_)} "
                          "would contradict it")
    _check_profile_flags(args)
    try:
        options = cache_options(args.bits, args.key_bits, args.value_bits, args.codec, args.max_kv_size,
                                args.turned_mean)
    except ValueError as e:
        args.parser.error(str(e))
    if args.profile is not None:
        options["profile"] = args.profile
    model, tok = load(args.model)
    if options.get("turned_mean"):         # asked for: the model's own refusal names the flag
        from .prompt_cache import turned_mean_refusal
        refusal = turned_mean_refusal(model, options.get("max_kv_size"))
        if refusal:
            args.parser.error(f"argument --turned-mean: the turned key mean needs RoPE positions in order: {refusal}")
    if getattr(args, "load_cache", None):  # the saved cache, with its own codecs (none were given)
        return model, tok, new_cache(model, options, args.load_cache)
    if "bits" in options:                # a budget below every measured configuration is a usage error
        try:
            if options.get("profile") is True:
                from .calibration.profiles import find_profile, no_profile_refusal
                if find_profile(model) is None:
                    args.parser.error(f"argument --profile: {no_profile_refusal('--profile')}")
            if "profile" in options and options.get("max_kv_size") is not None:
                from .prompt_cache import codes_keys_before_rope, window_refusal
                if codes_keys_before_rope(model, options["bits"], options["profile"]):
                    args.parser.error(f"argument --profile: the profile's configuration at {options['bits']:g} "
                                      "bits codes keys before RoPE, which this cache cannot hold: "
                                      f"{window_refusal(options['max_kv_size'], '--max-kv-size')}")
            return model, tok, new_cache(model, options)
        except ValueError as e:
            if "profile" in options:
                args.parser.error(f"argument --profile: {e}")
            args.parser.error(f"argument --bits: {e}")
    return model, tok, new_cache(model, options, getattr(args, "load_cache", None))


def _generate(args) -> int:
    from .generate import generate_text, report
    from .prompt_cache import save_prompt_cache
    if args.overwrite and not args.save_cache:
        args.parser.error("--overwrite applies to --save-cache, which was not given")
    if args.save_cache and Path(args.save_cache).exists() and not args.overwrite and not Path(args.save_cache).is_dir():
        args.parser.error(f"{args.save_cache} exists: pass --overwrite to replace it")
    model, tok, cache = _load_for_generation(args)
    ids = tok.encode(args.prompt, add_special_tokens=args.load_cache is None)
    print(args.prompt, end="", flush=True)
    r = generate_text(model, tok, ids, cache, args.max_tokens)
    print("\n" + report(model, cache, r["prefill"], r["decode"]))
    if args.save_cache:
        save_prompt_cache(args.save_cache, cache, {"model": str(args.model)}, model=model)
        print(f"cache saved to {args.save_cache}")
    return 0


def _chat(args) -> int:
    from .generate import chat
    model, tok, cache = _load_for_generation(args)
    print(f"chatting with {args.model} through a compressed cache; an empty line or /exit ends", flush=True)
    chat(model, tok, cache, args.max_tokens, system=args.system)
    return 0


def _cache_arguments(p) -> None:
    g = p.add_argument_group("cache (choose one; default --bits 4.25: centered 4-bit keys, 4-bit values, "
                             "one exact sink token, the key mean turned with each position)")
    g.add_argument("--bits", type=_bits, default=None, help="a budget in bits per coordinate, side information "
                   "included: the best measured configuration within it (Chapter 9)")
    g.add_argument("--profile", nargs="?", const=True, default=None, metavar="PATH",
                   help="with --bits (default 4.25): the model's calibrated profile (or the profile file PATH) instead of the "
                        "uncalibrated budgets; it helps on text like its calibration text and can lose on "
                        "other domains (Chapter 10)")
    g.add_argument("--key-bits", type=_int_in(1, 8), default=None, help="TurboQuant_mse bits for keys (1..8)")
    g.add_argument("--value-bits", type=_int_in(1, 8), default=None, help="TurboQuant_mse bits for values (1..8)")
    g.add_argument("--codec", default=None, help="a codec config as JSON, or a JSON file (keys and values)")
    g.add_argument("--max-kv-size", type=_int_at_least(1), default=None, help="keep at most this many tokens per layer")
    g.add_argument("--turned-mean", action=argparse.BooleanOptionalAction, default=None,
                   help="with --bits (default 4.25): learn the key mean before RoPE and turn it with each position "
                        "(no calibration; the default wherever the model allows it, Chapter 10); "
                        "--no-turned-mean learns it after RoPE (Chapter 9's centred rule)")


def _calibrate(args) -> int:
    from .calibration import calibrate, profile_path, save_profile
    from .models import load
    bad = [b for b in args.budgets if not 0 < b <= 8]
    if bad:
        args.parser.error(f"argument --budgets: bits per coordinate must be in (0, 8], got {bad[0]:g}")
    text = None
    if args.text is not None:
        path = Path(args.text)
        if not path.is_file():
            args.parser.error(f"argument --text: no file {path}")
        text = path.read_text(encoding="utf-8", errors="strict")
    _check_positions(args)
    model, tok = load(args.model)
    if args.pre_rope == "yes":
        from .prompt_cache import pre_rope_refusal
        why = pre_rope_refusal(model)
        if why:
            args.parser.error(f"argument --pre-rope: this model's keys cannot be coded before RoPE: {why}")
    name = args.model if args.name is None else args.name
    prof = calibrate(model, tok, args.budgets, name=name, corpus=args.corpus if text is None else str(args.text),
                     text=text, windows=args.windows, heldout=args.heldout,
                     positions="context" if args.positions is None else args.positions or None,
                     pre_rope={"auto": None, "yes": True, "no": False}[args.pre_rope], progress=not args.quiet)
    print(f"{'budget':>6} {'keys':>5} {'values':>6} {'outliers':>8} {'keys coded':>11} {'bits':>6} "
          f"{'Δppl % (held-out calibration text)':>36}")
    for e in prof["budgets"]:
        c = e["choice"]
        print(f"{e['budget']:>6g} {c['key_bits']:>5g} {c['value_bits']:>6g} {c['outliers']:>8d} "
              f"{'before RoPE' if c.get('pre_rope') else 'after RoPE':>11} {e['bits']:>6.3f} "
              f"{100 * e['ppl_increase']:>+36.2f}")
    from .calibration import fitted_positions
    print(f"fitted for positions below {fitted_positions(prof):,}"
          + (" (the model's context: keys and queries spread over it by RoPE)" if prof["calibration"].get("positions")
             else " (one calibration window: --positions 0)"))
    default = profile_path(name)
    out = save_profile(prof, args.out or default)
    if out.resolve().parent == default.resolve().parent:
        print(f"wrote {out}: make_prompt_cache(model, bits=…, profile=True) and --bits … --profile now use it "
              f"for this model")
    else:
        print(f"wrote {out}: use it with make_prompt_cache(model, bits=…, profile={str(out)!r}) or --profile "
              f"{out} (profiles in {default.parent} are found by profile=True / --profile)")
    return 0


def _config_names(args) -> list[str]:
    """``--configs`` as configuration names ('chapter' and 'all' expanded); an unknown name is
    a parser error with the valid ones, and a hint when quotes were missing."""
    from .suite import ALL_CONFIGS, CHAPTER_CONFIGS, CONFIGS
    names = list(ALL_CONFIGS) if args.configs == ["all"] else (
        list(CHAPTER_CONFIGS) if args.configs == ["chapter"] else args.configs)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        split = [n for n in CONFIGS if " " in n and " ".join(args.configs).find(n) >= 0 and n not in names]
        hint = (f" (a name with spaces is one argument: quote it, e.g. --configs \"{split[0]}\")" if split else "")
        import difflib
        close = [] if split else difflib.get_close_matches(unknown[0], list(CONFIGS), n=3)
        near = f" (closest: {', '.join(map(repr, close))})" if close else ""
        args.parser.error(f"argument --configs: unknown configuration(s) {', '.join(map(repr, unknown))}{hint}"
                          f"{near}; valid: 'chapter', 'all' or one of the {len(CONFIGS)} names "
                          "`turboquant eval --list` prints")
    return names


def _longctx(args) -> int:
    from .longcontext import long_context_run
    names = _config_names(args)
    try:
        record = long_context_run(args.model, names, args.context, args.questions, args.min_back, out=args.out,
                                  max_tokens=args.max_tokens, progress=not args.quiet)
    except ValueError as e:
        args.parser.error(str(e))
    except RuntimeError as e:                     # a configuration's process failed: the rows before it are kept
        kept = args.out and Path(args.out).exists()
        print(f"turboquant longctx: error: {e}" + (f"; the configurations before it are in {args.out}"
                                                   if kept else ""), file=sys.stderr)
        return 1
    s = record["setup"]
    print(f"{s['model']}: {s['context_tokens']:,} tokens of this package's source, {len(s['questions'])} "
          f"signature questions {min(q['tokens_back'] for q in s['questions']):,}–"
          f"{max(q['tokens_back'] for q in s['questions']):,} tokens back")
    print(f"{'configuration':16s} {'bits':>5} {'right':>7} {'95 % interval':>15} {'cache MB':>9} {'fp16 MB':>8} "
          f"{'prefill/s':>9} {'decode/s':>8} {'peak GB':>7}")
    from .evaluation.intervals import wilson
    for name, r in record["results"].items():
        iv = wilson(r["correct"], r["n"])
        print(f"{name:16s} {r['bits']:>5.3g} {r['correct']:>3}/{r['n']:<3} [{iv.lo:.2f}, {iv.hi:.2f}]".ljust(48)
              + f" {r['cache_nbytes'] / 1e6:>9.1f} {r['fp16_nbytes'] / 1e6:>8.1f} {r['prefill_tok_s']:>9.1f} "
              f"{r['decode_tok_s']:>8.2f} "
              f"{r['peak_rss'] / 1e9:>7.2f}")
    if args.out:
        print(f"wrote {args.out}")
    return 0


def _check_positions(args) -> None:
    """--positions (calibrate, needle): 0 (fit within the windows), or a context of at least one window."""
    from .calibration import WINDOW
    from .calibration.phases import valid_positions
    if args.positions and not valid_positions(args.positions, WINDOW):
        args.parser.error(f"argument --positions: at least one {WINDOW}-token window (and below 2**31), or 0, "
                          f"got {args.positions}")


def _needle(args) -> int:
    from .models import load
    from .needles import needle_grid, needle_scores, needle_table
    names = _config_names(args)
    _check_positions(args)
    if args.attention:
        for option, given in (("--contexts", args.contexts), ("--depths", args.depths)):
            if len(given) != 1:
                args.parser.error(f"argument {option}: --attention reads one cell; give one value, got {len(given)}")
        if not 0.0 <= args.depths[0] <= 1.0:
            args.parser.error(f"argument --depths: depth must lie in [0, 1], got {args.depths[0]}")
    model, tok = load(args.model)
    if args.attention:
        return _needle_reading(args, model, tok, names)
    try:
        record = needle_grid(model, tok, names, args.contexts, args.depths, args.values,
                             model_name=f"{args.model} (float32)", out=args.out, chunk=args.chunk,
                             calibration_corpus=args.calibration_corpus, progress=not args.quiet,
                             positions="context" if args.positions is None else args.positions or None)
    except ValueError as e:
        args.parser.error(str(e))
    rows = needle_table(record)
    heads = [k for k in rows[0] if k not in ("configuration", "bits")]
    print(f"needle retrieval (successes, 95 % Wilson interval) at context@depth; haystack: "
          f"{record['setup']['haystack']}")
    W = _width([r["configuration"] for r in rows], 28)
    print(f"{'configuration':{W}s} {'bits':>5} " + " ".join(f"{h:>20}" for h in heads))
    for r in rows:
        print(f"{r['configuration']:{W}s} {r['bits']:>5.3g} " + " ".join(f"{r.get(h, '—'):>20}" for h in heads))
    scored = needle_scores(record)
    unscored = sum(len(r["cells"]) for r in record["results"].values()) - len(scored)
    if scored:
        print("the right answer's scores (means over the trials that record them): greedy starts right, "
              "reads the code (p(code | start) > 1/2), lead of the start over the likeliest other token "
              "(nats), log p(code | start)")
        for s in scored:
            print(f"{s['configuration']:{W}s} {s['context']}@{s['depth']:.0%}: {s['starts']}/{s['n']} start right, "
                  f"{s['reads']}/{s['n']} read the code, lead {s['lead']:+.2f}, "
                  f"log p(code | start) {s['code_logp']:+.3f}")
    if unscored:
        print(f"{unscored} cell(s) were recorded before the trials scored the right answer, so they have no "
              "scores; remove their rows from the file to measure them again")
    if args.out:
        print(f"wrote {args.out}")
    return 0


def _needle_reading(args, model, tok, names) -> int:
    import numpy as np

    from .needles import needle_reading, reading_layers, reading_mass, score_lift, value_noise
    try:
        record = needle_reading(model, tok, names, args.contexts[0], args.depths[0], args.values,
                                model_name=f"{args.model} (float32)", out=args.out, chunk=args.chunk,
                                calibration_corpus=args.calibration_corpus, progress=not args.quiet,
                                positions="context" if args.positions is None else args.positions or None)
    except ValueError as e:
        args.parser.error(str(e))
    ref = "fp32" if "fp32" in record["results"] else names[0]
    layers = reading_layers(record, ref)
    print(f"where the answer reads the needle at {args.contexts[0]} tokens, {args.depths[0]:.0%} depth "
          f"({args.values} codes): attention on the code's tokens, summed over heads, in the layers where "
          f"{ref} gives them ≥ 0.1 ({', '.join(map(str, layers)) or 'none'}); mean score noise there; "
          "mean value noise there (what value coding changes in the attention output, relative) and its "
          "ratio to what independent per-token errors would give; the score lift there (how far key coding "
          f"raises the code's scores against the other tokens, heads weighted by {ref}'s attention on the code); "
          "log p(code | start)")
    W = _width(list(record["results"]), 28)
    for name, r in record["results"].items():
        mass = reading_mass(record, name)
        noise = np.mean([t["noise"] for t in r["trials"]], axis=0)
        measured, independent = (v[layers].mean() if layers else 0.0 for v in value_noise(record, name))
        coherence = f" ({measured / independent:.1f}×)" if independent > 0 else ""
        lift = f"  lift {score_lift(record, name, ref)[layers].mean():+.3f}" if layers else ""
        print(f"{name:{W}s} " + " ".join(f"L{n}:{mass[n]:.2f}" for n in layers)
              + (f"  noise {noise[layers].mean():.3f}  value noise {measured:.3f}{coherence}{lift}" if layers else "")
              + f"  log p {np.mean([t['code_logp'] for t in r['trials']]):+.2f}")
    if args.out:
        print(f"wrote {args.out}")
    return 0


def _width(names, least: int) -> int:
    """A table's first column: ``least`` characters, or the longest of ``names``."""
    return max([least, *map(len, names)])


def _eval(args) -> int:
    from .suite import CONFIGS, evaluate, frontier_rows
    if args.list:
        w = _width(CONFIGS, 32)
        for name, c in CONFIGS.items():
            print(f"{name:{w}s} {c.family}")
        return 0
    names = _config_names(args)
    if args.tokens < args.window:
        args.parser.error(f"argument --tokens: {args.tokens} tokens are fewer than one --window of "
                          f"{args.window}; give --tokens >= --window")
    for name in args.diff or ():
        if name not in CONFIGS:
            args.parser.error(f"argument --diff: unknown configuration {name!r}; see --list")
    if args.diff:
        names = names + [n for n in args.diff if n not in names]
    from .models import load
    from .suite import diff, evaluate_domains, worst_domain
    recorded = None
    if args.update:                       # checked before the work: a readable recorded run, one corpus
        if len(set(args.corpus)) > 1:
            args.parser.error("argument --update: updates one corpus's recorded run; give one --corpus")
        try:
            whole = json.loads(Path(args.update).read_text())
            recorded = whole["domains"][args.corpus[0]] if "domains" in whole else whole   # one domain of several
            recorded["setup"], recorded["results"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            args.parser.error(f"argument --update: {args.update} is not a recorded run of `turboquant eval` "
                              f"with {args.corpus[0]!r} ({e})")
        asked = {"model": f"{args.model} (float32)", "corpus": args.corpus[0], "tokens": args.tokens,
                 "window": args.window, "chunk": args.chunk, "seeds": args.seeds, "start": args.start,
                 "compare": args.compare}
        from .suite import setup_differences
        differ = setup_differences(recorded["setup"], asked)
        if differ:
            args.parser.error(f"argument --update: {args.update} was scored another way ({'; '.join(differ)})")
    if "fp32" not in names:
        names = ["fp32"] + names          # the reference every increase is measured against
    from .suite import calibration_corpus_for
    try:                                  # before loading a model: the check needs none
        calibration_corpus_for(names, args.corpus, args.calibration_corpus, args.start)
    except ValueError as e:
        args.parser.error(f"argument {'--corpus' if args.calibration_corpus else '--calibration-corpus'}: {e}")
    model, tok = load(args.model)
    kw = dict(tokens=args.tokens, window=args.window, chunk=args.chunk,
              agreement_tokens=args.agreement_tokens, fidelity_tokens=args.fidelity_tokens,
              needle_contexts=args.needle_contexts, progress=not args.quiet,
              model_name=f"{args.model} (float32)", calibration_corpus=args.calibration_corpus,
              compare=args.compare, needle_values=args.needle_values, seeds=args.seeds, start=args.start)
    corpora = list(dict.fromkeys(args.corpus))
    if len(corpora) == 1:
        result = evaluate(model, tok, names, corpus=corpora[0], **kw)
        runs = {corpora[0]: result}
    else:
        result = evaluate_domains(model, tok, names, corpora, **kw)
        runs = result["domains"]
    W = _width(names, 32)
    for corpus, run in runs.items():
        windows = run["results"]["fp32"]["per_window"]["n"]
        print(f"{corpus}: {len(windows)} windows of {args.window} tokens; 95 % intervals: paired block "
              f"bootstrap over windows" + (f", {args.seeds} rotation seeds where a configuration draws one"
                                          if args.seeds > 1 else ""))
        print(f"{'configuration':{W}s} {'bits':>6} {'ppl':>9} {'Δppl %':>8}  {'95 % interval':>18}")
        for name, _, bits, ppl, inc in frontier_rows(run):
            i = run["results"][name]["intervals"]["ppl_increase"]
            print(f"{name:{W}s} {bits:>6.3g} {ppl:>9.3f} {inc:>+8.2f}  [{i['lo']:>+7.2f}, {i['hi']:>+7.2f}]")
        needles = {n: r["needle_cells"] for n, r in run["results"].items() if "needle_cells" in r}
        if needles:
            cells = next(iter(needles.values()))
            heads = [f"{c['context']}@{c['depth']:.0%}" for c in cells]
            print(f"needle retrieval (successes of {cells[0]['n']}, 95 % Wilson interval) at context@depth:")
            print(f"{'configuration':{W}s} " + " ".join(f"{h:>17}" for h in heads))
            for name, cs in needles.items():
                print(f"{name:{W}s} " + " ".join(f"{c['ok']:>3d} [{c['lo']:.2f}, {c['hi']:.2f}]" for c in cs))
        if args.diff:
            d = diff(run, *args.diff)
            run["diff"] = d
            print(f"{d['a']} − {d['b']}: {d['value']:+.2f} points of Δppl, 95 % interval "
                  f"[{d['lo']:+.2f}, {d['hi']:+.2f}]: {d['verdict']}")
        print()
    if len(corpora) > 1:
        print(f"worst domain of each configuration ({', '.join(corpora)}):")
        for name in names:
            if name == "fp32":
                continue
            w = worst_domain(result, name)
            print(f"{name:{W}s} {w['corpus']:>10} {w['value']:>+8.2f}  [{w['lo']:>+7.2f}, {w['hi']:>+7.2f}]")
    if args.update:
        from .suite import update_run
        result = update_run(recorded, result)
        if "domains" in whole:
            whole["domains"][args.corpus[0]] = result
        else:
            whole = result
        Path(args.update).write_text(json.dumps(whole, indent=1))
        print(f"updated {args.update}: rows {', '.join(n for n in names if n != 'fp32')} (re)placed, "
              "intervals recomputed over all its rows")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
    return 0


def _kernels(args) -> int:
    from . import kernels
    if args.bench:
        print("turboquant kernels --bench is deprecated: use `turboquant bench decode` (with "
              "TURBOQUANT_KERNELS=cpp for the emulation); running it now", file=sys.stderr)
    if args.emulated:
        ctx = kernels.use(kernels.emulated())
    else:
        import contextlib
        ctx = contextlib.nullcontext()
    with ctx:
        name = kernels.backend_name()
        print(f"kernel back-end: {name} ({kernels.why()})")
        for where, what in kernels.VERIFIED.items():
            print(f"  verified ({where}): {what}")
        if kernels.active() is None:
            print("no kernel back-end in use: attention from codes runs on the mx path")
            return _bench_decode(args) if args.bench else 0
        problem = kernels.self_check(kernels.active())
        print("self-check against the mx path:", "passed" if problem is None else f"FAILED: {problem}")
        if problem is not None:
            return 1
        if args.bench:
            return _bench_decode(args)
    return 0


def _strict(v):
    """NaN/inf (a cell not measured) → null, so the file is strict JSON."""
    import math
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _strict(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_strict(x) for x in v]
    return v


def _write_json(path, result) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_strict(result), indent=1, allow_nan=False))
    print(f"wrote {out}")


def _bench_decode(args) -> int:
    from . import kernels
    from .bench import DECODE_HEADERS, decode_attention_rows
    from .viz.style import table
    print(f"decode attention, one query, B=1, H=8, D=128, float32, median of {args.repeats}; "
          f"kernels: {kernels.backend_name()}")
    print("speed-up over fp32 SDPA measured in the same run (> 1: faster; the two slow columns "
          f"only up to {args.slow_up_to} tokens)", flush=True)
    rows = decode_attention_rows(args.tokens, args.repeats, slow_up_to=args.slow_up_to,
                                 progress=None if args.quiet else lambda r: print(f"  T={r[0]} {r[1]} {r[2]:.3g}b done",
                                                                                  file=sys.stderr, flush=True))
    print(table(rows, DECODE_HEADERS, ".3g"))
    if getattr(args, "out", None):
        from .bench import decode_record
        _write_json(args.out, decode_record(rows, args.repeats))
    return 0


def _bench_generate(args) -> int:
    from .bench import generation_run
    say = None if args.quiet else lambda m: print(m + " ...", file=sys.stderr, flush=True)
    try:
        result = generation_run(args.model, args.context, args.new_tokens, args.bits, args.corpus, progress=say,
                                pre_rope=args.pre_rope, turned_mean=args.turned_mean,
                                profile_bits=args.profile_bits or ())
    except ValueError as e:                 # a corpus too short, a model without a profile, …
        args.parser.error(str(e))
    runs = result["runs"]
    base = next(iter(runs.values()))["tokens_per_s"]
    print(f"greedy decoding after {args.context} tokens of {args.corpus}, {args.new_tokens} steps per cache "
          "(interleaved), tokens/s from the median step:")
    for label, r in runs.items():
        print(f"  {label:60s} {r['tokens_per_s']:7.2f} tokens/s  ({r['tokens_per_s'] / base:.2f}x the fp32 cache)")
    if args.out:
        _write_json(args.out, result)
    return 0


def _serve(args) -> int:
    import shlex
    from .generate import cache_options
    from .serve import serve, serve_plain
    if args.plain and (args.turned_mean is not None or any(getattr(args, n) is not None
                                               for n in ("bits", "key_bits", "value_bits", "codec", "profile"))):
        args.parser.error("argument --plain: mlx-lm's own uncompressed caches; no cache option applies")
    if args.max_kv_size is not None:
        args.parser.error("argument --max-kv-size: its rotating caches keep 4 leading tokens, which are not "
                          "batched; serve windows through the model's own sliding layers")
    _check_profile_flags(args)
    try:
        options = cache_options(args.bits, args.key_bits, args.value_bits, args.codec, turned_mean=args.turned_mean)
    except ValueError as e:
        args.parser.error(str(e))
    options.pop("max_kv_size", None)
    if args.profile is not None:
        options["profile"] = args.profile
    mlx = ["--host", args.host, "--port", str(args.port), "--log-level", args.log_level,
           "--decode-concurrency", str(args.decode_concurrency), "--prompt-concurrency", str(args.prompt_concurrency),
           "--prefill-step-size", str(args.prefill_step_size), "--max-tokens", str(args.max_tokens),
           "--prompt-cache-size", str(args.prompt_cache_size)]
    if args.prompt_cache_bytes is not None:
        mlx += ["--prompt-cache-bytes", str(args.prompt_cache_bytes)]
    from .serve import check_mlx_options
    try:                                          # unbalanced quotes, or an option turboquant owns
        extra = shlex.split(args.mlx_options or "")
        check_mlx_options(extra)
    except ValueError as e:
        args.parser.error(f"argument --mlx-options: {e}")
    mlx += extra
    from .models import model_folder
    folder = model_folder(args.model)             # an unknown model fails before the banner
    if not args.plain and "bits" in options and "profile" not in options:   # so does a budget its thread refuses
        from types import SimpleNamespace

        from .budget import pick
        config = json.loads((folder / "config.json").read_text())
        try:                                      # the head size as the loaded model will give it
            dim = memory.geometry_from_model(SimpleNamespace(args=SimpleNamespace(**config))).head_dim
        except (AttributeError, TypeError, ZeroDivisionError):
            dim = None                            # another layout of config: the server's own check decides
        try:
            if dim:
                pick(options["bits"], dim)
        except ValueError as e:
            args.parser.error(f"argument --bits: {e}")
    what = "mlx-lm's uncompressed caches" if args.plain else f"caches {options}"
    print(f"turboquant serve: {args.model} on http://{args.host}:{args.port} (OpenAI-compatible: "
          f"/v1/chat/completions, /v1/completions), {what}", file=sys.stderr, flush=True)
    if args.plain:
        serve_plain(args.model, mlx)
    else:
        serve(args.model, options, mlx, from_codes=args.attention == "codes")
    return 0


def _loadtest(args) -> int:
    from .generate import cache_options
    from .loadtest import run_loadtest
    from .viz.style import table
    try:
        cache_options(args.bits)
    except ValueError as e:
        args.parser.error(str(e))
    say = None if args.quiet else lambda m: print(m + " ...", file=sys.stderr, flush=True)
    r = run_loadtest(args.model, conversations=args.conversations, concurrency=tuple(args.concurrency),
                     budgets=tuple(args.budgets), max_tokens=args.max_tokens, chars=args.chars,
                     cache_args=("--bits", str(args.bits)), faults=not args.no_faults, progress=say)
    rows = []
    for kind, e in r["servers"].items():
        for t in e["throughput"]:
            rows.append([e["label"], t["clients"], t["requests_per_s"], t["tokens_per_s"], t["p50_s"], t["p95_s"],
                         (t["peak_rss_bytes"] or 0) / 2**20])
    print(table(rows, ["server", "clients", "requests/s", "tokens/s", "p50 s", "p95 s", "peak MiB"], ".3g"))
    rows = [[e["label"], c["budget"], c["conversations"], c["kept"], c["second_turn_hits"]]
            for e in r["servers"].values() for c in e["capacity"]]
    print(table(rows, ["server", "--prompt-cache-bytes", "conversations", "kept", "2nd turns cached"], ".3g"))
    if "faults" in r:
        print("faults:", json.dumps(r["faults"]))
    if args.out:
        _write_json(args.out, r)
    return 0


def _size(text: str) -> int:
    """argparse type: a size in bytes as mlx-lm's server reads it (64MB, 1G, 123456)."""
    from .serve import size_in_bytes
    try:
        return size_in_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _size_text(text: str) -> str:
    """argparse type: a size as above, kept as written (it labels the results)."""
    _size(text)
    return text


def _decode_options(parser, hidden: bool = False) -> None:
    """``bench decode``'s options (also the deprecated ``kernels --bench``'s, hidden there)."""
    h = (lambda text: argparse.SUPPRESS) if hidden else (lambda text: text)
    parser.add_argument("--tokens", type=_int_at_least(1), nargs="+", default=[1024, 4096, 16384, 65536],
                        help=h("cache lengths T"))
    parser.add_argument("--repeats", type=_int_at_least(1), default=5, help=h("timed calls per cell (median)"))
    parser.add_argument("--slow-up-to", type=_int_at_least(1), default=16384,
                        help=h("time the slow paths (dequantize, mx path) only up to this T"))
    parser.add_argument("--quiet", action="store_true", help=h("no progress lines"))


class _Help(argparse.HelpFormatter):
    """Each option's help ends with its default, unless it has none (None, False) or the help
    already says it."""

    def _get_help_string(self, action):
        import shlex
        text = action.help or ""
        if (not action.option_strings or action.default is None or action.default is False
                or action.default is argparse.SUPPRESS or action.default == [] or "(default" in text):
            return text
        default = (shlex.join(map(str, action.default)) if isinstance(action.default, list)
                   else "%(default)s")
        return f"{text} (default: {default})".lstrip()


class _Parser(argparse.ArgumentParser):
    """Every command's parser (subparsers take their parent's class): defaults in its help."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)


def main(argv=None) -> int:
    p = _Parser(prog="turboquant", description="turboquant: KV-cache compression for long-context inference in MLX.",
                epilog="Run `turboquant COMMAND --help` for the options of each.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           title="commands", help="one of:")
    m = sub.add_parser("memory", help="KV-cache bytes for a model preset (Chapter 1's formula)")
    m.add_argument("--preset", choices=sorted(memory.PRESETS), default="llama-3.1-8b", help="the model's geometry")
    m.add_argument("--context", type=_int_at_least(1), nargs="+", default=[4096, 32768, 131072],
                   help="context lengths in tokens")
    m.add_argument("--bits", type=_bits, nargs="+", default=[16, 8, 4, 3, 2],
                   help="payload bits per coordinate (the codec's index bits; --side adds side information)")
    m.add_argument("--side", choices=["none", "norm", "affine"], default="norm",
                   help="side information per vector for bits < 16 (default: one fp16 norm)")
    m.add_argument("--group-size", type=_int_at_least(1), default=None,
                   help="affine group size for --side affine (default 64)")
    m.add_argument("--batch", type=_int_at_least(1), default=1, help="sequences held at once")
    m.set_defaults(run=_memory)

    from .models import MODELS
    d = sub.add_parser("model", help="convert (once) and check the installed real models offline")
    d.add_argument("--model", choices=["all", *sorted(MODELS)], default="all", help="which installed model")
    d.add_argument("--folder", default=None, help="where the converted model lives "
                   "(default: $TURBOQUANT_CACHE/models/<name>; needs one --model)")
    d.add_argument("--prompt", default="The capital of France is", help="the check's prompt")
    d.add_argument("--expect", default="Paris", help="fail unless this word's first token is among the "
                   "--top most likely next tokens ('' to skip)")
    d.add_argument("--top", type=_int_at_least(1), default=3, help="how many of the likeliest next tokens count")
    d.add_argument("--max-tokens", type=_int_at_least(1), default=8, help="greedy tokens printed after the prompt")
    d.set_defaults(run=_model)

    names = ", ".join(sorted(MODELS))
    gen = sub.add_parser("generate", help="text from a model through a compressed cache (attention from codes)")
    gen.add_argument("--model", default="smollm2-135m", help=f"{names}, or the path of an mlx-lm model folder")
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument("--max-tokens", type=_int_at_least(1), default=100, help="greedy tokens to generate at most")
    _cache_arguments(gen)
    gen.add_argument("--save-cache", default=None, help="save the prompt cache here afterwards")
    gen.add_argument("--overwrite", action="store_true", help="let --save-cache replace an existing file")
    gen.add_argument("--load-cache", default=None, help="continue from a cache saved by --save-cache")
    gen.set_defaults(run=_generate)

    ch = sub.add_parser("chat", help="a conversation through one compressed cache")
    ch.add_argument("--model", default="smollm2-135m", help=f"{names}, or the path of an mlx-lm model folder")
    ch.add_argument("--max-tokens", type=_int_at_least(1), default=256, help="per answer")
    ch.add_argument("--system", default=None, help="a system message")
    _cache_arguments(ch)
    ch.set_defaults(run=_chat)

    c = sub.add_parser("calibrate", help="fit calibrated caches for a model and write its profile")
    c.add_argument("--model", default="smollm2-135m", help=f"{names}, or the path of an mlx-lm model folder")
    c.add_argument("--budgets", type=float, nargs="+", default=[2.25, 3.25, 4.25],
                   help="bits per coordinate (side information included)")
    c.add_argument("--corpus", choices=sorted(DOMAINS) + sorted(CALIBRATION), default="wikipedia",
                   help="calibration text (evaluate on others); mixture: Wikipedia and Python source "
                        "interleaved, the source from modules the code and docs domains do not use")
    c.add_argument("--text", default=None, help="a UTF-8 text file to calibrate on instead of --corpus")
    c.add_argument("--windows", type=_int_at_least(1), default=8, help="512-token calibration windows")
    c.add_argument("--heldout", type=_int_at_least(1024), default=8192,
                   help="calibration-text tokens (after the windows) that choose between candidates: at least "
                        "two 512-token windows, the unit of the paired interval")
    c.add_argument("--positions", type=_int_at_least(0), default=None,
                   help="fit keys as if spread over this many positions (default: the model's context length), "
                        "so the profile holds at every position below it; 0: only where the 512-token windows "
                        "put them (the profile then holds within one window)")
    c.add_argument("--pre-rope", choices=("auto", "yes", "no"), default="auto",
                   help="offer candidates with keys coded before RoPE (auto: where the model allows it, i.e. no "
                        "sliding-window layers and mlx's plain RoPE); one is taken only if better beyond its interval")
    c.add_argument("--name", default=None, help="the profile's name (default: --model)")
    c.add_argument("--out", default=None, help="where to write the profile (default: $TURBOQUANT_CACHE/profiles/NAME.json)")
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    c.set_defaults(run=_calibrate)

    e = sub.add_parser("eval", help="perplexity, agreement, fidelity and needle per cache configuration")
    e.add_argument("--configs", nargs="+", default=["chapter"],
                   help="configuration names, 'chapter' (default) or 'all' (every one but the diagnoses); see --list")
    e.add_argument("--list", action="store_true", help="list the configurations and exit")
    e.add_argument("--model", default="smollm2-135m", help=f"{names}, or the path of an mlx-lm model folder")
    e.add_argument("--tokens", type=_int_at_least(2), default=1024, help="tokens scored for perplexity")
    e.add_argument("--window", type=_int_at_least(2), default=512, help="scoring window (a fresh cache each)")
    e.add_argument("--chunk", type=_int_at_least(1), default=128, help="prefill chunk size")
    e.add_argument("--agreement-tokens", type=_int_at_least(0), default=16, help="greedy tokens for top-1 agreement (0: skip)")
    e.add_argument("--fidelity-tokens", type=_int_at_least(0), default=512, help="tokens captured for per-layer fidelity (0: skip)")
    e.add_argument("--needle-contexts", type=_int_at_least(64), nargs="*", default=[], help="needle test context lengths")
    e.add_argument("--needle-values", type=_int_at_least(1), default=4,
                   help="secret codes per depth (three depths: trials per context = 3 × this)")
    e.add_argument("--corpus", choices=sorted(DOMAINS), nargs="+", default=["wikipedia"],
                   help="evaluation text; several: each scored apart, with the worst domain of each "
                        "configuration summarised")
    e.add_argument("--calibration-corpus", choices=sorted(DOMAINS), default=None,
                   help="text the calibrated configurations are fitted on (default: wikipedia, or lee when "
                        "wikipedia is scored)")
    e.add_argument("--start", type=_int_at_least(0), default=0,
                   help="skip this many tokens of each corpus before scoring; past 4096 (the calibration "
                        "windows) calibrated rows may be scored on their own calibration corpus: held-out "
                        "calibration text (profiles: past 6144, their search's held-out tokens too)")
    e.add_argument("--compare", action="store_true",
                   help="also KL divergence from fp32 and top-1 agreement on every scored token")
    e.add_argument("--seeds", type=_int_at_least(1), default=1,
                   help="rotation seeds for configurations that draw one (intervals then cover the seed)")
    e.add_argument("--diff", nargs=2, metavar=("A", "B"), default=None,
                   help="also print Δppl(A) − Δppl(B) with its paired interval (A and B are scored too)")
    e.add_argument("--out", default=None, help="write the results as JSON here")
    e.add_argument("--update", default=None, metavar="FILE",
                   help="add these rows to (or replace them in) a recorded run scored the same way "
                        "(same setup, bit-identical fp32 row), recomputing its intervals")
    e.add_argument("--quiet", action="store_true", help="no progress bars")
    e.set_defaults(run=_eval)

    nd = sub.add_parser("needle", help="needle retrieval grid (contexts × depths × secret codes), resumable JSON")
    nd.add_argument("--model", default="smollm2-135m", help=f"{names}, or the path of an mlx-lm model folder")
    nd.add_argument("--configs", nargs="+", default=["fp32"],
                    help="configuration names (see `eval --list`; calibrated ones are fitted on "
                         "--calibration-corpus)")
    nd.add_argument("--contexts", type=_int_at_least(64), nargs="+", default=[1024, 2048, 4096],
                    help="context lengths in tokens")
    nd.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9],
                    help="relative depths of the needle in [0, 1]")
    nd.add_argument("--values", type=_int_at_least(1), default=20, help="secret codes (trials) per cell")
    nd.add_argument("--chunk", type=_int_at_least(1), default=256, help="prefill chunk size")
    nd.add_argument("--calibration-corpus", choices=sorted(set(DOMAINS) - {"lee"}), default="wikipedia",
                    help="text calibrated configurations are fitted on (the haystack is lee)")
    nd.add_argument("--positions", type=_int_at_least(0), default=None,
                    help="calibrated configurations are fitted on keys moved by RoPE to positions spread "
                         "below this (default: the model's context; 0: where the 512-token windows put them)")
    nd.add_argument("--out", default=None,
                    help="JSON written after every configuration × context (its folder is made if missing); an "
                         "existing file resumes; without --out nothing is saved")
    nd.add_argument("--attention", action="store_true",
                    help="instead of the grid, record where the answer reads the needle (attention on the "
                         "code's tokens, the score noise and what value coding changes in the attention output, "
                         "per layer) at one context and depth; a few --values suffice")
    nd.add_argument("--quiet", action="store_true", help="no progress bars")
    nd.set_defaults(run=_needle)

    lc = sub.add_parser("longctx", help="long-context retrieval per cache: questions about function signatures far back in real code",
                        description="This package's own source fills the context (code no model was trained "
                        "on); questions ask for the signature of functions defined far back. Per cache "
                        "configuration (each in its own process): answers right, cache bytes, prefill and "
                        "decode tokens/s, peak process memory. Resumable JSON.")
    lc.add_argument("--model", default="qwen2.5-coder-1.5b", help=f"{names}, or the path of an mlx-lm model folder")
    lc.add_argument("--configs", nargs="+", default=["fp32", "budget K4/V4", "budget K3/V3", "budget K2/V2"],
                    help="configuration names (see `eval --list`; not calibrated ones)")
    lc.add_argument("--context", type=_int_at_least(256), default=8192, help="context tokens")
    lc.add_argument("--questions", type=_int_at_least(1), default=20, help="signature questions")
    lc.add_argument("--min-back", type=_int_at_least(0), default=2048,
                    help="questions ask about functions at least this many tokens before the end")
    lc.add_argument("--max-tokens", type=_int_at_least(1), default=32, help="greedy tokens per answer")
    lc.add_argument("--out", default=None, help="JSON written after every configuration; an existing file resumes")
    lc.add_argument("--quiet", action="store_true", help="no progress bars")
    lc.set_defaults(run=_longctx)

    k = sub.add_parser("kernels", help="which fused-kernel back-end is used, why, and its self-check")
    k.add_argument("--emulated", action="store_true", help="check the GPU kernel bodies through their C++ build (CPU)")
    k.add_argument("--bench", action="store_true", help=argparse.SUPPRESS)   # deprecated: `bench decode`
    _decode_options(k, hidden=True)
    k.set_defaults(run=_kernels)

    b = sub.add_parser("bench", help="decode speed: attention from codes vs fp32 (decode), tokens/s (generate)")
    bsub = b.add_subparsers(dest="what", required=True, metavar="{decode,generate}")
    bd = bsub.add_parser("decode", help="one decode step's attention over T cached tokens",
                         description="One decode step's attention over T cached tokens (B=1, H=8, D=128, "
                         "float32) for TurboQuant_mse 4/3/2 bits and FibQuant, as speed-ups over fp32 SDPA "
                         "measured in the same run.")
    _decode_options(bd)
    bd.add_argument("--out", default=None, help="write the results as JSON here")
    bd.set_defaults(run=_bench_decode)
    bg = bsub.add_parser("generate", help="greedy tokens/s of a real model after a long prompt",
                         description="Greedy tokens/s of a real model after a long prompt, fp32 cache against "
                         "TurboQuant caches read through attention from codes.")
    bg.add_argument("--model", default="smollm2-135m", help="an installed model or an mlx-lm folder")
    bg.add_argument("--context", type=_int_at_least(1), default=8192, help="prompt tokens before decoding")
    bg.add_argument("--new-tokens", type=_int_at_least(1), default=32, help="timed greedy tokens per cache")
    bg.add_argument("--bits", type=_int_at_least(1), nargs="+", default=[4],
                    help="TurboQuant_mse index bits per coordinate (the fp16 norm adds 16/D)")
    bg.add_argument("--corpus", choices=sorted(DOMAINS), default="lee", help="prompt text")
    bg.add_argument("--pre-rope", action="store_true",
                    help="also the same codecs with keys coded before RoPE (decoded at every step)")
    bg.add_argument("--turned-mean", action="store_true",
                    help="also the same codecs with centred keys, the mean learned after RoPE and before it "
                         "(turned to each position), both read from codes")
    bg.add_argument("--profile-bits", type=float, nargs="+", default=None, metavar="BITS",
                    help="also the model's calibrated profile at these budgets (its coders decode every key "
                         "at each step)")
    bg.add_argument("--out", default=None, help="write the results as JSON here")
    bg.add_argument("--quiet", action="store_true", help="no progress lines")
    bg.set_defaults(run=_bench_generate)
    sv = sub.add_parser("serve", help="mlx-lm's OpenAI-compatible HTTP server, batching compressed caches",
                        description="mlx-lm's server (its HTTP API, continuous batching and prompt-cache LRU) "
                        "with TurboQuant caches. Listens on 127.0.0.1 by default; stop it with Ctrl-C.")
    sv.add_argument("--model", default="smollm2-135m", help=f"{names}, or the path of an mlx-lm model folder")
    _cache_arguments(sv)
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    sv.add_argument("--port", type=_int_in(1, 65535), default=8080, help="port to listen on")
    sv.add_argument("--prompt-cache-bytes", type=_size, default=None,
                    help="bound on the bytes of the conversations kept for reuse (e.g. 64MB; the codes' real bytes)")
    sv.add_argument("--prompt-cache-size", type=_int_at_least(1), default=10,
                    help="at most this many conversations kept for reuse")
    sv.add_argument("--decode-concurrency", type=_int_at_least(1), default=32, help="sequences decoded together")
    sv.add_argument("--prompt-concurrency", type=_int_at_least(1), default=8, help="prompts prefilled together")
    sv.add_argument("--prefill-step-size", type=_int_at_least(1), default=2048, help="prompt tokens per prefill step")
    sv.add_argument("--max-tokens", type=_int_at_least(1), default=512, help="answer length when a request sets none")
    sv.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                    help="the server's log level")
    sv.add_argument("--mlx-options", default=None, help="further mlx_lm.server options, quoted "
                    "(e.g. \"--temp 0.7 --chat-template-args '{}'\"; one option without a value needs the = "
                    "form: --mlx-options=--trust-remote-code)")
    sv.add_argument("--attention", choices=["codes", "decoded"], default="codes",
                    help="attention computed from the codes (default) or on decoded keys and values")
    sv.add_argument("--plain", action="store_true", help="mlx-lm's own uncompressed caches (the load test's baseline)")
    sv.set_defaults(run=_serve)

    lt = sub.add_parser("loadtest", help="bounded load test on loopback: turboquant serve against mlx-lm's server",
                        description="Starts each server on a free 127.0.0.1 port, drives it with a fixed number of "
                        "conversations and clients, stops it: throughput, latency, peak memory, conversations "
                        "kept within --prompt-cache-bytes, faults.")
    lt.add_argument("--model", default="smollm2-135m", help=f"{names}, or the path of an mlx-lm model folder")
    lt.add_argument("--bits", type=_bits, default=4.25, help="the compressed server's budget (turboquant serve --bits)")
    lt.add_argument("--conversations", type=_int_in(2, 1000), default=8, help="conversations per run")
    lt.add_argument("--concurrency", type=_int_in(1, 64), nargs="+", default=[1, 4], help="client threads")
    lt.add_argument("--budgets", type=_size_text, nargs="+", default=["16MB", "48MB"],
                    help="--prompt-cache-bytes values (e.g. 32MB: decimal, 10⁶ bytes)")
    lt.add_argument("--max-tokens", type=_int_in(1, 512), default=16, help="generated tokens per answer")
    lt.add_argument("--chars", type=_int_in(100, 20000), default=1200, help="characters of news text per conversation")
    lt.add_argument("--no-faults", action="store_true", help="skip the fault injection")
    lt.add_argument("--out", default=None, help="write the results as JSON here")
    lt.add_argument("--quiet", action="store_true", help="no progress lines")
    lt.set_defaults(run=_loadtest)
    args, extra = p.parse_known_args(argv)
    args.parser = {"memory": m, "model": d, "generate": gen, "chat": ch, "eval": e, "kernels": k, "calibrate": c, "needle": nd, "longctx": lc, "serve": sv, "loadtest": lt,
                   "bench": {"decode": bd, "generate": bg}.get(getattr(args, "what", None), b)}[args.command]
    if extra:                                  # named by the command's own usage, not the top-level one
        args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command != "model" and isinstance(getattr(args, "model", None), str):
        from .models import model_refusal      # a wrong --model is a usage error before any work
        refusal = model_refusal(args.model)
        if refusal:
            args.parser.error(f"argument --model: {refusal}")
    try:
        # where results go is checked before the work that produces them
        if getattr(args, "save_cache", None):
            check_out_file(args.save_cache, "--save-cache", overwrite=True)
        if getattr(args, "out", None):
            check_out_file(args.out, "--out", make_parents=True)
        return args.run(args)
    except (ValueError, TypeError, FileNotFoundError) as e:   # bad input: one line, no traceback
        print(f"turboquant {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
