"""Evaluation through a cache: perplexity, attention fidelity per layer, needle retrieval,
greedy top-1 agreement (Chapters 7 and 9).

Every function takes ``make_cache``: a zero-argument callable returning a fresh prompt
cache (a list, one entry per layer), or None for mlx-lm's full-precision ``KVCache``. The
cache is *in* the computation: text is prefilled through it in chunks, so later chunks
attend to compressed keys and values (``mlx_lm.perplexity`` calls the model without a
cache and cannot see KV compression).
"""
from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from .attention import attention_fidelity, causal_mask, patch_attention
from .memory import measured_bits

__all__ = ["encode_text", "bos_id", "perplexity", "capture_qkv", "layer_fidelity",
           "needle_prompt", "needle_accuracy", "needle_values", "top1_agreement", "greedy_agreement", "ring_fidelity",
           "key_statistics"]

if TYPE_CHECKING:
    from .codecs.base import Codec

MakeCache = Optional[Callable[[], list]]


def _progress(iterable, total=None, desc=None, enabled=False):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm
    return tqdm(iterable, total=total, desc=desc, leave=False, file=sys.stderr)


def _fresh(model, make_cache: MakeCache) -> list:
    if make_cache is None:
        from mlx_lm.models.cache import make_prompt_cache
        return make_prompt_cache(model)
    return make_cache()


def encode_text(tokenizer, text: str, n_tokens: Optional[int] = None) -> list[int]:
    """Token ids of ``text`` (the first ``n_tokens`` if given), without special tokens.

    Only a prefix of the text long enough for ``n_tokens`` is tokenized, and the fast
    tokenizer's backend is used directly (no "sequence longer than the model" warning:
    the ids are scored in windows)."""
    if not isinstance(text, str) or not text:
        raise ValueError("text must be a non-empty string")
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(inner, "backend_tokenizer", None)
    enc = ((lambda s: backend.encode(s, add_special_tokens=False).ids) if backend is not None
           else (lambda s: list(tokenizer.encode(s))))
    if n_tokens is None:
        return enc(text)
    if not isinstance(n_tokens, int) or n_tokens < 2:
        raise ValueError(f"n_tokens must be an int ≥ 2, got {n_tokens!r}")
    chars = 8 * n_tokens
    while True:
        ids = enc(text[:chars])
        if len(ids) > n_tokens or chars >= len(text):
            break
        chars *= 2
    if len(ids) < n_tokens:
        raise ValueError(f"the text has only {len(ids)} tokens, {n_tokens} requested")
    return ids[:n_tokens]


def _prefill_logits(model, tokens: mx.array, cache, chunk: int) -> mx.array:
    out = []
    for i in range(0, tokens.shape[1], chunk):
        logits = model(tokens[:, i:i + chunk], cache=cache).astype(mx.float32)
        mx.eval(logits)
        out.append(logits)
    return mx.concatenate(out, axis=1)


def _greedy(model, ids: mx.array, cache, n_tokens: int, chunk: int) -> list[int]:
    """Prefill ``ids`` (1, P) through ``cache`` in chunks, then ``n_tokens`` greedy tokens."""
    logits = _prefill_logits(model, ids, cache, chunk)[:, -1]
    out = []
    for _ in range(n_tokens):
        t = logits.argmax(-1)
        out.append(t.item())
        logits = model(t[:, None], cache=cache)[:, -1]
    return out


