"""Which kernel back-end runs, and why (Performance chapter).

``active()`` is the back-end in use: a forced one (``use``), else by ``TURBOQUANT_KERNELS``
(``env_mode``): "auto" (the GPU's kernels if mlx has a GPU, else the CPU kernels), "0"
(none: the mx path), "cpp" (the GPU kernel bodies compiled as C++ and run on the CPU: the
emulation, ``emulation_backend``). Every back-end is adopted only after its
``self_check()``, once per process; ``why()`` says in one sentence what happened, and on
CUDA adds ``tf32_note()``: mlx runs float32 matmuls there in TF32 unless
``MLX_ENABLE_TF32=0``, so codes computed on the mx path of an NVIDIA GPU can differ from a
CPU's in a few bytes per thousand (dense rotations, FibQuant's codeword search; measured in
the Performance chapter). The kernels compute in float32 either way.
"""
from __future__ import annotations

import os
import warnings
from functools import lru_cache

import mlx.core as mx

from .context import AUTO, forced, use

__all__ = ["active", "use", "why", "backend_name", "env_mode", "adopt", "gpu_backend",
           "cpu_kernels_backend", "emulation_backend", "emulated", "tf32_note"]

_MODES = ("auto", "1", "0", "cpp")
_WHY = {}


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


def tf32_note(backend: str, environ=None) -> str | None:
    """What a user of back-end ``backend`` ("cuda", "metal", "cpu", …) should know about
    mlx's float32 matmuls there, or None. On CUDA mlx asks cuBLAS for TF32 (a 10-bit
    mantissa) unless ``MLX_ENABLE_TF32=0`` in ``environ`` (default ``os.environ``) when mlx
    starts: the mx path's rotations and codeword searches then round differently from a
    CPU's, which flips a few codes per thousand that lie near a decision boundary."""
    env = os.environ if environ is None else environ
    if backend != "cuda" or env.get("MLX_ENABLE_TF32") == "0":
        return None
    return ("mlx runs float32 matmuls in TF32 here (MLX_ENABLE_TF32 is not 0), so codes computed "
            "on the mx path can differ from a CPU's in a few bytes per thousand; set "
            "MLX_ENABLE_TF32=0 before mlx starts for full float32")


def adopt(make):
    """``make()`` if the back-end it builds passes its ``self_check``, else None (and a warning)."""
    from .backend import as_backend
    try:
        backend = make()
        problem = as_backend(backend).self_check()
    except Exception as e:                                   # compile or launch failure
        backend, problem = None, f"{type(e).__name__}: {e}"
    if problem is not None:
        warnings.warn(f"turboquant: the fused kernels were not adopted ({problem}); using the mx "
                      "path. Please report this.", RuntimeWarning, stacklevel=2)
        return None
    return backend


@lru_cache(maxsize=1)
def gpu_backend():
    """The GPU back-end mlx has here ("metal" or "cuda" kernels), or None on a CPU-only build.

    On first use the kernels are compiled and run once against the mx path (``self_check``);
    if that fails they are not used, with a RuntimeWarning saying why."""
    from .backend import MxKernels
    if mx.metal.is_available():
        return adopt(lambda: MxKernels("metal"))
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return adopt(lambda: MxKernels("cuda"))
    return None


@lru_cache(maxsize=1)
def cpu_kernels_backend():
    """The CPU kernels (``turboquant.kernels.cpu``), built on first use for the ``-march``
    of ``cpu.env_arch()`` (``TURBOQUANT_CPU_ARCH``, default "native") and adopted after their
    self-check; None (with one warning saying why) without a C++ compiler or when the build
    or the check fails."""
    from . import cpu, emulate
    arch = cpu.env_arch()
    cxx = emulate.compiler()
    if cxx is None:
        _WHY["cpu"] = "no C++ compiler (set $CXX or install g++)"
        warnings.warn("turboquant: no C++ compiler found (set $CXX or install g++), so attention "
                      "from codes runs on the slower mx path", RuntimeWarning, stacklevel=3)
        return None
    try:
        backend = cpu.CpuKernels(cxx, arch)
        problem = cpu.self_check(backend)
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


def emulated():
    """A new emulation of the GPU kernels: their bodies compiled as C++ for this CPU (needs a
    C++ compiler). How the tests check the GPU bodies without a GPU; slower than the CPU
    kernels."""
    from .emulate import CppKernels
    return CppKernels()


@lru_cache(maxsize=1)
def emulation_backend():
    """The emulation of the GPU kernels as an opt-in back-end (``TURBOQUANT_KERNELS=cpp``),
    adopted after the same self-check as a GPU's; None without a C++ compiler."""
    from .emulate import compiler
    if compiler() is None:
        warnings.warn("turboquant: TURBOQUANT_KERNELS=cpp needs a C++ compiler (set $CXX or "
                      "install g++); using the mx path", RuntimeWarning, stacklevel=3)
        return None
    return adopt(emulated)


def active():
    """The back-end the package uses now: a forced one (``use``), else by
    ``TURBOQUANT_KERNELS`` (``env_mode``): "auto" the GPU's if mlx has one, else the CPU
    kernels; "0" none; "cpp" the emulation. None means the mx-operations path."""
    if forced() is not AUTO:
        return forced()
    mode = env_mode()
    if mode == "0":
        return None
    if mode == "cpp":
        return emulation_backend()
    gpu = gpu_backend()
    return gpu if gpu is not None else cpu_kernels_backend()


def why() -> str:
    """Why the active back-end is the one it is, in one sentence."""
    if forced() is not AUTO:
        return "forced by kernels.use()"
    mode = env_mode()
    if mode == "0":
        return "TURBOQUANT_KERNELS=0: the mx path"
    if mode == "cpp":
        return "TURBOQUANT_KERNELS=cpp: the GPU kernel bodies compiled as C++ (the emulation)"
    if gpu_backend() is not None:
        name = gpu_backend().name
        note = tf32_note(name)
        return f"mlx has a GPU ({name}); its kernels passed their self-check" + (f"; {note}" if note else "")
    backend = cpu_kernels_backend()
    return "no GPU; CPU kernels " + _WHY.get("cpu", "") if backend is not None else \
        "no GPU, and the CPU kernels are not in use: " + _WHY.get("cpu", "unknown")


def backend_name() -> str:
    """"metal", "cuda", "cpu", "cpp" or "mx" (no kernels)."""
    b = active()
    return "mx" if b is None else b.name
