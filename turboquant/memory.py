"""The KV-cache memory model (Chapter 1, "The KV-cache memory wall").

For one attention layer the cache holds a key and a value vector per cached token and
kv head, so

    bytes = 2 · B · T_cached · H_kv · (D · b + s) / 8,    T_cached = min(T, W)

with B the batch, T the context, W the layer's window (∞ for a global layer), H_kv the
kv heads, D the head size, b the payload bits per coordinate and s the side-information
bits per stored vector (an fp16 norm: s = 16; affine groups of g with fp16 scale and
bias: s = 32 · ceil(D / g)). SSM layers keep a constant state and hold no KV cache.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

__all__ = [
    "Layer", "AttentionGeometry", "PRESETS", "kv_bytes", "kv_cache_bytes", "cached_tokens",
    "held_tokens", "fp16_cache_bytes", "measured_bits", "check_layers",
    "affine_side_bits", "NORM_SIDE_BITS", "bits_per_coordinate", "geometry_from_model", "cache_count",
    "model_geometry", "model_fingerprint", "describe_model",
]

NORM_SIDE_BITS = 16  # one fp16 norm per stored vector
_KINDS = ("global", "sliding", "ssm")


@dataclass(frozen=True)
class Layer:
    """One layer's kind: "global" attention, "sliding" attention (with ``window``) or "ssm"."""

    kind: str
    window: int | None = None

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"layer kind must be one of {_KINDS}, got {self.kind!r}")
        if self.kind == "sliding" and (self.window is None or self.window < 1):
            raise ValueError(f"a sliding layer needs a positive window, got {self.window!r}")
        if self.kind != "sliding" and self.window is not None:
            raise ValueError(f"only sliding layers have a window, got {self.kind!r} with {self.window}")


@dataclass(frozen=True)
class AttentionGeometry:
    """A model's attention geometry: its layers, kv heads H_kv and head size D."""

    name: str
    layers: tuple[Layer, ...]
    n_kv_heads: int
    head_dim: int
    n_heads: int | None = None
    hidden: int | None = None

    def __post_init__(self):
        for field in ("n_kv_heads", "head_dim"):
            v = getattr(self, field)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{field} must be a positive int, got {v!r}")
        if not self.layers:
            raise ValueError("a geometry needs at least one layer")

    @property
    def attention_layers(self) -> tuple[Layer, ...]:
        return tuple(layer for layer in self.layers if layer.kind != "ssm")

    def describe(self) -> str:
        counts = {k: sum(l.kind == k for l in self.layers) for k in _KINDS}
        windows = sorted({l.window for l in self.layers if l.kind == "sliding"})
        parts = [f"{counts[k]} {k}" for k in _KINDS if counts[k]]
        win = f", window {'/'.join(map(str, windows))}" if windows else ""
        return (f"{self.name}: {len(self.layers)} layers ({', '.join(parts)}{win}), "
                f"{self.n_kv_heads} kv heads x D={self.head_dim}")


def _stack(*groups: tuple[int, Layer]) -> tuple[Layer, ...]:
    return tuple(layer for n, layer in groups for _ in range(n))


def _gemma3_270m_layers() -> tuple[Layer, ...]:
    # every sixth layer is global, the other five use a 512-token window
    return tuple(Layer("global") if (i + 1) % 6 == 0 else Layer("sliding", 512) for i in range(18))


PRESETS: dict[str, AttentionGeometry] = {
    "bit-axon": AttentionGeometry(
        "bit-axon",
        _stack((8, Layer("ssm")), (8, Layer("sliding", 4096)), (8, Layer("ssm"))),
        n_kv_heads=32, head_dim=80, n_heads=32, hidden=2560),
    "smollm2-135m": AttentionGeometry(
        "smollm2-135m", _stack((30, Layer("global"))), n_kv_heads=3, head_dim=64,
        n_heads=9, hidden=576),
    "gemma3-270m": AttentionGeometry(
        "gemma3-270m", _gemma3_270m_layers(), n_kv_heads=1, head_dim=256, n_heads=4, hidden=640),
    "qwen2.5-coder-1.5b": AttentionGeometry(
        "qwen2.5-coder-1.5b", _stack((28, Layer("global"))), n_kv_heads=2, head_dim=128,
        n_heads=12, hidden=1536),
    "llama-3.1-8b": AttentionGeometry(
        "llama-3.1-8b", _stack((32, Layer("global"))), n_kv_heads=8, head_dim=128,
        n_heads=32, hidden=4096),
    "qwen2.5-7b": AttentionGeometry(
        "qwen2.5-7b", _stack((28, Layer("global"))), n_kv_heads=4, head_dim=128,
        n_heads=28, hidden=3584),
}


def _check_count(name: str, v, minimum: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, (int,)) or v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
    return v


