"""Calibration statistics and per-layer coders (Chapter 10): ``capture_statistics`` runs the
model on calibration windows; ``fit_layers`` fits one ``TransformCoder`` per layer for keys
and one for values; ``Choice`` is a calibrated configuration (its bits are the fitted
coders' own, ``TransformCoder.bits_for``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..progress import progress as progress_bar

__all__ = ["Choice", "capture_statistics", "fit_layers", "output_metric", "positions_seen", "signature", "WINDOW"]

WINDOW = 512


@dataclass(frozen=True)
class Choice:
    """A calibrated configuration: transform-coder bits per coordinate for keys and values
    (side information included: there is none per vector), exact outliers per vector
    (24 bits each, inside those bits) and exact leading tokens; ``pre_rope``: the key coders
    fitted and run on the keys with RoPE undone (``fit_layers(…, pre_rope=True)``, the caches
    wrapped in ``prerope.PreRopeCache``)."""

    key_bits: float
    value_bits: float
    outliers: int = 1
    sink_tokens: int = 1
    pre_rope: bool = False

    def fields(self) -> dict:
        """The fields a profile records: ``pre_rope`` only when set, so that a configuration
        after RoPE reads (and keys its fitted coders) as it did before the field existed."""
        from dataclasses import asdict
        d = asdict(self)
        if not self.pre_rope:
            del d["pre_rope"]
        return d

    def __str__(self) -> str:
        return (f"K{self.key_bits:g}/V{self.value_bits:g}, {self.outliers} outlier(s), {self.sink_tokens} sink(s)"
                + (", keys before RoPE" if self.pre_rope else ""))

    def bits(self, dim: int) -> float:
        """Average over K and V of the fitted coders' ``bits_per_coordinate``
        (``TransformCoder.bits_for``: ⌊bits·D⌋ bits per vector)."""
        from ..codecs.transform import TransformCoder
        return (TransformCoder.bits_for(self.key_bits, dim, self.outliers)
                + TransformCoder.bits_for(self.value_bits, dim, self.outliers)) / 2


def signature(model) -> dict:
    """What identifies a model for a profile: type, layers, kv heads, head size, vocabulary."""
    from ..memory import geometry_from_model
    g = geometry_from_model(model)
    args = getattr(model, "args", None)
    return {"model_type": getattr(args, "model_type", type(model).__module__.split(".")[-1]),
            "layers": len(model.layers), "kv_heads": g.n_kv_heads, "head_dim": g.head_dim,
            "vocab_size": int(getattr(args, "vocab_size", 0) or 0)}


def output_metric(model, layer: int, n_kv_heads: int, head_dim: int) -> np.ndarray:
    """(H, D, D): the value-side metric of layer ``layer``, the mean over the query heads j
    that read kv head h of W_jᵀ W_j, W_j the columns of the output projection ``o_proj``
    that head j's output passes through. A value error e reaches the layer's output as
    W_j Σ_t p_t e_t, so with errors independent across tokens its expected square is
    Σ_t p_t² eᵀ W_jᵀ W_j e: the output projection decides which value errors matter, as
    the queries do for keys (``metric``). Quantized projections are dequantized first."""
    import mlx.core as mx
    try:
        proj = model.layers[layer].self_attn.o_proj
    except (AttributeError, IndexError):
        raise ValueError(f"layer {layer} of this model has no self_attn.o_proj: no value metric") from None
    w = proj.weight
    if hasattr(proj, "scales"):                      # mlx QuantizedLinear
        w = mx.dequantize(w, proj.scales, getattr(proj, "biases", None), proj.group_size, proj.bits)
    w = np.array(w.astype(mx.float32), dtype=np.float64)             # (hidden, n_heads·D)
    n_heads, rem = divmod(w.shape[1], head_dim)
    if rem or n_heads % n_kv_heads:
        raise ValueError(f"o_proj of layer {layer} has {w.shape[1]} inputs: not a multiple of "
                         f"{n_kv_heads} kv heads × head size {head_dim}")
    g = n_heads // n_kv_heads
    per_head = w.reshape(w.shape[0], n_heads, head_dim).transpose(1, 0, 2)   # (n_heads, hidden, D)
    m = np.einsum("jod,joe->jde", per_head, per_head)
    return m.reshape(n_kv_heads, g, head_dim, head_dim).mean(axis=1)


def positions_seen(positions: Optional[int], window: int = WINDOW, bos: Optional[int] = None) -> int:
    """The positions below which calibration saw keys: ``positions`` when they were spread
    over a context (``phases.spread``), else where the windows put them — ``window``
    positions, one more with a BOS before each window (its last key sits at ``window``)."""
    return int(positions) if positions is not None else int(window) + (bos is not None)


def capture_statistics(model, ids: Sequence[int], bos: Optional[int] = None, window: int = WINDOW,
                       sink: int = 1, positions: Optional[int] = None, seed: int = 0,
                       pre_rope: bool = False, progress: bool = False) -> list[dict]:
    """Per layer {"k", "v": (H, N, D) float64, "metric", "value_metric": (H, D, D),
    "positions": ``positions_seen``} from the
    model run on consecutive windows of ``ids`` (each preceded by ``bos`` if given), the
    first ``sink`` positions of each window (and the BOS) left out. "metric" is E[q qᵀ]
    over the query heads that read each kv head (grouped-query attention);
    "value_metric" is ``output_metric`` (None where the model has no ``o_proj``).
    With ``positions`` (a context length), every captured key and query is moved by the
    layer's RoPE to a position drawn uniformly from [0, positions) (``phases.spread``,
    seeded by ``seed`` and the window): statistics that hold at every position below it,
    not only within the window (Chapter 10, "Past the calibrated positions").

    With ``pre_rope``, every layer also gets "k_pre": the keys with RoPE undone (each moved to
    position 0, where RoPE is the identity: what ``prerope.PreRopeCache`` hands its codec), and
    "metric_pre": E[q qᵀ] of the queries moved to positions drawn uniformly from [0, P) — P
    ``positions``, else the window — so that for a key error e before RoPE, q_s·R_t e =
    (R_{s−t} q)·e is weighted over query–key distances s − t in [0, P). Both are taken before
    any ``positions`` spread."""
    from ..evaluation import capture_qkv
    from .phases import layer_rope, spread, unrope, valid_positions
    ids = [int(i) for i in ids]
    n_win = len(ids) // window
    if n_win < 1:
        raise ValueError(f"calibration needs at least one window of {window} tokens, got {len(ids)}")
    if positions is not None and not valid_positions(positions, window):
        raise ValueError(f"positions must be a context length of at least the window ({window}) and below 2**31, "
                         f"or None (fit where the windows put the keys), got {positions!r}")
    head = [] if bos is None else [int(bos)]
    skip = len(head) + sink
    if not isinstance(pre_rope, bool):
        raise TypeError(f"pre_rope must be True or False, got {pre_rope!r}")
    ropes = None if positions is None and not pre_rope else [layer_rope(model, i) for i in range(len(model.layers))]
    acc = None
    for w in progress_bar(range(n_win), n_win, "capture", progress):
        cap = capture_qkv(model, head + ids[w * window:(w + 1) * window])
        part = [{n: np.array(layer[n][0, :, skip:]).astype(np.float64) for n in "qkv"} for layer in cap]
        if pre_rope:
            unrope(part, ropes, skip, positions or window, np.random.default_rng([seed, w, 1]))
        if positions is not None:
            spread(part, ropes, skip, positions, np.random.default_rng([seed, w]))
        acc = [[p] for p in part] if acc is None else [a + [p] for a, p in zip(acc, part)]
    stats = []
    for parts in acc:
        k = np.concatenate([p["k"] for p in parts], axis=1)
        v = np.concatenate([p["v"] for p in parts], axis=1)
        q = np.concatenate([p["q"] for p in parts], axis=1)
        H = k.shape[0]
        metric = _query_metric(q, H)
        try:
            vm = output_metric(model, len(stats), H, k.shape[-1])
        except ValueError:
            vm = None
        stats.append({"k": k, "v": v, "metric": metric, "value_metric": vm,
                      "positions": positions_seen(positions, window, bos)})
        if pre_rope:
            qp = np.concatenate([p["q_pre"] for p in parts], axis=1)
            stats[-1]["k_pre"] = np.concatenate([p["k_pre"] for p in parts], axis=1)
            stats[-1]["metric_pre"] = _query_metric(qp, H)
    return stats


def _query_metric(q: np.ndarray, H: int) -> np.ndarray:
    """(H, D, D): E[q qᵀ] over the query heads (H_q, N, D) that read each of ``H`` kv heads."""
    g = q.shape[0] // H
    return np.stack([np.einsum("gnd,gne->de", q[h * g:(h + 1) * g], q[h * g:(h + 1) * g]) / (g * q.shape[1])
                     for h in range(H)])


def fit_layers(stats: list[dict], key_bits: float, value_bits: float, outliers: int = 1,
               transform: str = "klt", query_metric: bool = True, uniform: bool = False,
               value_metric: bool = False, allocate: bool = False, pre_rope: bool = False,
               progress: bool = False) -> tuple[list, list]:
    """(key codecs, value codecs), one ``TransformCoder`` per layer of ``stats``. Keys are
    coded under the query metric (``query_metric``), values under the output projection's
    (``value_metric``; ``output_metric``), both only with ``transform="klt"``.
    ``key_bits``/``value_bits`` are one rate for every layer or one per layer; with
    ``allocate``, the rates are spread across layers by each layer's measured
    "sensitivity" (``allocation.layer_sensitivity``, stored in ``stats``) at the same mean
    (``allocation.allocate_layers``). The key coders record the statistics' "positions"
    (``TransformCoder.positions``: caches warn past them). With ``pre_rope`` the key coders
    are fitted on the keys with RoPE undone ("k_pre", under "metric_pre": ``capture_statistics(…,
    pre_rope=True)``), for a ``prerope.PreRopeCache``; such keys have no position, so the
    coders record none."""
    from ..codecs.transform import TransformCoder
    if value_metric and any(s.get("value_metric") is None for s in stats):
        raise ValueError("value_metric=True needs statistics with a value metric (a model with o_proj; "
                         "capture_statistics records it)")
    if pre_rope and any("k_pre" not in s for s in stats):
        raise ValueError("pre_rope=True needs statistics captured with pre_rope=True (keys with RoPE undone)")
    floor = 1.0 + 24 * outliers / stats[0]["k"].shape[-1] if stats else 1.0   # ≥ 1 payload bit per coordinate
    key_bits, value_bits = (_per_layer(b, stats, allocate, floor) for b in (key_bits, value_bits))
    keys, values = [], []
    for s, kb, vb in progress_bar(zip(stats, key_bits, value_bits), len(stats), "fit", progress):
        k, m, at = (s["k_pre"], s["metric_pre"], None) if pre_rope else (s["k"], s["metric"], s.get("positions"))
        metric = m if query_metric and transform == "klt" else None
        vmetric = s["value_metric"] if value_metric and transform == "klt" else None
        keys.append(TransformCoder.calibrate(k, kb, metric=metric, transform=transform,
                                             outliers=outliers, uniform=uniform, positions=at))
        values.append(TransformCoder.calibrate(s["v"], vb, metric=vmetric, transform=transform,
                                               outliers=outliers, uniform=uniform))
    return keys, values


def _per_layer(bits, stats: list[dict], allocate: bool, floor_bits: float) -> list[float]:
    """One rate per layer: ``bits`` repeated, a list checked for length, or (``allocate``)
    spread by the layers' measured sensitivity."""
    if allocate:
        from .allocation import allocate_layers
        if any("sensitivity" not in s for s in stats):
            raise ValueError("allocate=True needs each layer's 'sensitivity' in the statistics "
                             "(calibration.layer_sensitivity)")
        if not isinstance(bits, (int, float)):
            raise TypeError(f"allocate=True takes one mean rate, got {bits!r}")
        return allocate_layers([s["sensitivity"] for s in stats], float(bits), stats[0]["k"].shape[-1],
                               floor_bits=floor_bits)
    if isinstance(bits, (int, float)) and not isinstance(bits, bool):
        return [float(bits)] * len(stats)
    bits = list(bits)
    if len(bits) != len(stats):
        raise ValueError(f"{len(bits)} rates for {len(stats)} layers")
    return [float(b) for b in bits]
