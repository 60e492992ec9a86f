"""``turboquant generate`` and ``turboquant chat``: text from any mlx-lm model through a
compressed prompt cache, with attention computed from the codes (no dequantized copy).

``cache_options`` turns the command line's cache options into ``make_prompt_cache``
arguments; ``generate_text`` streams one completion; ``chat`` keeps one compressed cache
across turns, prefilling only each new turn, as mlx-lm's chat does with its own cache.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional, TextIO

import mlx.core as mx

from .memory import fp16_cache_bytes

__all__ = ["cache_options", "new_cache", "generate_text", "chat", "report", "DEFAULT_BITS"]


DEFAULT_BITS = 4.25   # what generate/chat use when no cache option is given


def cache_options(bits: Optional[float] = None, key_bits: Optional[int] = None, value_bits: Optional[int] = None,
                  codec: Optional[str] = None, max_kv_size: Optional[int] = None,
                  turned_mean: Optional[bool] = None) -> dict:
    """``make_prompt_cache`` keyword arguments from the CLI's options. At most one of
    ``bits`` (a budget including side information), ``key_bits``/``value_bits``
    (TurboQuant_mse index bits; the other side defaults to the same) and ``codec`` (a codec
    config as JSON text or a JSON file, for keys and values); none means ``bits=4.25``, the
    uncalibrated budget (``turboquant.budget``: centered 4-bit keys, 4-bit values, one exact
    sink token; the key mean learned before RoPE and turned with each position wherever the
    model allows it, ``make_prompt_cache``'s default).

    Not plain TurboQuant_mse at 4 bits: on Qwen2.5-Coder-1.5B it turns code perplexity
    from 2.8 into thousands (Chapter 12: one layer's keys are nearly a single shared
    vector, which a rotation cannot spread); centering removes that shared part.

    ``turned_mean``: None (neither flag) leaves ``make_prompt_cache``'s default; True
    (``--turned-mean``) asks for the key mean learned before RoPE, refused where the model does
    not allow it; False (``--no-turned-mean``) keeps the mean learned after RoPE (Chapter 9's
    centred rule). Either flag goes with a budget only, and ``--turned-mean`` not with a
    sliding window."""
    chosen = [n for n, v in (("--bits", bits), ("--key-bits/--value-bits", key_bits or value_bits),
                             ("--codec", codec)) if v]
    if len(chosen) > 1:
        raise ValueError(f"choose one way to set the cache: {' and '.join(chosen)} contradict each other")
    if turned_mean is not None:
        flag = "--turned-mean" if turned_mean else "--no-turned-mean"
        if chosen and chosen != ["--bits"]:
            raise ValueError(f"{flag} says where a budget's centred keys learn their mean (--bits), not for "
                             f"{chosen[0]}")
        from .prompt_cache import window_refusal
        refusal = window_refusal(max_kv_size, "--max-kv-size") if turned_mean else None
        if refusal:                                       # before any model loads
            raise ValueError(f"--turned-mean: {refusal}")
        return {**cache_options(bits=DEFAULT_BITS if bits is None else bits, max_kv_size=max_kv_size),
                "turned_mean": turned_mean}
    opts: dict = {"max_kv_size": max_kv_size}
    if codec:
        from .codecs.base import from_config, with_dim
        try:
            is_file = Path(codec).is_file()
        except OSError:                                    # e.g. inline JSON longer than a file name
            is_file = False
        text = Path(codec).read_text() if is_file else codec
        try:
            config = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--codec must be a codec config as JSON (or a JSON file), got {codec!r}: {e}") from None
        if not isinstance(config, dict):
            raise ValueError(f"--codec must be a JSON object such as {{\"codec\": \"turboquant_mse\", \"bits\": 4}}, "
                             f"got {codec!r}")
        try:                                               # the name and options, before any model loads
            from_config(with_dim(config, 64))
        except (TypeError, ValueError) as e:               # e.g. a missing or misspelt option
            raise ValueError(f"--codec {json.dumps(config)}: {e}") from None
        opts["key_codec"] = lambda d: from_config(with_dim(config, d))
    elif key_bits or value_bits:
        from .budget import codecs_for            # the one seed convention: keys seed 0, values seed 1
        opts["key_codec"], opts["value_codec"] = codecs_for(key_bits or value_bits, value_bits or key_bits)
    elif bits is not None:
        opts["bits"] = bits
    else:
        return cache_options(bits=DEFAULT_BITS, max_kv_size=max_kv_size)
    return opts


def new_cache(model, options: dict, load_path: Optional[str] = None) -> list:
    """A fresh compressed prompt cache, or the one saved at ``load_path`` (checked against
    the model: layers, kv heads, head size)."""
    from .prompt_cache import load_prompt_cache, make_prompt_cache
    if load_path is not None:
        return load_prompt_cache(load_path, model=model)
    return make_prompt_cache(model, **options, warn_rotating=False)


def fp16_bytes(model, cache: list) -> int:
    """Deprecated name of ``memory.fp16_cache_bytes`` (an int, as it was)."""
    from .checks import deprecated
    deprecated("generate.fp16_bytes", "memory.fp16_cache_bytes")
    return int(fp16_cache_bytes(model, cache))


def report(model, cache: list, prefill: tuple[int, float], decode: tuple[int, float]) -> str:
    """The closing line: tokens/s for prefill and decode; the bytes held (the codes of the
    held tokens and the tokens kept exactly: sinks, recent window, the tokens a codec is
    fitted on), the bytes allocated (storage grows in steps of 256 tokens) and what fp16
    would hold."""
    (np_, tp), (nd, td) = prefill, decode
    allocated = sum(c.nbytes for c in cache)
    codes = sum(c.code_nbytes(c.size()) + getattr(c, "exact_nbytes", 0) if hasattr(c, "code_nbytes") else c.nbytes
                for c in cache)
    fp16 = fp16_cache_bytes(model, cache)
    rate = lambda n, t: f"{n / t:,.1f}" if t > 0 and n else "-"   # noqa: E731
    ratio = "" if not codes else (f", {fp16 / codes:.2f}x smaller" if codes <= fp16 else f", {codes / fp16:.2f}x larger")
    seen, held = cache_len(cache), cache_held(cache)
    tokens = f"{held} tokens" if held == seen else f"the last {held} of {seen} tokens"
    return (f"[prefill {np_} tokens at {rate(np_, tp)} tok/s · decode {nd} tokens at {rate(nd, td)} tok/s · "
            f"cache: {codes / 1e6:,.3f} MB of codes and exact tokens for {tokens} ({allocated / 1e6:,.3f} MB "
            f"allocated), fp16 would hold {fp16 / 1e6:,.3f} MB{ratio}]")


def cache_len(cache: list) -> int:
    """Tokens seen by the cache (its first layer's offset)."""
    return next((c.offset for c in cache if hasattr(c, "offset")), 0)


def cache_held(cache: list) -> int:
    """Tokens the cache holds now (the most any layer holds: a sliding layer holds its window)."""
    return max((c.size() for c in cache if hasattr(c, "size")), default=0)


def generate_text(model, tokenizer, prompt_ids: list[int], cache: list, max_tokens: int,
                  out: Optional[TextIO] = None) -> dict:
    """Stream up to ``max_tokens`` greedy tokens after ``prompt_ids`` through ``cache``
    (attention from codes), writing the text to ``out`` (default: ``sys.stdout`` as it is at
    the call, not at import) as it comes. Returns {"text",
    "last_token" (the final generated token: EOS or the last one; like every generated
    token it is already in the cache), "prefill": (tokens, s), "decode": (tokens, s)}."""
    from mlx_lm.generate import stream_generate
    from .attention import codes_attention
    out = sys.stdout if out is None else out
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    # text = decode(generated ids), written as it grows (mlx-lm's streaming detokenizer drops
    # the first token's leading space); a partial UTF-8 character waits for its next byte
    ids, shown, t0, first, last = [], "", time.perf_counter(), None, None
    eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    with codes_attention(model):
        for r in stream_generate(model, tokenizer, mx.array(prompt_ids), max_tokens=max_tokens,
                                 prompt_cache=cache):
            if first is None:
                first = time.perf_counter()
            last = r.token
            if r.token in eos:
                continue
            ids.append(r.token)
            text = tokenizer.decode(ids)
            if not text.endswith("\ufffd") and text.startswith(shown):
                out.write(text[len(shown):])
                out.flush()
                shown = text
    n = len(ids) + (last is not None and last in eos)
    end = time.perf_counter()
    first = first or end
    return {"text": tokenizer.decode(ids), "last_token": last, "prefill": (len(prompt_ids), first - t0),
            "decode": (max(0, n - 1), end - first)}


def chat(model, tokenizer, cache: list, max_tokens: int, read: Callable[[str], str] = input,
         out: Optional[TextIO] = None, system: Optional[str] = None) -> list[dict]:
    """A multi-turn conversation with the model's chat template through one compressed
    cache, as mlx-lm's chat keeps its cache: each turn prefills only the new user message
    (templated alone, the BOS token only on the first turn); every token of the previous
    answer, its final one included, is already in the cache (mlx-lm runs the model on a
    token before yielding it). An empty line, ``/exit`` or end of input stops. Returns the
    messages."""
    out = sys.stdout if out is None else out          # as it is now (a notebook or a test may replace it)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this tokenizer has no chat template: use `turboquant generate`")
    messages = []
    bos = getattr(tokenizer, "bos_token_id", None)
    while True:
        try:
            line = read(">> ").strip()
        except EOFError:
            break
        if not line or line == "/exit":
            break
        turn = ([{"role": "system", "content": system}] if system and not messages else []) + \
            [{"role": "user", "content": line}]
        ids = list(tokenizer.apply_chat_template(turn, add_generation_prompt=True))
        if messages and bos is not None and ids[:1] == [bos]:
            ids = ids[1:]                                  # the cache already starts with BOS
        r = generate_text(model, tokenizer, ids, cache, max_tokens, out)
        out.write("\n" + report(model, cache, r["prefill"], r["decode"]) + "\n")
        messages += turn + [{"role": "assistant", "content": r["text"]}]
    return messages
