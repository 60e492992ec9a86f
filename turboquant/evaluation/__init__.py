"""Evaluation through a cache: perplexity, attention fidelity per layer, needle retrieval,
greedy top-1 agreement (Chapters 7 and 9). One module per idea: ``text`` (token ids),
``prefilling`` (the one prefill loop, ``prefill``), ``scoring`` (``perplexity``), ``agreement``,
``fidelity``, ``needle``, ``outliers`` (keys by channel, before and after a rotation).

Every function takes ``make_cache``: a zero-argument callable returning a fresh prompt
cache (a list, one entry per layer), or None for mlx-lm's full-precision ``KVCache``. The
cache is *in* the computation: text is prefilled through it in chunks, so later chunks
attend to compressed keys and values (``mlx_lm.perplexity`` calls the model without a
cache and cannot see KV compression).
"""
from .agreement import greedy_agreement, top1_agreement
from .fidelity import capture_qkv, key_statistics, layer_fidelity, position_error, recording
from .needle import (NEEDLE, NEEDLE_VALUES, QUESTION, answer_logprobs, needle_accuracy, needle_attention,
                     needle_prompt, needle_values)
from .outliers import channel_profile
from .scoring import perplexity
from .prefilling import MakeCache, fresh_cache, greedy, fill_cache, next_logits, prefill, prefill_logits
from .text import bos_id, encode_text

__all__ = ["encode_text", "bos_id", "perplexity", "capture_qkv", "layer_fidelity", "key_statistics",
           "position_error", "recording",
           "needle_prompt", "needle_accuracy", "needle_attention", "answer_logprobs", "needle_values", "NEEDLE", "QUESTION", "NEEDLE_VALUES",
           "top1_agreement", "greedy_agreement", "channel_profile", "MakeCache", "fresh_cache", "prefill", "prefill_logits", "fill_cache", "next_logits",
           "greedy"]