def bos_id(tokenizer) -> Optional[int]:
    """The BOS id when the tokenizer puts one at the start of every text (Gemma), else
    None (SmolLM2): perplexity windows then start with it, as the model was trained."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = list(tokenizer.encode("a"))
    return bos if ids and ids[0] == bos else None


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
    next token is the same): both teacher-forced on the same tokens."""
    tokens = list(tokens)
    if window < 2 or chunk < 1:
        raise ValueError(f"window must be ≥ 2 and chunk ≥ 1, got window={window}, chunk={chunk}")
    n_win = len(tokens) // window
    if n_win == 0:
        raise ValueError(f"{len(tokens)} tokens are fewer than one window of {window}")
    head = [] if bos is None else [int(bos)]
    total, count, bits, kl, top1 = 0.0, 0, None, 0.0, 0
    for w in _progress(range(n_win), n_win, "perplexity", progress):
        x = mx.array(head + tokens[w * window:(w + 1) * window])[None]
        first = len(head) + 1                       # index in x of the first scored token
        cache = _fresh(model, make_cache)
        ref = _fresh(model, None) if compare else None
        nll = 0.0
        for i in range(0, x.shape[1], chunk):
            logits = model(x[:, i:i + chunk], cache=cache).astype(mx.float32)
            lo = max(i, first - 1)                  # positions i..i+c−1 predict i+1..i+c
            hi = min(i + logits.shape[1], x.shape[1] - 1)
            if compare:
                exact = model(x[:, i:i + chunk], cache=ref).astype(mx.float32)
            if hi > lo:
                part = nn.losses.cross_entropy(logits[:, lo - i:hi - i], x[:, lo + 1:hi + 1], reduction="sum")
                nll += part.item()
                if compare:
                    lp = logits[:, lo - i:hi - i] - mx.logsumexp(logits[:, lo - i:hi - i], axis=-1, keepdims=True)
                    lr = exact[:, lo - i:hi - i] - mx.logsumexp(exact[:, lo - i:hi - i], axis=-1, keepdims=True)
                    kl += mx.sum(mx.exp(lr) * (lr - lp)).item()
                    top1 += mx.sum(lp.argmax(-1) == lr.argmax(-1)).item()
        total += nll
        count += window - 1
        if bits is None:
            bits = measured_bits(model, cache)
    out = {"ppl": math.exp(total / count), "nll": total / count, "n_scored": count,
           "windows": n_win, "bits": bits}
    if compare:
        out.update(kl=kl / count, top1=top1 / count)
    return out


def cache_bits(model, cache) -> float:
    """Deprecated name of ``memory.measured_bits``."""
    from .checks import deprecated
    deprecated("eval.cache_bits", "memory.measured_bits")
    return measured_bits(model, cache)


def _recording(model, record: list):
    """Record (queries, keys, values, scale) at every attention call of ``model``."""
    def wrap(original):
        def sdpa(queries, keys, values, cache=None, scale=1.0, mask=None, **kwargs):
            record.append((queries, keys, values, scale))
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)
        return sdpa
    return patch_attention(model, wrap)


def capture_qkv(model, tokens: Sequence[int]) -> list[dict]:
    """Each layer's attention inputs on ``tokens``: [{"q": (1, H, T, D), "k", "v": (1, H_kv,
    T, D), "scale"}] in layer order (keys after RoPE, as the cache would store them)."""
    record = []
    x = mx.array(list(tokens))[None]
    with _recording(model, record):
        model(x)
    mx.eval([r[:3] for r in record])
    return [{"q": q, "k": k, "v": v, "scale": s} for q, k, v, s in record]


def layer_fidelity(captured: list[dict], key_codec: Callable, value_codec: Optional[Callable] = None,
                   queries: int = 128, sink_tokens: int = 0) -> list[dict]:
    """Per layer: attention with codec-reconstructed K (and V) against exact, causal, on the
    last ``queries`` positions. ``key_codec``/``value_codec`` are callables dim → codec (a
    fresh one per layer, fitted on the layer's keys when it learns from data); None as
    ``value_codec`` keeps values exact; the first ``sink_tokens`` tokens stay exact, as in
    a cache with sink tokens. Returns attention_fidelity's dict per layer plus
    "key_rel_mse" (‖k̂ − k‖² / ‖k‖²)."""
    out = []
    for layer in captured:
        q, k, v, scale = layer["q"], layer["k"], layer["v"], layer["scale"]
        T, D = k.shape[2], k.shape[3]
        kc = key_codec(D)
        if hasattr(kc, "fit"):
            kc.fit(k)
        k_hat = kc.decode(kc.encode(k))
        v_hat = v
        if value_codec is not None:
            vc = value_codec(D)
            if hasattr(vc, "fit"):
                vc.fit(v)
            v_hat = vc.decode(vc.encode(v))
        if sink_tokens:
            k_hat = mx.concatenate([k[:, :, :sink_tokens], k_hat[:, :, sink_tokens:]], axis=2)
            v_hat = mx.concatenate([v[:, :, :sink_tokens], v_hat[:, :, sink_tokens:]], axis=2)
        nq = min(queries, T)
        mask = causal_mask(nq, T)
        f = attention_fidelity(q[:, :, T - nq:], k, v, k_hat, v_hat, scale=scale, mask=mask)
        f["key_rel_mse"] = (mx.sum((k_hat - k) ** 2) / mx.sum(k * k)).item()
        out.append(f)
    return out


