"""The best KV cache for a memory budget: ``make_prompt_cache(model, bits=4.25)`` (Chapter 9).

Users ask for "the best cache at about 4 bits", not for a codec. A budget is an average
number of bits per cached coordinate over keys and values, per-vector side information
(the fp16 norm) included; per-layer constants that do not grow with the context (a
centering mean, one sink token in full precision) are not counted — they cost
2·H·D·4 bytes per layer each, 1.5 KB per layer on SmolLM2-135M, and are reported by
``nbytes``.

``BUDGETS`` lists the configurations measured in Chapter 9 (perplexity on Wikipedia
through the cache; the chapter and ``turboquant eval`` print the numbers). What they
share is what the measurements showed:

* keys are centered (``Centered``: a per-head mean removed — exact for attention) and the
  first token, the attention sink, is kept exactly: centering alone barely helps because
  the sink's key lies far from the mean, and its score error moves most of the softmax
  mass; with both, the key error costs about half as much perplexity;
* keys get at least as many bits as values: the softmax amplifies key error, values are
  averaged.

``make_prompt_cache(model, bits=b)`` builds ``pick(b)``'s codecs and, wherever the model
allows it, learns the key mean before RoPE and turns it with each position
(``prerope.turned_mean``, Chapter 10): the same codes, bits and sink; against the mean
learned after RoPE better beyond the interval in 14 of 18 recorded comparisons (SmolLM2,
Qwen2.5-Coder), indistinguishable in the other 4 (Gemma 3, whose sliding-window layers keep
the mean after RoPE, and Qwen on news at 4.25 bits), worse in none. The rows measured here, and
every recorded row named ``budget …``, learn the mean after RoPE (``turned_mean=False``).

Each configuration carries its measured perplexity increase over fp32 (SmolLM2-135M, 4096
Wikipedia tokens, 512-token windows, three rotation seeds: the recorded run ``book/results/eval_full.json``, which
a test checks these numbers against). ``pick(bits)`` returns the configuration with the
smallest measured increase among those within the budget (fewer bits on a tie), so more
bits are never chosen when they measured worse (at 8.25 bits K6/V6, −0.03 %, over K8/V8, +0.00 %).
The recorded increases are point estimates over three rotation seeds; above 5 bits the
candidates' paired differences hold zero (Chapter 9), so the choice among them is within
the noise.

This module is the one home of three rules every other module uses:

* **bits of a configuration** are what its codecs say (``codec.bits_per_coordinate``,
  averaged over keys and values): ``Budget.bits`` builds its codecs and asks them;
* **the best configuration within a budget**: ``best_within`` (one tolerance, ``TOLERANCE``;
  smallest score, fewer bits on a tie) — budgets, profiles, the suite and the figures call it;
* **TurboQuant_mse for keys and values**: ``codecs_for`` (keys optionally centred; the
  value codec's rotation seed is the key codec's + 1, so keys and values are rotated
  independently, in every table that uses it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional, TypeVar

__all__ = ["Budget", "BUDGETS", "pick", "codecs_for", "best_within", "within", "TOLERANCE", "RECORDED_RUN", "GOALS"]

T = TypeVar("T")
TOLERANCE = 1e-9          # bits that differ by float rounding only are equal
# The quality goals (Chapter 10): within each budget (bits per coordinate of the codes and
# their side information, a configuration's `bits`), the largest perplexity increase (%)
# allowed on held-out text, on the worst held-out domain. The exact tokens a cache keeps
# besides its codes (sinks, fit tokens, float16 windows) are reported as measured bits.
GOALS = {4.25: 1.0, 3.25: 4.0, 2.25: 15.0}


def within(bits: float, budget: float) -> bool:
    """Whether ``bits`` per coordinate fit in ``budget`` (up to float rounding)."""
    return bits <= budget + TOLERANCE


def best_within(items: Iterable[T], budget: float, *, bits: Callable[[T], float],
                score: Callable[[T], float]) -> Optional[T]:
    """The item with the smallest ``score`` among ``items`` whose ``bits`` fit in ``budget``
    (fewer bits on a tie, then the first); None if none fits. The one rule for "the best
    configuration within a budget": ``pick``, calibrated profiles, ``suite.best_under`` and
    the figures all call it."""
    fits = [(score(it), bits(it), i, it) for i, it in enumerate(items) if within(bits(it), budget)]
    return min(fits, key=lambda t: t[:3])[3] if fits else None


_SAME = object()


def codecs_for(key_bits, value_bits=_SAME, center_keys: bool = False, seed: int = 0, *,
               center_values: bool = False):
    """(key codec factory, value codec factory), each ``dim -> codec``, for
    TurboQuant_mse at ``key_bits``/``value_bits`` bits (``value_bits`` defaults to
    ``key_bits``; None keeps that side exact, ``Identity``), keys (and values, with
    ``center_values``) optionally ``Centered``. The one seed convention: keys use ``seed``,
    values ``seed + 1`` (independent rotations). ``key_bits`` may be a ``Budget`` (its bits
    and centering; then only ``seed=`` may follow)."""
    from .codecs import Centered, Identity, TurboQuantMSE
    if isinstance(key_bits, Budget):
        if value_bits is not _SAME:
            if isinstance(value_bits, int) and not isinstance(value_bits, bool):   # codecs_for(budget, seed)
                from .checks import deprecated
                deprecated("codecs_for(budget, seed)", "codecs_for(budget, seed=seed)")
                seed = value_bits
            else:
                raise TypeError(f"codecs_for(budget, …) takes only seed=, got {value_bits!r}")
        key_bits, value_bits, center_keys = key_bits.key_bits, key_bits.value_bits, key_bits.center_keys
    elif value_bits is _SAME:
        value_bits = key_bits

    def factory(b, s, centered):
        if b is None:
            return lambda d: Identity(d)
        if centered:
            return lambda d: Centered(TurboQuantMSE(d, b, seed=s))
        return lambda d: TurboQuantMSE(d, b, seed=s)
    return factory(key_bits, seed, center_keys), factory(value_bits, seed + 1, center_values)


@dataclass(frozen=True)
class Budget:
    """One measured configuration: TurboQuant_mse bits for keys and values, key centering,
    and the number of leading tokens kept exactly (attention sinks)."""

    key_bits: int
    value_bits: int
    measured_increase: float          # % perplexity over fp32 in the recorded run
    center_keys: bool = True
    sink_tokens: int = 1

    def codecs(self, dim: int, seed: int = 0) -> tuple:
        """(key codec, value codec) at head size ``dim`` (``codecs_for``)."""
        key, value = codecs_for(self, seed=seed)
        return key(dim), value(dim)

    def bits(self, dim: int) -> float:
        """Average over keys and values of the codecs' ``bits_per_coordinate`` (b + 16/D: the
        fp16 norm of each vector)."""
        key, value = self.codecs(dim)
        return (key.bits_per_coordinate + value.bits_per_coordinate) / 2

    def bits_per_coordinate(self, dim: int) -> float:
        """Deprecated name of ``bits``."""
        from .checks import deprecated
        deprecated("Budget.bits_per_coordinate(dim)", "Budget.bits(dim)")
        return self.bits(dim)

    @property
    def name(self) -> str:
        c = "centered " if self.center_keys else ""
        return f"{c}K{self.key_bits}/V{self.value_bits}, {self.sink_tokens} sink"


BUDGETS = (
    Budget(2, 2, 80.80), Budget(3, 2, 23.57), Budget(3, 3, 14.46), Budget(4, 3, 4.84),
    Budget(4, 4, 2.79), Budget(5, 4, 1.15), Budget(5, 5, 0.61), Budget(6, 6, -0.03),
    Budget(8, 8, 0.00),
)
RECORDED_RUN = "book/results/eval_full.json"   # where the measured increases come from


def pick(bits: float, dim: int) -> Budget:
    """The measured configuration with the smallest perplexity increase among those with at
    most ``bits`` bits per coordinate (at head size ``dim``); fewer bits on a tie."""
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or bits != bits:
        raise TypeError(f"bits must be a number, got {bits!r}")
    best = best_within(BUDGETS, bits, bits=lambda b: b.bits(dim), score=lambda b: b.measured_increase)
    if best is None:
        lo = min(b.bits(dim) for b in BUDGETS)
        raise ValueError(f"no measured configuration fits {bits:g} bits per coordinate at head size "
                         f"{dim}; the smallest is {lo:g}")
    return best
