"""``evaluation.position_error``: a cache's error per band of positions, on a tiny random model."""
import mlx.core as mx
import numpy as np
import pytest

import turboquant as tq
from turboquant.codecs import Identity, TurboQuantMSE
from turboquant.evaluation.fidelity import capture_qkv, position_error
from turboquant.models import tiny_model


@pytest.fixture(scope="module")
def captured():
    model = tiny_model("llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    tokens = [(7 * i) % 251 for i in range(96)]
    return model, capture_qkv(model, tokens)


def test_an_exact_cache_has_no_error_and_a_coded_one_the_codecs_in_every_band(captured):
    model, cap = captured
    exact = position_error(cap, tq.make_prompt_cache(model, key_codec=Identity(16)), [0, 32, 64, 96])
    assert exact["edges"] == [0, 32, 64, 96]
    assert np.array(exact["keys"]).shape == (2, 3) and np.all(np.array(exact["keys"]) == 0.0)
    assert np.all(np.array(exact["values"]) == 0.0)
    coded = position_error(cap, tq.make_prompt_cache(model, key_codec=TurboQuantMSE(16, 3, seed=0)), [0, 32, 64, 96])
    k = np.array(coded["keys"])
    # a rotation and a universal codebook do not care where a key sits: every band has the
    # 3-bit codec's error (≈ 0.03 at D = 16 … 128), none is exact
    assert np.all(k > 0.005) and np.all(k < 0.1)
    assert k.max() / k.min() < 3
    # the bands are where they are said to be: 32 exact sink tokens, then codes
    sunk = position_error(cap, tq.make_prompt_cache(model, key_codec=TurboQuantMSE(16, 3, seed=0), sink_tokens=32),
                          [0, 32, 96])
    assert np.all(np.array(sunk["keys"])[:, 0] == 0.0) and np.all(np.array(sunk["keys"])[:, 1] > 0.005)
    assert np.allclose(np.array(sunk["keys"])[:, 1], k[:, 1:].mean(axis=1), rtol=0.05)


def test_bad_bands_and_caches_are_refused(captured):
    model, cap = captured
    with pytest.raises(ValueError, match="increasing"):
        position_error(cap, tq.make_prompt_cache(model), [32, 32])
    with pytest.raises(ValueError, match="beyond the 96 captured"):
        position_error(cap, tq.make_prompt_cache(model), [0, 128])
    used = tq.make_prompt_cache(model)
    model(mx.array([[1, 2, 3]]), cache=used)
    with pytest.raises(ValueError, match="empty prompt cache"):
        position_error(cap, used, [0, 64])
    with pytest.raises(ValueError, match="1 layer\\(s\\), the capture 2"):
        position_error(cap, tq.make_prompt_cache(model)[:1], [0, 64])
