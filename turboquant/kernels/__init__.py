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
(the mx path); ``TURBOQUANT_KERNELS=cpp`` uses the GPU kernel bodies compiled as C++ (the
emulation, ``emulation_backend()``: how the tests check those bodies without a GPU; slower
than ``cpu``). ``use(backend)`` forces one in a block (``use(None)``: the mx path).
``turboquant kernels`` says which back-end is active and why.

The modules: ``backend`` (what a back-end is; the launch maths of the GPU bodies),
``select`` (which one runs, and why), ``cpu`` and ``emulate`` (the two C++ builds),
``source`` (the kernel bodies), ``verified`` (what was verified where, ``VERIFIED``). This
file only connects them to the codecs (``codecs.table.set_accelerator``).
"""
from __future__ import annotations

import mlx.core as mx

from ..checks import deprecated
from ..codecs.table import KernelSpec, set_accelerator
from . import source
from .backend import (Backend, LaunchBackend, as_backend, encode, encode_fits, encode_groups, fits, rotated_values,
                      spec_for, unit_scores, value_splits)
from .select import (active, adopt, backend_name, cpu_kernels_backend, emulated, emulation_backend, env_mode,
                     gpu_backend, tf32_note, use, why)
from .verified import VERIFIED

__all__ = ["KernelSpec", "Backend", "LaunchBackend", "as_backend", "spec_for", "backend_name", "active", "use", "why",
           "env_mode", "adopt", "self_check", "gpu_backend", "cpu_kernels_backend", "emulation_backend",
           "emulated", "fits", "encode_fits", "encode", "unit_scores", "rotated_values", "encode_groups",
           "value_splits", "VERIFIED", "source", "tf32_note"]


def self_check(backend) -> str | None:
    """``backend.self_check()``: None when it reproduces the mx path, else what differed."""
    return as_backend(backend).self_check()


def cpu_backend():
    """Deprecated: the *emulation* of the GPU kernels; now ``emulation_backend()``."""
    deprecated("kernels.cpu_backend()", "kernels.emulation_backend() (the emulation of the GPU kernels)")
    return emulation_backend()


def fast_cpu_backend():
    """Deprecated: the CPU kernels; now ``cpu_kernels_backend()``."""
    deprecated("kernels.fast_cpu_backend()", "kernels.cpu_kernels_backend()")
    return cpu_kernels_backend()


cpu_backend.cache_clear = emulation_backend.cache_clear          # they were lru_cache'd
fast_cpu_backend.cache_clear = cpu_kernels_backend.cache_clear


class _Dispatch:
    """What the rotated-table codecs call (``codecs.table.set_accelerator``): the active
    back-end's kernels when one is active and takes the launch, else None (the mx path)."""

    def encode(self, codec, x: mx.array):
        backend = as_backend(active())
        if backend is None or x.size == 0:
            return None
        spec = codec.kernel_spec()
        return backend.encode(spec, x) if backend.takes_encode(spec, x.size // x.shape[-1]) else None

    def scores(self, codec, q_rot: mx.array, idx: mx.array):
        backend = as_backend(active())
        if backend is None:
            return None
        B, Hk, R, Tq, _ = q_rot.shape
        spec = codec.kernel_spec()
        return backend.scores(spec, q_rot, idx) if backend.takes(spec, B * Hk * R * Tq, B * Hk, idx.shape[2]) \
            else None

    def values(self, codec, w: mx.array, idx: mx.array):
        backend = as_backend(active())
        if backend is None:
            return None
        B, Hk, R, Tq, T = w.shape
        spec = codec.kernel_spec()
        return backend.values(spec, w, idx) if backend.takes(spec, B * Hk * R * Tq, B * Hk, T) else None

    def attend(self, kc, kcode, vc, vcode, q: mx.array, scale: float):
        """Decode attention in one call, q (B, H_kv, R, Tq, D) unrotated and unscaled → the
        output (B, H_kv, R, Tq, D), when the active back-end takes it (the CPU kernels, a
        few queries per kv head) and both codecs are rotated tables; else None."""
        backend = as_backend(active())
        if backend is None or spec_for(kc) is None or spec_for(vc) is None or not backend.takes_attend(q):
            return None
        return backend.attend(kc.kernel_spec(), kcode, vc.kernel_spec(), vcode, q, scale)


set_accelerator(_Dispatch())
