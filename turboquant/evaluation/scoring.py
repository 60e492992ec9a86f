"""Perplexity through a cache (Chapters 7, 9, 10): each window prefilled through a fresh cache
in chunks, so later chunks attend to compressed keys and values (``mlx_lm.perplexity`` calls
the model without a cache and cannot see KV compression); optionally the KL divergence from
and top-1 agreement with a full-precision run on the same tokens."""
from __future__ import annotations

import math
from itertools import repeat
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..memory import measured_bits
from ..progress import progress as progress_bar
from .prefilling import MakeCache, fresh_cache, prefill

__all__ = ["perplexity"]


def perplexity(model, tokens: Sequence[int], make_cache: MakeCache = None, window: int = 512,
               chunk: int = 128, progress: bool = False, bos: Optional[int] = None,
               compare: bool = False) -> dict:
    """Perplexity of ``tokens`` scored in consecutive windows of ``window`` tokens, each
    prefilled through a fresh cache in chunks of ``chunk`` tokens.

    With ``bos`` (``bos_id(tokenizer)``) each window is preceded by that token; either way
    the window's tokens 2…window are scored (window − 1 per window). Logits are reduced to
    losses chunk by chunk, so memory stays bounded for large vocabularies (Gemma's
    262,144 × 2,048 tokens × 4 bytes would be 2.1 GB at once).

    Returns {"ppl", "nll" (mean, nats), "n_scored", "windows", "bits"}: "bits" is the
    cache's measured bits per cached coordinate after the first window (``memory.measured_bits``).
    With ``compare``, every window also runs through a full-precision cache, and the
    result adds "kl" (mean KL divergence of the next-token distribution from the
    full-precision one, nats) and "top1" (fraction of scored positions whose most likely
    next token is the same): both teacher-forced on the same tokens. "per_window" keeps the
    sums per window ({"nll", "n"} and, with ``compare``, {"kl", "top1"}): what
    ``evaluation.intervals`` resamples."""
    tokens = list(tokens)
    if window < 2 or chunk < 1:
        raise ValueError(f"window must be ≥ 2 and chunk ≥ 1, got window={window}, chunk={chunk}")
    n_win = len(tokens) // window
    if n_win == 0:
        raise ValueError(f"{len(tokens)} tokens are fewer than one window of {window}")
    head = [] if bos is None else [int(bos)]
    total, count, bits, kl, top1 = 0.0, 0, None, 0.0, 0
    per = {"nll": [], "n": []} if not compare else {"nll": [], "n": [], "kl": [], "top1": []}
    for w in progress_bar(range(n_win), n_win, "perplexity", progress):
        x = mx.array(head + tokens[w * window:(w + 1) * window])[None]
        first = len(head) + 1                       # index in x of the first scored token
        cache = fresh_cache(model, make_cache)
        ref = fresh_cache(model, None) if compare else None
        nll, kl_w, top1_w = 0.0, 0.0, 0
        exacts = prefill(model, x, ref, chunk) if compare else repeat((None, None))
        for (i, logits), (_, exact) in zip(prefill(model, x, cache, chunk), exacts):
            lo = max(i, first - 1)                  # positions i..i+c−1 predict i+1..i+c
            hi = min(i + logits.shape[1], x.shape[1] - 1)
            if hi > lo:
                part = nn.losses.cross_entropy(logits[:, lo - i:hi - i], x[:, lo + 1:hi + 1], reduction="sum")
                nll += part.item()
                if compare:
                    lp = logits[:, lo - i:hi - i] - mx.logsumexp(logits[:, lo - i:hi - i], axis=-1, keepdims=True)
                    lr = exact[:, lo - i:hi - i] - mx.logsumexp(exact[:, lo - i:hi - i], axis=-1, keepdims=True)
                    kl_w += mx.sum(mx.exp(lr) * (lr - lp)).item()
                    top1_w += mx.sum(lp.argmax(-1) == lr.argmax(-1)).item()
        total += nll
        count += window - 1
        kl += kl_w
        top1 += top1_w
        per["nll"].append(nll)
        per["n"].append(window - 1)
        if compare:
            per["kl"].append(kl_w)
            per["top1"].append(top1_w)
        if bits is None:
            bits = measured_bits(model, cache)
    out = {"ppl": math.exp(total / count), "nll": total / count, "n_scored": count,
           "windows": n_win, "bits": bits, "per_window": per}
    if compare:
        out.update(kl=kl / count, top1=top1 / count)
    return out
