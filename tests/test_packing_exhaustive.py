"""Issue #13.1: mlx 0.32.4's ``mx.compile`` miscompiles shift-and-mask chains with scalar
constants (``mx.compile(lambda w: (w >> 1) & 63)`` returns 0 for uint32 input), which made
single-vector decode wrong at 5–6 bits. Every path the codecs use is checked here against a
NumPy bit-stream reference: raw packing for every width 1–16 × every length up to 256 ×
batch sizes 1, 2, 3, 7, 200, and TurboQuant_mse's encode/decode (whose cores are compiled)
for every bit width and head size it accepts, for one vector and for batches."""
import mlx.core as mx
import numpy as np
import pytest

import turboquant as tq
from turboquant.packing import pack, unpack

ROWS = (1, 2, 3, 7, 200)


def reference_pack(idx: np.ndarray, bits: int) -> np.ndarray:
    """(rows, n) ints → (rows, ceil(n·bits/8)) uint8: index j at bits [j·b, (j+1)·b), little-endian."""
    rows, n = idx.shape
    bitplanes = (idx[..., None] >> np.arange(bits)) & 1                 # (rows, n, bits)
    return np.packbits(bitplanes.reshape(rows, n * bits).astype(np.uint8), axis=1, bitorder="little")


def reference_unpack(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    rows = packed.shape[0]
    stream = np.unpackbits(packed, axis=1, bitorder="little")[:, :n * bits].reshape(rows, n, bits)
    return (stream.astype(np.uint32) << np.arange(bits, dtype=np.uint32)).sum(-1).astype(np.uint32)


@pytest.mark.parametrize("bits", range(1, 17))
def test_pack_and_unpack_equal_the_numpy_reference(bits):
    rng = np.random.default_rng(bits)
    for n in range(1, 257):
        for rows in ROWS:
            idx = rng.integers(0, 2 ** bits, (rows, n), dtype=np.uint32)
            ref = reference_pack(idx, bits)
            packed = pack(mx.array(idx), bits)
            assert np.array_equal(np.array(packed), ref), (bits, n, rows)
            assert np.array_equal(np.array(unpack(mx.array(ref), bits, n)), idx), (bits, n, rows)


@pytest.mark.parametrize("bits", range(1, 9))
def test_scalar_codec_paths_equal_the_reference_for_every_size(bits):
    """Compiled encode and decode of TurboQuant_mse against eager NumPy: the indices are the
    reference bucketization of the rotated unit vectors, the packed bytes the reference
    packing, and decode the centroids of the reference unpacking, for one vector and many."""
    for dim in range(3, 257):
        codec = tq.TurboQuantMSE(dim, bits, rotation="haar", seed=dim)
        thresholds = np.array(codec.thresholds)
        centroids = np.array(codec.centroids)
        R = np.array(codec.rotation.matrix(), dtype=np.float64)
        x = np.random.default_rng(dim).standard_normal((200, dim)).astype(np.float32)
        for rows in (1, 200):
            xr = x[:rows]
            # one vector as a 1-D input (the case that was wrong), more as a batch
            code = codec.encode(mx.array(xr[0] if rows == 1 else xr))
            u = xr / np.linalg.norm(xr, axis=1, keepdims=True)
            y = u.astype(np.float64) @ R.T
            idx_ref = (y[..., None] > thresholds).sum(-1)
            got = reference_unpack(np.array(code["idx"]).reshape(rows, -1), bits, dim)
            # a coordinate within float32 rounding of a threshold may fall either side
            near = np.abs(y[..., None] - thresholds).min(-1) < 1e-5
            assert np.all((got == idx_ref) | near), (bits, dim, rows)
            dec = np.array(codec.decode(code)).reshape(rows, dim)
            norm = np.array(code["norm"].astype(mx.float32)).reshape(rows, 1)
            ref = (centroids[got] @ R) * norm
            assert np.allclose(dec, ref, atol=1e-5 * max(1.0, float(np.abs(ref).max()))), (bits, dim, rows)
