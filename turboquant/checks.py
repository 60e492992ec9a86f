"""Argument checks shared by every layer of the package (the lowest module: imports nothing
of turboquant)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

__all__ = ["check_int", "check_out_file", "deprecated", "TurboQuantDeprecationWarning"]


class TurboQuantDeprecationWarning(FutureWarning):
    """A name kept for one release after it was renamed (shown to users, unlike
    ``DeprecationWarning``)."""


_WARNED: set = set()


def deprecated(old: str, new: str) -> None:
    """Warn, once per process, that ``old`` is now ``new``."""
    if old not in _WARNED:
        _WARNED.add(old)
        import warnings
        warnings.warn(f"{old} is deprecated: use {new} (the old name goes in the next release)",
                      TurboQuantDeprecationWarning, stacklevel=3)


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


def check_out_file(path, what: str = "output file", overwrite: bool = True, make_parents: bool = False) -> Path:
    """Check where a file will be written *before* the work that produces it: not a folder,
    not an existing file unless ``overwrite``, in a folder that exists (or, with
    ``make_parents``, can be created) and is writable. Raises ``ValueError`` naming it."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"{what}: expected a file path, got {path!r}")
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path} is a folder: give a file name inside it")
    if path.exists() and not overwrite:
        raise ValueError(f"{what} {path} exists (pass --overwrite to replace it)")
    parent = path.parent
    while make_parents and not parent.exists() and parent != parent.parent:
        parent = parent.parent                   # the nearest folder that exists
    if not parent.is_dir():
        raise ValueError(f"{what} {path}: the folder {path.parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {path}: the folder {parent} is not writable")
    return path
