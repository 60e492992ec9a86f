"""What this machine is, as detected facts: CPU, SIMD level, BLAS, kernel back-end, and the
mlx compiler defect of Chapter 3.

Results that depend on the machine — the last bits of a float32 sum, which code path MKL or
NumPy dispatches to, whether a compiler defect shows — are printed by the book as what was
*detected* here, never as universal facts. ``describe()`` gathers them; Chapters 3 and 11
print them, and ``python -m turboquant.machine`` prints them all.

``make test`` re-runs the notebooks under a *foreign* configuration (``FOREIGN_ENV``:
MKL's and NumPy's AVX2 code paths, the AVX2 build of the CPU kernels, mlx's compiler off),
so a stored output that holds only on the machine that wrote it fails there first.
"""
from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import mlx.core as mx

__all__ = ["simd_level", "cpu_flags", "numpy_dispatch", "compile_defect", "describe", "FOREIGN_ENV", "foreign_env"]

# The configuration nbval re-runs the chapters under (``make test-notebooks``): on an
# AVX-512 machine it computes what an AVX2-only one does, and with mlx's compiler off the
# stored output of the compiler-defect demonstration cannot pass by accident.
FOREIGN_ENV = {
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",                          # MKL's AVX2 kernels
    "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR",  # NumPy's AVX2 dispatch
    "TURBOQUANT_CPU_ARCH": "x86-64-v3",                          # cpu.cpp's AVX2 branch
    "MLX_DISABLE_COMPILE": "1",                                  # mx.compile runs eagerly
}


def foreign_env(machine: str | None = None, flags: set[str] | None = None,
                numpy_features: dict | None = None) -> dict:
    """``FOREIGN_ENV`` as it applies to this machine (or to the one described by the
    arguments, for tests): on x86-64, NumPy's switches only for the dispatch targets this
    NumPy has and this CPU offers (NumPy refuses others), and the AVX2 build of the kernels
    only where the CPU has AVX2 (else the portable one); on arm64 (Macs) and elsewhere only
    what is not x86-specific: mlx's compiler off."""
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64"):
        return {"MLX_DISABLE_COMPILE": FOREIGN_ENV["MLX_DISABLE_COMPILE"]}
    flags = cpu_flags() if flags is None else flags
    if numpy_features is None:
        numpy_features = numpy_dispatch()
    env = dict(FOREIGN_ENV)
    off = [f for f in FOREIGN_ENV["NPY_DISABLE_CPU_FEATURES"].split() if numpy_features.get(f)]
    if off:
        env["NPY_DISABLE_CPU_FEATURES"] = " ".join(off)
    else:
        del env["NPY_DISABLE_CPU_FEATURES"]
    if "avx2" not in flags:
        env["TURBOQUANT_CPU_ARCH"] = "x86-64"                                # no AVX2 to force
    return env


def numpy_dispatch() -> dict:
    """NumPy's dispatch targets → whether this CPU offers each (empty before NumPy 2)."""
    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    except ImportError:                                                      # pragma: no cover
        return {}
    return {f: bool(__cpu_features__.get(f, False)) for f in __cpu_dispatch__}


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux: /proc/cpuinfo; macOS: sysctl's hw.optional names
    that are set); empty where neither is readable."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    if sys.platform == "darwin":
        import subprocess
        try:
            out = subprocess.run(["sysctl", "hw.optional"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return set()
        return {k.strip().rsplit(".", 1)[-1].lower() for k, _, v in
                (line.partition(":") for line in out.splitlines()) if v.strip() == "1"}
    return set()


def simd_level(flags: set[str] | None = None, machine: str | None = None) -> str:
    """"AVX-512", "AVX2", "SSE2" (x86-64), "NEON" (arm64) or "unknown": the widest vector
    instructions this CPU offers, from its feature flags."""
    machine = (machine or platform.machine()).lower()
    flags = cpu_flags() if flags is None else flags
    if machine in ("arm64", "aarch64"):
        return "NEON"                       # every arm64 CPU has it (AdvSIMD)
    if machine in ("x86_64", "amd64"):
        if "avx512f" in flags:
            return "AVX-512"
        if "avx2" in flags:
            return "AVX2"
        return "SSE2"
    return "unknown"


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo; else ``platform.processor()``), or
    "unknown"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def arithmetic() -> dict:
    """What decides the low bits of a float32 run here, as a recorded run keeps it: the CPU,
    its widest vector instructions, the BLAS library mlx's matmuls go through (with its
    package version where one is installed: MKL's kernels change between releases) and
    MKL's instruction cap. Two runs whose fp32 rows differ in the last digits differ in
    one of these (or in mlx: ``describe``)."""
    from importlib import metadata

    from . import blas
    library = blas.status()["library"]
    version = None
    if library and "mkl" in Path(library).name:
        try:
            version = metadata.version("mkl")
        except metadata.PackageNotFoundError:
            pass
    return {"cpu": cpu_model(), "simd": simd_level(),
            "blas": (Path(library).name + (f" {version}" if version else "")) if library else "mlx's own",
            "mkl_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS", "(MKL's choice)")}


