"""Each layer's measured sensitivity to coding (Chapter 10's levers): what
``allocation.allocate_layers`` spreads bits across layers by."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..progress import progress as progress_bar
from .allocation import PROBE_BITS
from .fitting import WINDOW, fit_layers

__all__ = ["layer_sensitivity"]


def layer_sensitivity(model, stats: list[dict], ids: Sequence[int], bos: Optional[int] = None,
                      bits: float = PROBE_BITS, outliers: int = 1, window: int = WINDOW,
                      progress: bool = False) -> np.ndarray:
    """(L,): increase of the mean NLL per token (nats) on ``ids`` (scored in windows of
    ``window``, as ``evaluation.perplexity``) when layer l alone is coded by the transform
    coder fitted on ``stats`` at ``bits`` (keys under the query metric, ``outliers`` exact
    values per vector, the first token exact) and every other layer is exact. Noise can
    make a layer's value slightly negative; ``allocate_layers`` floors it."""
    from mlx_lm.models.cache import make_prompt_cache as exact_cache

    from ..cache import tag_group
    from ..evaluation import perplexity
    from ..prompt_cache import make_prompt_cache
    keys, values = fit_layers(stats, bits, bits, outliers)
    ref = perplexity(model, ids, None, window=window, bos=bos)["nll"]
    out = []
    for layer in progress_bar(range(len(stats)), len(stats), "sensitivity", progress):
        def mk(layer=layer):
            cache = exact_cache(model)
            cache[layer] = make_prompt_cache(model, key_codec=keys, value_codec=values, sink_tokens=1,
                                             warn_rotating=False)[layer]
            return tag_group(cache)                  # the one coded layer is its own group
        out.append(perplexity(model, ids, mk, window=window, bos=bos)["nll"] - ref)
    return np.array(out)
