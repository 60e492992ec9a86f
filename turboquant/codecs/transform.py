"""Transform coding fitted on calibration vectors: the data-aware counterpart of TurboQuant.

TurboQuant rotates at random so that *any* input looks the same to its scalar quantizer:
a guarantee that holds without seeing data. Real keys and values are far from worst-case:
a few directions carry most of their energy (Chapter 10 measures it). The classical answer
is transform coding (Huang & Schultheiss 1963; Gersho & Gray, ch. 8): per head h,

    y = T_h (x − μ_h),   ŷ_i = Q_i(y_i) with b_i bits,   x̂ = T_h⁻¹ ŷ + μ_h,

with T_h the Karhunen–Loève basis (eigenvectors of the covariance, largest variance first)
and the bits given out by reverse water-filling: each further bit goes to the coordinate
whose distortion it lowers most, σ_i² (D(b_i) − D(b_i + 1)) with D the Lloyd–Max Gaussian
distortion per bit count. The average need not be an integer: 4.25 bits per coordinate
at D = 64 is 272 bits per vector, given where they buy most. Each Q_i is a Lloyd–Max
quantizer fitted to the calibration values of y_i itself (not a Gaussian law).

A *metric* M_h (D×D, positive semi-definite) changes which error counts: coding
M^{1/2}(x − μ) and inverting makes the squared error in the coded space equal to
(x̂ − x)ᵀ M (x̂ − x). For keys, M = E[q qᵀ] over the queries that read head h makes it the
expected squared score error E[(q·(k̂ − k))²]: the bits go where queries look. Softmax
sees only q·k, so this changes nothing but the error.

Optionally the ``outliers`` coordinates of largest error per vector are stored exactly
(fp16 value + one index byte: 24 bits each), KVQuant's dense-and-sparse idea with a fixed
count per vector.

Per-head parameters (μ, T, T⁻¹, the levels: per layer, not per token) are the codec's
configuration and are reported by ``side_nbytes``; ``bits_per_coordinate`` counts what
each vector stores. A codec with parameters for one head accepts any (…, D) input;
otherwise input is (…, H, T, D) with H its heads. Build one with
``TransformCoder.calibrate(x, bits, …)``.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from ..packing import pack, packed_bytes, unpack
from .base import FP16_MAX, Code, Codec, check_input, check_int, register

__all__ = ["TransformCoder", "OutOfRangeError", "gaussian_distortion", "allocate_bits", "lloyd_1d", "reverse_water_filling"]

TRANSFORMS = ("channels", "klt")
REACH = 16                  # coefficients beyond REACH × a head's largest level are refused


class OutOfRangeError(ValueError):
    """A vector a fitted ``TransformCoder`` cannot represent: more coefficients beyond its
    range (``REACH`` × a head's largest level) than it stores exactly."""
_CHUNK = 1 << 14            # vectors per encode step: bounded memory for long contexts


def gaussian_distortion(bits: int) -> float:
    """Lloyd–Max distortion of N(0, 1) at ``bits`` bits (1 at 0 bits: the mean alone)."""
    from ..lloyd import gaussian_codebook
    return 1.0 if bits == 0 else float(gaussian_codebook(1, bits).mse)


def allocate_bits(variances: Sequence[float], total: int, max_bits: int = 8) -> list[int]:
    """Reverse water-filling on integers: ``total`` bits over coordinates of the given
    variances, each next bit where σ²·(D(b) − D(b + 1)) is largest (Gaussian Lloyd–Max D).
    Greedy is optimal here because each coordinate's gains decrease with b."""
    lam = np.asarray(variances, dtype=np.float64)
    if total < 0 or total > max_bits * len(lam):
        raise ValueError(f"cannot give {total} bits to {len(lam)} coordinates of at most {max_bits} bits")
    gain = np.array([gaussian_distortion(b) - gaussian_distortion(b + 1) for b in range(max_bits)] + [0.0])
    b = np.zeros(len(lam), dtype=int)
    for _ in range(total):
        i = int(np.argmax(np.where(b < max_bits, lam * gain[b], -np.inf)))
        b[i] += 1
    return b.tolist()


def reverse_water_filling(variances: Sequence[float], bits: float) -> tuple[float, float]:
    """Shannon's answer for independent Gaussian coordinates: at ``bits`` per coordinate on
    average, the least total squared error is Σ min(θ, λ_i), with the water level θ set by
    Σ max(0, ½ log2(λ_i/θ)) = bits·n. Returns (θ, the total distortion). With equal
    variances this is n·λ·2^(−2·bits): what a random rotation leaves a scalar quantizer."""
    lam = np.asarray(variances, dtype=np.float64)
    if lam.ndim != 1 or lam.size == 0 or np.any(lam < 0) or not np.all(np.isfinite(lam)):
        raise ValueError("variances must be a non-empty 1-D array of finite values ≥ 0")
    if bits < 0:
        raise ValueError(f"bits must be ≥ 0, got {bits}")
    target = bits * lam.size
    pos = lam[lam > 0]
    if pos.size == 0:
        return 0.0, 0.0

    def rate(theta):
        return float(np.sum(np.maximum(0.0, 0.5 * np.log2(pos / theta))))
    lo, hi = pos.min() * 2.0 ** (-2 * target / pos.size), pos.max()   # rate(lo) ≥ target ≥ rate(hi)
    for _ in range(200):                         # bisection on log θ
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if rate(mid) > target else (lo, mid)
    theta = math.sqrt(lo * hi)
    return theta, float(np.sum(np.minimum(theta, lam)))


def lloyd_1d(samples: np.ndarray, n_levels: int, iters: int = 50) -> np.ndarray:
    """Lloyd's algorithm on 1-D samples: ``n_levels`` sorted levels minimising the squared
    error, from quantile initialisation (exact segment means by prefix sums)."""
    x = np.sort(np.asarray(samples, dtype=np.float64))
    if n_levels == 1:
        return np.array([x.mean()])
    c = np.quantile(x, (np.arange(n_levels) + 0.5) / n_levels)
    cs = np.concatenate([[0.0], np.cumsum(x)])
    for _ in range(iters):
        pos = np.searchsorted(x, (c[1:] + c[:-1]) / 2)
        st, en = np.concatenate([[0], pos]), np.concatenate([pos, [len(x)]])
        n = en - st
        new = np.where(n > 0, (cs[en] - cs[st]) / np.maximum(n, 1), c)
        new = np.maximum.accumulate(new)                    # keep sorted (empty cells)
        if np.allclose(new, c, rtol=0, atol=1e-12 * (abs(x[-1]) + abs(x[0]) + 1e-30)):
            c = new
            break
        c = new
    return c


def _psd_root(m: np.ndarray, floor: float) -> tuple[np.ndarray, np.ndarray]:
    """(M^{1/2}, M^{−1/2}) of a symmetric PSD matrix, eigenvalues floored at floor·mean."""
    w, u = np.linalg.eigh((m + m.T) / 2)
    w = np.maximum(w, floor * max(w.mean(), 1e-30))
    return (u * np.sqrt(w)) @ u.T, (u / np.sqrt(w)) @ u.T


@register
class TransformCoder(Codec):
    """``TransformCoder(dim, alloc, mean, transform, inverse, levels, *, outliers=0, kind="klt")``.

    ``alloc``: bits per transformed coordinate (D ints, non-increasing); ``mean`` (H, D);
    ``transform``/``inverse`` (H, D, D); ``levels``: per distinct bit count b > 0 in
    ``alloc`` (in order of appearance), nested lists (H, n_b, 2^b) of sorted levels; the
    coordinates given 0 bits take ``levels0`` (H, n_0) (their calibration mean).
    ``kind`` records how the transform was made (for reports only). ``positions``: the
    calibration vectors were keys at positions below it (RoPE turns keys with their position,
    so a key coder holds only where it was fitted: ``calibration.phases``); a cache storing
    keys at or past it warns (``FittedPositionsWarning``). None: not position-bound (values,
    or not recorded).

    Code fields: ``c`` (…, ⌈Σ b_i / 8⌉) uint8, every index's bits in one stream (no byte
    padding per bit count); with outliers ``oi`` uint8 and ``ov`` float16 (…, outliers).
    """

    name = "transform"

    def __init__(self, dim: int, alloc, mean, transform, inverse, levels, levels0=None, *,
                 outliers: int = 0, kind: str = "klt", positions: Optional[int] = None):
        self.dim = check_int("dim", dim, 2, 256)
        self.positions = None if positions is None else check_int("positions", positions, 1)
        alloc = [check_int("alloc entry", b, 0, 8) for b in alloc]
        if len(alloc) != self.dim or any(a < b for a, b in zip(alloc, alloc[1:])):
            raise ValueError(f"alloc must be {self.dim} non-increasing ints in 0..8, got {alloc!r}")
        kinds = TRANSFORMS + tuple(f"{t}+metric" for t in TRANSFORMS)
        if kind not in kinds:
            raise ValueError(f"kind must be one of {kinds}, got {kind!r}")
        self.alloc, self.kind = alloc, kind
        self.outliers = check_int("outliers", outliers, 0, self.dim)
        self.mean = self._array("mean", mean, 2)
        self.heads = self.mean.shape[0]
        self.transform = self._array("transform", transform, 3)
        self.inverse = self._array("inverse", inverse, 3)
        self.groups = []                              # (bits, start, stop)
        for b in sorted(set(alloc), reverse=True):
            idx = [i for i, a in enumerate(alloc) if a == b]
            self.groups.append((b, idx[0], idx[-1] + 1))
        nz = [g for g in self.groups if g[0] > 0]
        if not isinstance(levels, (list, tuple)) or len(levels) != len(nz):
            raise ValueError(f"levels must hold one (H, n, 2^b) table per bit count in {[g[0] for g in nz]}")
        self.levels = []
        for (b, lo, hi), table in zip(nz, levels):
            t = self._array(f"levels for {b} bits", table, 3, (self.heads, hi - lo, 1 << b))
            if not mx.all(t[..., 1:] >= t[..., :-1]).item():
                raise ValueError(f"levels for {b} bits must be sorted")
            self.levels.append(t)
        n0 = sum(1 for a in alloc if a == 0)
        self.levels0 = self._array("levels0", levels0 if levels0 is not None else [[0.0] * n0] * self.heads,
                                   2, (self.heads, n0))
        self._thresholds = [(t[..., 1:] + t[..., :-1]) / 2 for t in self.levels]
        # per head, the largest |level|: how far the fitted quantizers reach (the range rule)
        tables = [mx.abs(t).reshape(self.heads, -1) for t in self.levels] + [mx.abs(self.levels0)]
        self._reach = mx.maximum(mx.max(mx.concatenate(tables, axis=-1), axis=-1), 1e-30)     # (H,)
        self._config = None

    def _array(self, name, value, ndim, shape=None):
        a = mx.array(np.asarray(value, dtype=np.float32))
        want = shape or ((a.shape[0],) + (self.dim,) * (ndim - 1) if a.ndim == ndim else None)
        if a.ndim != ndim or (want is not None and tuple(a.shape) != tuple(want)):
            raise ValueError(f"{name} must have shape {want or ('H',) + (self.dim,) * (ndim - 1)}, "
                             f"got {tuple(a.shape)}")
        if name != "mean" and hasattr(self, "heads") and a.shape[0] != self.heads:
            raise ValueError(f"{name} has {a.shape[0]} heads, mean has {self.heads}")
        if not mx.all(mx.isfinite(a)).item():
            raise ValueError(f"{name} contains NaN or Inf")
        return a

    # ------------------------------------------------------------------ calibration
    @classmethod
    def calibrate(cls, x, bits: float, *, metric=None, transform: str = "klt", outliers: int = 0,
                  uniform: bool = False, max_bits: int = 8, floor: float = 1e-3,
                  positions: Optional[int] = None) -> "TransformCoder":
        """Fit on calibration vectors ``x`` (H, N, D) (numpy or mx).

        ``bits``: average bits per coordinate including outliers (⌊bits·D⌋ bits per vector;
        24 per outlier); with ``uniform``, the integer bits of every coordinate,
        outliers coming on top. ``metric`` (H, D, D) PSD or None (identity): the
        error measure (e.g. the queries' second moment for keys). ``transform``: "klt"
        (eigenvectors of the metric-weighted covariance) or "channels" (the channels
        themselves, ordered by variance: per-channel quantization as in KVQuant).
        ``uniform``: every coordinate gets the same bits (``bits`` must then be an
        integer); otherwise reverse water-filling. ``floor``: metric eigenvalues are
        floored at floor × their mean (a query direction never seen is not free).
        ``positions``: recorded (the positions of the keys ``x`` holds, see the class)."""
        if transform not in TRANSFORMS:
            raise ValueError(f"transform must be one of {TRANSFORMS}, got {transform!r}")
        x = np.asarray(x.astype(mx.float32) if isinstance(x, mx.array) else x, dtype=np.float64)
        if x.ndim != 3 or x.shape[1] < 2:
            raise ValueError(f"calibration vectors must be (H, N ≥ 2, D), got shape {x.shape}")
        if not np.all(np.isfinite(x)):
            raise ValueError("calibration vectors contain NaN or Inf")
        H, N, D = x.shape
        total = cls.vector_bits(bits, D, outliers, uniform) - 24 * outliers      # the payload: never above bits
        if total < 0 or total > max_bits * D:
            raise ValueError(f"bits={bits} leaves {total} bits per vector for D={D} with {outliers} outliers")
        if uniform and total % D:
            raise ValueError(f"uniform allocation needs an integer number of bits, got {bits!r}")
        if metric is not None:
            metric = np.asarray(metric.astype(mx.float32) if isinstance(metric, mx.array) else metric, np.float64)
            if metric.shape != (H, D, D):
                raise ValueError(f"metric must be (H, D, D) = {(H, D, D)}, got {metric.shape}")
        means, ts, invs, lams = [], [], [], []
        for h in range(H):
            mu = x[h].mean(0)
            xc = x[h] - mu
            root, iroot = (np.eye(D), np.eye(D)) if metric is None else _psd_root(metric[h], floor)
            if transform == "klt":
                cov = root @ (xc.T @ xc / N) @ root
                lam, u = np.linalg.eigh((cov + cov.T) / 2)
                order = np.argsort(-lam, kind="stable")
                lam, u = lam[order], u[:, order]
                for j in range(D):                      # a deterministic sign per vector
                    if u[np.argmax(np.abs(u[:, j])), j] < 0:
                        u[:, j] = -u[:, j]
                t, ti = u.T @ root, iroot @ u
            else:
                if metric is not None:
                    raise ValueError("transform='channels' takes no metric")
                var = (xc ** 2).mean(0)
                order = np.argsort(-var, kind="stable")
                t = np.eye(D)[order]
                ti, lam = t.T, var[order]
            means.append(mu), ts.append(t), invs.append(ti), lams.append(np.maximum(lam, 0))
        alloc = [total // D] * D if uniform else allocate_bits(np.mean(lams, axis=0), total, max_bits)
        y = np.stack([(x[h] - means[h]) @ ts[h].T for h in range(H)])      # (H, N, D)
        levels, levels0 = [], []
        for b in sorted(set(alloc), reverse=True):
            cols = [i for i, a in enumerate(alloc) if a == b]
            if b == 0:
                levels0 = [[float(y[h, :, i].mean()) for i in cols] for h in range(H)]
            else:
                levels.append([[lloyd_1d(y[h, :, i], 1 << b).tolist() for i in cols] for h in range(H)])
        return cls(D, alloc, np.stack(means), np.stack(ts), np.stack(invs), levels, levels0 or None,
                   outliers=outliers, kind=transform if metric is None else f"{transform}+metric",
                   positions=positions)

    @staticmethod
    def vector_bits(bits: float, dim: int, outliers: int = 0, uniform: bool = False) -> int:
        """Bits each vector stores when ``calibrate`` is asked for ``bits`` per coordinate:
        ⌊bits·D⌋, exact outliers (24 bits each) inside; with ``uniform``, bits·D plus the
        outliers on top. The one home of this rule: ``bits_for`` and profiles' budgets use it."""
        per = int(math.floor(float(bits) * dim + 1e-9))
        return per + 24 * outliers if uniform else per

    @classmethod
    def bits_for(cls, bits: float, dim: int, outliers: int = 0, uniform: bool = False) -> float:
        """``bits_per_coordinate`` of the coder ``calibrate(…, bits, outliers=, uniform=)``
        fits at head size ``dim`` (known before fitting: ``vector_bits / dim``)."""
        return cls.vector_bits(bits, dim, outliers, uniform) / dim

    @classmethod
    def example(cls, dim):
        """For the codec contract: one head, fitted on correlated Gaussian vectors, 4 bits."""
        rng = np.random.default_rng(0)
        a = rng.standard_normal((dim, dim)) / math.sqrt(dim)
        x = rng.standard_normal((1, 4096, dim)) @ (np.eye(dim) + a)
        return cls.calibrate(x, 4, outliers=1)

    # ------------------------------------------------------------------ accounting
    @property
    def payload_bits(self) -> float:
        return sum(self.alloc) / self.dim

    @property
    def bits_per_coordinate(self) -> float:
        """float: Σ b_i / D plus 24 bits per exact outlier (no per-vector norm or scale)."""
        return (sum(self.alloc) + 24 * self.outliers) / self.dim

    @property
    def nbytes_per_vector(self) -> int:
        return packed_bytes(max(1, sum(self.alloc)), 1) + 3 * self.outliers

    @property
    def side_nbytes(self) -> int:
        """int: bytes of the per-layer constants (float32), μ, T, T⁻¹ and the levels."""
        return 4 * (self.mean.size + self.transform.size + self.inverse.size + self.levels0.size
                    + sum(t.size for t in self.levels))

    @property
    def rotation(self):
        return None

    def config(self) -> dict:
        if self._config is None:            # tolist() is a host sync: once per codec
            self._config = {"codec": self.name, "dim": self.dim, "alloc": list(self.alloc),
                            "mean": self.mean.tolist(), "transform": self.transform.tolist(),
                            "inverse": self.inverse.tolist(), "levels": [t.tolist() for t in self.levels],
                            "levels0": self.levels0.tolist(), "outliers": self.outliers, "kind": self.kind}
            if self.positions is not None:      # configs written before it existed load as None
                self._config["positions"] = self.positions
        return dict(self._config)

    def __eq__(self, other):                  # config() holds every parameter; compare arrays directly
        return isinstance(other, TransformCoder) and self.alloc == other.alloc and \
            self.outliers == other.outliers and self.kind == other.kind and \
            self.positions == other.positions and all(
                mx.array_equal(a, b).item() for a, b in zip(self._params(), other._params())) and \
            len(self.levels) == len(other.levels)

    def __repr__(self):                       # the configuration holds H·D² numbers: summarise
        return (f"TransformCoder(dim={self.dim}, heads={self.heads}, bits={self.bits_per_coordinate:g}, "
                f"alloc={self.alloc[0]}…{self.alloc[-1]}, outliers={self.outliers}, kind={self.kind!r}"
                + ("" if self.positions is None else f", positions={self.positions}") + ")")

    def __hash__(self):
        return hash((self.name, self.dim, tuple(self.alloc), self.outliers, self.heads))

    def _params(self):
        return [self.mean, self.transform, self.inverse, self.levels0, *self.levels]

    # ------------------------------------------------------------------ encode / decode
    def _heads(self, x: mx.array):
        """x (…, D) → (H, N, D) and a function mapping (H, N, w) back to (…, w)."""
        D, H = self.dim, self.heads
        lead = tuple(x.shape[:-1])
        if H == 1:
            return x.reshape(1, -1, D), lambda a: a.reshape(*lead, a.shape[-1])
        if x.ndim < 3 or x.shape[-3] != H:
            raise ValueError(f"this TransformCoder was fitted on {H} heads: input must be (…, {H}, T, {D}), "
                             f"got shape {tuple(x.shape)}")
        xm = mx.moveaxis(x, -3, 0)
        inner = tuple(xm.shape[1:-1])
        return xm.reshape(H, -1, D), lambda a: mx.moveaxis(a.reshape(H, *inner, a.shape[-1]), 0, -3)

    def _encode(self, x: mx.array) -> Code:
        dtype = x.dtype if isinstance(x, mx.array) else None
        x = check_input(x, self.dim)
        xh, back = self._heads(x)
        parts = [self._encode_rows(xh[:, i:i + _CHUNK]) for i in range(0, xh.shape[1], _CHUNK)]
        fields = {n: back(mx.concatenate([p[n] for p in parts], axis=1)) for n in parts[0]}
        return Code(fields, tuple(x.shape[:-1]), dtype, self.config())

    def _encode_rows(self, xh: mx.array) -> dict:
        y = mx.matmul(xh - self.mean[:, None, :], mx.swapaxes(self.transform, -1, -2))   # (H, N, D)
        fields, dec, bits = {}, [], []
        nz = [g for g in self.groups if g[0]]
        for (b, lo, hi), thr, lev in zip(nz, self._thresholds, self.levels):
            idx = mx.sum(y[..., lo:hi, None] > thr[:, None], axis=-1).astype(mx.uint32)      # (H, N, n)
            bits.append(((idx[..., None] >> mx.arange(b, dtype=mx.uint32)) & 1).reshape(*idx.shape[:2], -1))
            if self.outliers:
                dec.append(self._gather(lev, idx))
        stream = mx.concatenate(bits, axis=-1) if bits else mx.zeros((*y.shape[:2], 1), mx.uint32)
        fields["c"] = pack(stream, 1)
        if self.outliers:
            if self.levels0.shape[1]:
                dec.append(mx.broadcast_to(self.levels0[:, None], (*y.shape[:2], self.levels0.shape[1])))
            err = mx.abs(y - mx.concatenate(dec, axis=-1))
            oi = mx.argpartition(-err, self.outliers - 1, axis=-1)[..., :self.outliers]
            fields["oi"] = oi.astype(mx.uint8)
            ov = mx.take_along_axis(y, oi, axis=-1)
            worst, largest = mx.stack([self._far(y), mx.max(mx.abs(ov))]).tolist()   # one sync for both rules
            self._check_reach(worst)
            if largest > FP16_MAX:
                raise ValueError(f"an outlier of {largest:.4g} exceeds fp16's range "
                                 f"({FP16_MAX}); outliers are stored in fp16: scale the input down")
            fields["ov"] = ov.astype(mx.float16)
        else:
            self._check_reach(self._far(y).item())
        return fields

    def _far(self, y: mx.array) -> mx.array:
        """The largest number of coefficients of one vector beyond ``REACH`` × its head's
        largest level (a float32 scalar; 0 for no vectors)."""
        far = mx.sum(mx.abs(y) > REACH * self._reach[:, None, None], axis=-1)            # (H, N)
        return (mx.max(far) if far.size else mx.array(0)).astype(mx.float32)

    def _check_reach(self, worst: float) -> None:
        """The range rule of a fitted coder: a coefficient beyond ``REACH`` times the largest
        level of its head would come back as that level (a relative error near 1), so a
        vector with more of them than it stores exactly (``outliers``) is refused."""
        worst = int(worst)
        if worst > self.outliers:
            raise OutOfRangeError(f"a vector has {worst} coefficient(s) beyond {REACH}x the range this TransformCoder "
                             f"was fitted on (its largest level, {self._reach.max().item():.4g}); it cannot "
                             f"represent them ({self.outliers} stored exactly). Refit it on data like this "
                             "input (turboquant calibrate), or use a TurboQuant codec, which needs no fitting")

    @staticmethod
    def _gather(levels: mx.array, idx: mx.array) -> mx.array:
        """levels (H, n, L), idx (H, N, n) → the levels picked, (H, N, n)."""
        H, n, L = levels.shape
        flat = idx.astype(mx.int32) + (mx.arange(H)[:, None, None] * n + mx.arange(n)[None, None]) * L
        return mx.take(levels.reshape(-1), flat)

    def _decode(self, code: Code) -> mx.array:
        arrays = {n: a.reshape(-1, a.shape[-1])[None] if self.heads == 1 else a for n, a in code.arrays.items()}
        if self.heads > 1:
            arrays = {n: mx.moveaxis(a, -3, 0) for n, a in arrays.items()}
            inner = tuple(next(iter(arrays.values())).shape[1:-1])
            arrays = {n: a.reshape(self.heads, -1, a.shape[-1]) for n, a in arrays.items()}
        parts, at = [], 0
        stream = unpack(arrays["c"], 1, max(1, sum(self.alloc)))
        nz = [g for g in self.groups if g[0]]
        for (b, lo, hi), lev in zip(nz, self.levels):
            n = (hi - lo) * b
            chunk = stream[..., at:at + n].reshape(*stream.shape[:2], hi - lo, b)
            at += n
            parts.append(self._gather(lev, mx.sum(chunk << mx.arange(b, dtype=mx.uint32), axis=-1)))
        N = next(iter(arrays.values())).shape[1]
        if self.levels0.shape[1]:
            parts.append(mx.broadcast_to(self.levels0[:, None], (self.heads, N, self.levels0.shape[1])))
        y = mx.concatenate(parts, axis=-1)
        if self.outliers:
            y = mx.put_along_axis(y, arrays["oi"].astype(mx.int32), arrays["ov"].astype(mx.float32), axis=-1)
        x = mx.matmul(y, mx.swapaxes(self.inverse, -1, -2)) + self.mean[:, None, :]       # (H, N, D)
        if self.heads == 1:
            x = x.reshape(*code.shape, self.dim)
        else:
            x = mx.moveaxis(x.reshape(self.heads, *inner, self.dim), 0, -3)
        return x.astype(code.dtype)
