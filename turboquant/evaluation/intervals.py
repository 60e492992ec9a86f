"""How sure a measured difference is (Chapter 9): a paired block bootstrap over windows,
combined with the spread over rotation seeds.

Perplexity is scored in windows (512 tokens each, every window through a fresh cache), so
the window is the unit that is independent: tokens inside a window share their context
and are not. A *block bootstrap* therefore resamples whole windows, with replacement, and
recomputes the statistic on each resample; the 2.5 % and 97.5 % quantiles of the
resampled statistics are a 95 % interval. It is *paired*: every configuration is scored on
the same windows, and each resample draws the same windows for all of them, so a window
that is hard for every cache moves them together and drops out of their difference — the
interval of a difference is much narrower than the two intervals side by side. For a
codec with a random rotation, each resample also draws rotation seeds with replacement
from those measured, so the interval covers the choice of seed too.

The inputs are per-window sums (``scoring.perplexity`` returns them): negative log
likelihoods ``nll`` (seeds × windows, or windows), scored tokens ``n`` (windows), and
optionally KL sums and top-1 counts. Nothing here runs a model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

__all__ = ["Interval", "resample", "increase", "ppl_increase", "mean_rate", "difference", "wilson", "sign_test",
           "as_text", "LEVEL", "N_BOOT"]

LEVEL = 0.95
N_BOOT = 2000


@dataclass(frozen=True)
class Interval:
    """A point estimate on all scored tokens and its bootstrap interval [lo, hi]."""

    value: float
    lo: float
    hi: float

    @property
    def holds_zero(self) -> bool:
        """bool: whether the interval contains 0 (then the difference is not established)."""
        return self.lo <= 0.0 <= self.hi

    def as_dict(self) -> dict:
        return {"value": self.value, "lo": self.lo, "hi": self.hi}

    def text(self, fmt: str = "+.2f") -> str:
        """The interval as "value [lo, hi]" with ``fmt``, e.g. "+4.29 [+3.12, +5.91]"."""
        return as_text(self.as_dict(), fmt)


def as_text(interval: dict, fmt: str = "+.2f") -> str:
    """An interval as recorded in JSON ({"value", "lo", "hi"}) as "value [lo, hi]"."""
    v, lo, hi = (format(interval[k], fmt) for k in ("value", "lo", "hi"))
    return f"{v} [{lo}, {hi}]"


def increase(nll, nll_ref, tokens):
    """Perplexity increase in % from NLL sums over the same ``tokens``:
    100·(exp((nll − nll_ref)/tokens) − 1). The one formula: point estimates, bootstrap
    samples and per-window plots all go through it (numbers or arrays)."""
    return 100 * (np.exp((np.asarray(nll, dtype=np.float64) - nll_ref) / tokens) - 1)


def _seeds_by_windows(a, n_windows: int, name: str) -> np.ndarray:
    """``a`` as (seeds, windows) float64; one row when it has no seed axis."""
    x = np.asarray(a, dtype=np.float64)
    if x.ndim == 1:
        x = x[None]
    if x.ndim != 2 or x.shape[1] != n_windows or x.shape[0] < 1:
        raise ValueError(f"{name} must be (windows,) or (seeds, windows) with {n_windows} windows, got {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} contains NaN or Inf")
    return x


def resample(n_windows: int, n_boot: int = N_BOOT, seed: int = 0) -> np.ndarray:
    """(n_boot, n_windows) window indices drawn with replacement: the resamples every
    configuration shares (this is what makes the bootstrap paired)."""
    if n_windows < 1:
        raise ValueError(f"a bootstrap needs at least one window, got {n_windows}")
    return np.random.default_rng(seed).integers(0, n_windows, size=(n_boot, n_windows))


def _seed_draws(n_seeds: int, n_boot: int, salt: int) -> np.ndarray:
    return np.random.default_rng([salt, n_seeds]).integers(0, n_seeds, size=(n_boot, n_seeds))


def _pooled(x: np.ndarray, windows: np.ndarray, seeds: Optional[np.ndarray]) -> np.ndarray:
    """Σ over the drawn windows of the mean over the drawn seeds: (n_boot,) (or the point
    estimate when ``windows`` is None)."""
    if windows is None:
        return x.mean(axis=0).sum()
    per_seed = x[:, windows].sum(axis=-1)                       # (seeds, n_boot)
    picked = np.take_along_axis(per_seed.T, seeds, axis=1)     # (n_boot, seeds drawn)
    return picked.mean(axis=1)


def _interval(point: float, samples: np.ndarray, level: float) -> Interval:
    a = (1 - level) / 2
    lo, hi = np.quantile(samples, [a, 1 - a])
    return Interval(float(point), float(min(lo, point)), float(max(hi, point)))


def ppl_increase(nll, nll_ref, n, windows: Optional[np.ndarray] = None, level: float = LEVEL,
                 salt: int = 1) -> Interval:
    """Perplexity increase over the reference, in %: 100·(exp((Σ nll − Σ nll_ref)/Σ n) − 1),
    the NLL of a configuration with seeds averaged over them; its interval from ``windows``
    (``resample``; default: 2000 resamples with seed 0)."""
    n = np.asarray(n, dtype=np.float64)
    W = n.shape[0]
    x, ref = _seeds_by_windows(nll, W, "nll"), _seeds_by_windows(nll_ref, W, "nll_ref")
    windows = resample(W) if windows is None else windows
    seeds, ref_seeds = _seed_draws(x.shape[0], len(windows), salt), _seed_draws(ref.shape[0], len(windows), salt + 1)
    point = increase(_pooled(x, None, None), _pooled(ref, None, None), n.sum())
    samples = increase(_pooled(x, windows, seeds), _pooled(ref, windows, ref_seeds), n[windows].sum(axis=-1))
    return _interval(point, samples, level)


def mean_rate(sums, n, windows: Optional[np.ndarray] = None, level: float = LEVEL, salt: int = 1) -> Interval:
    """A per-token mean (mean KL, top-1 agreement): Σ sums / Σ n, with its interval."""
    n = np.asarray(n, dtype=np.float64)
    x = _seeds_by_windows(sums, n.shape[0], "sums")
    windows = resample(n.shape[0]) if windows is None else windows
    seeds = _seed_draws(x.shape[0], len(windows), salt)
    return _interval(_pooled(x, None, None) / n.sum(), _pooled(x, windows, seeds) / n[windows].sum(axis=-1), level)


def difference(nll_a, nll_b, nll_ref, n, windows: Optional[np.ndarray] = None, level: float = LEVEL,
               paired: bool = True) -> Interval:
    """Δppl(A) − Δppl(B) in percentage points, both on the same resampled windows (paired):
    ``holds_zero`` says the two are indistinguishable on these windows and seeds.
    ``paired=False`` resamples B's windows independently of A's — the interval one would get
    had the two been scored on different text (Chapter 9 shows how much wider it is)."""
    n = np.asarray(n, dtype=np.float64)
    W = n.shape[0]
    a, b, ref = (_seeds_by_windows(v, W, name) for v, name in ((nll_a, "nll_a"), (nll_b, "nll_b"),
                                                                 (nll_ref, "nll_ref")))
    windows = resample(W) if windows is None else windows
    B = len(windows)
    sa, sb, sr = _seed_draws(a.shape[0], B, 1), _seed_draws(b.shape[0], B, 2), _seed_draws(ref.shape[0], B, 3)
    if a.shape == b.shape and np.array_equal(a, b):
        sb = sa                                                # the same configuration: the same draws
    stat = increase
    tokens = n[windows].sum(axis=-1)
    ref_s = _pooled(ref, windows, sr)
    if paired:
        windows_b, ref_b, tokens_b = windows, ref_s, tokens
    else:
        windows_b = np.random.default_rng([7, W]).integers(0, W, size=windows.shape)
        ref_b, tokens_b = _pooled(ref, windows_b, sr), n[windows_b].sum(axis=-1)
    samples = stat(_pooled(a, windows, sa), ref_s, tokens) - stat(_pooled(b, windows_b, sb), ref_b, tokens_b)
    r0 = _pooled(ref, None, None)
    point = stat(_pooled(a, None, None), r0, n.sum()) - stat(_pooled(b, None, None), r0, n.sum())
    return _interval(point, samples, level)


def wilson(successes: int, trials: int, level: float = LEVEL) -> Interval:
    """A success rate k/n (needle retrieval) with Wilson's score interval (Wilson 1927):
    the p whose normal test at ``level`` does not reject k successes in n trials,

        (p̂ + z²/2n ± z·√(p̂(1 − p̂)/n + z²/4n²)) / (1 + z²/n).

    Unlike p̂ ± z·√(p̂(1 − p̂)/n) it stays inside [0, 1] and is not empty at 0/n or n/n
    (20 of 20 gives [0.84, 1]: twenty successes do not prove a perfect method)."""
    from statistics import NormalDist
    for name, v in (("successes", successes), ("trials", trials)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {v!r}")
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"need 0 ≤ successes ≤ trials and trials ≥ 1, got {successes} of {trials}")
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level!r}")
    z = NormalDist().inv_cdf((1 + level) / 2)
    p, n = successes / trials, trials
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    lo = 0.0 if successes == 0 else float(max(0.0, centre - half))       # exact ends, not rounding error
    hi = 1.0 if successes == trials else float(min(1.0, centre + half))
    return Interval(p, lo, hi)


def sign_test(only_a: int, only_b: int) -> float:
    """Exact two-sided p-value of McNemar's test for two configurations answering the same
    questions (the long-context run): only the questions exactly one of them answers
    right carry information, and if both were equally good the ``only_a`` of those
    n = only_a + only_b would be Binomial(n, 1/2). p = min(1, 2·P[X ≤ min(only_a, only_b)]);
    1.0 when n = 0. Paired, like the bootstrap above: questions both get right or both get
    wrong drop out, so it separates configurations that two Wilson intervals side by side
    cannot."""
    from math import comb
    for name, v in (("only_a", only_a), ("only_b", only_b)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(comb(n, i) for i in range(min(only_a, only_b) + 1)) / 2 ** n
    return min(1.0, 2 * tail)