def arithmetic_differences(recorded: dict | None, here: dict) -> list[str]:
    """One "key: X there, Y here" per way ``here`` (``arithmetic()``) differs from a recorded
    run's; a run recorded before runs kept it gives ["the recorded run does not say …"]."""
    if not recorded:
        return ["the recorded run does not say which CPU and BLAS computed it"]
    return [f"{k}: {recorded.get(k)!r} there, {v!r} here" for k, v in here.items() if recorded.get(k) != v]


def compile_defect() -> dict:
    """Run Chapter 3's smallest reproduction of the mlx compiler defect here:
    ``(w >> 1) & 63`` on uint32, eagerly and under ``mx.compile``. → {"eager", "compiled",
    "reproduced": whether the compiled result is wrong on this machine, "compile_enabled"}.
    Seen with mlx 0.32.4 on one AMD EPYC with AVX-512 (compiled: [0, 0, 0]), not on one
    with AVX2 only nor on another with AVX-512; the package never compiles bit unpacking,
    whatever this returns."""
    w = mx.array([1000, 1002, 255], dtype=mx.uint32)
    fn = lambda w: (w >> 1) & 63                                  # noqa: E731
    eager, compiled = fn(w).tolist(), mx.compile(fn)(w).tolist()
    return {"eager": eager, "compiled": compiled, "reproduced": eager != compiled,
            "compile_enabled": _compile_enabled()}


def _compile_enabled() -> bool:
    return os.environ.get("MLX_DISABLE_COMPILE", "").strip().lower() in ("", "0", "false", "no", "off")


def describe() -> dict:
    """Detected facts about this machine and the paths the package takes on it."""
    from . import blas, kernels
    backend = kernels.active()
    return {
        "machine": platform.machine(), "system": platform.system(),
        "simd": simd_level(),
        "blas": blas.status(),
        "mkl_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS", "(MKL's choice)"),
        "numpy_dispatch": [f for f, on in numpy_dispatch().items() if on],
        "kernels": kernels.backend_name(),
        "kernels_isa": getattr(backend, "isa", None),
        "kernels_why": kernels.why(),
        "mlx": mx.__version__,
        "mlx_compile": "on" if _compile_enabled() else "off (MLX_DISABLE_COMPILE)",
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m turboquant.machine``: print ``describe()`` as JSON.
    ``python -m turboquant.machine --foreign CMD ...``: run CMD under ``foreign_env()``
    (printed first), returning its exit status — how ``make test`` runs nbval."""
    import json
    import subprocess
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(json.dumps(describe(), indent=1))
        return 0
    if argv[0] != "--foreign" or len(argv) < 2:
        print("usage: python -m turboquant.machine [--foreign CMD ...]", file=sys.stderr)
        return 2
    env = foreign_env()
    print("foreign configuration: " + " ".join(f"{k}={v!r}" for k, v in env.items()), flush=True)
    return subprocess.call(argv[1:], env={**os.environ, **env})


if __name__ == "__main__":
    sys.exit(main())
