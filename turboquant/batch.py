"""Batched generation on compressed caches (Chapter 7): ``BatchCodesCache``.

mlx-lm batches sequences of different lengths (``mlx_lm.batch_generate``, its
``BatchGenerator`` and the server built on it) by merging each sequence's cache into one
batch cache per layer (``cache.merge([...])``), padding the shorter prompts, and masking the
padding. Its ``BatchKVCache`` stores one (B, H, T, D) array with padding slots inside it.

A cache of codes cannot do the same without changing what it holds: its first tokens are
kept exact (attention sinks), a centered codec learns its mean from the first real tokens
of *its* sequence, a recent window is exact, a sliding window evicts by position. A padding
slot would become a "first token". So ``BatchCodesCache`` keeps one ordinary cache per
sequence (a *row*: a ``TurboQuantKVCache``, ``TurboQuantRotatingKVCache``, ``TurnedMeanCache`` or
``PreRopeCache`` of batch 1)
and gives each row only its real tokens:

* ``merge`` copies the rows' codes (``copy.deepcopy``: arrays copied, codecs rebuilt from
  their configurations — never re-encoded), ``extract(i)`` copies row i back out, so a
  sequence leaves a batch holding exactly the codes it would hold had it run alone;
* ``prepare(lengths=…, right_padding=…)`` / ``prepare(left_padding=…)`` say which columns
  of the next updates are padding; ``update_and_fetch`` strips them before the rows see
  the tokens, and returns the rows' decoded keys and values laid out for the batch's
  attention: row i's history right-aligned against the new columns, zeros elsewhere;
* ``make_mask`` masks everything that is not row i's own history, causally, within the
  sliding window if there is one (window positions are contiguous: the rows hold their
  tokens in temporal order).

Given the same keys and values, a sequence in a batch therefore holds the same codes and
attention sees the same keys and values as alone (tested on any machine). Batched greedy
text equals one-at-a-time text when, in addition, no code flips: the model's batched
forward may round differently from a single one (``batch_drift`` measures by how much),
and a rounding-level change can move a coordinate across a quantization level boundary —
a real change that grows through the layers (Chapter 7; equal in the tests on the CPU
the book was built on).
"""
from __future__ import annotations

import copy
from typing import Optional, Sequence

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from .cache_base import CacheBase, codes_mode
from .codes import CodesView

__all__ = ["BatchCodesCache", "RowsView", "batch_drift"]

# the caches a batch holds, one per sequence (``turboquant.cache``; named, not imported: that
# module imports this one for ``merge``)
_ROW_KINDS = ("TurboQuantKVCache", "TurboQuantRotatingKVCache", "TurnedMeanCache", "PreRopeCache")


def batch_drift(model, prompts: Sequence[Sequence[int]]) -> float:
    """The largest absolute difference of the logits between each prompt (token ids) run
    alone and the prompts right-padded into one batch, without any cache (causal mask: real
    positions never see the padding).

    0.0 where the machine computes a row bit for bit the same in a batch as alone (without
    padding, on the CPU the book was built on; with padding about 5e-5 there). The larger
    it is, the likelier that batched greedy text through a compressed cache differs from
    one-at-a-time text: a rounding-level change of one key can move a coordinate across a
    quantization level boundary, and that flipped code is a real change that grows through
    the layers (Chapter 7)."""
    prompts = [list(p) for p in prompts]
    if not prompts or not all(prompts):
        raise ValueError("batch_drift needs one or more non-empty prompts")
    n = max(len(p) for p in prompts)
    both = model(mx.array([p + [0] * (n - len(p)) for p in prompts]))
    return max(float(mx.abs(both[i, :len(p)] - model(mx.array(p)[None])[0]).max()) for i, p in enumerate(prompts))


def _ints(name: str, xs, n: Optional[int] = None) -> list[int]:
    """``xs`` (a list or an mx.array) as a list of non-negative ints, of length ``n`` if given."""
    vals = xs.tolist() if isinstance(xs, mx.array) else list(xs)
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in vals):
        raise ValueError(f"{name} must be non-negative integers, got {vals!r}")
    if n is not None and len(vals) != n:
        raise ValueError(f"{name} needs one entry per sequence of the batch ({n}), got {len(vals)}")
    return vals


