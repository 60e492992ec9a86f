"""Phase-complete calibration (Chapter 10, "Past the calibrated positions"). RoPE turns pair
i of a key at position p by the angle p·θ_i, so keys captured in 512-token windows cover
only an arc of each slow pair's circle, and a transform fitted on them codes later keys
badly. ``spread`` moves each captured key and query from the position it was computed at
to a position drawn uniformly from [0, ``context``) with the layer's own RoPE (a rotation:
norms and every query–key product at a fixed distance are kept), so a fit on the moved
vectors has seen every phase the model can produce within its context."""
from __future__ import annotations

import numpy as np

__all__ = ["context_length", "layer_rope", "move", "spread", "unrope", "valid_positions"]

_CHUNK = 4096                     # vectors moved per call: bounded memory for long captures


def valid_positions(positions, window: int) -> bool:
    """Whether ``positions`` can be a profile's context: an integer from one calibration
    window up to 2³¹ (the shifts ``move`` hands RoPE are int32). The one rule the
    statistics, the profile files and the command line check."""
    return not isinstance(positions, bool) and isinstance(positions, int) and window <= positions < 2 ** 31


def context_length(model) -> int:
    """The positions the model was trained for (``max_position_embeddings``)."""
    args = getattr(model, "args", None)
    n = getattr(args, "max_position_embeddings", None)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"the model's arguments give no context length (max_position_embeddings={n!r}): give "
                         "the positions to calibrate for (calibrate(positions=N), `turboquant calibrate "
                         "--positions N`), or fit within the windows only (positions=None, --positions 0)")
    return n


def layer_rope(model, layer: int):
    """The RoPE module of attention layer ``layer``, checked to be a rotation linear in the
    position (turning by a then b equals turning by a + b; norms kept): the property
    ``move`` relies on. ``ValueError`` otherwise (e.g. a RoPE variant that also scales)."""
    import mlx.core as mx
    try:
        rope = model.layers[layer].self_attn.rope
    except (AttributeError, IndexError):
        raise ValueError(f"layer {layer} of this model has no self_attn.rope: its keys cannot be moved "
                         "to other positions") from None
    dims = int(getattr(rope, "dims", 0) or 0)
    if dims < 2:
        raise ValueError(f"layer {layer}: RoPE {type(rope).__name__} has no rotary size (dims={dims})")
    refuse = (f"layer {layer}: RoPE {type(rope).__name__} is not a rotation linear in the position, applied "
              "per vector; phase-complete calibration does not apply (calibrate with positions=None, "
              "`turboquant calibrate --positions 0`)")
    x = mx.random.normal((3, 1, 1, dims), key=mx.random.key(0))
    a, b = mx.array([5, -300, 2000]), mx.array([-11, 700, 3000])
    try:
        two, one = rope(rope(x, offset=a), offset=b), rope(x, offset=a + b)
        alone = mx.concatenate([rope(x[i:i + 1], offset=int(a[i] + b[i])) for i in range(3)])
    except Exception as e:                       # e.g. a variant that takes only one offset per call
        raise ValueError(f"{refuse} ({type(e).__name__}: {e})") from None
    norm = float(mx.linalg.norm(x, axis=-1).max())
    if (float(mx.abs(two - one).max()) > 1e-2 * norm or float(mx.abs(one - alone).max()) > 1e-4 * norm
            or float(mx.abs(mx.linalg.norm(one, axis=-1) - mx.linalg.norm(x, axis=-1)).max()) > 1e-4 * norm):
        raise ValueError(refuse)
    return rope


def move(x: np.ndarray, shift: np.ndarray, rope) -> np.ndarray:
    """(H, N, D) → (H, N, D): vector n of every head turned by RoPE as if its position grew
    by ``shift[n]`` (any sign), in float32 like the model, returned as ``x``'s dtype."""
    import mlx.core as mx
    x = np.asarray(x)
    shift = np.asarray(shift)
    if x.ndim != 3 or shift.shape != (x.shape[1],):
        raise ValueError(f"move needs x (H, N, D) and one shift per vector, got {x.shape} and {shift.shape}")
    out = np.empty_like(x)
    for s in range(0, x.shape[1], _CHUNK):
        part = mx.array(np.ascontiguousarray(x[:, s:s + _CHUNK].transpose(1, 0, 2))[:, :, None, :]
                        .astype(np.float32))                                       # (n, H, 1, D): batch = vector
        turned = rope(part, offset=mx.array(shift[s:s + _CHUNK].astype(np.int32)))
        out[:, s:s + _CHUNK] = np.array(turned[:, :, 0, :]).transpose(1, 0, 2)
    return out


def spread(parts: list[dict], ropes: list, start: int, context: int, rng: np.random.Generator) -> None:
    """In place: the "q" and "k" (H, N, D) of every layer in ``parts`` (one window's capture,
    token n at position ``start`` + n) moved to positions drawn uniformly from
    [0, ``context``), one draw per token shared by its query and key in every layer (a token
    has one position). Values carry no position and are left alone."""
    n = parts[0]["k"].shape[1]
    shift = rng.integers(0, context, size=n) - (start + np.arange(n))
    for p, rope in zip(parts, ropes):
        p["k"] = move(p["k"], shift, rope)
        p["q"] = move(p["q"], shift, rope)


def unrope(parts: list[dict], ropes: list, start: int, context: int, rng: np.random.Generator) -> None:
    """In place: add "k_pre" and "q_pre" (H, N, D) to every layer in ``parts`` (one window's
    capture, token n at position ``start`` + n): the keys moved to position 0 (RoPE undone:
    what a cache coding keys before RoPE codes), the queries to positions drawn uniformly from
    [0, ``context``), one draw per token shared by every layer — the distance at which a
    query reads a key before RoPE, q_s·R_t e = (R_{s−t} q)·e."""
    n = parts[0]["k"].shape[1]
    at = start + np.arange(n)
    to = rng.integers(0, context, size=n)
    for p, rope in zip(parts, ropes):
        p["k_pre"] = move(p["k"], -at, rope)
        p["q_pre"] = move(p["q"], to - at, rope)
