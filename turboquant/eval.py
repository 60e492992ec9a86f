"""Evaluation through a cache (Chapter 7; the real-model measurements build on it)."""
from __future__ import annotations

import mlx.core as mx

__all__ = ["top1_agreement"]


def top1_agreement(model, prompt: mx.array, continuation: mx.array, make_cache, reference_cache=None) -> float:
    """Teacher-forced greedy agreement: prefill ``prompt`` (1, P), then feed ``continuation``
    (1, N) one token at a time through a cache from ``make_cache()`` and through a
    full-precision cache, and return the fraction of the N + 1 steps whose argmax agree.

    Both runs see the same tokens, so one early disagreement does not derail the rest."""
    from mlx_lm.models.cache import make_prompt_cache
    ref = reference_cache if reference_cache is not None else make_prompt_cache(model)
    ours = make_cache()
    agree = []
    a = model(prompt, cache=ref)[:, -1].argmax(-1)
    b = model(prompt, cache=ours)[:, -1].argmax(-1)
    agree.append(mx.array_equal(a, b).item())
    for i in range(continuation.shape[1]):
        t = continuation[:, i:i + 1]
        a = model(t, cache=ref)[:, -1].argmax(-1)
        b = model(t, cache=ours)[:, -1].argmax(-1)
        agree.append(mx.array_equal(a, b).item())
    return sum(agree) / len(agree)
