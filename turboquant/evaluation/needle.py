"""Needle in a haystack through a cache (Chapter 9): a secret code hidden at a relative depth
of distractor text, then the question; a trial succeeds when the greedy answer contains
the code."""
from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from ..progress import progress as progress_bar
from .prefilling import MakeCache, fill_cache, fresh_cache, greedy, next_logits
from .text import encode_text

__all__ = ["needle_prompt", "needle_accuracy", "needle_attention", "answer_logprobs", "needle_values", "NEEDLE", "QUESTION",
           "NEEDLE_VALUES", "READING_FIELDS"]

# what ``needle_attention`` records per trial: a reading made before one of these existed is read again
READING_FIELDS = ("mass", "noise", "noise_code", "score_lift", "value_noise", "value_incoherent", "code_logp",
                  "code_tokens")


NEEDLE = "The secret code of the blue door is {value}."
QUESTION = "\n\nWhat is the secret code of the blue door? The secret code of the blue door is"


def needle_prompt(tokenizer, haystack_ids: Sequence[int], context: int, depth: float, value: str) -> list[int]:
    """Token ids: ``context`` tokens of distractor text with the needle sentence inserted at
    relative ``depth`` ∈ [0, 1] (on a sentence-free token boundary), then the question."""
    return _needle_layout(tokenizer, haystack_ids, context, depth, value)[0]


