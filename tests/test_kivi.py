"""The KIVI-style comparison cache (``turboquant.kivi``)."""
import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from turboquant.kivi import KIVICache
from turboquant.models import tiny_model


def feed(cache, steps, H=2, D=64, seed=0):
    ks, vs, out = [], [], None
    for i, T in enumerate(steps):
        k = mx.random.normal((1, H, T, D), key=mx.random.key(seed + 2 * i))
        v = mx.random.normal((1, H, T, D), key=mx.random.key(seed + 2 * i + 1))
        ks.append(k), vs.append(v)
        out = cache.update_and_fetch(k, v)
    return mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2), out


def test_recent_tokens_exact_older_ones_quantized_per_channel_and_per_token():
    c = KIVICache(4, group=32, residual=32)
    K, V, (k, v) = feed(c, [100, 1, 1, 50, 1])              # 153 tokens
    assert k.shape == K.shape and c.offset == 153 and not hasattr(c, "bits")
    held = c.fk.shape[2]
    assert 32 <= held < 64 and (153 - held) % 32 == 0       # whole groups of 32 quantized
    recent = slice(153 - held, 153)
    assert mx.allclose(k[:, :, recent], K[:, :, recent], atol=2e-3).item()    # float16 copies
    old = slice(0, 153 - held)
    err = mx.abs(k[:, :, old] - K[:, :, old])
    assert 0.01 < err.mean().item() < 0.5                    # 4-bit codes: small but not zero
    # bytes: 4-bit codes + one fp16 scale and bias per channel per group (keys) and per 64 values
    n_q = 153 - held
    codes = 2 * 2 * n_q * 64 * 4 // 8 + 2 * 64 * (n_q // 32) * 4 + 2 * n_q * 4
    assert c.nbytes == codes + 2 * 2 * held * 64 * 2


def test_more_bits_less_error():
    errs = []
    for bits in (2, 4, 8):
        c = KIVICache(bits, residual=0)
        K, _, (k, _) = feed(c, [128])
        errs.append(mx.mean((k - K) ** 2).item())
    assert errs[0] > errs[1] > errs[2]


def test_generation_through_kivi_caches():
    model = tiny_model("llama", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2)   # D = 64
    prompt = mx.array([(7 * i) % 251 + 1 for i in range(77)])
    ref = list(generate_step(prompt, model, max_tokens=6))
    cache = [KIVICache(8, residual=32) for _ in model.layers]
    ours = list(generate_step(prompt, model, prompt_cache=cache, max_tokens=6))
    assert [t for t, _ in ours] == [t for t, _ in ref]
    # 8-bit codes on 77 - 32 tokens: log-probabilities within a few thousandths
    assert max(mx.abs(a - b).max().item() for (_, a), (_, b) in zip(ours, ref)) < 0.02
    assert cache[0].offset >= 77 + 5 and cache[0].kq is not None


@pytest.mark.parametrize("kwargs, message", [
    (dict(bits=7), "bits in"), (dict(bits=4, group=48), "group and value_group"),
    (dict(bits=4, residual=-1), "residual"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KIVICache(**kwargs)


def test_values_beyond_float16_are_refused():
    with pytest.raises(ValueError, match="float16"):
        KIVICache(4).update_and_fetch(mx.full((1, 1, 2, 64), 1e6), mx.zeros((1, 1, 2, 64)))


def test_restoring_a_state_is_refused_clearly():
    c = KIVICache(4)
    feed(c, [40])
    assert len(c.state) == 2                                 # only the float16 window so far
    with pytest.raises(NotImplementedError, match="not saved"):
        c.state = c.state


def test_a_deep_copy_continues_independently():
    """A needle trial continues a shared prefill from a deep copy: the copy and the original
    then give the same answers to the same input, and feeding one leaves the other as it was."""
    import copy
    c = KIVICache(4)
    feed(c, [70, 1])
    d = copy.deepcopy(c)
    k = mx.random.normal((1, 2, 3, 64), key=mx.random.key(9))
    out_d = d.update_and_fetch(k, k)
    assert c.offset == 71 and d.offset == 74
    out_c = c.update_and_fetch(k, k)
    assert all(mx.array_equal(a, b).item() for a, b in zip(out_c, out_d))
