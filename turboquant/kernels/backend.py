"""What a kernel back-end is (Performance chapter): the ``Backend`` base class, and the
launch maths of the back-ends that run the three kernel bodies of ``source`` over a grid
of threads — the GPU kernels (``MxKernels``) and their C++ emulation
(``emulate.CppKernels``). The CPU kernels (``cpu.CpuKernels``) are a ``Backend`` too.

A back-end works on a rotated-table codec's ``KernelSpec`` and its code fields:

- ``encode(spec, x)`` → packed indices and norms;
- ``scores(spec, q_rot, idx)`` → unit scores ⟨q_rot, c[i_t]⟩;
- ``values(spec, w, idx)`` → Σ_t w_t c[i_t] in the rotated frame;
- optionally ``attend(...)``: a whole decode step's attention in one call;

and says which launches it takes (``takes_encode``, ``takes``, ``takes_attend``), so the
dispatcher in ``turboquant.kernels`` has no per-back-end branches. ``self_check()``
compares it with the mx path before it is adopted.
"""
from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from ..codecs.base import from_config
from ..codecs.table import KernelSpec, RotatedTable
from . import source

__all__ = ["Backend", "LaunchBackend", "MxKernels", "as_backend", "spec_for", "fits", "encode_fits", "encode",
           "unit_scores", "rotated_values", "encode_groups", "value_splits"]

_INT_MAX = 2 ** 31 - 1


def spec_for(codec) -> KernelSpec | None:
    """The ``KernelSpec`` of a rotated-table codec (``RotatedTable``: TurboQuant_mse,
    FibQuant), None for any other codec."""
    return codec.kernel_spec() if isinstance(codec, RotatedTable) else None


class Backend:
    """A kernel back-end. Subclasses implement ``encode``, ``scores``, ``values`` and
    ``self_check``; ``attend`` is optional (``takes_attend`` says when it applies)."""

    name = "backend"

    def encode(self, spec: KernelSpec, x: mx.array) -> tuple[mx.array, mx.array]:
        """x (..., D) → packed indices (..., NB) uint8 and norms (..., 1) float32."""
        raise NotImplementedError

    def scores(self, spec: KernelSpec, q_rot: mx.array, idx: mx.array) -> mx.array:
        """q_rot (B, H_kv, R, Tq, D), idx (B, H_kv, T, NB) → (B, H_kv, R, Tq, T) float32."""
        raise NotImplementedError

    def values(self, spec: KernelSpec, w: mx.array, idx: mx.array) -> mx.array:
        """w (B, H_kv, R, Tq, T), idx (B, H_kv, T, NB) → (B, H_kv, R, Tq, D) float32."""
        raise NotImplementedError

    def attend(self, kspec, kcode, vspec, vcode, q: mx.array, scale: float) -> mx.array:
        """A decode step's attention from codes in one call (``cpu.CpuKernels``)."""
        raise NotImplementedError(f"the {self.name} back-end has no fused attention")

    def takes_encode(self, spec: KernelSpec, rows: int) -> bool:
        """Whether this back-end encodes ``rows`` vectors (else the mx path does)."""
        return True

    def takes(self, spec: KernelSpec, q_rows: int, kv_rows: int, T: int) -> bool:
        """Whether this back-end computes scores and value sums of this size."""
        return True

    def takes_attend(self, q: mx.array) -> bool:
        """Whether ``attend`` applies to queries ``q`` (B, H_kv, R, Tq, D)."""
        return False

    def self_check(self) -> str | None:
        """None when this back-end reproduces the mx path on small problems, else what differed."""
        raise NotImplementedError


