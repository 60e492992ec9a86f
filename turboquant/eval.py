"""Deprecated module: evaluation is one package now, ``turboquant.evaluation`` (and
``ring_fidelity`` is Bit-Axon's, ``turboquant.bitaxon``). This name re-exports them for one
release and warns once."""
from .bitaxon import ring_fidelity  # noqa: F401
from .checks import deprecated as _deprecated
from .evaluation import *  # noqa: F401,F403
from .evaluation import __all__ as _all

__all__ = [*_all, "ring_fidelity", "cache_bits"]

_deprecated("the module turboquant.eval", "turboquant.evaluation")


def cache_bits(model, cache) -> float:
    """Deprecated name of ``memory.measured_bits``."""
    from .memory import measured_bits
    _deprecated("eval.cache_bits", "memory.measured_bits")
    return measured_bits(model, cache)
