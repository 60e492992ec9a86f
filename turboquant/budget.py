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

Each configuration carries its measured perplexity increase over fp32 (SmolLM2-135M, 4096
Wikipedia tokens, 512-token windows: the recorded run ``book/results/eval_full.json``, which
a test checks these numbers against). ``pick(bits)`` returns the configuration with the
smallest measured increase among those within the budget (fewer bits on a tie), so more
bits are never chosen when they measured worse (K5/V5 at +0.58 % against K5/V4 at +0.38 %).
"""
from __future__ import annotations

from dataclasses import dataclass

from .codecs import Centered, TurboQuantMSE

__all__ = ["Budget", "BUDGETS", "pick", "codecs_for", "RECORDED_RUN"]


@dataclass(frozen=True)
class Budget:
    """One measured configuration: TurboQuant_mse bits for keys and values, key centering,
    and the number of leading tokens kept exactly (attention sinks)."""

    key_bits: int
    value_bits: int
    measured_increase: float          # % perplexity over fp32 in the recorded run
    center_keys: bool = True
    sink_tokens: int = 1

    def bits_per_coordinate(self, dim: int) -> float:
        """Average over K and V of b + 16/D (the fp16 norm of each vector)."""
        return (self.key_bits + self.value_bits) / 2 + 16 / dim

    @property
    def name(self) -> str:
        c = "centered " if self.center_keys else ""
        return f"{c}K{self.key_bits}/V{self.value_bits}, {self.sink_tokens} sink"


BUDGETS = (
    Budget(2, 2, 73.31), Budget(3, 2, 24.14), Budget(3, 3, 13.76), Budget(4, 3, 5.45),
    Budget(4, 4, 2.67), Budget(5, 4, 0.38), Budget(5, 5, 0.58), Budget(6, 6, 0.32),
    Budget(8, 8, -0.02),
)
RECORDED_RUN = "book/results/eval_full.json"   # where the measured increases come from


def pick(bits: float, dim: int) -> Budget:
    """The measured configuration with the smallest perplexity increase among those with at
    most ``bits`` bits per coordinate (at head size ``dim``); fewer bits on a tie."""
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or bits != bits:
        raise TypeError(f"bits must be a number, got {bits!r}")
    fits = [b for b in BUDGETS if b.bits_per_coordinate(dim) <= bits + 1e-9]
    if not fits:
        lo = min(b.bits_per_coordinate(dim) for b in BUDGETS)
        raise ValueError(f"no measured configuration fits {bits} bits per coordinate at head size "
                         f"{dim}; the smallest is {lo:g}")
    return min(fits, key=lambda b: (b.measured_increase, b.bits_per_coordinate(dim)))


def codecs_for(budget: Budget, seed: int = 0):
    """(key codec factory, value codec factory) for ``make_prompt_cache``."""
    def key(d):
        c = TurboQuantMSE(d, budget.key_bits, seed=seed)
        return Centered(c) if budget.center_keys else c

    def value(d):
        return TurboQuantMSE(d, budget.value_bits, seed=seed + 1)
    return key, value
