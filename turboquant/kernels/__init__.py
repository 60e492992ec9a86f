"""Fused kernels for encode and for decode attention from packed codes (Performance chapter).

The mx-operations path in ``turboquant.codecs`` and ``turboquant.attention`` is the
reference. Behind the query-table protocol of the rotated-table codecs (TurboQuant_mse,
FibQuant) one back-end is chosen automatically, on first use:

- mlx with a GPU: the three kernel bodies of ``turboquant.kernels.source`` as
  ``mx.fast.metal_kernel`` (Apple GPUs) or ``mx.fast.cuda_kernel`` (NVIDIA);
- a CPU (the default elsewhere): ``turboquant.kernels.cpu``, a C++ file compiled on first
  use with the system's compiler for this CPU (SIMD table lookups from the packed bytes,
  threads over heads and token blocks) and cached in ``$TURBOQUANT_CACHE/kernels``. With no
  C++ compiler: one warning, then the mx path.

Every back-end is adopted only after it reproduces the mx path on small problems
(``self_check``), once per process. ``TURBOQUANT_KERNELS=0`` turns the automatic choice off
(the mx path); ``TURBOQUANT_KERNELS=cpp`` uses the GPU kernel bodies compiled as C++
(``emulated()``: how the tests check those bodies without a GPU; slower than ``cpu``).
``use(backend)`` forces one in a block (``use(None)``: the mx path). ``turboquant kernels``
says which back-end is active and why.

What was verified where is stated in ``VERIFIED`` and in the Performance chapter.
"""
from __future__ import annotations

import contextvars
import math
import os
import warnings
from contextlib import contextmanager
from functools import lru_cache

import mlx.core as mx
import numpy as np

from ..codecs.base import from_config
from ..codecs.table import KernelSpec, RotatedTable, set_accelerator
from . import source

__all__ = ["KernelSpec", "spec_for", "backend_name", "active", "use", "emulated", "gpu_backend",
           "fits", "encode_fits", "encode", "unit_scores", "rotated_values", "VERIFIED", "adopt", "self_check", "cpu_backend",
           "env_mode", "fast_cpu_backend", "why"]

VERIFIED = {
    "cpu": "turboquant/kernels/cpu.cpp compiled with g++ 12 (-O3 -march=native, OpenMP) on an "
           "AMD EPYC (AVX-512) and compared with the mx path (tests/test_cpu_kernels.py, also "
           "with its AVX2 and portable branches); its self-check runs on every machine first",
    "cpp": "the three kernel bodies compiled with g++ and run on this CPU, compared with the "
           "mx reference (tests/test_kernels.py, Chapter 11)",
    "cuda": "the CUDA translation unit in mlx 0.32's generated layout compiled with nvcc 13 "
            "for sm_90 (tests/test_kernels.py, with a stand-in for mlx's device header; once by "
            "hand with the headers of the mlx-cuda-13 0.32.4 wheel); not run: no NVIDIA GPU "
            "was available to this project",
    "metal": "not compiled and not run: no Apple GPU or Metal compiler was available",
}


def spec_for(codec) -> KernelSpec | None:
    """The ``KernelSpec`` of a rotated-table codec (``RotatedTable``: TurboQuant_mse,
    FibQuant), None for any other codec."""
    return codec.kernel_spec() if isinstance(codec, RotatedTable) else None


# --------------------------------------------------------------------------- back-ends
class _MxKernels:
    """The bodies as ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel`` objects."""

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


@lru_cache(maxsize=1)
def gpu_backend():
    """The GPU back-end mlx has here ("metal" or "cuda" kernels), or None on a CPU-only build.

    On first use the kernels are compiled and run once against the mx path (``self_check``);
    if that fails they are not used, with a RuntimeWarning saying why."""
    if mx.metal.is_available():
        return adopt(lambda: _MxKernels("metal"))
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return adopt(lambda: _MxKernels("cuda"))
    return None


def adopt(make):
    """``make()`` if the back-end it builds passes ``self_check``, else None (and a warning)."""
    try:
        backend = make()
        problem = self_check(backend)
    except Exception as e:                                   # compile or launch failure
        backend, problem = None, f"{type(e).__name__}: {e}"
    if problem is not None:
        warnings.warn(f"turboquant: the fused kernels were not adopted ({problem}); using the mx "
                      "path. Please report this.", RuntimeWarning, stacklevel=2)
        return None
    return backend


