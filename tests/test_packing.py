import math

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turboquant.packing import index_bits, pack, packed_bytes, unpack


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 16), n=st.integers(1, 300), rows=st.integers(1, 4), seed=st.integers(0, 10**6))
def test_round_trip_is_exact(bits, n, rows, seed):
    x = mx.random.randint(0, 2**bits, (rows, n), key=mx.random.key(seed)).astype(mx.uint32)
    words = pack(x, bits)
    assert words.dtype == mx.uint8 and words.shape == (rows, math.ceil(n * bits / 8))
    assert mx.array_equal(unpack(words, bits, n), x).item()


def test_extreme_values_and_layout():
    # all-ones indices at 3 bits fill the first 96 bits exactly
    x = mx.full((32,), 7, dtype=mx.uint32)
    assert pack(x, 3).tolist() == [0xFF] * 12
    # little-endian: index j sits at bits j*b
    assert pack(mx.array([1, 0, 0, 0], dtype=mx.uint32), 8).tolist() == [1, 0, 0, 0]
    assert pack(mx.array([5, 3], dtype=mx.uint32), 4).tolist() == [0x35]
    # 80 indices of 3 bits: 30 bytes, not 32
    assert pack(mx.zeros((80,), mx.uint32), 3).shape == (30,)


def test_index_bits():
    assert [index_bits(n) for n in (2, 3, 4, 16, 17, 256, 257)] == [1, 2, 2, 4, 5, 8, 9]
    with pytest.raises(ValueError, match="1"):
        index_bits(1)


def test_bad_arguments():
    with pytest.raises(ValueError, match="17"):
        pack(mx.zeros((4,), mx.uint32), 17)
    with pytest.raises(ValueError, match="bytes"):
        unpack(mx.zeros((3,), mx.uint8), 4, 100)
    with pytest.raises(TypeError):
        unpack(mx.zeros((50,), mx.uint32), 4, 100)
    assert packed_bytes(80, 3) == 30
