import math

import mlx.core as mx
import numpy as np
import pytest

from turboquant.attention import cosine_similarity, reference_attention, relative_error


def test_reference_matches_mlx_fast_sdpa_with_gqa_and_mask():
    q = mx.random.normal((2, 6, 5, 32), key=mx.random.key(0))
    k = mx.random.normal((2, 2, 9, 32), key=mx.random.key(1))
    v = mx.random.normal((2, 2, 9, 32), key=mx.random.key(2))
    mask = mx.tril(mx.ones((5, 9), dtype=mx.bool_), k=4)
    ours = reference_attention(q, k, v, mask=mask)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(32), mask=mask)
    assert mx.abs(ours - theirs).max().item() < 1e-5


def test_metrics():
    a = mx.array([[1.0, 0.0], [0.0, 2.0]])
    assert np.allclose(np.array(cosine_similarity(a, a)), 1)
    assert cosine_similarity(a, -a)[0].item() == pytest.approx(-1)
    assert relative_error(a * 1.1, a) == pytest.approx(0.1, rel=1e-5)
    with pytest.raises(ValueError, match="shape"):
        reference_attention(a, a, a)


def test_codes_attention_refuses_what_is_not_a_model():
    import pytest as _pytest
    from turboquant.attention import codes_attention
    with _pytest.raises(TypeError, match="needs an mlx-lm model"):
        with codes_attention(None):
            pass


def test_reference_attention_takes_causal_like_attention_from_codes():
    import mlx.core as mx
    from turboquant.attention import reference_attention
    q = mx.random.normal((1, 2, 3, 8), key=mx.random.key(0))
    k = mx.random.normal((1, 2, 7, 8), key=mx.random.key(1))
    explicit = mx.arange(4, 7)[:, None] >= mx.arange(7)[None]
    assert mx.allclose(reference_attention(q, k, k, mask="causal"), reference_attention(q, k, k, mask=explicit)).item()
