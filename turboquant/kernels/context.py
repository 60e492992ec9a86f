"""The back-end forced in this context (``use``), apart from the choice of back-end
(``select``) so that a back-end's self-check can force the mx path without importing the
selection."""
from __future__ import annotations

import contextvars
from contextlib import contextmanager

__all__ = ["use", "forced", "AUTO"]

# A back-end forced by ``use()`` in this context (thread or task); AUTO: choose by the
# environment. A ContextVar, so a ``use`` block in one thread does not switch another's.
AUTO = object()
_forced: contextvars.ContextVar = contextvars.ContextVar("turboquant_kernels", default=AUTO)


def forced():
    """The back-end forced here (None: the mx path), or ``AUTO``."""
    return _forced.get()


@contextmanager
def use(backend):
    """Force a back-end inside the block (this thread or task only): ``use(None)`` for the
    mx path, ``use(emulated())`` for the emulation."""
    token = _forced.set(backend)
    try:
        yield backend
    finally:
        _forced.reset(token)
