"""Progress bars on long work: one helper, so every loop shows them the same way (tqdm,
on standard error, cleared when done) and only when asked."""
from __future__ import annotations

import sys

__all__ = ["progress"]


def progress(iterable, total=None, desc=None, enabled: bool = False, unit: str = "it"):
    """``iterable`` itself, or wrapped in a tqdm bar (on standard error, cleared when done)
    when ``enabled``."""
    if not enabled:
        return iterable
    from tqdm.auto import tqdm
    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=False, file=sys.stderr)