def _dense(x) -> mx.array:
    return x.dequantize() if isinstance(x, CodesView) else x


class BatchCodesCache(CacheBase):
    """One layer's cache for a batch of sequences: ``BatchCodesCache(rows)``.

    ``rows`` are caches of batch 1, all ``TurboQuantKVCache``, all
    ``TurboQuantRotatingKVCache`` (with the same ``max_size`` and ``keep=0``) or all
    ``prerope.TurnedMeanCache`` (each row its own key mean, turned with its own positions) or all
    ``prerope.PreRopeCache`` (each row undoes RoPE at its own positions). The keys and
    values given to ``update_and_fetch`` have shape (B, H_kv, N, D), B = len(rows); what it
    returns has shape (B, H_kv, L, D) with L = N + the longest history any row shows
    attention, and ``make_mask(N)`` the matching (B, 1, N, L) boolean mask.
    """

    def __init__(self, rows: Sequence):
        rows = list(rows)
        kinds = {type(r).__name__ for r in rows}
        if not rows or not kinds <= set(_ROW_KINDS) or len(kinds) > 1:
            raise TypeError(f"a BatchCodesCache holds one or more caches of a single kind, {' or '.join(_ROW_KINDS)}; "
                            f"got {sorted(kinds) or 'none'}")
        self.rotating = kinds == {"TurboQuantRotatingKVCache"}
        if self.rotating:
            sizes = {r.max_size for r in rows}
            if len(sizes) > 1:
                raise ValueError(f"sliding-window caches batch only with the same max_size, got {sorted(sizes)}")
            if any(r.keep for r in rows):
                raise ValueError("sliding-window caches with keep > 0 (max_kv_size's first kept tokens) are not "
                                 "batched: their kept tokens are not contiguous with the window")
            self.max_size = rows[0].max_size
        for r in rows:
            b = r.batch_size
            if b is not None:
                if b != 1:
                    raise ValueError(f"each row of a batch cache holds one sequence; a row holds batch {b}")
        self.rows = rows
        self._skip = [0] * len(rows)          # left padding still to come, per row
        self._left: Optional[list[int]] = None  # real tokens still to come while right-padded, per row

    # ------------------------------------------------------------------ batch protocol
    @classmethod
    def merge(cls, caches: Sequence) -> "BatchCodesCache":
        """A batch of copies of ``caches`` (one per sequence, batch 1 each): codes and exact
        tokens copied bit for bit, nothing re-encoded; the caches given are not changed."""
        return cls([copy.deepcopy(c) for c in caches])

    def extract(self, idx: int):
        """A copy of sequence ``idx``'s cache, as it would be had the sequence run alone."""
        return copy.deepcopy(self.rows[idx])

    def filter(self, batch_indices) -> None:
        """Keep only the sequences at ``batch_indices`` (in that order)."""
        idx = _ints("batch_indices", batch_indices)
        if any(i >= len(self.rows) for i in idx):
            raise ValueError(f"batch_indices {idx} out of range for a batch of {len(self.rows)}")
        self.rows = [self.rows[i] for i in idx]
        self._skip = [self._skip[i] for i in idx]
        if self._left is not None:
            self._left = [self._left[i] for i in idx]

    def extend(self, other: "BatchCodesCache") -> None:
        """Append ``other``'s sequences to this batch (both between forward passes)."""
        if not isinstance(other, BatchCodesCache) or other.rotating != self.rotating or \
                (self.rotating and other.max_size != self.max_size) or \
                type(other.rows[0]) is not type(self.rows[0]):
            theirs = other.rows[0] if isinstance(other, BatchCodesCache) else other
            raise TypeError(f"cannot extend a batch of {type(self.rows[0]).__name__} with {type(theirs).__name__}")
        if (self._left is None) != (other._left is None):
            raise ValueError("cannot extend a batch in the middle of a right-padded prompt")
        self.rows += other.rows
        self._skip += other._skip
        if self._left is not None:
            self._left += other._left

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """Announce padding in the next updates: ``left_padding`` (only on an empty batch)
        leading padding columns per sequence; ``lengths`` with ``right_padding`` the real
        tokens of the coming prompt per sequence (the rest of each row is padding), until
        ``finalize()``."""
        n = len(self.rows)
        if left_padding is not None:
            lp = _ints("left_padding", left_padding, n)
            if any(p and not r.empty() for p, r in zip(lp, self.rows)):
                raise ValueError("left padding can only be added to a sequence whose cache is empty")
            self._skip = [s + p for s, p in zip(self._skip, lp)]
        if right_padding is not None and max(_ints("right_padding", right_padding, n), default=0) > 0:
            if lengths is None:
                raise ValueError("right_padding needs lengths (the real tokens of each sequence)")
            self._left = _ints("lengths", lengths, n)

    def finalize(self) -> None:
        """End of a right-padded prompt: the rows hold only real tokens already, so only
        the bookkeeping is reset."""
        self._left = None

    # ------------------------------------------------------------------ layout
    def _history(self, row) -> int:
        """Tokens of ``row`` the next update's queries may see besides the new ones: all it
        holds, or for a sliding window the ``max_size`` − 1 most recent."""
        if self.rotating:
            return min(row.size(), self.max_size - 1)
        return row.offset

    def _layout(self, N: int):
        """(L, per-row history, per-row leading padding) for N new columns."""
        hist = [self._history(r) for r in self.rows]
        lead = [min(N, s) for s in self._skip]
        return N + max(hist), hist, lead

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        """(B, 1, N, L) boolean mask: query j of sequence i sees its own history and its new
        tokens up to j (and within ``window_size`` of j), never padding or other rows' slots."""
        L, hist, lead = self._layout(N)
        start = mx.array([L - N - h + a for h, a in zip(hist, lead)])
        window = window_size if window_size is not None else (self.max_size if self.rotating else None)
        return create_causal_mask(N, offset=L - N, window_size=window, left_padding=start)

    @property
    def offset(self) -> mx.array:
        """(B,) int32 array, each sequence's position of the next column (what RoPE reads):
        the tokens its row holds, less the leading padding still to come."""
        return mx.array([r.offset - s for r, s in zip(self.rows, self._skip)])

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Give each row its real tokens of ``keys``/``values`` (B, H_kv, N, D) and return
        the batch's keys and values (B, H_kv, L, D) as ``make_mask(N)`` lays them out; under
        ``codes_attention``, a ``RowsView`` (twice) from which attention is computed row by
        row from the codes."""
        B = len(self.rows)
        if not isinstance(keys, mx.array) or keys.ndim != 4 or keys.shape[0] != B:
            raise ValueError(f"keys must be (B={B}, H, N, D), got {getattr(keys, 'shape', type(keys).__name__)}")
        N = keys.shape[2]
        if codes_mode.get() > 0:
            view = self._rows_view(keys, values)
            return view, view
        L, hist, _ = self._layout(N)
        ks, vs = [], []
        for i, row in enumerate(self.rows):
            a, n = self._take(i, N)
            if n > 0:
                k, v = row.update_and_fetch(keys[i:i + 1, :, a:a + n], values[i:i + 1, :, a:a + n])
                if self.rotating:
                    k, v = (c.dequantize() for c in row.codes())
                k, v = _dense(k)[:, :, -(hist[i] + n):], _dense(v)[:, :, -(hist[i] + n):]
            elif hist[i]:
                k, v = (_dense(c)[:, :, -hist[i]:] for c in row.codes())
            else:
                k = v = None
            before = L - N - hist[i] + a
            ks.append(self._place(k, before, L, keys))
            vs.append(self._place(v, before, L, values))
        return mx.concatenate(ks, axis=0), mx.concatenate(vs, axis=0)

    def _take(self, i: int, N: int) -> tuple[int, int]:
        """(a, n) for row i in N new columns: the first a are its leading padding, the next n
        its real tokens (the rest trailing padding); both are consumed from the bookkeeping."""
        a = min(N, self._skip[i])
        n = N - a if self._left is None else min(N - a, self._left[i])
        self._skip[i] -= a
        if self._left is not None:
            self._left[i] -= n
        return a, n

    def _rows_view(self, keys: mx.array, values: mx.array) -> "RowsView":
        """Each row takes its real tokens; what its own cache returns under codes mode (its
        ``CodesView``s) and the mask it would give alone, for ``RowsView.attend_rows``."""
        N, parts = keys.shape[2], []
        for i, row in enumerate(self.rows):
            a, n = self._take(i, N)
            if n > 0:
                mask = row.make_mask(n, window_size=self.max_size) if self.rotating else row.make_mask(n)
                k, v = row.update_and_fetch(keys[i:i + 1, :, a:a + n], values[i:i + 1, :, a:a + n])
                parts.append((k, v, mask, a, n))
            else:
                parts.append(None)
        return RowsView(parts, tuple(keys.shape))

    @staticmethod
    def _place(x: Optional[mx.array], before: int, L: int, like: mx.array) -> mx.array:
        """``x`` (1, H, m, D) placed at columns [before, before + m) of a (1, H, L, D) row of zeros."""
        H, D = like.shape[1], like.shape[3]
        if x is None:
            return mx.zeros((1, H, L, D), like.dtype)
        x = x.astype(like.dtype)
        return mx.pad(x, [(0, 0), (0, 0), (before, L - before - x.shape[2]), (0, 0)])

    # ------------------------------------------------------------------ the rest of the protocol
    def _kind(self) -> str:
        return "sliding-window caches" if self.rotating else "caches"

    def size(self) -> int:
        return max(r.size() for r in self.rows)

    def empty(self) -> bool:
        return all(r.empty() for r in self.rows)

    def is_trimmable(self) -> bool:
        return all(r.is_trimmable() for r in self.rows)

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens of every sequence; returns how many were dropped from
        the longest."""
        return max(r.trim(n) for r in self.rows)

    @property
    def state(self):
        """list, the rows' states (code fields, exact tokens, meta JSON), one per sequence,
        for ``mx.eval``; a batch is saved by extracting its sequences."""
        return [r.state for r in self.rows]

    @property
    def nbytes(self) -> int:
        """int, the bytes the rows hold (their codes and exact tokens; no padding is stored)."""
        return sum(r.nbytes for r in self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        return (f"BatchCodesCache({len(self.rows)} {self._kind()}, offsets "
                f"{[r.offset for r in self.rows]}, {self.nbytes:,} bytes)")


class RowsView:
    """What a ``BatchCodesCache`` returns under ``codes_attention``: per sequence, the
    (keys, values) ``CodesView`` its own cache returned, the mask it would use alone, and
    which columns of the chunk hold its real queries (``None`` for a sequence with none).
    ``attend_rows`` computes the batch's attention output (B, H, N, D) from the codes, one
    sequence at a time (the CPU kernels where they apply); padded query columns get zeros."""

    def __init__(self, parts: list, shape: tuple):
        self.parts, self.shape = parts, shape

    def attend_rows(self, queries: mx.array, scale: float, attend) -> mx.array:
        """``attend`` is ``turboquant.attention.attention_from_codes`` (passed in: that
        module reaches this one through the caches)."""
        B, H, N, D = queries.shape
        outs = []
        for i, part in enumerate(self.parts):
            if part is None:
                outs.append(mx.zeros((1, H, N, D), queries.dtype))
                continue
            k, v, mask, a, n = part
            q = queries[i:i + 1, :, a:a + n]
            if isinstance(k, CodesView):
                o = attend(q, k, v, scale=scale, mask=mask)
            else:                                   # exact tokens (a TurnedMeanCache still learning its mean)
                o = mx.fast.scaled_dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), scale=scale,
                                                         mask=mask)
            outs.append(mx.pad(o, [(0, 0), (0, 0), (a, N - a - n), (0, 0)]))
        return mx.concatenate(outs, axis=0)
