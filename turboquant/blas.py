"""Fast CPU matmuls on Linux: put MKL's BLAS in the global symbol scope before mlx loads.

The Linux ``mlx[cpu]`` wheel links the reference (netlib) BLAS, about 2–6 GFLOP/s for a
float32 matmul on this machine's CPU. mlx calls ``cblas_sgemm`` through the dynamic
linker, so a BLAS loaded earlier with ``RTLD_GLOBAL`` wins the symbol lookup. MKL's
single dynamic library ``libmkl_rt`` (from the ``mkl`` wheel) makes the same calls run
at ~150 GFLOP/s (Chapter 9 measures both in one run).

``enable()`` runs when ``turboquant`` is imported. It

* does nothing on macOS (mlx uses Accelerate there) or without the ``mkl`` wheel;
* does nothing when ``TURBOQUANT_FAST_BLAS=0`` is set (the opt-out);
* warns, with the fix, when ``mlx.core`` was imported before ``turboquant``: by then
  mlx's symbols are bound to the reference BLAS and loading MKL would change nothing.

Results stay float32; only the speed of matrix products changes (and their last-bit
rounding, as with any other BLAS).
"""
from __future__ import annotations

import ctypes
import os
import sys
import warnings
from pathlib import Path
from typing import Optional

__all__ = ["ENV", "enable", "status", "find_mkl", "skip_reason"]

ENV = "TURBOQUANT_FAST_BLAS"
_state = {"loaded": None, "reason": "not attempted"}


def find_mkl() -> Optional[Path]:
    """Path of ``libmkl_rt.so*`` installed by the ``mkl`` wheel, or None."""
    try:
        from importlib.metadata import PackageNotFoundError, distribution
        dist = distribution("mkl")
    except PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name.startswith("libmkl_rt.so"):
            p = Path(dist.locate_file(f)).resolve()
            if p.is_file():
                return p
    return None


def skip_reason(platform: str, environ) -> Optional[str]:
    """Why ``enable()`` does not try to load MKL on ``platform`` (``sys.platform``'s spelling)
    with the environment ``environ``, or None when it tries."""
    if not platform.startswith("linux"):
        return f"not needed on {platform}"
    if environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return f"disabled by {ENV}=0"
    return None


def enable() -> bool:
    """Load MKL globally if possible (see the module docstring); True when it is in use."""
    if _state["loaded"] is not None:
        return bool(_state["loaded"])
    reason = skip_reason(sys.platform, os.environ)
    if reason is not None:
        return _done(None, reason)
    path = find_mkl()
    if path is None:
        return _done(None, "the mkl wheel is not installed")
    if "mlx.core" in sys.modules:
        warnings.warn(
            "turboquant: mlx was imported before turboquant, so its matmuls keep the slow "
            "reference BLAS (~25x slower on CPU). Import turboquant first (before mlx/mlx_lm), "
            f"or set {ENV}=0 to silence this.", RuntimeWarning, stacklevel=3)
        return _done(None, "mlx was imported first")
    try:
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        return _done(None, f"could not load {path}: {e}")
    return _done(str(path), "loaded")


def _done(loaded, reason) -> bool:
    _state["loaded"], _state["reason"] = loaded or False, reason
    return bool(loaded)


def status() -> dict:
    """{"fast_blas": bool, "library": path or None, "reason": str}."""
    return {"fast_blas": bool(_state["loaded"]), "library": _state["loaded"] or None,
            "reason": _state["reason"]}