def self_check(backend) -> str | None:
    """Run ``backend``'s three kernels on small random inputs for a scalar and a vector codec
    and compare with the mx path: None when they agree, else what differed. The CPU
    back-end has its own check (``turboquant.kernels.cpu.self_check``)."""
    if not hasattr(backend, "run"):
        from .cpu import self_check as cpu_check
        return cpu_check(backend)
    cases = ({"codec": "turboquant_mse", "dim": 64, "bits": 3},              # small: quick to build
             {"codec": "fibquant", "dim": 64, "k": 2, "n_codewords": 8})
    for codec in map(from_config, cases):
        x = mx.random.normal((2, 3, 33, 64), key=mx.random.key(0))
        spec = spec_for(codec)
        with use(None):
            ref = codec.encode(x)
            units = codec.decode_rotated(ref)
        idx, norm = encode(backend, spec, x)
        agree = np.mean(np.array(idx) == np.array(ref["idx"]))
        if agree < 0.999 or not np.array_equal(np.array(norm.astype(mx.float16)), np.array(ref["norm"])):
            return f"{codec!r}: encode agrees on {agree:.4f} of the code bytes"
        q = mx.random.normal((2, 3, 2, 1, 64), key=mx.random.key(1))
        s_ref = q @ mx.swapaxes(units, -1, -2)[:, :, None]
        err = mx.abs(unit_scores(backend, spec, q, ref["idx"]) - s_ref).max().item()
        if not err < 1e-4:
            return f"{codec!r}: scores differ by {err:.3g}"
        w = mx.softmax(s_ref, axis=-1)
        err = mx.abs(rotated_values(backend, spec, w, ref["idx"]) - w @ units[:, :, None]).max().item()
        if not err < 1e-5:
            return f"{codec!r}: value sums differ by {err:.3g}"
    return None


def emulated():
    """The kernel bodies compiled as C++ for this CPU (needs a C++ compiler): for tests."""
    from .emulate import CppKernels
    return CppKernels()


# A back-end forced by ``use()`` in this context (thread or task); _AUTO: choose by the
# environment. A ContextVar, so a ``use`` block in one thread does not switch another's.
_AUTO = object()
_forced: contextvars.ContextVar = contextvars.ContextVar("turboquant_kernels", default=_AUTO)
_MODES = ("auto", "1", "0", "cpp")


@lru_cache(maxsize=1)
def env_mode() -> str:
    """``TURBOQUANT_KERNELS``, read and validated once per process: "auto" (default, also
    "1"), "0" or "cpp". A bad value gives one warning naming the variable, then "auto"."""
    mode = os.environ.get("TURBOQUANT_KERNELS", "auto")
    if mode not in _MODES:
        warnings.warn(f"turboquant: TURBOQUANT_KERNELS must be one of {_MODES}, got {mode!r}; "
                      "using 'auto'", RuntimeWarning, stacklevel=3)
        return "auto"
    return mode


_WHY = {}


@lru_cache(maxsize=1)
def fast_cpu_backend():
    """The CPU back-end (``turboquant.kernels.cpu``), built on first use for the ``-march``
    of ``cpu.env_arch()`` (``TURBOQUANT_CPU_ARCH``, default "native") and adopted after its
    self-check; None (with one warning saying why) without a C++ compiler or when the build
    or the check fails."""
    from .cpu import CpuKernels, env_arch, self_check as cpu_check
    from .emulate import compiler
    arch = env_arch()
    cxx = compiler()
    if cxx is None:
        _WHY["cpu"] = "no C++ compiler (set $CXX or install g++)"
        warnings.warn("turboquant: no C++ compiler found (set $CXX or install g++), so attention "
                      "from codes runs on the slower mx path", RuntimeWarning, stacklevel=3)
        return None
    try:
        backend = CpuKernels(cxx, arch)
        problem = cpu_check(backend)
    except Exception as e:                                   # compile or load failure
        backend, problem = None, f"{type(e).__name__}: {e}"
    if problem is not None:
        _WHY["cpu"] = problem
        warnings.warn(f"turboquant: the CPU kernels were not adopted ({problem}); using the mx "
                      "path. Please report this.", RuntimeWarning, stacklevel=3)
        return None
    target = "this CPU" if arch == "native" else f"-march={arch} (TURBOQUANT_CPU_ARCH)"
    _WHY["cpu"] = f"built for {target} ({backend.isa}) at {backend.path}, self-check passed"
    return backend


