"""The fast-BLAS switch: on by default on Linux with the mkl wheel, opt-out, and a warning
with the fix when mlx was imported first."""
import subprocess
import sys

import pytest

from turboquant import blas

linux_mkl = pytest.mark.skipif(not sys.platform.startswith("linux") or blas.find_mkl() is None,
                               reason="MKL is loaded on Linux with the mkl wheel only")


def run(code, **env):
    import os
    e = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=120)


@linux_mkl
def test_loaded_when_turboquant_comes_first():
    r = run("import turboquant, turboquant.blas as b; print(b.status()['fast_blas'])")
    assert r.stdout.strip() == "True" and "RuntimeWarning" not in r.stderr


@linux_mkl
def test_opt_out():
    r = run("import turboquant, turboquant.blas as b; print(b.status())", TURBOQUANT_FAST_BLAS="0")
    assert "'fast_blas': False" in r.stdout and "disabled" in r.stdout


@linux_mkl
def test_warns_with_the_fix_when_mlx_came_first():
    r = run("import mlx.core, turboquant, turboquant.blas as b; print(b.status()['fast_blas'])")
    assert r.stdout.strip() == "False"
    assert "Import turboquant first" in r.stderr and "TURBOQUANT_FAST_BLAS=0" in r.stderr


@linux_mkl
def test_matmul_results_stay_float32_and_correct():
    import mlx.core as mx
    import numpy as np
    a = np.random.default_rng(0).normal(size=(300, 200)).astype(np.float32)
    b = np.random.default_rng(1).normal(size=(200, 100)).astype(np.float32)
    c = mx.array(a) @ mx.array(b)
    assert c.dtype == mx.float32
    assert np.allclose(np.array(c), a.astype(np.float64) @ b, atol=1e-3)
