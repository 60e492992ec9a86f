"""The CPU back-end of attention from codes: ``cpu.cpp`` built on first use (Performance chapter).

``cpu.cpp`` reads a rotated-table codec's packed codes in place and turns each token's
bytes into its D rotated coordinates in SIMD registers (the 2^b centroids of a scalar
table held in one register and looked up with a permute), for the two passes of decode
attention: unit scores ⟨Πq, c[i_t]⟩ and value sums Σ_t w_t c[i_t]. Float32 throughout,
exact up to summation order.

On first use the file is compiled with the system's C++ compiler (``$CXX``, else g++ or
c++; ``-O3 -march=native`` and OpenMP when available) into
``$TURBOQUANT_CACHE/kernels/`` under a name that hashes the source, the compiler, its
flags and this CPU's model and features (a cache folder shared between machines never
hands a binary to a CPU it was not built for), loaded with ctypes and self-checked against
the mx path (``self_check``) before it is used. ``turboquant kernels`` says what happened.

The threads are OpenMP's (GNU libgomp with g++), which is not fork-safe: a process that has
used the kernels and then forks (``multiprocessing`` with the "fork" start method) should
use "spawn" children, or set ``TURBOQUANT_KERNELS=0`` in the parent.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..paths import plain_mode
from .backend import Backend

__all__ = ["CpuKernels", "ENCODE_ROWS", "MATMUL_ROWS", "build", "self_check", "machine_signature", "env_arch", "compile_attempts", "SOURCE", "ARCH_ENV"]

SOURCE = Path(__file__).with_name("cpu.cpp")
ARCH_ENV = "TURBOQUANT_CPU_ARCH"
FLAGS = ["-std=c++17", "-O3", "-shared", "-fPIC", "-Wall", "-Wextra"]


def machine_signature() -> str:
    """The CPU this process runs on: architecture, and its model and feature flags (Linux:
    the first processor's block of /proc/cpuinfo; macOS: sysctl's machdep.cpu and hw
    entries; elsewhere the platform's processor name)."""
    sig = [platform.machine(), platform.system(), platform.processor()]
    try:
        block = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
        sig += [line for line in block.splitlines() if not line.startswith(("cpu MHz", "bogomips", "BogoMIPS"))]
    except OSError:
        try:
            sig.append(subprocess.run(["sysctl", "machdep.cpu", "hw.optional"], capture_output=True, text=True,
                                      timeout=10).stdout)
        except (OSError, subprocess.SubprocessError):
            pass
    return "\n".join(sig)


def env_arch() -> str:
    """``TURBOQUANT_CPU_ARCH``: the ``-march`` the CPU kernels are built for, "native" by
    default. "x86-64-v3" forces the AVX2 branch and "x86-64" the portable one, so a machine
    with AVX-512 can reproduce what an AVX2-only machine computes (``make test`` does, for
    the notebooks). A value the compiler refuses builds the portable branch instead
    (``CpuKernels.isa`` says which branch runs)."""
    arch = os.environ.get(ARCH_ENV, "native").strip() or "native"
    if not all(ch.isalnum() or ch in "-_.+" for ch in arch):
        raise ValueError(f"{ARCH_ENV} must be a -march value such as native, x86-64-v3 or x86-64, got {arch!r}")
    return arch


def _cache_dir() -> Path:
    from ..paths import cache_root
    d = cache_root() / "kernels"
    d.mkdir(parents=True, exist_ok=True)
    return d


def compile_attempts(arch: str = "native", system: str | None = None, machine: str | None = None) -> list[list[str]]:
    """The flag sets ``build`` tries in order, until one compiles, for a platform
    (``platform.system()``/``machine()`` by default; the tests pass others). Linux and other
    Unix: ``-march=arch`` with OpenMP, then without OpenMP (one thread), then both again
    without ``-march`` (the portable branch). macOS: Apple clang has no ``-fopenmp`` and no
    ``-march`` for arm64, so ``-mcpu=native`` on arm64 (``-march`` on Intel Macs), then
    nothing; one thread."""
    system = system or platform.system()
    machine = (machine or platform.machine()).lower()
    quiet = "-Wno-unknown-pragmas"                      # the OpenMP pragmas, without OpenMP
    if system == "Darwin":
        target = [f"-mcpu={arch}"] if machine in ("arm64", "aarch64") else [f"-march={arch}"]
        return [FLAGS + target + [quiet], FLAGS + [quiet]]
    return [FLAGS + [f"-march={arch}", "-fopenmp"], FLAGS + [f"-march={arch}", quiet],
            FLAGS + ["-fopenmp"], FLAGS + [quiet]]


def build(cxx: str, arch: str = "native") -> tuple[Path, str]:
    """Compile ``cpu.cpp`` with ``cxx`` once per (source, compiler, CPU, ``arch``): (library
    path, the compiler's messages, empty when it was already built). ``arch`` is the
    ``-march`` value: "native" (this CPU: what the package uses); the tests also build
    "x86-64-v3" (AVX2, no AVX-512) and "x86-64" (the portable branch) to check every branch.
    The flag sets tried are ``compile_attempts(arch)``."""
    text = SOURCE.read_text()
    attempts = compile_attempts(arch)
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    digest = hashlib.sha256("\0".join([text, cxx, version, " ".join(attempts[0]), machine_signature()]).encode())
    so = _cache_dir() / f"cpu-{digest.hexdigest()[:20]}.so"
    if so.exists():
        return so, ""
    fd, tmp = tempfile.mkstemp(suffix=".tmp", prefix=so.stem + "-", dir=so.parent)   # one per build
    os.close(fd)
    tmp = Path(tmp)
    messages = []
    for flags in attempts:
        try:
            proc = subprocess.run([cxx, *flags, str(SOURCE), "-o", str(tmp)], capture_output=True, text=True,
                                  timeout=600)
        except subprocess.TimeoutExpired:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"compiling {SOURCE.name} took more than 10 minutes") from None
        messages.append(f"{' '.join(flags[len(FLAGS):])}: {'ok' if not proc.returncode else 'failed'}")
        if not proc.returncode:
            break
    if proc.returncode:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"compiling {SOURCE.name} failed:\n{proc.stderr[-4000:]}")
    plain_mode(tmp, executable=True)                        # mkstemp's 0600, as the compiler left it
    os.replace(tmp, so)
    return so, "\n".join(messages) + "\n" + proc.stderr


