"""A recorded needle grid (Chapter 10, ``turboquant needle``): needle retrieval for several
cache configurations at several context lengths and depths, written to a JSON file after
every cell so that a run of hours can stop and resume where it was.

The trials themselves are ``evaluation.needle_accuracy``'s; this module only orders them,
labels them (model, haystack, the shipped profile's digest) and keeps what was measured."""
from __future__ import annotations

import hashlib
import json
import math
import platform
import time
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx

__all__ = ["needle_grid", "needle_table", "needle_scores", "reads_code", "needle_reading", "reading_layers", "reading_mass",
           "value_noise", "score_lift"]

HAYSTACK = "lee"      # the distractor text: prose no profile is calibrated on


def _profile_digest(model, names: Sequence[str]) -> Optional[str]:
    """SHA-256 of the profile ``make_prompt_cache(profile=True)`` would use (None without one,
    or when none of the configurations ``names`` uses it), so a grid resumed after a
    re-calibration cannot mix two profiles silently."""
    from .calibration.profiles import find_profile
    from .suite import CONFIGS
    if not any(CONFIGS[n].needs_profile for n in names):
        return None
    p = find_profile(model)
    return None if p is None else hashlib.sha256(json.dumps(p, sort_keys=True).encode()).hexdigest()


_IDENTITY = {"profile_sha256": "the profile", "calibration_positions": "the positions its coders were fitted for"}


def _identity(config, digest: Optional[str], positions: Optional[int]) -> dict:
    """What a row of ``config`` is measured with, of ``_IDENTITY``'s keys: the profile's digest
    for a profile row, the positions its coders were fitted for for a calibrated one."""
    return {**({"profile_sha256": digest} if config.needs_profile else {}),
            **({"calibration_positions": positions} if config.needs_calibration else {})}


def _changed(held: dict, identity: dict) -> Optional[str]:
    """What a held row was measured with that differs from ``identity`` (``_IDENTITY``'s words
    for the first), or None when the row can be kept."""
    return next((_IDENTITY[k] for k in _IDENTITY if held.get(k) != identity.get(k)), None)


def _calibration_positions(model, positions) -> Optional[int]:
    """``needle_grid``'s ``positions``: "context" → the model's context length, None, or an
    integer of at least one calibration window (else ``ValueError`` naming it)."""
    from .calibration import WINDOW
    from .calibration.phases import context_length, valid_positions
    if positions == "context":
        return context_length(model)
    if positions is not None and not valid_positions(positions, WINDOW):
        raise ValueError(f"positions must be 'context', None or a context length of at least {WINDOW} tokens "
                         f"(and below 2**31), got {positions!r}")
    return positions


def _check_request(names: Sequence[str], calibration_corpus: str) -> None:
    """The configurations named exist, and calibrated ones are not fitted on the haystack."""
    from .suite import CONFIGS
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        raise ValueError(f"unknown configuration(s) {unknown or names}; known: {sorted(CONFIGS)}")
    if calibration_corpus == HAYSTACK:
        raise ValueError(f"calibrated configurations must not be fitted on the haystack text {HAYSTACK!r}")


def _setup(model_name, contexts, depths, values, chunk, calibration_corpus) -> dict:
    return {"model": model_name, "haystack": HAYSTACK, "contexts": list(contexts), "depths": list(depths),
            "values": values, "chunk": chunk, "calibration": {"corpus": calibration_corpus, "windows": 8}}


