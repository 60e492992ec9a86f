"""Calibration (Chapter 10): calibrated codecs, model profiles, and the search that writes
them (``turboquant calibrate``) — what ``make_prompt_cache(model, bits=…, profile=True)`` needs
to rebuild a model's calibrated cache. One package, one module per idea: ``fitting`` (statistics and
per-layer coders), ``allocation`` and ``sensitivity`` (bits across layers by measured sensitivity),
``phases`` (keys and queries moved by RoPE to positions spread over the model's context
before fitting, so a profile holds at every position), ``profiles`` (the profile files and
the choice within a budget),
``store`` (fitted coders kept on disk and in memory), ``search`` (``calibrate``).

A profile records, for one model, which calibrated cache to use at each memory budget and
what it measured. It is made in three steps, on text that is never the evaluation text:

1. ``capture_statistics``: run the model on calibration windows (512 tokens each, as the
   evaluation scores them) and keep every layer's keys, values and the second moment of
   the queries that read each kv head — without the first token of each window (the
   attention sink: it is kept exactly by the cache and is far from the other keys) — with
   every key and query moved by RoPE to a position drawn over the model's context
   (``positions``: ``phases.spread``), since RoPE turns keys by an angle that grows with
   their position;
2. ``fit_layers``: per layer, a ``TransformCoder`` for keys (Karhunen–Loève basis under
   the query metric, so the error measured is the score error) and one for values, at
   the given bits, optionally with exact outliers;
3. ``calibrate``: for each budget, a few candidate splits (keys/values bits, outliers) are
   scored by perplexity on held-out tokens of the *calibration* corpus, and the best one is
   recorded with its numbers.

The profile stores the calibration token ids, so ``profile_codecs(model, profile, bits)``
rebuilds the same codecs from the model alone: fitted once (about a minute on 2 cores),
then kept as tensors under ``$TURBOQUANT_CACHE/coders`` (``coder_store_path``), so a later
process loads them in about a second; memoised within a process.
Profiles for the installed models ship in ``turboquant/profiles``; ``turboquant calibrate``
writes new ones under ``$TURBOQUANT_CACHE/profiles``, where ``find_profile`` looks first.
"""
from .allocation import PROBE_BITS, allocate_layers
from .fitting import WINDOW, Choice, capture_statistics, fit_layers, output_metric, signature
from .phases import context_length
from .profiles import (PROFILE_FORMAT, PROFILE_VERSION, SHIPPED, find_profile, fitted_positions, ids_digest, load_profile,
                       no_profile_refusal, profile_entry, profile_path, resolve_profile, save_profile,
                       shipped_profiles)
from .search import calibrate, candidates, choose
from .sensitivity import layer_sensitivity
from .store import CODER_STORE_VERSION, clear_memo, coder_store_path, profile_codecs

__all__ = ["context_length", "fitted_positions", "layer_sensitivity", "allocate_layers", "PROBE_BITS", "Choice", "capture_statistics", "fit_layers", "output_metric", "signature", "WINDOW", "profile_path", "shipped_profiles",
           "find_profile", "load_profile", "save_profile", "profile_entry", "ids_digest", "PROFILE_FORMAT",
           "PROFILE_VERSION", "SHIPPED", "profile_codecs", "coder_store_path", "clear_memo", "CODER_STORE_VERSION",
           "candidates", "choose", "calibrate", "resolve_profile", "no_profile_refusal"]
