"""Argument checks shared by every layer of the package (the lowest module: imports nothing
of turboquant)."""
from __future__ import annotations

import numpy as np

__all__ = ["check_int"]


def check_int(name: str, value, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as a Python int: NumPy integers are accepted and converted; bools, floats
    and anything else, or a value outside [lo, hi], raise ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        span = f"in {lo}..{hi}" if lo is not None and hi is not None else (f">= {lo}" if lo is not None else f"<= {hi}")
        raise ValueError(f"{name} must be an int {span}, got {value}")
    return value