def why() -> str:
    """Why the active back-end is the one it is, in one sentence."""
    forced = _forced.get()
    if forced is not _AUTO:
        return "forced by kernels.use()"
    mode = env_mode()
    if mode == "0":
        return "TURBOQUANT_KERNELS=0: the mx path"
    if mode == "cpp":
        return "TURBOQUANT_KERNELS=cpp: the GPU kernel bodies compiled as C++"
    if gpu_backend() is not None:
        return f"mlx has a GPU ({gpu_backend().name}); its kernels passed their self-check"
    backend = fast_cpu_backend()
    return "no GPU; CPU kernels " + _WHY.get("cpu", "") if backend is not None else \
        "no GPU, and the CPU kernels are not in use: " + _WHY.get("cpu", "unknown")


@lru_cache(maxsize=1)
def cpu_backend():
    """The kernel bodies' C++ build as an opt-in CPU back-end (``TURBOQUANT_KERNELS=cpp``),
    adopted after the same self-check as a GPU's; None without a C++ compiler."""
    from .emulate import compiler
    if compiler() is None:
        warnings.warn("turboquant: TURBOQUANT_KERNELS=cpp needs a C++ compiler (set $CXX or "
                      "install g++); using the mx path", RuntimeWarning, stacklevel=3)
        return None
    return adopt(emulated)


def active():
    """The back-end the package uses now: a forced one (``use``), else by
    ``TURBOQUANT_KERNELS`` (``env_mode``): "auto" the GPU's if mlx has one, "0" none,
    "cpp" the C++ build on the CPU. None means the mx-operations path."""
    forced = _forced.get()
    if forced is not _AUTO:
        return forced
    mode = env_mode()
    if mode == "0":
        return None
    if mode == "cpp":
        return cpu_backend()
    gpu = gpu_backend()
    return gpu if gpu is not None else fast_cpu_backend()


def backend_name() -> str:
    """"metal", "cuda", "cpu", "cpp" or "mx" (no kernels)."""
    b = active()
    return "mx" if b is None else b.name


@contextmanager
def use(backend):
    """Force a back-end inside the block (this thread or task only): ``use(None)`` for the
    mx path, ``use(emulated())`` for the C++ build."""
    token = _forced.set(backend)
    try:
        yield backend
    finally:
        _forced.reset(token)


# --------------------------------------------------------------------------- operations
_INT_MAX = 2 ** 31 - 1
_CPU_ENCODE_ROWS = 64              # vectors per call the CPU kernels encode (decode steps)


