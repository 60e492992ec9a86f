"""Needle in a haystack through a cache (Chapter 9): a secret code hidden at a relative depth
of distractor text, then the question; a trial succeeds when the greedy answer contains
the code."""
from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from ..progress import progress as progress_bar
from .prefilling import MakeCache, fresh_cache, greedy
from .text import encode_text

__all__ = ["needle_prompt", "needle_accuracy", "needle_values", "NEEDLE", "QUESTION", "NEEDLE_VALUES"]


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


def needle_accuracy(model, tokenizer, haystack_ids: Sequence[int], contexts: Sequence[int],
                    depths: Sequence[float], make_cache: MakeCache = None, values: Sequence[str] = NEEDLE_VALUES,
                    chunk: int = 256, max_tokens: int = 6,
                    progress: bool = False) -> dict:
    """Greedy answer to the needle question for each context length × depth × value; a
    trial succeeds when the generated text contains the value. Returns {context: accuracy}
    and the per-trial records under "trials"."""
    trials, acc = [], {}
    jobs = [(c, d, v) for c in contexts for d in depths for v in values]
    for c, d, v in progress_bar(jobs, len(jobs), "needle", progress):
        ids = mx.array(needle_prompt(tokenizer, haystack_ids, c, d, v))[None]
        text = tokenizer.decode(greedy(model, ids, fresh_cache(model, make_cache), max_tokens, chunk))
        trials.append({"context": c, "depth": d, "value": v, "answer": text, "ok": v in text})
    for c in contexts:
        ok = [t["ok"] for t in trials if t["context"] == c]
        acc[c] = sum(ok) / len(ok)
    return {"accuracy": acc, "trials": trials}
