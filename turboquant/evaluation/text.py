"""Text to token ids for evaluation (Chapters 9–10): ``encode_text`` tokenizes only the prefix
needed; ``bos_id`` says whether windows start with a BOS token, as the model was trained."""
from __future__ import annotations

from typing import Optional

__all__ = ["encode_text", "bos_id"]


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


def bos_id(tokenizer) -> Optional[int]:
    """The BOS id when the tokenizer puts one at the start of every text (Gemma), else
    None (SmolLM2): perplexity windows then start with it, as the model was trained."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = list(tokenizer.encode("a"))
    return bos if ids and ids[0] == bos else None
