"""Where the package keeps what it builds on disk: one home for the directory rule.

``cache_root()`` is ``$TURBOQUANT_CACHE`` (default ``~/.cache/turboquant``). Beneath it:
``models/`` (converted models), ``fibquant/`` (vector codebooks), ``kernels/`` (the CPU
kernels and the C++ emulation of the GPU ones), ``coders/`` (fitted profile coders),
``profiles/`` (profiles written by ``turboquant calibrate``). Imports nothing of turboquant.
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root", "require_free", "plain_mode"]


def cache_root() -> Path:
    """``$TURBOQUANT_CACHE`` (default ``~/.cache/turboquant``): converted models, codebooks,
    kernels, fitted coders."""
    return Path(os.environ.get("TURBOQUANT_CACHE", Path.home() / ".cache" / "turboquant"))


def require_free(folder: Path, need: int, doing: str,
                 hint: str = "set TURBOQUANT_CACHE to a larger disk") -> None:
    """Refuse (``ValueError``) before writing ``need`` bytes into ``folder`` (or the nearest
    existing folder above it) when its disk has less free space; ``doing`` says what would
    be written, ``hint`` what to do about it. The one disk check of every large write
    (creating ``.venv``, joining a GGUF, converting it)."""
    import shutil
    folder = Path(folder)
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if free < need:
        raise ValueError(f"{doing} needs {need / 2**30:.2f} GiB free in {folder}; only {free / 2**30:.2f} GiB "
                         f"are free ({hint})")



def plain_mode(path: Path, executable: bool = False) -> None:
    """Give ``path`` the permissions a plain ``open`` would: 0o666 (``executable``, or a
    folder: 0o777) less the process's umask. ``tempfile.mkstemp``/``mkdtemp`` and
    safetensors make files 0600 and folders 0700, which the other users of a shared cache or
    results folder could not read. The one home of that rule for every file written
    atomically (a record, a joined GGUF, a converted model, a compiled kernel)."""
    path = Path(path)
    mask = _umask()
    try:
        os.chmod(path, (0o777 if executable or path.is_dir() else 0o666) & ~mask)
    except OSError:                             # a file system without POSIX modes: what it gives stays
        pass


def _umask() -> int:
    """The process's umask, read without changing it where the system says it (Linux), else
    by setting and restoring it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


if __name__ == "__main__":
    # make's check before it creates .venv (run by the system Python, before any package is
    # installed): python turboquant/paths.py FOLDER GIB WHAT HINT
    import sys
    if len(sys.argv) != 5:
        sys.exit("usage: python turboquant/paths.py FOLDER GIB WHAT HINT (make's disk check)")
    try:
        require_free(Path(sys.argv[1]), int(float(sys.argv[2]) * 2**30), sys.argv[3], sys.argv[4])
    except ValueError as err:
        sys.exit(f"make: {err}")
