"""The kernel bodies compiled as C++ and run on the CPU, the grid's threads as loop iterations.

This is how the Metal/CUDA bodies are checked on a machine without a GPU: the exact text
of ``source.BODIES`` becomes a C++ function of the thread index ``tq_gid`` (template
arguments as ``constexpr int``), compiled once per template with the system's C++
compiler (``$CXX`` or g++; with OpenMP when it has it, since the threads are independent),
loaded with ctypes and called for every thread of the grid.
What it cannot check: GPU-only matters (the generated signatures, memory coalescing,
speed); those are said in Chapter 11.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..paths import cache_root
from . import source
from .backend import LaunchBackend

__all__ = ["CppKernels", "compiler", "cpp_source"]

_NP = {"float": np.float32, "uint8_t": np.uint8, "int32_t": np.int32}
_MX = {mx.float32: "float", mx.uint8: "uint8_t", mx.int32: "int32_t"}


def compiler() -> str | None:
    """Path of the C++ compiler used (``$CXX``, else g++ or c++), or None."""
    for c in (os.environ.get("CXX"), "g++", "c++"):
        if c and shutil.which(c):
            return shutil.which(c)
    return None


def cpp_source(op: str, template: dict) -> str:
    """A C++ file running kernel ``op`` over ``n`` threads: ``extern "C" void run(...)``."""
    ins, outs = source.CTYPES[op]
    params = [f"const {t}* {n}" for t, n in zip(ins, source.INPUTS[op])]
    params += [f"{t}* {n}" for t, n in zip(outs, source.OUTPUTS[op])]
    names = ", ".join(source.INPUTS[op] + source.OUTPUTS[op])
    consts = "".join(f"  constexpr int {k} = {int(template[k])};\n" for k in source.TEMPLATES[op])
    return (source.CPP_PRELUDE
            + f"static inline void thread_{op}(const unsigned int tq_gid, {', '.join(params)}) {{\n"
            + consts + source.BODIES[op] + "}\n\n"
            + f'extern "C" void run({", ".join(params)}, const unsigned int n) {{\n'
            + "  #pragma omp parallel for schedule(static)\n"
            + f"  for (long long g = 0; g < (long long)n; ++g) thread_{op}((unsigned int)g, {names});\n}}\n")


def _cache_dir() -> Path:
    d = cache_root() / "kernels" / "emulate"
    d.mkdir(parents=True, exist_ok=True)
    return d


class CppKernels(LaunchBackend):
    """The emulation of the GPU kernels: a back-end with their interface (``run``), the
    bodies compiled for this CPU."""

    name = "cpp"

    def __init__(self):
        self.cxx = compiler()
        if self.cxx is None:
            raise RuntimeError("no C++ compiler found (set $CXX or install g++): the kernel "
                               "emulation needs one")
        self._libs = {}
        self.warnings = {}

    def library(self, op: str, template: dict):
        """The compiled ``run`` for ``op`` at ``template`` (built once, cached on disk)."""
        key = (op, tuple(int(template[k]) for k in source.TEMPLATES[op]))
        if key in self._libs:
            return self._libs[key]
        text = cpp_source(op, template)
        digest = hashlib.sha256((self.cxx + text).encode()).hexdigest()[:20]
        so = _cache_dir() / f"{op}-{digest}.so"
        if not so.exists():
            cpp = so.with_suffix(".cpp")
            cpp.write_text(text)
            tmp = so.with_suffix(f".{os.getpid()}.tmp")
            flags = ["-std=c++17", "-O2", "-Wall", "-Wextra", "-shared", "-fPIC"]
            proc = subprocess.run([self.cxx, *flags, "-fopenmp", str(cpp), "-o", str(tmp)],
                                  capture_output=True, text=True)
            if proc.returncode:                              # no OpenMP: one thread after another
                proc = subprocess.run([self.cxx, *flags, "-Wno-unknown-pragmas", str(cpp), "-o", str(tmp)],
                                      capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"compiling kernel {op!r} failed:\n{proc.stderr}")
            self.warnings[key] = proc.stderr
            os.replace(tmp, so)
        lib = ctypes.CDLL(str(so))
        n_args = len(source.INPUTS[op]) + len(source.OUTPUTS[op])
        lib.run.argtypes = [ctypes.c_void_p] * n_args + [ctypes.c_uint]
        lib.run.restype = None
        self._libs[key] = lib.run
        return lib.run

    def run(self, op, inputs, template, threads, out_shapes, out_dtypes):
        ins, outs = source.CTYPES[op]
        arrays = []
        for name, want, a in zip(source.INPUTS[op], ins, inputs):
            if _MX.get(a.dtype) != want:
                raise TypeError(f"kernel {op!r} input {name!r} must be {want}, got {a.dtype}")
            arrays.append(np.ascontiguousarray(np.array(a)))
        # outputs start as garbage (NaN, 0xAB bytes), as GPU memory would: an element the
        # kernel forgets to write shows up in the comparison with the reference
        results = [np.full(shape, np.nan if _MX[d] == "float" else 0xAB, dtype=_NP[_MX[d]])
                   for shape, d in zip(out_shapes, out_dtypes)]
        fn = self.library(op, template)
        fn(*[a.ctypes.data_as(ctypes.c_void_p) for a in arrays + results], int(threads))
        return [mx.array(r) for r in results]
