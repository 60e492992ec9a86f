"""Where the package keeps what it builds on disk: one home for the directory rule.

``cache_root()`` is ``$TURBOQUANT_CACHE`` (default ``~/.cache/turboquant``). Beneath it:
``models/`` (converted models), ``fibquant/`` (vector codebooks), ``kernels/`` (the CPU
kernels and the C++ emulation of the GPU ones), ``coders/`` (fitted profile coders),
``profiles/`` (profiles written by ``turboquant calibrate``). Imports nothing of turboquant.
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root() -> Path:
    """``$TURBOQUANT_CACHE`` (default ``~/.cache/turboquant``): converted models, codebooks,
    kernels, fitted coders."""
    return Path(os.environ.get("TURBOQUANT_CACHE", Path.home() / ".cache" / "turboquant"))
