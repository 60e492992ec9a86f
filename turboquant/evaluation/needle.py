"""Needle in a haystack through a cache (Chapter 9): a secret code hidden at a relative depth
of distractor text, then the question; a trial succeeds when the greedy answer contains
the code."""
from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from ..progress import progress as progress_bar
from .prefilling import MakeCache, fill_cache, fresh_cache, greedy, next_logits
from .text import encode_text

__all__ = ["needle_prompt", "needle_accuracy", "answer_logprobs", "needle_values", "NEEDLE", "QUESTION",
           "NEEDLE_VALUES"]


NEEDLE = "The secret code of the blue door is {value}."
QUESTION = "\n\nWhat is the secret code of the blue door? The secret code of the blue door is"


def needle_prompt(tokenizer, haystack_ids: Sequence[int], context: int, depth: float, value: str) -> list[int]:
    """Token ids: ``context`` tokens of distractor text with the needle sentence inserted at
    relative ``depth`` ∈ [0, 1] (on a sentence-free token boundary), then the question."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth!r}")
    needle = encode_text(tokenizer, " " + NEEDLE.format(value=value) + " ")
    question = encode_text(tokenizer, QUESTION)
    n_hay = context - len(needle) - len(question)
    if n_hay < 16 or len(haystack_ids) < n_hay:
        raise ValueError(f"context {context} is too short or the haystack too small")
    at = int(round(depth * n_hay))
    hay = list(haystack_ids[:n_hay])
    return hay[:at] + needle + hay[at:] + question


NEEDLE_VALUES = ("4721", "8356", "1943", "6208")


def needle_values(n: int) -> tuple[str, ...]:
    """``n`` distinct 4-digit secret codes: the four of Chapter 9 first, then more drawn
    with a fixed seed."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the number of needle values must be an int ≥ 1, got {n!r}")
    import random
    out, rng = list(NEEDLE_VALUES[:n]), random.Random(0)
    while len(out) < n:
        v = str(rng.randrange(1000, 10000))
        if v not in out:
            out.append(v)
    return tuple(out)


def answer_logprobs(model, logits: mx.array, cache, answer: Sequence[int]) -> dict:
    """How the cache's model scores the right answer: {"start_logp": log p of its first token,
    "start_margin": that minus the log p of the likeliest other token (> 0: a greedy answer
    starts right), "code_logp": log p of the rest given the first}. ``logits`` (1, V) are the
    next-token logits after the prompt held in ``cache``; the answer's tokens but its last are
    fed, as one chunk, through a deep copy of ``cache`` (``cache`` itself is left as it was).
    A one-token answer gives 0.0 for the rest."""
    import copy
    first = (logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0]
    start = first[answer[0]].item()
    rival = mx.max(mx.concatenate([first[:answer[0]], first[answer[0] + 1:]])).item()
    out = {"start_logp": start, "start_margin": start - rival, "code_logp": 0.0}
    if len(answer) > 1:
        rest = model(mx.array(list(answer[:-1]))[None], cache=copy.deepcopy(cache)).astype(mx.float32)
        rest = rest - mx.logsumexp(rest, axis=-1, keepdims=True)
        out["code_logp"] = sum(rest[0, j - 1, answer[j]].item() for j in range(1, len(answer)))
    return out


def _shared_length(prompts: Sequence[Sequence[int]], chunk: int) -> int:
    """Tokens every prompt starts with, rounded down to a multiple of ``chunk``."""
    first, n = prompts[0], min(len(p) for p in prompts)
    same = next((i for i in range(n) if any(p[i] != first[i] for p in prompts)), n)
    return min(same, n - 1) // chunk * chunk


def needle_accuracy(model, tokenizer, haystack_ids: Sequence[int], contexts: Sequence[int],
                    depths: Sequence[float], make_cache: MakeCache = None, values: Sequence[str] = NEEDLE_VALUES,
                    chunk: int = 256, max_tokens: int = 6, share_prefix: bool = True,
                    progress: bool = False) -> dict:
    """Greedy answer to the needle question for each context length × depth × value; a
    trial succeeds when the generated text contains the value. Returns {"accuracy":
    {context: rate}, "cells": [{"context", "depth", "ok", "n", "lo", "hi"}] (rate per cell
    with its 95 % Wilson interval, ``intervals.wilson``), "trials": per-trial records}.

    Each trial also records the right answer's log-probabilities through the same cache
    (``answer_logprobs`` of " " + value): "start_logp", of its first token (a space on
    SmolLM2), "start_margin", its lead over the likeliest other token, and "code_logp", of the
    code's tokens given that start. A greedy answer can fail at its first token while the code
    is still there to be read; these tell apart how the answer starts and whether the needle
    was retrieved.

    ``share_prefix``: the trials of one cell differ only from the needle on, so the
    haystack before it is prefilled once and the cache deep-copied for each value. Only
    whole chunks are shared, so every trial runs exactly the chunks it would run alone
    (the same results; a test pins it) at about half the cost."""
    import copy

    from .intervals import wilson
    if not values:
        raise ValueError("needle_accuracy needs at least one value")
    trials, cells, ok = [], [], 0
    jobs = [(c, d, i) for c in contexts for d in depths for i in range(len(values))]
    for c, d, i in progress_bar(jobs, len(jobs), "needle", progress):
        if i == 0:                                   # a new cell: its prompts and shared prefix
            prompts = [needle_prompt(tokenizer, haystack_ids, c, d, v) for v in values]
            shared = _shared_length(prompts, chunk) if share_prefix and len(prompts) > 1 else 0
            base, ok = None, 0
            if shared:
                base = fresh_cache(model, make_cache)
                fill_cache(model, mx.array(prompts[0][:shared])[None], base, chunk)
        cache = copy.deepcopy(base) if shared else fresh_cache(model, make_cache)
        v, ids = values[i], prompts[i]
        logits = next_logits(model, mx.array(ids[shared:])[None], cache, chunk)
        scores = answer_logprobs(model, logits, cache, encode_text(tokenizer, " " + v))
        text = tokenizer.decode(greedy(model, None, cache, max_tokens, chunk, logits=logits))
        trials.append({"context": c, "depth": d, "value": v, "answer": text, "ok": v in text, **scores})
        ok += v in text
        if i == len(values) - 1:
            iv = wilson(ok, len(values))
            cells.append({"context": c, "depth": d, "ok": ok, "n": len(values), "lo": iv.lo, "hi": iv.hi})
    acc = {c: sum(t["ok"] for t in trials if t["context"] == c) / (len(depths) * len(values)) for c in contexts}
    return {"accuracy": acc, "cells": cells, "trials": trials}