def needle_grid(model, tokenizer, names: Sequence[str], contexts: Sequence[int],
                depths: Sequence[float] = (0.1, 0.5, 0.9), values: int = 20, *, model_name: str = "",
                out: Optional[Path] = None, chunk: int = 256, calibration_corpus: str = "wikipedia",
                positions="context", progress: bool = True) -> dict:
    """Needle accuracy of each named ``suite.CONFIGS`` configuration: for every context × depth,
    ``values`` secret codes (``needle_values``), each a trial; per cell the successes with a
    95 % Wilson interval. Returns {"setup": …, "results": {name: {"bits", "family", "cells":
    [{context, depth, ok, n, lo, hi}], "trials": [...], "seconds"}}}.

    ``out``: the JSON file written after every cell (configuration, context, depth). If it exists, its
    setup must match this call's (else ``ValueError``) and the cells it holds are kept, not
    re-run: an interrupted grid resumes. A profile row records the profile's SHA-256; if the
    shipped profile changed since, that row is measured again rather than mixed. Contexts run shortest first for every configuration
    before the next context, so a partial file is a complete grid at its shorter contexts.
    Calibrated configurations (KVQuant-style, ``calibrated b``) are fitted on 8 windows of
    ``calibration_corpus`` (``suite.calibration_statistics``), captured once when first needed,
    with their keys and queries moved to ``positions`` spread over [0, N) as a profile is
    (``calibration.capture_statistics``): "context" (default) the model's context, an integer
    N, or None to fit where the 512-token windows put them. A grid's cells reach far past one
    window, and a coder fitted within it codes later keys many-fold worse (Chapter 10, "Past the
    calibrated positions"). Each calibrated row records its ``calibration_positions``; a row
    resumed with other positions is measured again rather than mixed, as a profile row is."""
    from .checks import check_int
    from .data import load_text
    from .evaluation import encode_text, needle_accuracy, needle_values
    from .memory import geometry_from_model
    from .records import read_record, write_record
    from .suite import CONFIGS, calibration_statistics
    values = check_int("values", values, 1)
    chunk = check_int("chunk", chunk, 1)
    contexts = sorted({check_int("context", c, 64) for c in contexts})
    if not contexts:
        raise ValueError("needle_grid needs at least one context length")
    if not depths or any(not (isinstance(d, (int, float)) and 0.0 <= d <= 1.0) for d in depths):
        raise ValueError(f"depths must lie in [0, 1], got {list(depths)}")
    _check_request(names, calibration_corpus)
    digest = _profile_digest(model, names)
    positions = _calibration_positions(model, positions)
    setup = _setup(model_name, contexts, list(depths), values, chunk, calibration_corpus)
    record = {"setup": setup, "results": {}}
    old_record = read_record(out, "needle grid")
    if old_record is not None:
        record = old_record
        old = {k: record.get("setup", {}).get(k) for k in setup if k != "contexts"}
        if old != {k: v for k, v in setup.items() if k != "contexts"}:
            raise ValueError(f"{out} holds a grid with another setup ({old}); remove it or choose another --out")
        record["setup"]["contexts"] = sorted(set(record["setup"]["contexts"]) | set(contexts))
    hay = encode_text(tokenizer, load_text(HAYSTACK), max(contexts))
    codes = needle_values(values)
    dim = geometry_from_model(model).head_dim
    stats = None
    for context in contexts:
        for name in names:
            fresh = {"family": CONFIGS[name].family, "bits": CONFIGS[name].bits(dim), "cells": [],
                     "trials": [], "seconds": 0.0, **_identity(CONFIGS[name], digest, positions)}
            row = record["results"].setdefault(name, fresh)
            stale = _changed(row, fresh)
            if stale:
                if progress:                              # another profile or fit: its cells are stale
                    print(f"needle: {name}: {stale} changed since its cells were measured; re-running them",
                          flush=True)
                row = record["results"][name] = fresh
            todo = [d for d in depths if not any(c["context"] == context and c["depth"] == d for c in row["cells"])]
            for depth in todo:                            # cells an earlier run of this grid measured are kept
                if progress:
                    print(f"needle: {name} at {context} tokens, depth {depth:.0%}", flush=True)
                t0 = time.time()
                if CONFIGS[name].needs_calibration and stats is None:
                    stats = calibration_statistics(model, tokenizer, names, calibration_corpus, 8, progress,
                                                   positions=positions)
                r = needle_accuracy(model, tokenizer, hay, [context], [depth], CONFIGS[name].make_cache(model, stats),
                                    values=codes, chunk=chunk, progress=progress)
                row["cells"] += r["cells"]
                row["trials"] += r["trials"]
                row["seconds"] += time.time() - t0
                record["setup"].update(machine=platform.machine(), mlx=mx.__version__)
                if out is not None:
                    write_record(out, record)
    return record


