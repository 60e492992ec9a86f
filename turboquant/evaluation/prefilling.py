"""The one prefill loop of evaluation: text fed through a cache in chunks, so later chunks
attend to what the cache holds (compressed keys and values). Every measurement —
perplexity, agreement, needles — prefills through ``prefill``."""
from __future__ import annotations

from typing import Callable, Iterator, Optional

import mlx.core as mx

__all__ = ["MakeCache", "fresh_cache", "prefill", "prefill_logits", "fill_cache", "next_logits", "greedy"]

MakeCache = Optional[Callable[[], list]]


def fresh_cache(model, make_cache: MakeCache) -> list:
    """``make_cache()``, or mlx-lm's full-precision prompt cache when ``make_cache`` is None."""
    if make_cache is None:
        from mlx_lm.models.cache import make_prompt_cache
        return make_prompt_cache(model)
    return make_cache()


def prefill(model, x: mx.array, cache, chunk: int) -> Iterator[tuple[int, mx.array]]:
    """Feed ``x`` (1, P) through ``cache`` in chunks of ``chunk`` tokens: yields (start of the
    chunk, its logits (1, c, V) float32)."""
    for i in range(0, x.shape[1], chunk):
        yield i, model(x[:, i:i + chunk], cache=cache).astype(mx.float32)


def _body(model):
    """The model without its output head: mlx-lm's causal LMs (llama, qwen2, gemma3_text)
    hold it as ``model.model(inputs, cache)``, returning hidden states; another model is
    called whole."""
    inner = getattr(model, "model", None)
    return (lambda x, cache: inner(x, cache)) if callable(inner) else (lambda x, cache: model(x, cache=cache))


def fill_cache(model, x: mx.array, cache, chunk: int) -> None:
    """Feed ``x`` (1, P) through ``cache`` in chunks, as ``prefill`` does, without the output
    head: what the cache holds afterwards is what ``prefill`` leaves, but no (c, V) logits
    are computed (Gemma's head alone is 262,144 × 640 multiply-adds per token)."""
    body = _body(model)
    for i in range(0, x.shape[1], chunk):
        mx.eval(body(x[:, i:i + chunk], cache))


def prefill_logits(model, tokens: mx.array, cache, chunk: int) -> mx.array:
    """All logits (1, P, V) of ``tokens`` (1, P) prefilled through ``cache``."""
    out = []
    for _, logits in prefill(model, tokens, cache, chunk):
        mx.eval(logits)
        out.append(logits)
    return mx.concatenate(out, axis=1)


def next_logits(model, ids: mx.array, cache, chunk: int) -> mx.array:
    """Prefill ``ids`` (1, P) through ``cache`` in chunks; the logits (1, V) float32 of the token
    after them. Only the last chunk goes through the output head (``fill_cache`` before it),
    and only its last position's logits are kept: never all (P, V)."""
    last = (ids.shape[1] - 1) // chunk * chunk
    fill_cache(model, ids[:, :last], cache, chunk)
    logits = model(ids[:, last:], cache=cache)[:, -1].astype(mx.float32)
    mx.eval(logits)
    return logits


def greedy(model, ids: Optional[mx.array], cache, n_tokens: int, chunk: int,
           logits: Optional[mx.array] = None) -> list[int]:
    """Prefill ``ids`` (1, P) through ``cache`` in chunks (``next_logits``), then ``n_tokens``
    greedy tokens. ``logits``: ``next_logits``' result when the prompt is already in ``cache``;
    then ``ids`` is ignored (pass None) and nothing is prefilled."""
    if logits is None:
        logits = next_logits(model, ids, cache, chunk)
    out = []
    for _ in range(n_tokens):
        t = logits.argmax(-1)
        out.append(t.item())
        logits = model(t[:, None], cache=cache)[:, -1]
    return out
