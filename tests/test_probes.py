"""Reproductions of the defects found by probing the package as a new user would (issue
#13), one test per defect, so each stays fixed."""
import copy
import threading

import mlx.core as mx
import numpy as np
import pytest

import turboquant as tq
from turboquant.codecs.base import Code


def all_codecs(dim=64):
    """One instance of every registered codec at head size ``dim`` (fitted where needed)."""
    return [tq.TurboQuantMSE(dim, 4), tq.QJL(dim), tq.TurboQuantProd(dim, 3), tq.PolarQuant(dim),
            tq.FibQuant(dim, 2, bits=2), tq.Identity(dim), tq.AffineCodec(dim, 4),
            tq.OutlierSplit(dim, 32, channels=list(range(32))),
            tq.Centered(tq.TurboQuantMSE(dim, 4), mean=[0.5] * dim)]


# -------------------------------------------------------------- 8. empty input
@pytest.mark.parametrize("codec", all_codecs(), ids=lambda c: c.name)
@pytest.mark.parametrize("shape", [(0, 64), (1, 8, 0, 64), (0, 3, 64)])
def test_empty_input_gives_empty_results(codec, shape):
    code = codec.encode(mx.zeros(shape, mx.float16))
    full = codec.encode(mx.ones((1, 64)))
    assert code.shape == shape[:-1]
    for name, a in code.arrays.items():
        assert a.shape == (*shape[:-1], full[name].shape[-1]) and a.dtype == full[name].dtype
    x = codec.decode(code)
    assert x.shape == shape and x.dtype == mx.float16


# -------------------------------------------------------------- 9. one set of input rules
@pytest.mark.parametrize("make", [
    lambda v: tq.TurboQuantMSE(64, 4, seed=v), lambda v: tq.QJL(64, seed=v),
    lambda v: tq.TurboQuantProd(64, 3, seed=v), lambda v: tq.PolarQuant(64, seed=v),
    lambda v: tq.FibQuant(64, 2, bits=2, seed=v), lambda v: tq.AffineCodec(64, 4, seed=v),
    lambda v: tq.OutlierSplit(64, 32, seed=v)])
def test_seed_rules_are_the_same_everywhere(make):
    with pytest.raises(ValueError, match="seed must be an int >= 0, got -1"):
        make(-1)
    with pytest.raises(ValueError, match=r"seed must be an int, got 1\.5"):
        make(1.5)
    with pytest.raises(ValueError, match="seed must be an int"):
        make(True)
    assert make(np.int64(3)) == make(3)
    assert type(make(np.int64(3)).config()["seed"]) is int


def test_numpy_integers_are_normalised_and_serialise():
    import json
    c = tq.FibQuant(np.int64(64), k=np.int32(2), bits=2)
    assert c == tq.FibQuant(64, 2, bits=2)
    hash(c)
    json.dumps(c.config())
    for c in (tq.TurboQuantMSE(np.int64(64), np.int64(4)), tq.PolarQuant(np.int16(64), (np.int8(4), 2)),
              tq.QJL(np.int64(64), m=np.int64(32))):
        json.dumps(c.config())


@pytest.mark.parametrize("make, name", [(lambda: tq.TurboQuantMSE(64, 4.0), "bits"),
                                        (lambda: tq.TurboQuantMSE(64.0, 4), "dim"),
                                        (lambda: tq.QJL(64, m=3.5), "m"),
                                        (lambda: tq.AffineCodec(64, 4, group_size=64.0), "group_size"),
                                        (lambda: tq.PolarQuant(64, (4, 2.5)), r"level_bits\[1\]"),
                                        (lambda: tq.OutlierSplit(64, 8.0), "n_outliers")])
def test_floats_are_rejected_with_the_parameter_name(make, name):
    with pytest.raises(ValueError, match=name):
        make()


def test_outlier_split_speaks_in_the_users_terms():
    with pytest.raises(ValueError, match=r"dim=100, n_outliers=32.*32 and 68 channels.*haar"):
        tq.OutlierSplit(100)
    assert tq.OutlierSplit(100, rotation="haar").dim == 100


def test_affine_accepts_every_input_shape_the_others_accept():
    c = tq.AffineCodec(64, 4)
    x = mx.random.normal((64,), key=mx.random.key(0))
    one = c.decode(c.encode(x))
    batch = c.decode(c.encode(x.reshape(1, 1, 1, 64)))
    assert one.shape == (64,) and batch.shape == (1, 1, 1, 64)
    assert mx.array_equal(one, batch.reshape(64)).item()


# -------------------------------------------------------------- 10. decode checks Code.shape
@pytest.mark.parametrize("codec", all_codecs(), ids=lambda c: c.name)
def test_decode_refuses_a_code_whose_shape_contradicts_its_fields(codec):
    code = codec.encode(mx.random.normal((3, 64), key=mx.random.key(1)))
    forged = Code(code.arrays, (1,), code.dtype, code.codec)
    with pytest.raises(ValueError, match=r"code's shape is \(1,\)"):
        codec.decode(forged)
    one_field_cut = dict(code.arrays)
    name = next(iter(one_field_cut))
    one_field_cut[name] = one_field_cut[name][:2]
    with pytest.raises(ValueError, match=name):
        codec.decode(Code(one_field_cut, code.shape, code.dtype, code.codec))


# -------------------------------------------------------------- 11. out of the storage range
def test_identity_float16_refuses_values_beyond_its_range():
    c = tq.Identity(64, "float16")
    with pytest.raises(ValueError, match="float16's range"):
        c.encode(mx.full((2, 64), 1e6))
    assert mx.all(mx.isfinite(c.decode(c.encode(mx.full((2, 64), 6e4))))).item()
