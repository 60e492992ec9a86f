import mlx.core as mx
import numpy as np
import pytest

from turboquant.rotation import Rotation, hadamard_matrix, hadamard_sizes_ok

HEAD_SIZES = [64, 80, 96, 128, 256]


@pytest.mark.parametrize("kind", ["haar", "hadamard"])
@pytest.mark.parametrize("dim", HEAD_SIZES)
def test_orthogonal_and_inverse(kind, dim):
    r = Rotation(kind, dim, seed=7)
    m = r.matrix()
    assert np.abs(m @ m.T - np.eye(dim)).max() < 1e-6
    x = mx.random.normal((50, dim), key=mx.random.key(1))
    y = r.apply(x)
    assert mx.abs(r.invert(y) - x).max().item() < 1e-5
    # apply is the matrix it reports, and preserves norms
    assert np.abs(np.array(y) - np.array(x) @ m.T).max() < 1e-5
    assert mx.abs(mx.linalg.norm(y, axis=-1) - mx.linalg.norm(x, axis=-1)).max().item() < 1e-4


@pytest.mark.parametrize("dim", [12, 20, 40, 48, 80, 96, 160, 192, 64, 128])
def test_hadamard_matrices_are_exact(dim):
    h = hadamard_matrix(dim)
    assert set(np.unique(h)) == {-1, 1}
    assert np.array_equal(h @ h.T, dim * np.eye(dim, dtype=np.int64))


@pytest.mark.parametrize("dim", [36, 60, 72, 84, 100, 108, 120, 50, 81])
def test_unsupported_hadamard_sizes_raise(dim):
    # mlx's hadamard_transform is wrong at 36/84 and crashes at 60..120: refuse cleanly
    assert not hadamard_sizes_ok(dim)
    with pytest.raises(ValueError, match=str(dim)):
        Rotation("hadamard", dim)
    Rotation("haar", dim)  # any size works with Haar


def test_rebuilt_bit_for_bit_and_seed_matters():
    for kind in ("haar", "hadamard"):
        a, b, c = Rotation(kind, 80, 3), Rotation(kind, 80, 3), Rotation(kind, 80, 4)
        assert np.array_equal(a.matrix(), b.matrix())
        assert not np.array_equal(a.matrix(), c.matrix())
        assert Rotation(**a.config()).config() == a.config()


def test_haar_sign_fix_makes_it_haar():
    # without the sign fix, diag(Q) is biased positive; with it, E[Π_11] = 0, Var = 1/D
    d = 8
    diag = np.array([Rotation("haar", d, s).matrix()[0, 0] for s in range(3000)])
    assert abs(diag.mean()) < 3 * np.sqrt(1 / d / 3000)
    assert abs(diag.var() - 1 / d) < 0.15 / d


def test_bad_arguments():
    with pytest.raises(ValueError, match="kind"):
        Rotation("dct", 64)
    with pytest.raises(ValueError, match="dim"):
        Rotation("haar", 1)
    with pytest.raises(ValueError, match="shape"):
        Rotation("haar", 64).apply(mx.zeros((3, 65)))
    with pytest.raises(TypeError):
        Rotation("haar", 64).apply(np.zeros((3, 64)))


@pytest.mark.parametrize("dim, kind", [(10**9, "hadamard"), (10**5, "haar"), (1 << 17, "hadamard")])
def test_huge_dimensions_are_refused_before_anything_is_allocated(dim, kind):
    """Issue #26.9: TurboQuantMSE(10**9, 4) drew 10⁹ signs (8 GB, 32 s) before refusing;
    Haar at a large dim raised MemoryError."""
    import time
    from turboquant.codecs import TurboQuantMSE
    t = time.perf_counter()
    with pytest.raises(ValueError, match=f"rotation dim {dim} is above"):
        TurboQuantMSE(dim, 4, rotation=kind)
    assert time.perf_counter() - t < 1


def test_a_size_without_a_hadamard_matrix_is_refused_before_its_signs_are_drawn():
    with pytest.raises(ValueError, match="no Hadamard matrix of order 1000"):
        Rotation("hadamard", 1000)