# ------------------------------------------------------------------ needle in a haystack
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
    for c, d, v in _progress(jobs, len(jobs), "needle", progress):
        ids = mx.array(needle_prompt(tokenizer, haystack_ids, c, d, v))[None]
        text = tokenizer.decode(_greedy(model, ids, _fresh(model, make_cache), max_tokens, chunk))
        trials.append({"context": c, "depth": d, "value": v, "answer": text, "ok": v in text})
    for c in contexts:
        ok = [t["ok"] for t in trials if t["context"] == c]
        acc[c] = sum(ok) / len(ok)
    return {"accuracy": acc, "trials": trials}


# ------------------------------------------------------------------ top-1 agreement
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


def greedy_agreement(model, prompt: Sequence[int], n_tokens: int, make_cache, chunk: int = 256) -> float:
    """Greedy top-1 agreement over ``n_tokens`` generated by the full-precision model: the
    full-precision continuation is generated once, then teacher-forced through both caches
    (``top1_agreement``)."""
    from mlx_lm.models.cache import make_prompt_cache
    p = mx.array(list(prompt))[None]
    cont = _greedy(model, p, make_prompt_cache(model), n_tokens, chunk)
    return top1_agreement(model, p, mx.array(cont)[None], make_cache)


def key_statistics(captured: list[dict]) -> dict:
    """Per layer, from ``capture_qkv`` output: "sink_mass" — mean causal attention weight on
    the first token; "centered_energy" — Σ‖k − μ_h‖² / Σ‖k‖² with μ_h the per-head key mean
    (what centering leaves for the codec); "sink_distance" — ‖k_0 − μ‖ / mean ‖k_t − μ‖."""
    from .attention import _repeat_kv
    mass, energy, dist = [], [], []
    for layer in captured:
        q, k, s = layer["q"], layer["k"], layer["scale"]
        T = k.shape[2]
        scores = (q * s) @ mx.swapaxes(_repeat_kv(k, q.shape[1]), -1, -2)
        p = mx.softmax(mx.where(causal_mask(T, T), scores, -mx.inf), axis=-1, precise=True)
        mass.append(mx.mean(p[..., 1:, 0]).item())
        mu = mx.mean(k, axis=2, keepdims=True)
        energy.append((mx.sum((k - mu) ** 2) / mx.sum(k * k)).item())
        d = mx.linalg.norm(k - mu, axis=-1)                                   # (1, H, T)
        dist.append(mx.mean(d[..., 0] / mx.mean(d[..., 1:], axis=-1)).item())
    return {"sink_mass": mass, "centered_energy": energy, "sink_distance": dist}


def ring_fidelity(captured: list[dict], codec: Callable[[int], Codec], window: int, chunk: int = 512,
                  value_codec: Optional[Callable[[int], Codec]] = None) -> list[dict]:
    """Per layer of a real model: the window attention of its captured queries, keys and
    values (``turboquant.eval.capture_qkv``; one prefill, so it runs past the window) through
    a ``QuantizedSWACache`` (keys with ``codec(D)``, values with ``value_codec`` or the same)
    against the same attention on exact keys and values. Returns per layer {"cos_mean",
    "cos_min", "rel_error"} over every query row and head."""
    from .attention import output_fidelity
    from .bitaxon import QuantizedSWACache, window_attention
    out = []
    for layer in captured:
        q, k, v, scale = layer["q"], layer["k"], layer["v"], layer["scale"]
        D = k.shape[-1]
        ring = QuantizedSWACache(window, codec(D), None if value_codec is None else value_codec(D))
        approx = window_attention(q, k, v, ring, window, chunk, scale)
        exact = window_attention(q, k, v, None, window, chunk, scale)
        out.append(output_fidelity(approx, exact))
    return out