def _host(a: mx.array, dtype) -> np.ndarray:
    """``a`` as a C-contiguous NumPy array of ``dtype``, sharing mlx's memory when it already
    is one (the usual case: no copy), else one copy."""
    if a.dtype != dtype:
        a = a.astype(dtype)
    mx.eval(a)
    return np.ascontiguousarray(np.asarray(memoryview(a)))


def _codes(field: mx.array) -> tuple[np.ndarray, int]:
    """A code field (B, H, T, w) (packed uint8 bytes, or float16 norms with w = 1) → (an
    array whose memory holds it, the stride in elements between the B·H heads). A view
    sliced along T (a cache's buffer) is read in place: tokens w elements apart, heads a
    fixed stride apart; anything else is copied once."""
    mx.eval(field)
    a = np.asarray(memoryview(field))
    B, H, T, w = a.shape
    s = [x // a.itemsize for x in a.strides]
    if (s[3] == 1 or w == 1) and (s[2] == w or T <= 1) and (B == 1 or s[0] == H * s[1]):
        return a, s[1]
    a = np.ascontiguousarray(a)
    return a, T * w


def _check_codes(spec, idx: mx.array, norm: mx.array | None = None) -> None:
    """Refuse code arrays that do not fit ``spec`` before C++ reads them."""
    if idx.dtype != mx.uint8 or idx.ndim != 4 or idx.shape[3] != spec.NB:
        raise ValueError(f"codes must be (B, H, T, {spec.NB}) uint8 for this codec, got {tuple(idx.shape)} {idx.dtype}")
    if norm is not None and tuple(norm.shape) != (*idx.shape[:3], 1):
        raise ValueError(f"norms must be {(*idx.shape[:3], 1)}, got {tuple(norm.shape)}")


def _check_rows(x: mx.array, width: int, what: str) -> None:
    if x.ndim != 5 or x.shape[-1] != width:
        raise ValueError(f"{what} must be (B, H_kv, R, Tq, {width}), got {tuple(x.shape)}")


_F = ctypes.c_void_p
# From this many query rows per kv head on (a prefill block), scores and value sums decode
# the codes once (in C++) and multiply with mlx's matmul, instead of a lookup per row.
MATMUL_ROWS = 16


# The CPU kernels encode what a decode step adds (a few vectors per layer, where mx's
# per-operation costs dominate); prefill chunks and bulk encodes keep the mx path, so the
# codes a prompt gets — and every measurement made by prefilling — are the reference's bit
# for bit (the two differ in float rounding: the kernel rotates by a matrix product, the mx
# path by a fast transform; on real keys about one code byte in 10^4 differs, which moved
# Chapter 9's perplexities by up to 0.5 points when it touched the attention sink's key).
ENCODE_ROWS = 64


class CpuKernels(Backend):
    """Scores and value sums of rotated-table codes on the CPU (``cpu.cpp``)."""

    name = "cpu"

    def takes_encode(self, spec, rows: int) -> bool:
        return rows <= ENCODE_ROWS                  # decode steps only: see ENCODE_ROWS

    def takes_attend(self, q: mx.array) -> bool:
        return q.shape[2] * q.shape[3] < MATMUL_ROWS    # many queries per kv head: decode + matmul

    def self_check(self) -> str | None:
        return self_check(self)

    def __init__(self, cxx: str, arch: str = "native"):
        self.path, self.messages = build(cxx, arch)
        lib = ctypes.CDLL(str(self.path))
        for fn in (lib.tq_scores, lib.tq_values):
            fn.argtypes = [_F, _F, ctypes.c_longlong, _F] + [ctypes.c_int] * 8 + [_F]
            fn.restype = None
        side = [_F, ctypes.c_longlong, _F, ctypes.c_longlong, _F] + [ctypes.c_int] * 4
        lib.tq_attend.argtypes = [_F, ctypes.c_float, _F, _F] + side + side + [ctypes.c_int] * 4 + [_F]
        lib.tq_attend.restype = None
        lib.tq_encode.argtypes = [_F] * 5 + [ctypes.c_int] * 6 + [_F, _F]
        lib.tq_encode.restype = None
        lib.tq_decode.argtypes = [_F, ctypes.c_longlong, _F] + [ctypes.c_int] * 7 + [_F]
        lib.tq_decode.restype = None
        lib.tq_isa.restype = ctypes.c_char_p
        self._lib = lib
        self.isa = lib.tq_isa().decode()

    def _run(self, fn, spec, rows: np.ndarray, idx: mx.array, out_cols: int) -> np.ndarray:
        _check_codes(spec, idx)
        codes, head_stride = _codes(idx)
        B, Hk, T, NB = codes.shape
        table = _host(spec.table, mx.float32)
        HK = B * Hk
        RT = rows.shape[0] // HK if HK else 0
        out = np.empty((HK * RT, out_cols), np.float32)
        if T and RT:
            fn(rows.ctypes.data, codes.ctypes.data, head_stride, table.ctypes.data,
               HK, RT, T, spec.D, spec.K, spec.IB, spec.N, NB, out.ctypes.data)
        return out

    def encode(self, spec, x: mx.array) -> tuple[mx.array, mx.array]:
        """x (..., D) → packed indices (..., NB) uint8 and norms (..., 1) float32."""
        lead = x.shape[:-1]
        xs = _host(x, mx.float32).reshape(-1, spec.D)
        rows = xs.shape[0]
        idx = np.empty((rows, spec.NB), np.uint8)
        norm = np.empty((rows,), np.float32)
        if rows:
            tabs = [_host(a, mx.float32) for a in (spec.rot, spec.bounds, spec.table, spec.c2)]
            self._lib.tq_encode(xs.ctypes.data, *[t.ctypes.data for t in tabs], rows, spec.D, spec.K,
                                spec.IB, spec.N, spec.NB, idx.ctypes.data, norm.ctypes.data)
        return mx.array(idx).reshape(*lead, spec.NB), mx.array(norm).reshape(*lead, 1)

    def decode_rotated(self, spec, idx: mx.array) -> mx.array:
        """idx (B, H_kv, T, NB) → the rotated unit vectors c[i_t], (B, H_kv, T, D) float32."""
        _check_codes(spec, idx)
        codes, head_stride = _codes(idx)
        B, Hk, T, NB = codes.shape
        out = np.empty((B * Hk, T, spec.D), np.float32)
        if T and B * Hk:
            table = _host(spec.table, mx.float32)
            self._lib.tq_decode(codes.ctypes.data, head_stride, table.ctypes.data, B * Hk, T, spec.D, spec.K,
                                spec.IB, spec.N, NB, out.ctypes.data)
        return mx.array(out).reshape(B, Hk, T, spec.D)

    def scores(self, spec, q_rot: mx.array, idx: mx.array) -> mx.array:
        """q_rot (B, H_kv, R, Tq, D), idx (B, H_kv, T, NB) → (B, H_kv, R, Tq, T) float32.
        Many query rows per kv head (a prefill block): decoded once, then one matmul."""
        _check_rows(q_rot, spec.D, "q_rot")
        B, Hk, R, Tq, D = q_rot.shape
        if R * Tq >= MATMUL_ROWS:
            return q_rot.astype(mx.float32) @ mx.swapaxes(self.decode_rotated(spec, idx), -1, -2)[:, :, None]
        q = _host(q_rot, mx.float32).reshape(B * Hk * R * Tq, D)
        out = self._run(self._lib.tq_scores, spec, q, idx, idx.shape[2])
        return mx.array(out).reshape(B, Hk, R, Tq, idx.shape[2])

    def values(self, spec, w: mx.array, idx: mx.array) -> mx.array:
        """w (B, H_kv, R, Tq, T), idx (B, H_kv, T, NB) → (B, H_kv, R, Tq, D) float32."""
        _check_rows(w, idx.shape[2], "w")
        B, Hk, R, Tq, T = w.shape
        if R * Tq >= MATMUL_ROWS:
            return w.astype(mx.float32) @ self.decode_rotated(spec, idx)[:, :, None]
        wf = _host(w, mx.float32).reshape(B * Hk * R * Tq, T)
        out = self._run(self._lib.tq_values, spec, wf, idx, spec.D)
        return mx.array(out).reshape(B, Hk, R, Tq, spec.D)


    def attend(self, kspec, kcode, vspec, vcode, q: mx.array, scale: float) -> mx.array:
        """Decode attention in one call: softmax_t(ν_t ⟨Π_K q·scale, c[k_t]⟩) weighting
        ν'_t Π_Vᵀ c[v_t], i.e. attention over the decoded keys and values, never decoded.

        q (B, H_kv, R, Tq, D) as the model gives it; ``kcode``/``vcode`` code fields ``idx``
        (B, H_kv, T, NB) and ``norm`` (B, H_kv, T, 1) float16 → (B, H_kv, R, Tq, D) float32.
        No mask: every token counts."""
        _check_rows(q, kspec.D, "q")
        for spec, code in ((kspec, kcode), (vspec, vcode)):
            _check_codes(spec, code["idx"], code["norm"])
            if tuple(code["idx"].shape[:3]) != (q.shape[0], q.shape[1], kcode["idx"].shape[2]):
                raise ValueError(f"keys, values and queries disagree: q {tuple(q.shape)}, keys "
                                 f"{tuple(kcode['idx'].shape)}, values {tuple(vcode['idx'].shape)}")
        if kspec.D != vspec.D:
            raise ValueError(f"key and value codecs have different dimensions ({kspec.D}, {vspec.D})")
        B, Hk, R, Tq, D = q.shape
        qh = _host(q, mx.float32).reshape(B * Hk * R * Tq, D)
        args, T = [], kcode["idx"].shape[2]
        for spec, code in ((kspec, kcode), (vspec, vcode)):
            idx, hs = _codes(code["idx"])
            norm, nhs = _codes(code["norm"] if code["norm"].dtype == mx.float16 else code["norm"].astype(mx.float16))
            table = _host(spec.table, mx.float32)
            args += [idx, hs, norm, nhs, table, spec.K, spec.IB, spec.N, idx.shape[3]]
        out = np.empty((B * Hk * R * Tq, D), np.float32)
        if T and out.size:
            ptr = [a.ctypes.data if isinstance(a, np.ndarray) else a for a in args]
            rots = [_host(spec.rot, mx.float32) for spec in (kspec, vspec)]
            self._lib.tq_attend(qh.ctypes.data, float(scale), rots[0].ctypes.data, rots[1].ctypes.data, *ptr,
                                B * Hk, R * Tq, T, D, out.ctypes.data)
        else:
            out[:] = 0.0
        return mx.array(out).reshape(B, Hk, R, Tq, D)


def self_check(backend: CpuKernels) -> str | None:
    """Compare ``backend`` with the mx path on small random codes of every kind it has a
    dedicated path for (scalar 1–4 and 8 bits, FibQuant with 8-bit and other indices,
    grouped heads, a view sliced along T): None when they agree, else what differed."""
    from ..codecs import FibQuant, TurboQuantMSE
    from .context import use
    with use(None):                                          # the reference: the mx path
        return _check(backend, FibQuant, TurboQuantMSE)


def _check(backend, FibQuant, TurboQuantMSE) -> str | None:
    cases = [TurboQuantMSE(64, b) for b in (1, 2, 3, 4, 8)] + [TurboQuantMSE(48, 3), TurboQuantMSE(40, 4), FibQuant(64, 2, 256),
                                                                 FibQuant(64, 2, 32)]
    for n, codec in enumerate(cases):
        D = codec.dim
        x = mx.random.normal((2, 2, 37, D), key=mx.random.key(n))
        code = codec.encode(x)
        idx, norm = backend.encode(codec.kernel_spec(), x)
        agree = np.mean(np.array(idx) == np.array(code["idx"]))
        # norms: a summation-order difference of one float32 ulp can cross an fp16 rounding
        # boundary, so one fp16 step (2^-10 relative) is allowed
        if agree < 0.999 or not np.allclose(np.array(norm.astype(mx.float16)).astype(np.float32),
                                            np.array(code["norm"]).astype(np.float32), rtol=2 ** -10, atol=0):
            return f"{codec!r}: encode agrees on {agree:.4f} of the code bytes"
        idx = code["idx"][:, :, :35]                         # a view along T, as caches hold
        units = codec.decode_rotated(code)[:, :, :35]
        spec = codec.kernel_spec()
        for Tq in (2, MATMUL_ROWS):                           # lookups per row; decode + matmul
            q = mx.random.normal((2, 2, 3, Tq, D), key=mx.random.key(100 + n))
            ref = q @ mx.swapaxes(units, -1, -2)[:, :, None]
            err = mx.abs(backend.scores(spec, q, idx) - ref).max().item()
            if not err <= 1e-4 * max(1.0, mx.abs(ref).max().item()):
                return f"{codec!r}: scores differ by {err:.3g}"
            w = mx.softmax(ref, axis=-1)
            ref_v = w @ units[:, :, None]
            err = mx.abs(backend.values(spec, w, idx) - ref_v).max().item()
            if not err <= 1e-5:
                return f"{codec!r}: value sums differ by {err:.3g}"
    pairs = [(TurboQuantMSE(D, b, seed=1), TurboQuantMSE(D, b, seed=2)) for D, b in
             ((64, 4), (128, 4), (256, 4), (128, 2), (64, 3))]
    pairs += [(cases[n], cases[(n + 3) % len(cases)]) for n in range(len(cases))]
    for n, (codec, vcodec) in enumerate(pairs):                # keys and values through two codecs
        D, T = codec.dim, 1100 if n < 5 else 35                 # 1100: three blocks to merge
        if vcodec.dim == D:
            code = codec.encode(mx.random.normal((2, 2, T + 2, D), key=mx.random.key(300 + n)))
            units = codec.decode_rotated(code)[:, :, :T]
            q = mx.random.normal((2, 2, 3, 2, D), key=mx.random.key(400 + n))
            vcode = vcodec.encode(mx.random.normal((2, 2, T + 2, D), key=mx.random.key(200 + n)))
            vc = {f: a[:, :, :T] for f, a in vcode.arrays.items()}
            # the reference in float64 (NumPy), so that the check measures the kernel's rounding,
            # not the difference between two float32 BLAS summation orders
            f64 = lambda a: np.array(a.astype(mx.float32), dtype=np.float64)   # noqa: E731
            s64 = f64(q) @ np.swapaxes(f64(units), -1, -2)[:, :, None]
            s64 = s64 * np.swapaxes(f64(code["norm"][:, :, :T]), -1, -2)[:, :, None]
            p64 = np.exp(s64 - s64.max(axis=-1, keepdims=True))
            p64 /= p64.sum(axis=-1, keepdims=True)
            vn = np.swapaxes(f64(vc["norm"]), -1, -2)[:, :, None]
            ref_o = vcodec.rotation.invert(mx.array(((p64 * vn) @ f64(vcodec.decode_rotated(vcode)[:, :, :T])[:, :, None])
                                                    .astype(np.float32)))
            qu = codec.rotation.invert(q) / 0.5                # unrotated and unscaled: the kernel does both
            got = backend.attend(codec.kernel_spec(), {f: a[:, :, :T] for f, a in code.arrays.items()},
                                 vcodec.kernel_spec(), vc, qu, 0.5)
            err = mx.abs(got - ref_o).max().item()
            tol = 1e-5 * max(1.0, mx.abs(ref_o).max().item())
            if not err <= tol:
                return f"{codec!r} keys, {vcodec!r} values: attention differs by {err:.3g} (bound {tol:.3g})"
    return None