def needle_table(record: dict) -> list[dict]:
    """One row per configuration: its bits and, per context@depth, "ok/n [lo, hi]"."""
    rows = []
    for name, r in record["results"].items():
        row = {"configuration": name, "bits": r["bits"]}
        for c in sorted(r["cells"], key=lambda c: (c["context"], c["depth"])):
            row[f"{c['context']}@{c['depth']:.0%}"] = f"{c['ok']}/{c['n']} [{c['lo']:.2f}, {c['hi']:.2f}]"
        rows.append(row)
    return rows


def reads_code(trial: dict) -> bool:
    """Whether a scored trial reads the code: its probability given the answer's start is above
    1/2, so each of its tokens is the likeliest at its step and a greedy answer that starts
    right writes it (sufficient, not necessary). The one home of that rule."""
    return trial["code_logp"] > -math.log(2)


def needle_scores(record: dict) -> list[dict]:
    """Per configuration × context × depth whose trials carry the right answer's scores
    (``evaluation.needle.answer_logprobs``; trials recorded before them do not): {"configuration",
    "context", "depth", "n", "starts" (trials whose greedy answer starts right: lead > 0),
    "reads" (trials whose code has probability above 1/2 given the start, so that each of its
    tokens does and greedy decoding, once the answer starts right, writes the code: a
    sufficient condition, not a necessary one), "lead" (mean lead of the start, nats),
    "code_logp" (mean log p of the code given the start)}."""
    out = []
    for name, r in record["results"].items():
        for c in sorted(r["cells"], key=lambda c: (c["context"], c["depth"])):
            ts = [t for t in r["trials"] if t["context"] == c["context"] and t["depth"] == c["depth"]
                  and "start_margin" in t]
            if ts:
                out.append({"configuration": name, "context": c["context"], "depth": c["depth"], "n": len(ts),
                            "starts": sum(t["start_margin"] > 0 for t in ts),
                            "reads": sum(map(reads_code, ts)),
                            "lead": sum(t["start_margin"] for t in ts) / len(ts),
                            "code_logp": sum(t["code_logp"] for t in ts) / len(ts)})
    return out


def needle_reading(model, tokenizer, names: Sequence[str], context: int, depth: float, values: int = 3, *,
                   model_name: str = "", out: Optional[Path] = None, chunk: int = 256,
                   calibration_corpus: str = "wikipedia", positions="context", progress: bool = True) -> dict:
    """Where the answer reads the needle (``evaluation.needle.needle_attention``) through each
    named configuration, for the first ``values`` codes of the grid (``needle_values``) at one
    ``context`` and ``depth``: {"setup": …, "results": {name: {"family", "bits", "trials":
    [{"value", "mass" (layers × query heads), "noise", "noise_code", "value_noise",
    "value_incoherent" (per layer), "code_logp",
    "code_tokens"}]}}}. Calibrated rows are fitted as ``needle_grid`` fits them. ``out``: the
    JSON file written after every configuration; a configuration it holds (same setup) is kept,
    not re-run, unless what it was measured with changed (the profile, the positions its coders
    were fitted for), as in ``needle_grid``, or it lacks a quantity ``needle_attention`` records
    now (it was read before that quantity existed)."""
    from .checks import check_int
    from .data import load_text
    from .evaluation import encode_text, needle_values
    from .evaluation.needle import READING_FIELDS, needle_attention
    from .records import read_record, write_record
    from .suite import CONFIGS, calibration_statistics
    values = check_int("values", values, 1)
    context = check_int("context", context, 64)
    chunk = check_int("chunk", chunk, 1)
    if isinstance(depth, bool) or not (isinstance(depth, (int, float)) and 0.0 <= depth <= 1.0):
        raise ValueError(f"depth must lie in [0, 1], got {depth!r}")
    _check_request(names, calibration_corpus)
    positions = _calibration_positions(model, positions)
    setup = {**_setup(model_name, [context], [depth], values, chunk, calibration_corpus), "context": context,
             "depth": depth, "kind": "needle reading"}
    for k in ("contexts", "depths"):
        setup.pop(k)
    record = read_record(out, "needle reading") or {"setup": setup, "results": {}}
    old = {k: v for k, v in record["setup"].items() if k not in ("machine", "mlx", "updates")}
    if old != {k: v for k, v in setup.items() if k not in ("machine", "mlx")}:
        raise ValueError(f"{out} holds a reading with another setup ({old}); remove it or choose another --out")
    hay = encode_text(tokenizer, load_text(HAYSTACK), context)
    codes = needle_values(values)
    from .memory import geometry_from_model
    dim = geometry_from_model(model).head_dim
    stats = None
    digest = _profile_digest(model, names)
    for name in names:
        identity = _identity(CONFIGS[name], digest, positions)
        held = record["results"].get(name)
        lacks = None if held is None else next((f for f in READING_FIELDS if any(f not in t for t in held["trials"])),
                                                None)
        stale = None if held is None else _changed(held, identity)
        if held is not None and not stale and not lacks:
            continue                                      # measured with the same profile and fit: kept
        if progress and (stale or lacks):
            why = f"{stale} changed since it was measured" if stale else f"it lacks {lacks} (read before it was recorded)"
            print(f"needle reading: {name}: {why}; reading it again", flush=True)
        if CONFIGS[name].needs_calibration and stats is None:
            stats = calibration_statistics(model, tokenizer, names, calibration_corpus, 8, progress,
                                           positions=positions)
        make = CONFIGS[name].make_cache(model, stats)
        trials = []
        for v in codes:
            if progress:
                print(f"needle reading: {name}, code {v}", flush=True)
            trials.append({"value": v, **needle_attention(model, tokenizer, hay, context, depth, v, make, chunk)})
        record["results"][name] = {"family": CONFIGS[name].family, "bits": CONFIGS[name].bits(dim),
                                   "trials": trials, **identity}
        record["setup"].update(machine=platform.machine(), mlx=mx.__version__)
        if out is not None:
            write_record(out, record)
    return record


