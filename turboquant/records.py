"""Recorded runs as JSON files that long measurements write as they go (``turboquant
needle``, ``turboquant longctx``): one home for reading a record back and for writing it
so that an interrupted run never leaves half a file."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from .paths import plain_mode

__all__ = ["read_record", "write_record"]


def read_record(path, what: str, option: str = "--out") -> Optional[dict]:
    """The record at ``path`` ({"setup": …, "results": …}), or None when there is no file;
    a file that is not such a record is refused by name (``what``: the command that writes
    it), never overwritten."""
    if path is None or not Path(path).exists():
        return None
    try:
        record = json.loads(Path(path).read_text())
        if not (isinstance(record["setup"], dict) and isinstance(record["results"], dict)):
            raise TypeError("its setup and results are not objects")
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a {what} record ({e}); remove it or choose another {option}") from None
    return record


def write_record(path, record: dict) -> None:
    """Write ``record`` to ``path`` atomically: to a new uniquely named sibling file (never
    one that exists), then renamed over ``path``; the sibling is removed if anything fails."""
    import os
    import tempfile
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(record, indent=1))
        plain_mode(tmp)                                     # mkstemp's 0600 is not what open gives
        os.replace(tmp, path)                               # never a half-written file
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
