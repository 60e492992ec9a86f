"""mlx-lm's cache protocol, written once (Chapter 7).

mlx-lm's models and its generation loop talk to a layer's cache through a small protocol
(``models/cache.py``): ``update_and_fetch(keys, values)``, ``offset``, ``state`` /
``meta_state``, ``size()``, ``empty()``, ``is_trimmable()`` / ``trim(n)``,
``make_mask(N, …)``, ``nbytes``. ``CacheBase`` holds the defaults every cache of this
package shares — a cache that holds its ``offset`` tokens in order, is not trimmable and
masks as mlx-lm's ``KVCache`` does — so a cache class writes only what differs
(``TurboQuantKVCache``, ``TurboQuantRotatingKVCache``, ``KIVICache``, Bit-Axon's
``ExactSWACache``).
"""
from __future__ import annotations

import contextvars
from contextlib import contextmanager
from typing import Optional

from mlx_lm.models.base import create_causal_mask

__all__ = ["CacheBase", "protocol_mask", "codes_mode", "returning_codes"]

# Set by turboquant.attention.codes_attention: caches then return CodesView, not K/V. A depth
# count, not a flag, so blocks may exit in any order.
codes_mode: contextvars.ContextVar[int] = contextvars.ContextVar("turboquant_codes_mode", default=0)


@contextmanager
def returning_codes():
    """Inside the block, caches' ``update_and_fetch`` returns ``CodesView`` objects (codes
    for attention from codes), not dequantized K and V."""
    codes_mode.set(codes_mode.get() + 1)
    try:
        yield
    finally:
        codes_mode.set(max(0, codes_mode.get() - 1))


def protocol_mask(N: int, offset: int, return_array: bool = False, window_size: Optional[int] = None):
    """The mask of a plain (non-rotating) cache holding ``offset`` tokens for ``N`` new
    queries, as mlx-lm's ``KVCache.make_mask`` gives it: None for one query, "causal"
    (mlx's fused causal mask) for several, an array with a window or on request."""
    if window_size is not None or return_array:
        return create_causal_mask(N, offset, window_size=window_size)
    return None if N == 1 else "causal"


class CacheBase:
    """mlx-lm's protocol defaults for a cache that holds ``offset`` tokens in order."""

    offset = 0

    def update_and_fetch(self, keys, values):  # pragma: no cover - interface
        raise NotImplementedError

    @property
    def nbytes(self) -> int:  # pragma: no cover - interface
        """Bytes the cache holds."""
        raise NotImplementedError

    def size(self) -> int:
        """Tokens held."""
        return self.offset

    def empty(self) -> bool:
        return self.size() == 0

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        raise ValueError(f"{type(self).__name__} cannot be trimmed (is_trimmable() is False)")

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        return protocol_mask(N, self.offset, return_array, window_size)