def cached_tokens(layer: Layer, context: int, alloc_step: int = 1) -> int:
    """Tokens a layer's cache holds at ``context``: min(T, W), 0 for SSM layers.

    ``alloc_step`` models caches that grow in fixed steps (mlx-lm: 256): the token
    count is rounded up to a multiple of the step, never past the window.
    """
    _check_count("context", context)
    _check_count("alloc_step", alloc_step, 1)
    if layer.kind == "ssm":
        return 0
    held = -(-context // alloc_step) * alloc_step
    return min(held, layer.window) if layer.kind == "sliding" else held


def _check_bits(bits, side_bits_per_vector) -> None:
    if isinstance(bits, bool) or not (isinstance(bits, (int, float)) and math.isfinite(bits) and bits > 0):
        raise ValueError(f"bits must be a positive finite number, got {bits!r}")
    if isinstance(side_bits_per_vector, bool) or not (isinstance(side_bits_per_vector, (int, float))
                                                      and math.isfinite(side_bits_per_vector)
                                                      and side_bits_per_vector >= 0):
        raise ValueError(f"side_bits_per_vector must be >= 0, got {side_bits_per_vector!r}")


def kv_bytes(tokens: int, kv_heads: int, head_dim: int, bits: float = 16,
             side_bits_per_vector: float = 0) -> float:
    """Bytes of K and V for ``tokens`` cached tokens of one layer: 2·T·H_kv·(D·b + s)/8.
    The one formula: ``kv_cache_bytes`` (all layers of a geometry), the roofline's bytes per
    step, ``fp16_cache_bytes`` and ``measured_bits`` call it."""
    _check_count("tokens", tokens)
    _check_count("kv_heads", kv_heads, 1)
    _check_count("head_dim", head_dim, 1)
    _check_bits(bits, side_bits_per_vector)
    return 2 * tokens * kv_heads * (head_dim * bits + side_bits_per_vector) / 8


def held_tokens(cache: list) -> int:
    """Tokens the caches of a model's prompt cache hold, summed over layers (``size()``: a
    sliding-window layer holds its window, not every token it has seen). A cache that does
    not implement ``size()`` (mlx-lm's ``QuantizedKVCache`` inherits 0 from ``_BaseCache``)
    holds its ``offset``."""
    def held(c) -> int:
        n = c.size() if hasattr(c, "size") else 0
        return n if n or not hasattr(c, "offset") else int(c.offset)
    return sum(held(c) for c in cache)


def fp16_cache_bytes(model, cache: list) -> float:
    """Bytes an fp16 mlx-lm cache would hold for the tokens ``cache`` holds."""
    g = geometry_from_model(model)
    return kv_bytes(held_tokens(cache), g.n_kv_heads, g.head_dim, 16)


def measured_bits(model, cache: list) -> float:
    """Bits per held coordinate that ``cache`` really spends: its bytes (``nbytes``: codes,
    side information, exact tokens, storage allocated in steps) × 8 over the coordinates
    of the tokens it holds (NaN for an empty cache)."""
    g = geometry_from_model(model)
    per_bit = kv_bytes(held_tokens(cache), g.n_kv_heads, g.head_dim, 1)
    return sum(c.nbytes for c in cache) / per_bit if per_bit else float("nan")


def kv_cache_bytes(geometry: AttentionGeometry | str, context: int, bits: float = 16,
                   side_bits_per_vector: float = 0, batch: int = 1,
                   alloc_step: int = 1) -> float:
    """Bytes of K and V over all attention layers: 2·B·ΣT_cached·H_kv·(D·b + s)/8.

    ``geometry`` may be a preset name. ``bits`` is payload bits per coordinate (may be
    fractional); ``side_bits_per_vector`` is side information per stored D-vector.
    """
    g = PRESETS[geometry] if isinstance(geometry, str) and geometry in PRESETS else geometry
    if not isinstance(g, AttentionGeometry):
        raise ValueError(f"unknown geometry {geometry!r}; presets: {sorted(PRESETS)}")
    _check_count("batch", batch, 1)
    _check_bits(bits, side_bits_per_vector)
    tokens = sum(cached_tokens(l, context, alloc_step) for l in g.attention_layers)
    return batch * kv_bytes(tokens, g.n_kv_heads, g.head_dim, bits, side_bits_per_vector)


def affine_side_bits(head_dim: int, group_size: int = 64, scale_bits: int = 16) -> int:
    """Side bits per vector of affine group quantization: a scale and a bias per group.

    Groups that do not divide D still cost a whole group each (ceil(D / g)); note that
    ``mx.quantize`` itself only accepts D divisible by g, with g in {32, 64, 128}.
    """
    _check_count("head_dim", head_dim, 1)
    _check_count("group_size", group_size, 1)
    return 2 * scale_bits * -(-head_dim // group_size)


def bits_per_coordinate(bits: float, head_dim: int, side_bits_per_vector: float) -> float:
    """Effective bits per coordinate: b + s / D."""
    _check_count("head_dim", head_dim, 1)
    return bits + side_bits_per_vector / head_dim


def geometry_from_model(model, name: str = "model") -> AttentionGeometry:
    """Read an mlx-lm model's geometry from its ``args`` (llama-style configs).

    Sliding layers are recognised from ``sliding_window`` plus a ``layer_types`` list or
    gemma-3's ``sliding_window_pattern``; every other layer is global.
    """
    a = getattr(model, "args", None)
    if a is None:
        raise TypeError(f"{type(model).__name__} has no .args: not an mlx-lm model?")
    n_layers = a.num_hidden_layers
    n_heads = a.num_attention_heads
    n_kv = getattr(a, "num_key_value_heads", None) or n_heads
    head_dim = getattr(a, "head_dim", None) or a.hidden_size // n_heads
    window = getattr(a, "sliding_window", None)
    kinds = ["global"] * n_layers
    if window:
        types = getattr(a, "layer_types", None)
        pattern = getattr(a, "sliding_window_pattern", None)
        if types:
            kinds = ["sliding" if "sliding" in t else "global" for t in types]
        elif pattern:
            kinds = ["global" if (i + 1) % pattern == 0 else "sliding" for i in range(n_layers)]
    layers = tuple(Layer(k, window if k == "sliding" else None) for k in kinds)
    return AttentionGeometry(name, layers, n_kv_heads=n_kv, head_dim=head_dim,
                             n_heads=n_heads, hidden=a.hidden_size)


def measured_nbytes(model, cache: list, prompt_tokens: int, decode_steps: int = 0,
                    seed: int = 0) -> int:
    """Run ``model`` over a random prompt of ``prompt_tokens`` (one prefill call), then
    ``decode_steps`` single-token calls, through ``cache``; return Σ cache.nbytes."""
    import mlx.core as mx
    _check_count("prompt_tokens", prompt_tokens, 1)
    _check_count("decode_steps", decode_steps)
    vocab = model.args.vocab_size
    tokens = mx.random.randint(0, vocab, (1, prompt_tokens + decode_steps), key=mx.random.key(seed))
    mx.eval(model(tokens[:, :prompt_tokens], cache=cache))
    for i in range(decode_steps):
        mx.eval(model(tokens[:, prompt_tokens + i: prompt_tokens + i + 1], cache=cache))
    return sum(c.nbytes for c in cache)


def cache_count(model) -> int:
    """How many caches an mlx-lm model takes: ``len(model.make_cache())`` when it defines one
    (some models share caches between layers), else one per layer."""
    return len(model.make_cache()) if hasattr(model, "make_cache") else len(model.layers)


def model_geometry(model) -> tuple[int, int, int]:
    """(layers, kv heads, head size) of an mlx-lm model."""
    g = geometry_from_model(model)
    return len(model.layers), g.n_kv_heads, g.head_dim


def model_fingerprint(model) -> dict:
    """What identifies the model a cache was filled by: architecture, layers, kv heads, head
    size, and a SHA-256 of the first and last 4,096 values of its first and last weight
    tensors (two models of one shape still differ there). A dict of str, saved with caches."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten
    layers, kv, d = model_geometry(model)
    args = getattr(model, "args", None)
    arch = str(getattr(args, "model_type", None) or type(model).__module__.rsplit(".", 1)[-1])
    params = sorted(tree_flatten(model.parameters()), key=lambda t: t[0])
    h = hashlib.sha256()
    for name, w in (params[0], params[-1]) if params else ():
        flat = w.reshape(-1)
        for part in (flat[:4096], flat[-4096:]):
            h.update(name.encode() + np.array(part.astype(mx.float32)).tobytes())
    return {"architecture": arch, "layers": str(layers), "kv_heads": str(kv), "head_dim": str(d),
            "weights_sha256": h.hexdigest()[:16]}


def describe_model(fp: dict) -> str:
    """A model fingerprint in words (for error messages)."""
    return (f"{fp.get('architecture')} with {fp.get('layers')} layers, {fp.get('kv_heads')} kv heads of "
            f"{fp.get('head_dim')} (weights {fp.get('weights_sha256')})")


def check_layers(cache: list, model) -> None:
    """Raise unless ``cache`` has one entry per cache ``model`` takes (mlx-lm zips layers and
    caches, so a shorter list silently runs the model without its last layers)."""
    n = cache_count(model)
    if len(cache) != n:
        raise ValueError(f"the prompt cache has {len(cache)} layers, the model has {n}")