def _needle_layout(tokenizer, haystack_ids, context, depth, value) -> tuple[list[int], int, list[int]]:
    """(``needle_prompt``'s ids, the needle's first position, the needle's ids)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth!r}")
    needle = encode_text(tokenizer, " " + NEEDLE.format(value=value) + " ")
    question = encode_text(tokenizer, QUESTION)
    n_hay = context - len(needle) - len(question)
    if n_hay < 16 or len(haystack_ids) < n_hay:
        raise ValueError(f"context {context} is too short or the haystack too small")
    at = int(round(depth * n_hay))
    hay = list(haystack_ids[:n_hay])
    return hay[:at] + needle + hay[at:] + question, at, needle


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


def needle_attention(model, tokenizer, haystack_ids: Sequence[int], context: int, depth: float, value: str,
                     make_cache: MakeCache = None, chunk: int = 256) -> dict:
    """Where the answer reads the needle, layer by layer. The prompt of ``needle_prompt``
    (``context`` tokens, the needle at ``depth``, code ``value``) is prefilled through a fresh
    cache (``make_cache()``; None: mlx-lm's full precision), then the right answer " value" is
    fed but its last token, as ``answer_logprobs`` feeds it; the rows of that pass are the
    queries that predict the code's tokens. Per layer ℓ and query head h:

    - ``mass[ℓ][h]``: the attention weight those rows give the code's tokens in the needle,
      summed over the code's tokens, averaged over the rows;
    - ``noise[ℓ]``: the standard deviation over the other tokens of the score error the
      cache's coding adds, scale·q·(k̂ − k) (k: the keys this run computed, k̂: what its cache
      returns for them; q: the answer's queries), averaged over heads and rows; 0 for exact
      caches;
    - ``noise_code[ℓ]``: the mean absolute score error on the code's tokens;
    - ``score_lift[ℓ][h]``: the mean score error on the code's tokens minus its mean over the
      other tokens, averaged over the rows: how far the key coding moves the code's scores
      against the rest (positive: the code stands out more than in fp32); 0 for exact keys;
    - ``value_noise[ℓ]``: what the cache's value coding changes in those rows' attention
      output, ‖Σᵢ wᵢ(v̂ᵢ − vᵢ)‖ / ‖Σᵢ wᵢvᵢ‖ (w: the rows' attention weights in this run),
      averaged over heads and rows; 0 for exact values;
    - ``value_incoherent[ℓ]``: the same ratio were the tokens' value errors independent with
      mean zero, √(Σᵢ wᵢ²‖v̂ᵢ − vᵢ‖²) / ‖Σᵢ wᵢvᵢ‖: averaging over many tokens shrinks such
      errors, so ``value_noise`` well above it says the errors share a direction (a bias the
      attention output keeps however many tokens it averages). Both are ratios per head and
      row, then averaged, so a head whose output is small weighs as much as one whose output is
      large; a zero output gives 0 when nothing was changed, else inf.

    Also "code_logp", as ``answer_logprobs`` gives it, and "code_tokens" (their positions).
    The errors are measured inside the cache's own run: what earlier layers' coding changed
    in k and q is not in ``noise`` but shows in ``mass``. Models whose layers have sliding
    windows are refused (their caches return a window, not the positions read here)."""
    from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache

    from ..attention import causal_mask, patch_attention, repeat_kv
    from ..cache import TurboQuantRotatingKVCache
    from ..checks import check_int
    chunk = check_int("chunk", chunk, 1)
    ids, at, needle = _needle_layout(tokenizer, haystack_ids, context, depth, value)
    answer = encode_text(tokenizer, " " + value)
    if len(answer) < 2:
        raise ValueError(f"the answer {' ' + value!r} is one token: no row of the answer reads the code")
    code = answer[1:]
    starts = [at + i for i in range(len(needle) - len(code) + 1) if needle[i:i + len(code)] == code]
    if len(starts) != 1:
        raise ValueError(f"the code's tokens {code} occur {len(starts)} times in the needle's {needle}: "
                         "their positions are not one span")
    code_pos = list(range(starts[0], starts[0] + len(code)))
    span = set(range(at, at + len(needle)))
    cache = fresh_cache(model, make_cache)
    for c in cache:                                  # what the reading below can hold
        kind = type(getattr(c, "inner", c))
        if issubclass(kind, (RotatingKVCache, TurboQuantRotatingKVCache)):
            raise ValueError(f"needle_attention reads caches that hold every position; this one has "
                             f"sliding-window layers ({kind.__name__})")
        if issubclass(kind, QuantizedKVCache):
            raise ValueError("needle_attention reads the keys attention is given; mlx-lm's QuantizedKVCache "
                             "gives packed tuples instead")
    layer_of = {id(c): n for n, c in enumerate(cache)}
    exact: dict = {}                 # layer → ([key chunks], [value chunks]) as the run computed them
    held = lambda n, i: mx.concatenate(exact[n][i], axis=2)   # joined once, when the answer reads them
    record: dict = {}

    def recording(original):
        def sdpa(queries, keys, values, cache=None, scale=1.0, mask=None, **kw):
            read(queries, keys, values, cache, scale)
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)
        return sdpa

    def read(queries, keys, values, cache, scale):
        n = layer_of.get(id(cache))
        if answering[0] and n is not None and keys.shape[2] == sum(c.shape[2] for c in exact[n][0]):
            q = queries[0].astype(mx.float32)                       # (Hq, L, D)
            as_q = lambda x: repeat_kv(x.astype(mx.float32), q.shape[0])[0]   # (Hq, T, D)
            k, e = as_q(keys), as_q(held(n, 0))
            T, L = k.shape[1], q.shape[1]
            s = (q @ k.transpose(0, 2, 1)) * scale
            w = mx.softmax(mx.where(causal_mask(L, T), s, -mx.inf), axis=-1)
            err = (q @ (k - e).transpose(0, 2, 1)) * scale          # (Hq, L, T)
            others = mx.array([i for i in range(T - L) if i not in span])
            v = as_q(held(n, 1))                                    # the values this run computed
            dv = as_q(values) - v                                   # what the cache's coding changed
            out = mx.linalg.norm(w @ v, axis=-1)                    # (Hq, L)
            ratio = lambda x: mx.where(out > 0, x / mx.maximum(out, 1e-30), mx.where(x > 0, mx.inf, 0.0))
            on_code = err[:, :, code_pos[0]:code_pos[-1] + 1]
            record[n] = (w[:, :, code_pos[0]:code_pos[-1] + 1].sum(-1).mean(-1),
                         mx.take(err, others, axis=2).std(axis=-1).mean(),
                         mx.abs(on_code).mean(),
                         ratio(mx.linalg.norm(w @ dv, axis=-1)).mean(),
                         ratio(mx.sqrt((w * w) @ mx.sum(dv * dv, axis=-1)[..., None])[..., 0]).mean(),
                         (on_code.mean(-1) - mx.take(err, others, axis=2).mean(-1)).mean(-1))   # (Hq,)

    def keeping(c, n):
        inner = c.update_and_fetch

        def update_and_fetch(keys, values):
            chunks = exact.setdefault(n, ([], []))       # appended, not re-joined at every chunk
            chunks[0].append(keys)
            chunks[1].append(values)
            return inner(keys, values)
        c.update_and_fetch = update_and_fetch

    answering = [False]
    before = [c.__dict__.get("update_and_fetch") for c in cache]   # an instance's own method, if it had one
    for n, c in enumerate(cache):
        keeping(c, n)
    try:
        with patch_attention(model, recording):
            next_logits(model, mx.array(ids)[None], cache, chunk)
            answering[0] = True                          # the answer's rows, not the prompt's
            rest = model(mx.array(list(answer[:-1]))[None], cache=cache).astype(mx.float32)
    finally:
        for c, own in zip(cache, before):
            if own is None:
                c.__dict__.pop("update_and_fetch", None)
            else:
                c.update_and_fetch = own
    rest = rest - mx.logsumexp(rest, axis=-1, keepdims=True)
    if sorted(record) != list(range(len(cache))):
        raise ValueError(f"needle_attention saw {len(record)} of {len(cache)} layers' attention")
    return {"mass": [record[n][0].tolist() for n in range(len(cache))],
            "noise": [record[n][1].item() for n in range(len(cache))],
            "noise_code": [record[n][2].item() for n in range(len(cache))],
            "score_lift": [record[n][5].tolist() for n in range(len(cache))],
            "value_noise": [record[n][3].item() for n in range(len(cache))],
            "value_incoherent": [record[n][4].item() for n in range(len(cache))],
            "code_logp": sum(rest[0, j - 1, answer[j]].item() for j in range(1, len(answer))),
            "code_tokens": code_pos}
