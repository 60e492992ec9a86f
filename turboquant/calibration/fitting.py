"""Calibration statistics and per-layer coders (Chapter 10): ``capture_statistics`` runs the
model on calibration windows; ``fit_layers`` fits one ``TransformCoder`` per layer for keys
and one for values; ``Choice`` is a calibrated configuration (its bits are the fitted
coders' own, ``TransformCoder.bits_for``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..progress import progress as progress_bar

__all__ = ["Choice", "capture_statistics", "fit_layers", "signature", "WINDOW"]

WINDOW = 512


@dataclass(frozen=True)
class Choice:
    """A calibrated configuration: transform-coder bits per coordinate for keys and values
    (side information included: there is none per vector), exact outliers per vector
    (24 bits each, inside those bits) and exact leading tokens."""

    key_bits: float
    value_bits: float
    outliers: int = 1
    sink_tokens: int = 1

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


def capture_statistics(model, ids: Sequence[int], bos: Optional[int] = None, window: int = WINDOW,
                       sink: int = 1, progress: bool = False) -> list[dict]:
    """Per layer {"k", "v": (H, N, D) float64, "metric": (H, D, D)} from the model run on
    consecutive windows of ``ids`` (each preceded by ``bos`` if given), the first ``sink``
    positions of each window (and the BOS) left out. "metric" is E[q qᵀ] over the query
    heads that read each kv head (grouped-query attention)."""
    from ..evaluation import capture_qkv
    ids = [int(i) for i in ids]
    n_win = len(ids) // window
    if n_win < 1:
        raise ValueError(f"calibration needs at least one window of {window} tokens, got {len(ids)}")
    head = [] if bos is None else [int(bos)]
    skip = len(head) + sink
    acc = None
    for w in progress_bar(range(n_win), n_win, "capture", progress):
        cap = capture_qkv(model, head + ids[w * window:(w + 1) * window])
        part = [{n: np.array(layer[n][0, :, skip:]).astype(np.float64) for n in "qkv"} for layer in cap]
        acc = [[p] for p in part] if acc is None else [a + [p] for a, p in zip(acc, part)]
    stats = []
    for parts in acc:
        k = np.concatenate([p["k"] for p in parts], axis=1)
        v = np.concatenate([p["v"] for p in parts], axis=1)
        q = np.concatenate([p["q"] for p in parts], axis=1)
        H, g = k.shape[0], q.shape[0] // k.shape[0]
        metric = np.stack([np.einsum("gnd,gne->de", q[h * g:(h + 1) * g], q[h * g:(h + 1) * g])
                           / (g * q.shape[1]) for h in range(H)])
        stats.append({"k": k, "v": v, "metric": metric})
    return stats


def fit_layers(stats: list[dict], key_bits: float, value_bits: float, outliers: int = 1,
               transform: str = "klt", query_metric: bool = True, uniform: bool = False,
               progress: bool = False) -> tuple[list, list]:
    """(key codecs, value codecs), one ``TransformCoder`` per layer of ``stats``."""
    from ..codecs.transform import TransformCoder
    keys, values = [], []
    for s in progress_bar(stats, len(stats), "fit", progress):
        metric = s["metric"] if query_metric and transform == "klt" else None
        keys.append(TransformCoder.calibrate(s["k"], key_bits, metric=metric, transform=transform,
                                             outliers=outliers, uniform=uniform))
        values.append(TransformCoder.calibrate(s["v"], value_bits, transform=transform, outliers=outliers,
                                               uniform=uniform))
    return keys, values
