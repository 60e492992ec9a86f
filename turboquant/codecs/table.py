"""The rotated-table base: codecs that normalise, rotate and look up a table (Chapters 3, 6, 7).

For x of shape (..., D):

    ν = ‖x‖ (fp16),  y = Π (x/ν),  i_b = nearest codeword to block b of y (K coordinates)
    x̂ = ν · Πᵀ c[i]                       c: the table, (N, K) float32, N ≤ 2^IB

TurboQuant_mse is the case K = 1 (a scalar Lloyd–Max table, quantized by its thresholds),
FibQuant K ≥ 2 (a vector codebook). This class owns what they share: the one ``encode``
body, unpacking, decoding in the rotated frame, the description the fused kernels need
(``kernel_spec``) and the public query-table protocol that attention from codes uses
(``score_table(q)`` → ``QueryTable.scores``, and ``value_sum``), in the manner of nanopq's
``dtable(query).adist(codes)``: queries go in and scores and weighted sums come out in the
caller's frame — the rotation and the norm field stay inside the codec.

Fused kernels (``turboquant.kernels``) sit above the codecs: they import this module, never
the other way round. They register themselves here (``set_accelerator``) when imported;
without them every method below runs as mx operations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from ..packing import pack, packed_bytes, unpack
from .base import Code, Codec, check_input, check_norms, split_norm

__all__ = ["RotatedTable", "QueryTable", "KernelSpec", "set_accelerator", "accelerator"]

_CHUNK_ELEMENTS = 1 << 23          # bound on (rows × N) distances held at once


@dataclass(frozen=True)
class KernelSpec:
    """What the fused kernels need to know about a rotated-table codec: dimension D, block
    size K, table size N, index bits IB, packed bytes NB per vector, and the (N·K,) table,
    (N−1,) thresholds (scalar tables; (1,) zeros otherwise), (N,) squared codeword norms
    and the (D, D) rotation Π, as float32 mx arrays."""

    D: int
    K: int
    N: int
    IB: int
    NB: int
    table: mx.array
    bounds: mx.array
    c2: mx.array
    rot: mx.array


_accelerator = [None]


def set_accelerator(acc) -> None:
    """Register the fused-kernel dispatcher (``turboquant.kernels`` does this on import).

    ``acc`` offers ``encode(codec, x)`` → (idx, norm) or None, ``scores(codec, q_rot, idx)``
    and ``values(codec, w, idx)`` → arrays or None (None: use the mx path); it asks the codec
    for its ``kernel_spec`` only when a back-end is active."""
    _accelerator[0] = acc


def accelerator():
    """The registered kernel dispatcher, or None."""
    return _accelerator[0]


class QueryTable:
    """Scores of codes against one batch of queries, in the caller's frame: ⟨q, x̂_t⟩.

    ``QueryTable(codec, q)`` with queries q (B, H_kv, R, Tq, D) (R query heads per kv head)
    as the model gives them; the table rotates them once (``q_rot`` = Πq). ``scores(code)``
    for a code of shape (B, H_kv, T) → (B, H_kv, R, Tq, T) float32: ⟨q, x̂_t⟩ = ν_t ⟨Πq,
    c[i_t]⟩; ``unit_scores(code)`` without the stored norms ν_t. Which path computes them —
    fused kernels, a per-query table looked up per stored byte (scalar tables of 1, 2, 4 or
    8 bits) or per block (vector tables), or gathered codewords — and the codec's frame
    (rotation, norm field) are this object's business, not the caller's."""

    def __init__(self, codec: "RotatedTable", q: mx.array, *, rotated: bool = False):
        if q.ndim != 5 or q.shape[-1] != codec.dim:
            raise ValueError(f"queries must be (B, H_kv, R, Tq, {codec.dim}), got {tuple(q.shape)}")
        q = q.astype(mx.float32)
        self.codec, self.q_rot = codec, q if rotated else codec.rotation.apply(q)

    def scores(self, code: Code) -> mx.array:
        """⟨q, x̂_t⟩ for every query and coded token: (B, H_kv, R, Tq, T) float32."""
        return self.unit_scores(code) * _token_weights(code["norm"])

    def unit_scores(self, code: Code) -> mx.array:
        """⟨Πq, c[i_t]⟩ (the stored norms left out): (B, H_kv, R, Tq, T) float32."""
        c, q = self.codec, self.q_rot
        B, H, R, Tq, D = q.shape
        idx = code["idx"]                                              # (B, H, T, NB) uint8
        T = idx.shape[2]
        acc = accelerator()
        fused = None if acc is None else acc.scores(c, q, idx)
        if fused is not None:
            return fused
        if c.k == 1 and c.index_bits in (1, 2, 4, 8) and (D * c.index_bits) % 8 == 0 \
                and c.n_codewords == 1 << c.index_bits:
            table, P = c._byte_table(q)                                # (B, H, R·Tq, P, 256)
            pos = (idx.astype(mx.int32) + mx.arange(P, dtype=mx.int32) * 256).reshape(B, H, 1, T * P)
            looked = mx.take_along_axis(table.reshape(B, H, R * Tq, P * 256),
                                        mx.broadcast_to(pos, (B, H, R * Tq, T * P)), axis=-1)
            return looked.reshape(B, H, R, Tq, T, P).sum(axis=-1)
        if c.k > 1:
            nb, n = D // c.k, c.n_codewords
            table = q.reshape(B, H, R, Tq, nb, c.k) @ c.codewords.T   # (B, H, R, Tq, D/K, N)
            ids = c.indices(code)                                      # (B, H, T, D/K)
            pos = (ids + mx.arange(nb, dtype=mx.int32) * n).reshape(B, H, 1, T * nb)
            looked = mx.take_along_axis(table.reshape(B, H, R * Tq, nb * n),
                                        mx.broadcast_to(pos, (B, H, R * Tq, T * nb)), axis=-1)
            return looked.reshape(B, H, R, Tq, T, nb).sum(axis=-1)
        return q @ mx.swapaxes(c.decode_rotated(code), -1, -2)[:, :, None]


class _RotatedQueryTable(QueryTable):
    """The table ``query_table`` gave before #27: rotated queries in, unit scores out."""

    def __init__(self, codec: "RotatedTable", q_rot: mx.array):
        super().__init__(codec, q_rot, rotated=True)

    def scores(self, code: Code) -> mx.array:
        return self.unit_scores(code)


