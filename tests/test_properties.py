"""Property tests (hypothesis), bounded to about a minute: random shapes, sizes and seeds
for the rules every codec and cache file must keep (issue #13, "keep the probing")."""
import copy
import functools
import math

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import turboquant as tq
from turboquant.codecs import CODECS
from turboquant.rotation import Rotation

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SCALAR_DIMS = [16, 24, 48, 64, 80, 96, 128]


@FAST
@given(dim=st.integers(2, 300), kind=st.sampled_from(["haar", "hadamard"]), seed=st.integers(0, 2**31),
       rows=st.integers(1, 5))
def test_rotation_inverts(dim, kind, seed, rows):
    try:
        r = Rotation(kind, dim, seed)
    except ValueError as e:
        assert kind == "hadamard" and "Hadamard" in str(e)
        return
    x = mx.random.normal((rows, dim), key=mx.random.key(seed % 1000))
    assert mx.allclose(r.invert(r.apply(x)), x, atol=1e-4).item()


@FAST
@given(dim=st.sampled_from(SCALAR_DIMS), bits=st.integers(1, 6), seed=st.integers(0, 1000),
       lead=st.lists(st.integers(1, 4), min_size=0, max_size=3),
       dtype=st.sampled_from([mx.float32, mx.float16, mx.bfloat16]))
def test_scalar_codec_round_trip_properties(dim, bits, seed, lead, dtype):
    codec = tq.TurboQuantMSE(dim, bits, rotation="haar", seed=seed)
    n = max(64, math.prod(lead))
    x = mx.random.normal((n, dim), key=mx.random.key(seed))
    xs = x[:math.prod(lead)].reshape(*lead, dim).astype(dtype)
    code = codec.encode(xs)
    out = codec.decode(code)
    assert out.shape == xs.shape and out.dtype == dtype and mx.all(mx.isfinite(out)).item()
    # error within a small factor of the codec's expected distortion (a batch of n vectors)
    full = codec.decode(codec.encode(x))
    rel = (mx.sum((full - x) ** 2) / mx.sum(x * x)).item()
    assert rel < 2.0 * codec.expected_mse + 1e-3
    again = tq.from_config(codec.config())
    assert again == codec
    code2 = again.encode(xs)
    assert all(mx.array_equal(code[k], code2[k]).item() for k in code.arrays)


@functools.lru_cache(maxsize=None)
def _example(name: str, dim: int):
    from conftest import codec_examples
    (codec,) = [c for c in codec_examples(dim) if c.name == name]
    return codec


@FAST
@given(name=st.sampled_from(sorted(CODECS)),                 # every registered codec
       dim=st.sampled_from([32, 64, 96]), seed=st.integers(0, 1000), rows=st.integers(0, 9),
       dtype=st.sampled_from([mx.float32, mx.float16, mx.bfloat16]))
def test_every_codec_keeps_shape_dtype_and_rebuilds(name, dim, seed, rows, dtype):
    codec = _example(name, dim)
    x = mx.random.normal((rows, dim), key=mx.random.key(seed)).astype(dtype)
    code = codec.encode(x)
    out = codec.decode(code)
    assert out.shape == x.shape and out.dtype == dtype and mx.all(mx.isfinite(out)).item()
    assert tq.from_config(codec.config()) == codec
    assert code.nbytes == rows * codec.nbytes_per_vector


@pytest.fixture(scope="module")
def llama():
    from turboquant.models import tiny_model
    return tiny_model("llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)


CACHE_SPECS = [dict(), dict(fp_window=4), dict(sink_tokens=2), dict(max_kv_size=12),
               dict(key_codec=lambda d: tq.Centered(tq.TurboQuantMSE(d, 3))),
               dict(key_codec=lambda d: tq.FibQuant(d, 2, 12), value_codec=lambda d: tq.PolarQuant(d, rotation="haar"))]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=st.integers(0, len(CACHE_SPECS) - 1), n=st.integers(1, 40), seed=st.integers(0, 1000),
       data=st.data())
def test_cache_files_round_trip_and_corruption_is_always_caught(llama, tmp_path_factory, spec, n, seed, data):
    from turboquant.models import run_in_chunks
    cache = tq.make_prompt_cache(llama, **CACHE_SPECS[spec])
    toks = mx.random.randint(1, 256, (1, n), key=mx.random.key(seed))
    split = data.draw(st.integers(1, n))
    run_in_chunks(llama, toks, cache, [split] + [1] * (n - split))
    path = tmp_path_factory.mktemp("c") / "cache.bin"
    tq.save_prompt_cache(path, cache)
    loaded = tq.load_prompt_cache(path)
    nxt = mx.array([[7]])
    reference = llama(nxt, cache=copy.deepcopy(cache))           # the original, not another load
    assert mx.array_equal(llama(nxt, cache=loaded), reference).item()
    # damage: flip, truncate or zero random bytes → ValueError, or (a byte nobody reads) the same cache
    raw = bytearray(path.read_bytes())
    how = data.draw(st.sampled_from(["flip", "truncate", "zero"]))
    at = data.draw(st.integers(0, len(raw) - 1))
    if how == "flip":
        raw[at] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        raw = raw[:at]
    else:
        raw[at:at + 16] = bytes(len(raw[at:at + 16]))
    bad = path.with_name("bad.bin")
    bad.write_bytes(bytes(raw))
    try:
        damaged = tq.load_prompt_cache(bad)
    except ValueError:
        return
    assert mx.array_equal(llama(nxt, cache=damaged), reference).item()