def reading_mass(record: dict, name: str):
    """Per layer, the attention ``name``'s answer gives the code's tokens in a needle reading:
    summed over query heads, averaged over the recorded codes (a numpy array, one per layer)."""
    import numpy as np
    if name not in record["results"]:
        raise ValueError(f"{name!r} is not a row of this reading ({sorted(record['results'])})")
    return np.mean([t["mass"] for t in record["results"][name]["trials"]], axis=0).sum(-1)


def value_noise(record: dict, name: str):
    """Per layer, what ``name``'s value coding changes in the answer's attention output in a
    needle reading, and what it would change were the tokens' value errors independent with
    mean zero (``needle_attention``'s "value_noise" and "value_incoherent", averaged over the
    recorded codes): two numpy arrays, one value per layer."""
    import numpy as np
    if name not in record["results"]:
        raise ValueError(f"{name!r} is not a row of this reading ({sorted(record['results'])})")
    trials = record["results"][name]["trials"]
    if any(k not in t for t in trials for k in ("value_noise", "value_incoherent")):
        raise ValueError(f"{name!r} was read before the value measures were recorded; read it again "
                         "(turboquant needle --attention re-reads such rows)")
    return tuple(np.mean([t[k] for t in trials], axis=0) for k in ("value_noise", "value_incoherent"))


def score_lift(record: dict, name: str, reference: str = "fp32"):
    """Per layer, how far ``name``'s key coding raises the code's scores against the other
    tokens in a needle reading (``needle_attention``'s "score_lift", in the softmax's logit
    units), averaged over the recorded codes and over query heads weighted by the attention
    ``reference``'s answer gives the code in each head, so that the heads that read the code
    count: a numpy array, one value per layer."""
    import numpy as np
    for n in (name, reference):
        if n not in record["results"]:
            raise ValueError(f"{n!r} is not a row of this reading ({sorted(record['results'])})")
    trials = record["results"][name]["trials"]
    if any("score_lift" not in t for t in trials):
        raise ValueError(f"{name!r} was read before the score lift was recorded; read it again "
                         "(turboquant needle --attention re-reads such rows)")
    lift = np.mean([t["score_lift"] for t in trials], axis=0)                       # (layers, heads)
    weight = np.mean([t["mass"] for t in record["results"][reference]["trials"]], axis=0)
    return (lift * weight).sum(-1) / np.maximum(weight.sum(-1), 1e-30)


def reading_layers(record: dict, reference: str = "fp32", least: float = 0.1) -> list[int]:
    """The layers where ``reference``'s answer gives the code's tokens at least ``least`` of its
    attention (``reading_mass``): where the needle is read."""
    import numpy as np
    return [int(n) for n in np.flatnonzero(reading_mass(record, reference) >= least)]
