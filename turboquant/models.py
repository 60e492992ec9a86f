"""Models for tests and chapters.

``tiny_model`` builds a small randomly initialised mlx-lm model (llama, or gemma3_text
for sliding-window layers); it needs no download and is deterministic in its seed.
"""
from __future__ import annotations

import mlx.core as mx

__all__ = ["tiny_model", "ByteTokenizer", "run_in_chunks"]


def tiny_model(kind: str = "llama", seed: int = 0, num_layers: int = 4, hidden_size: int = 64,
               num_heads: int = 4, num_kv_heads: int = 2, vocab_size: int = 256,
               sliding_window: int = 32):
    """A random mlx-lm model: ``kind`` is "llama" (global attention) or "gemma3"
    (gemma3_text: sliding-window layers with one global layer every sixth).

    Weights are float32 and drawn from ``mx.random`` with ``seed``.
    """
    if kind == "llama":
        from mlx_lm.models import llama as arch
        args = arch.ModelArgs(
            model_type="llama", hidden_size=hidden_size, num_hidden_layers=num_layers,
            intermediate_size=2 * hidden_size, num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads, rms_norm_eps=1e-5, vocab_size=vocab_size,
            rope_theta=10000.0, tie_word_embeddings=True)
    elif kind == "gemma3":
        from mlx_lm.models import gemma3_text as arch
        args = arch.ModelArgs(
            model_type="gemma3_text", hidden_size=hidden_size, num_hidden_layers=num_layers,
            intermediate_size=2 * hidden_size, num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads, head_dim=hidden_size // num_heads,
            vocab_size=vocab_size, sliding_window=sliding_window, sliding_window_pattern=6)
    else:
        raise ValueError(f"kind must be 'llama' or 'gemma3', got {kind!r}")
    mx.random.seed(seed)
    model = arch.Model(args)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


class ByteTokenizer:
    """A byte-level stand-in for a Hugging Face tokenizer (ids 1…255 are bytes, 0 is EOS),
    enough for ``mlx_lm.generate`` with the random ``tiny_model``s. Not a real tokenizer."""

    eos_token_id = 0
    bos_token = None
    chat_template = None
    vocab_size = 256

    def get_vocab(self):
        return {chr(i): i for i in range(256)}

    def encode(self, text, **kw):
        return list(text.encode("utf-8"))

    def decode(self, ids, **kw):
        return bytes(i % 256 for i in ids).decode("latin-1")

    def apply_chat_template(self, messages, **kw):
        raise NotImplementedError("ByteTokenizer has no chat template: pass raw prompts")


def run_in_chunks(fn, x: mx.array, cache, splits) -> mx.array:
    """Feed ``x`` (B, T, …) to ``fn(x_chunk, cache=cache)`` in consecutive pieces of the
    sizes in ``splits`` (a long prefill, chunks, single steps) and concatenate the outputs
    along the token axis: (B, sum(splits), …). ``fn`` is a model or an attention layer."""
    if sum(splits) > x.shape[1]:
        raise ValueError(f"splits add up to {sum(splits)} tokens, x has {x.shape[1]}")
    out, i = [], 0
    for n in splits:
        out.append(fn(x[:, i:i + n], cache=cache))
        i += n
    return mx.concatenate(out, axis=1)