def fits(spec: KernelSpec, q_rows: int, kv_rows: int, T: int) -> bool:
    """True when every index the score/value kernels form fits their int32 arithmetic
    (score threads q_rows·T, value threads at most q_rows·D·T/64, code bytes
    kv_rows·T·NB); otherwise use the mx path."""
    return q_rows * max(T, spec.D * max(1, T // 64)) <= _INT_MAX and kv_rows * T * spec.NB <= _INT_MAX


def encode_fits(spec: KernelSpec, rows: int) -> bool:
    """True when the encode kernel's int32 indices hold ``rows`` vectors (rows·max(D, NB))."""
    return rows * max(spec.D, spec.NB) <= _INT_MAX


def encode(backend, spec: KernelSpec, x: mx.array) -> tuple[mx.array, mx.array]:
    """x (..., D) float32 → packed indices (..., NB) uint8 and norms (..., 1) float32."""
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
    """⟨q_rot, c[i_t]⟩ for every query and coded token: q_rot (B, H_kv, R, Tq, D) float32,
    idx (B, H_kv, T, NB) uint8 → (B, H_kv, R, Tq, T) float32."""
    B, Hk, R, Tq, D = q_rot.shape
    T = idx.shape[2]
    rows = B * Hk * R * Tq
    t = {"D": D, "K": spec.K, "IB": spec.IB, "NB": spec.NB, "RT": R * Tq}
    meta = mx.array([rows * T, T], dtype=mx.int32)
    (s,) = backend.run("scores", [q_rot.astype(mx.float32).reshape(rows, D), idx.reshape(B * Hk * T, spec.NB),
                                  spec.table, meta], t, rows * T, [(rows, T)], [mx.float32])
    return s.reshape(B, Hk, R, Tq, T)


def rotated_values(backend, spec: KernelSpec, w: mx.array, idx: mx.array) -> mx.array:
    """Σ_t w_t c[i_t] in the rotated frame: w (B, H_kv, R, Tq, T) float32, idx
    (B, H_kv, T, NB) uint8 → (B, H_kv, R, Tq, D) float32."""
    B, Hk, R, Tq, T = w.shape
    rows = B * Hk * R * Tq
    S = value_splits(rows * spec.D, T)
    t = {"D": spec.D, "K": spec.K, "IB": spec.IB, "NB": spec.NB, "RT": R * Tq}
    meta = mx.array([rows * S * spec.D, T, S], dtype=mx.int32)
    (o,) = backend.run("values", [w.astype(mx.float32).reshape(rows, T), idx.reshape(B * Hk * T, spec.NB),
                                  spec.table, meta], t, rows * S * spec.D, [(rows, S, spec.D)], [mx.float32])
    return o.sum(axis=1).reshape(B, Hk, R, Tq, spec.D)


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


class _Dispatch:
    """What the rotated-table codecs call (``codecs.table.set_accelerator``): the active
    back-end's kernels when one is active and the launch fits, else None (the mx path)."""

    def encode(self, codec, x: mx.array):
        backend = active()
        if backend is None or x.size == 0:
            return None
        if not hasattr(backend, "run"):
            # the CPU kernels encode what a decode step adds (a few vectors per layer, where
            # mx's per-operation costs dominate); prefill chunks and bulk encodes keep the mx
            # path, so the codes a prompt gets — and every measurement made by prefilling —
            # are the reference's bit for bit (the two differ in float rounding: the kernel
            # rotates by a matrix product, the mx path by a fast transform; on real keys about
            # one code byte in 10^4 differs, which moved Chapter 9's perplexities by up to 0.5
            # points when it touched the attention sink's key)
            rows = x.size // x.shape[-1]
            return backend.encode(codec.kernel_spec(), x) if rows <= _CPU_ENCODE_ROWS else None
        spec = codec.kernel_spec()
        if not encode_fits(spec, x.size // x.shape[-1]):
            return None
        return encode(backend, spec, x)

    def scores(self, codec, q_rot: mx.array, idx: mx.array):
        B, Hk, R, Tq, _ = q_rot.shape
        backend = active()
        if backend is not None and not hasattr(backend, "run"):               # cpu: 64-bit offsets
            return backend.scores(codec.kernel_spec(), q_rot, idx)
        if backend is None or not fits(spec := codec.kernel_spec(), B * Hk * R * Tq, B * Hk, idx.shape[2]):
            return None
        return unit_scores(backend, spec, q_rot, idx)

    def values(self, codec, w: mx.array, idx: mx.array):
        B, Hk, R, Tq, T = w.shape
        backend = active()
        if backend is not None and not hasattr(backend, "run"):
            return backend.values(codec.kernel_spec(), w, idx)
        if backend is None or not fits(spec := codec.kernel_spec(), B * Hk * R * Tq, B * Hk, T):
            return None
        return rotated_values(backend, spec, w, idx)


    def attend(self, kc, kcode, vc, vcode, q: mx.array, scale: float):
        """Decode attention in one call, q (B, H_kv, R, Tq, D) unrotated and unscaled → the
        output (B, H_kv, R, Tq, D), when the active back-end has it (the CPU's) and both
        codecs are rotated tables; else None."""
        from .cpu import MATMUL_ROWS
        backend = active()
        if backend is None or not hasattr(backend, "attend") or spec_for(kc) is None or spec_for(vc) is None:
            return None
        if q.shape[2] * q.shape[3] >= MATMUL_ROWS:          # many queries per kv head: decode + matmul
            return None
        return backend.attend(kc.kernel_spec(), kcode, vc.kernel_spec(), vcode, q, scale)


set_accelerator(_Dispatch())