def _token_weights(norm: mx.array) -> mx.array:
    """Stored norms (B, H_kv, T, 1) as per-token weights (B, H_kv, 1, 1, T) float32."""
    return mx.swapaxes(norm.astype(mx.float32)[:, :, None], -1, -2)


class RotatedTable(Codec):
    """Base of the codecs that normalise, rotate and look up a table of codewords.

    A subclass sets ``dim``, ``k`` (block size), ``rotation`` (a ``Rotation``) and calls
    ``_set_table(codewords, index_bits, thresholds=None)``; it may override
    ``quantize_rotated`` (default: the nearest codeword, chunked). Code fields: ``idx``
    (..., ceil(D/K · IB / 8)) uint8 and ``norm`` (..., 1) float16.
    """

    k: int = 1

    def _set_table(self, codewords: mx.array, index_bits: int, thresholds: Optional[mx.array] = None):
        """codewords (N, K) float32; thresholds (N − 1,) for scalar tables (K = 1)."""
        self.codewords = codewords
        self.index_bits = index_bits
        self.thresholds = thresholds
        self._c2 = mx.sum(codewords * codewords, axis=1)                  # (N,)
        self._spec = None

    @property
    def n_codewords(self) -> int:
        return self.codewords.shape[0]

    @property
    def payload_bits(self) -> float:
        """float: stored index bits per coordinate, IB / K (no side information)."""
        return self.index_bits / self.k

    @property
    def bits_per_coordinate(self) -> float:
        """float: payload plus the fp16 norm, IB/K + 16/D."""
        return self.payload_bits + 16 / self.dim

    @property
    def nbytes_per_vector(self) -> int:
        return packed_bytes(self.dim // self.k, self.index_bits) + 2

    # ------------------------------------------------------------------ encode / decode
    def quantize_rotated(self, y: mx.array) -> mx.array:
        """Rotated unit vectors (..., D) → block indices (..., D/K) uint32: the nearest
        codeword of each block, chunked over rows so memory stays bounded."""
        blocks = y.reshape(-1, self.k)                                      # (rows·D/K, K)
        rows = max(1, _CHUNK_ELEMENTS // self.n_codewords)
        out = []
        for s in range(0, blocks.shape[0], rows):
            d = self._c2 - 2 * (blocks[s:s + rows] @ self.codewords.T)      # (rows, N)
            out.append(mx.argmin(d, axis=1).astype(mx.uint32))
            if len(out) > 1:
                mx.eval(out[-1])                                            # bound live memory
        idx = mx.concatenate(out) if out else mx.zeros((0,), mx.uint32)
        return idx.reshape(*y.shape[:-1], self.dim // self.k)

    def _quantize_unit(self, u: mx.array) -> mx.array:
        """Unit vectors (..., D) → block indices (..., D/K) uint32 (subclasses may compile)."""
        return self.quantize_rotated(self.rotation.apply(u))

    def _encode(self, x: mx.array) -> Code:
        dtype = x.dtype if isinstance(x, mx.array) else None
        x = check_input(x, self.dim, finite=False)
        acc = accelerator()
        fused = None if acc is None else acc.encode(self, x)
        if fused is not None:
            idx, norm = fused
            check_norms(norm)
            return Code({"idx": idx, "norm": norm.astype(mx.float16)}, tuple(x.shape[:-1]), dtype, self.config())
        norm, u = split_norm(x)
        # packing runs eagerly, never inside mx.compile (Chapter 3: a compiler pitfall)
        return Code({"idx": pack(self._quantize_unit(u), self.index_bits), "norm": norm.astype(mx.float16)},
                    tuple(x.shape[:-1]), dtype, self.config())

    def indices(self, code: Code) -> mx.array:
        """Block indices of a code: (..., D/K) int32 (unpacked eagerly, never compiled)."""
        return unpack(code["idx"], self.index_bits, self.dim // self.k).astype(mx.int32)

    def decode_rotated(self, code: Code) -> mx.array:
        """Unit vectors in the rotated frame, c[i]: (..., D) float32 (no norm, no Πᵀ)."""
        idx = self.indices(code)
        return mx.take(self.codewords, idx, axis=0).reshape(*idx.shape[:-1], self.dim)

    def validate_code(self, fields: dict) -> None:
        """A codebook whose size is not a power of two leaves index values unused: a code
        naming one would index past the table."""
        if self.n_codewords == 1 << self.index_bits or "idx" not in fields:
            return
        idx = unpack(fields["idx"], self.index_bits, self.dim // self.k)
        top = mx.max(idx).item() if idx.size else 0
        if top >= self.n_codewords:
            raise ValueError(f"idx names codeword {top}, the codebook has {self.n_codewords}")

    def _decode(self, code: Code) -> mx.array:
        x = self.rotation.invert(self.decode_rotated(code)) * code["norm"].astype(mx.float32)
        return x.astype(code.dtype)

    # ------------------------------------------------------------------ attention protocol
    def score_table(self, q: mx.array) -> QueryTable:
        """The per-query table for queries q (B, H_kv, R, Tq, D) in the caller's frame."""
        return QueryTable(self, q)

    def value_sum(self, w: mx.array, code: Code) -> mx.array:
        """Σ_t w_t x̂_t in the caller's frame: w (B, H_kv, R, Tq, T) float32 and a code of
        shape (B, H_kv, T) → (B, H_kv, R, Tq, D) float32 (the norms applied, one inverse
        rotation for all tokens)."""
        return self.rotation.invert(self.rotated_weighted_sum(w * _token_weights(code["norm"]), code))

    def query_table(self, q_rot: mx.array) -> "_RotatedQueryTable":
        """Deprecated (#27): a table of already-rotated queries whose ``scores`` are unit
        scores ⟨q_rot, c[i_t]⟩; now ``score_table(q)`` takes the queries as they are."""
        from ..checks import deprecated
        deprecated("RotatedTable.query_table(q_rot)", "score_table(q) (queries unrotated, norms applied)")
        return _RotatedQueryTable(self, q_rot)

    def weighted_sum(self, w: mx.array, code: Code) -> mx.array:
        """Deprecated (#27): Σ_t w_t c[i_t] in the rotated frame; now ``value_sum`` (the
        caller's frame, norms applied) or ``rotated_weighted_sum`` (this)."""
        from ..checks import deprecated
        deprecated("RotatedTable.weighted_sum(w, code)", "value_sum(w, code) or rotated_weighted_sum(w, code)")
        return self.rotated_weighted_sum(w, code)

    def rotated_weighted_sum(self, w: mx.array, code: Code) -> mx.array:
        """Σ_t w_t c[i_t] in the rotated frame (unit codewords, no norms): w (B, H_kv, R, Tq,
        T) float32 → (B, H_kv, R, Tq, D) float32."""
        acc = accelerator()
        fused = None if acc is None else acc.values(self, w, code["idx"])
        if fused is not None:
            return fused
        return w @ self.decode_rotated(code)[:, :, None]

    def _byte_table(self, q: mx.array):
        """Scalar tables of b ∈ {1, 2, 4, 8} bits: each stored byte holds 8/b indices, so a
        table of 256 entries per byte position per query turns T·D·b/8 lookups of the stored
        bytes into the scores. q (B, H, R, Tq, D) → ((B, H, R·Tq, P, 256), P)."""
        B, H, R, Tq, D = q.shape
        b = self.index_bits
        per, P = 8 // b, D * b // 8
        byte = mx.arange(256, dtype=mx.uint32)
        cents = self.codewords[:, 0]
        parts = [mx.take(cents, ((byte >> (b * s)) & ((1 << b) - 1)).astype(mx.int32)) for s in range(per)]
        qp = q.reshape(B, H, R * Tq, P, per)
        return sum(qp[..., s:s + 1] * parts[s] for s in range(per)), P

    def kernel_spec(self) -> KernelSpec:
        """This codec described for the fused kernels (built once)."""
        if self._spec is None:
            import numpy as np
            rot = mx.array(self.rotation.matrix().astype(np.float32))
            bounds = self.thresholds if self.thresholds is not None else mx.zeros((1,), mx.float32)
            self._spec = KernelSpec(self.dim, self.k, self.n_codewords, self.index_bits,
                                    packed_bytes(self.dim // self.k, self.index_bits),
                                    self.codewords.reshape(-1), bounds, self._c2, rot)
        return self._spec