# --------------------------------------------------------------------------- launch maths
def fits(spec: KernelSpec, q_rows: int, kv_rows: int, T: int) -> bool:
    """True when every index the score/value kernels form fits their int32 arithmetic
    (score threads q_rows·T, value threads at most q_rows·D·T/64, code bytes
    kv_rows·T·NB); otherwise use the mx path."""
    return q_rows * max(T, spec.D * max(1, T // 64)) <= _INT_MAX and kv_rows * T * spec.NB <= _INT_MAX


def encode_fits(spec: KernelSpec, rows: int) -> bool:
    """True when the encode kernel's int32 indices hold ``rows`` vectors (rows·max(D, NB))."""
    return rows * max(spec.D, spec.NB) <= _INT_MAX


def encode_groups(spec: KernelSpec) -> tuple[int, int]:
    """(G, NG): blocks per encode thread — the fewest that fill whole bytes (8/gcd(IB, 8)),
    at least 4 — and groups per vector."""
    base = 8 // math.gcd(spec.IB, 8)
    G = base * -(-4 // base)
    return G, -(-(spec.D // spec.K) // G)


def value_splits(threads: int, T: int, target: int = 1 << 16, min_span: int = 64) -> int:
    """Token spans S for the values kernel: enough threads (``target``) for a GPU, while
    each span keeps at least ``min_span`` tokens."""
    return max(1, min(-(-target // max(threads, 1)), T // min_span))


def encode(backend, spec: KernelSpec, x: mx.array) -> tuple[mx.array, mx.array]:
    """Launch the encode body: x (..., D) float32 → packed indices (..., NB) uint8 and norms
    (..., 1) float32."""
    lead = x.shape[:-1]
    rows = int(np.prod(lead)) if lead else 1
    if not encode_fits(spec, rows):
        raise ValueError(f"{rows} vectors are too many for one encode launch (int32 indices); "
                         "encode in chunks")
    G, NG = encode_groups(spec)
    t = {"D": spec.D, "K": spec.K, "N": spec.N, "IB": spec.IB, "NB": spec.NB, "G": G, "NG": NG}
    meta = mx.array([rows * NG], dtype=mx.int32)
    idx, norm = backend.run("encode", [x.reshape(rows, spec.D), spec.rot, spec.bounds, spec.table, spec.c2, meta],
                            t, rows * NG, [(rows, spec.NB), (rows,)], [mx.uint8, mx.float32])
    return idx.reshape(*lead, spec.NB), norm.reshape(*lead, 1)


def unit_scores(backend, spec: KernelSpec, q_rot: mx.array, idx: mx.array) -> mx.array:
    """Launch the scores body: ⟨q_rot, c[i_t]⟩ for every query and coded token: q_rot
    (B, H_kv, R, Tq, D) float32, idx (B, H_kv, T, NB) uint8 → (B, H_kv, R, Tq, T) float32."""
    B, Hk, R, Tq, D = q_rot.shape
    T = idx.shape[2]
    rows = B * Hk * R * Tq
    t = {"D": D, "K": spec.K, "IB": spec.IB, "NB": spec.NB, "RT": R * Tq}
    meta = mx.array([rows * T, T], dtype=mx.int32)
    (s,) = backend.run("scores", [q_rot.astype(mx.float32).reshape(rows, D), idx.reshape(B * Hk * T, spec.NB),
                                  spec.table, meta], t, rows * T, [(rows, T)], [mx.float32])
    return s.reshape(B, Hk, R, Tq, T)


def rotated_values(backend, spec: KernelSpec, w: mx.array, idx: mx.array) -> mx.array:
    """Launch the values body: Σ_t w_t c[i_t] in the rotated frame: w (B, H_kv, R, Tq, T)
    float32, idx (B, H_kv, T, NB) uint8 → (B, H_kv, R, Tq, D) float32."""
    B, Hk, R, Tq, T = w.shape
    rows = B * Hk * R * Tq
    S = value_splits(rows * spec.D, T)
    t = {"D": spec.D, "K": spec.K, "IB": spec.IB, "NB": spec.NB, "RT": R * Tq}
    meta = mx.array([rows * S * spec.D, T, S], dtype=mx.int32)
    (o,) = backend.run("values", [w.astype(mx.float32).reshape(rows, T), idx.reshape(B * Hk * T, spec.NB),
                                  spec.table, meta], t, rows * S * spec.D, [(rows, S, spec.D)], [mx.float32])
    return o.sum(axis=1).reshape(B, Hk, R, Tq, spec.D)


class LaunchBackend(Backend):
    """A back-end that launches the bodies of ``source`` over a grid of threads: subclasses
    give ``run(op, inputs, template, threads, out_shapes, out_dtypes)`` → outputs."""

    def run(self, op, inputs, template, threads, out_shapes, out_dtypes) -> list:
        raise NotImplementedError

    def encode(self, spec, x):
        return encode(self, spec, x)

    def scores(self, spec, q_rot, idx):
        return unit_scores(self, spec, q_rot, idx)

    def values(self, spec, w, idx):
        return rotated_values(self, spec, w, idx)

    def takes_encode(self, spec, rows):
        return encode_fits(spec, rows)

    def takes(self, spec, q_rows, kv_rows, T):
        return fits(spec, q_rows, kv_rows, T)

    def self_check(self) -> str | None:
        """Run the three kernels on small random inputs for a scalar and a vector codec and
        compare with the mx path: None when they agree, else what differed."""
        from .context import use
        cases = ({"codec": "turboquant_mse", "dim": 64, "bits": 3},              # small: quick to build
                 {"codec": "fibquant", "dim": 64, "k": 2, "n_codewords": 8})
        for codec in map(from_config, cases):
            x = mx.random.normal((2, 3, 33, 64), key=mx.random.key(0))
            spec = spec_for(codec)
            # the reference in float32 on the CPU: on CUDA mlx's matmuls default to TF32
            # (select.tf32_note), which flips about 0.15 % of FibQuant's codes by itself
            with use(None), mx.stream(mx.cpu):
                ref = codec.encode(x)
                units = codec.decode_rotated(ref)
                mx.eval(ref, units)
            idx, norm = self.encode(spec, x)
            agree = np.mean(np.array(idx) == np.array(ref["idx"]))
            if agree < 0.999 or not np.array_equal(np.array(norm.astype(mx.float16)), np.array(ref["norm"])):
                return f"{codec!r}: encode agrees on {agree:.4f} of the code bytes"
            q = mx.random.normal((2, 3, 2, 1, 64), key=mx.random.key(1))
            with mx.stream(mx.cpu):
                s_ref = q @ mx.swapaxes(units, -1, -2)[:, :, None]
            err = mx.abs(self.scores(spec, q, ref["idx"]) - s_ref).max().item()
            if not err < 1e-4:
                return f"{codec!r}: scores differ by {err:.3g}"
            with mx.stream(mx.cpu):
                w = mx.softmax(s_ref, axis=-1)
                v_ref = w @ units[:, :, None]
            err = mx.abs(self.values(spec, w, ref["idx"]) - v_ref).max().item()
            if not err < 1e-5:
                return f"{codec!r}: value sums differ by {err:.3g}"
        return None


class _Launcher(LaunchBackend):
    """A ``LaunchBackend`` around an object that has only ``run`` (the contract before #27)."""

    def __init__(self, inner):
        self.inner, self.name = inner, getattr(inner, "name", type(inner).__name__)

    def run(self, op, inputs, template, threads, out_shapes, out_dtypes):
        return self.inner.run(op, inputs, template, threads, out_shapes, out_dtypes)


def as_backend(obj):
    """``obj`` as a ``Backend``: itself, None for None, and an object that has only ``run``
    (a kernel launcher, the contract before ``Backend``) wrapped as a ``LaunchBackend``."""
    if obj is None or isinstance(obj, Backend):
        return obj
    if hasattr(obj, "run"):
        return _Launcher(obj)
    raise TypeError(f"{type(obj).__name__} is not a kernel back-end (no Backend methods, no run)")


class MxKernels(LaunchBackend):
    """The bodies as ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel`` objects (a GPU)."""

    def __init__(self, kind: str):
        self.name = kind
        make = mx.fast.metal_kernel if kind == "metal" else mx.fast.cuda_kernel
        prelude = source.METAL_PRELUDE if kind == "metal" else source.CUDA_PRELUDE
        self._kernels = {op: make(name=f"turboquant_{op}", input_names=source.INPUTS[op],
                                  output_names=source.OUTPUTS[op],
                                  source=source.THREAD_INDEX[kind] + source.BODIES[op], header=prelude)
                         for op in source.BODIES}

    def run(self, op, inputs, template, threads, out_shapes, out_dtypes):
        outs = self._kernels[op](inputs=inputs, template=[(k, int(template[k])) for k in source.TEMPLATES[op]],
                                 grid=(max(threads, 1), 1, 1), threadgroup=(min(256, max(threads, 1)), 1, 1),
                                 output_shapes=out_shapes, output_dtypes=out_dtypes)
        return list(outs)
