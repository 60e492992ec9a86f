"""Codecs as a new user meets them: empty input, one set of input rules (seeds, NumPy
integers, floats), codes whose shape contradicts their fields, values beyond the storage
range, copies and pickles, codebook builds that cannot finish or take long, every registered
codec (``conftest.codec_examples``)."""
import copy

import mlx.core as mx
import numpy as np
import pytest

import turboquant as tq
from turboquant.codecs.base import Code


def all_codecs(dim=64):
    """One instance of every registered codec at head size ``dim`` (fitted where needed)."""
    from conftest import codec_examples
    return codec_examples(dim)


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


def _seeded():
    """A maker seed → codec for every registered codec whose configuration has a seed."""
    from conftest import codec_examples
    return [(c.name, lambda v, cfg=c.config(): tq.from_config({**cfg, "seed": v}))
            for c in codec_examples(64, fitted=False) if "seed" in c.config()]


@pytest.mark.parametrize("make", [m for _, m in _seeded()], ids=[n for n, _ in _seeded()])
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


def test_identity_float16_refuses_values_beyond_its_range():
    c = tq.Identity(64, "float16")
    with pytest.raises(ValueError, match="float16's range"):
        c.encode(mx.full((2, 64), 1e6))
    assert mx.all(mx.isfinite(c.decode(c.encode(mx.full((2, 64), 6e4))))).item()


# FibQuant construction is bounded
def test_fibquant_refuses_a_build_it_cannot_finish():
    import time
    t = time.perf_counter()
    with pytest.raises(ValueError, match=r"N=65536 .* would take about"):
        tq.FibQuant(64, k=2, bits=8)
    assert time.perf_counter() - t < 5


def test_codecs_pickle_and_deep_copy_through_their_configuration():
    import pickle
    for codec in all_codecs():
        assert pickle.loads(pickle.dumps(codec)) == codec
        twin = copy.deepcopy(codec)
        x = mx.random.normal((3, 64), key=mx.random.key(2))
        assert all(mx.array_equal(codec.encode(x)[n], twin.encode(x)[n]).item() for n in codec.encode(x).arrays)


def test_a_long_codebook_build_shows_a_progress_bar_on_a_terminal(tmp_path, monkeypatch):
    import io
    import sys

    from turboquant.codecs import fibquant

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setenv("TURBOQUANT_CACHE", str(tmp_path))
    fibquant.clear_memory_cache()
    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    assert fibquant.build_seconds(32, 2, 128) > 2
    fibquant.fibquant_codebook(32, 2, 128, seed=5)
    assert "FibQuant codebook D=32 k=2 N=128" in err.getvalue()
    quiet = io.StringIO()                                      # not a terminal: no bar
    monkeypatch.setattr(sys, "stderr", quiet)
    fibquant.clear_memory_cache()
    fibquant.fibquant_codebook(32, 2, 128, seed=6)
    assert quiet.getvalue() == ""


def test_unregistered_codec_subclasses_still_copy():
    class Mine(tq.TurboQuantMSE):
        name = "mine_not_registered"

        def config(self):
            return {**super().config(), "codec": self.name}

    c = Mine(64, 3)
    assert copy.deepcopy(c).config() == c.config()


def test_scalar_byte_tables_only_where_whole_bytes_hold_indices():
    from turboquant.attention import attention_from_codes, reference_attention
    codec = tq.TurboQuantMSE(20, 1, rotation="haar")                 # D·b = 20 bits: not whole bytes
    c = tq.TurboQuantKVCache(codec)
    k = mx.random.normal((1, 1, 6, 20), key=mx.random.key(0))
    kd, vd = c.update_and_fetch(k, k)
    kv, vv = c.codes()
    q = mx.random.normal((1, 2, 1, 20), key=mx.random.key(1))
    assert mx.abs(attention_from_codes(q, kv, vv) - reference_attention(q, kd, vd)).max().item() < 1e-5


def test_a_config_missing_or_inventing_a_field_is_refused_by_name():
    """from_config names the fields a config lacks or does not have (not a TypeError from the
    constructor); every registered codec's own config still rebuilds it."""
    from conftest import codec_examples
    with pytest.raises(ValueError, match=r"codec 'turboquant_mse': the config lacks 'dim', 'bits' \(its fields: "):
        tq.from_config({"codec": "turboquant_mse"})
    with pytest.raises(ValueError, match=r"has unknown field\(s\) 'seedx'"):
        tq.from_config({"codec": "turboquant_mse", "dim": 64, "bits": 4, "seedx": 1})
    for c in codec_examples(64, fitted=False):
        assert tq.from_config(c.config()).config() == c.config()
