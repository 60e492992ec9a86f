"""Machine-dependent behaviour as detected facts (``turboquant.machine``), the foreign
configuration ``make test`` re-runs the notebooks under, and the platform branches
(macOS, arm64) reasoned and checked by simulation: kernel build flags, fast BLAS, Chromium."""
import os
import re
import subprocess
import sys

import pytest

from turboquant import blas, machine
from turboquant.kernels import cpu


@pytest.mark.parametrize("flags, arch, expected", [
    ({"avx512f", "avx2", "sse2"}, "x86_64", "AVX-512"),
    ({"avx2", "fma", "sse2"}, "x86_64", "AVX2"),
    ({"sse2"}, "AMD64", "SSE2"),
    (set(), "arm64", "NEON"),
    ({"asimd", "fp"}, "aarch64", "NEON"),
    (set(), "riscv64", "unknown"),
])
def test_simd_level_from_flags(flags, arch, expected):
    assert machine.simd_level(flags, arch) == expected


def test_simd_level_of_this_machine_is_one_of_the_named_levels():
    assert machine.simd_level() in ("AVX-512", "AVX2", "SSE2", "NEON", "unknown")


def test_foreign_env_is_x86_specific_where_it_must_be():
    npy = {"X86_V3": True, "X86_V4": True, "AVX512_ICL": True, "AVX512_SPR": False}
    x86 = machine.foreign_env("x86_64", {"avx2", "avx512f"}, npy)
    assert x86["MKL_ENABLE_INSTRUCTIONS"] == "AVX2" and x86["TURBOQUANT_CPU_ARCH"] == "x86-64-v3"
    assert x86["NPY_DISABLE_CPU_FEATURES"] == "X86_V4 AVX512_ICL" and x86["MLX_DISABLE_COMPILE"] == "1"
    assert machine.foreign_env("arm64") == {"MLX_DISABLE_COMPILE": "1"}     # no x86 names on a Mac


def test_foreign_env_asks_nothing_an_older_cpu_cannot_do():
    avx2 = machine.foreign_env("x86_64", {"avx2"}, {"X86_V3": True, "X86_V4": False})
    assert "NPY_DISABLE_CPU_FEATURES" not in avx2                     # NumPy refuses unknown features
    assert avx2["TURBOQUANT_CPU_ARCH"] == "x86-64-v3"
    sse = machine.foreign_env("x86_64", {"sse2"}, {})
    assert sse["TURBOQUANT_CPU_ARCH"] == "x86-64"                      # an AVX2 build would not run


def test_numpy_accepts_the_foreign_configuration_here():
    env = machine.foreign_env()
    out = subprocess.run([sys.executable, "-W", "error", "-c", "import numpy; print(numpy.ones(3).sum())"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert out.returncode == 0 and out.stdout.strip() == "3.0", out.stderr


def test_compile_defect_reports_what_it_ran():
    d = machine.compile_defect()
    assert d["eager"] == [52, 53, 63]                        # (w >> 1) & 63 of 1000, 1002, 255
    assert d["reproduced"] == (d["compiled"] != d["eager"])
    assert isinstance(d["compile_enabled"], bool)


def test_compile_defect_never_shows_with_the_compiler_off():
    code = "import json, turboquant.machine as m; print(json.dumps(m.compile_defect()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MLX_DISABLE_COMPILE": "1"})
    assert out.returncode == 0, out.stderr
    assert '"reproduced": false' in out.stdout and '"compile_enabled": false' in out.stdout


def test_describe_names_the_paths_taken():
    d = machine.describe()
    for key in ("simd", "blas", "kernels", "kernels_why", "mlx", "mlx_compile", "numpy_dispatch"):
        assert key in d
    assert d["kernels"] in ("cpu", "cpp", "mx", "metal", "cuda")


def test_foreign_runner_sets_the_configuration():
    code = "import os; print(os.environ.get('MLX_DISABLE_COMPILE'), os.environ.get('TURBOQUANT_CPU_ARCH'))"
    out = subprocess.run([sys.executable, "-m", "turboquant.machine", "--foreign", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    expected = machine.foreign_env()
    assert out.stdout.splitlines()[-1] == f"1 {expected.get('TURBOQUANT_CPU_ARCH')}"
    bad = subprocess.run([sys.executable, "-m", "turboquant.machine", "--foreign"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_cpu_arch_variable_is_checked(monkeypatch):
    monkeypatch.delenv(cpu.ARCH_ENV, raising=False)
    assert cpu.env_arch() == "native"
    monkeypatch.setenv(cpu.ARCH_ENV, "x86-64-v3")
    assert cpu.env_arch() == "x86-64-v3"
    monkeypatch.setenv(cpu.ARCH_ENV, "native; rm -rf /")
    with pytest.raises(ValueError, match="TURBOQUANT_CPU_ARCH"):
        cpu.env_arch()


def test_kernel_build_flags_on_linux_x86():
    tries = cpu.compile_attempts("native", "Linux", "x86_64")
    assert tries[0][-2:] == ["-march=native", "-fopenmp"]
    assert not any(f.startswith("-march") for f in tries[-1])      # the portable branch last
    assert all(t[:len(cpu.FLAGS)] == cpu.FLAGS for t in tries)


def test_kernel_build_flags_on_a_mac():
    arm = cpu.compile_attempts("native", "Darwin", "arm64")
    assert "-mcpu=native" in arm[0]                                 # Apple clang: no -march on arm64
    assert not any("-fopenmp" in t or any(f.startswith("-march") for f in t) for t in arm)
    assert not any(f.startswith(("-mcpu", "-march")) for f in arm[-1])
    intel = cpu.compile_attempts("native", "Darwin", "x86_64")
    assert "-march=native" in intel[0] and not any("-fopenmp" in t for t in intel)


def test_fast_blas_is_not_attempted_on_macos_or_when_opted_out():
    assert blas.skip_reason("darwin", {}) == "not needed on darwin"
    assert blas.skip_reason("linux", {blas.ENV: " Off"}) == f"disabled by {blas.ENV}=0"
    assert blas.skip_reason("linux", {}) is None and blas.skip_reason("linux", {blas.ENV: "1"}) is None


def test_chromium_is_found_in_a_mac_application_bundle(monkeypatch):
    import browser
    monkeypatch.delenv("TURBOQUANT_CHROMIUM", raising=False)
    monkeypatch.setattr(browser.shutil, "which", lambda name: None)
    app = browser.MAC_BROWSERS[1]
    monkeypatch.setattr(browser.os, "access", lambda path, mode: path == app)
    assert browser.find_chromium("Darwin") == app
    assert browser.find_chromium("Linux") is None


def test_below_prints_the_guarantee_not_the_last_ulp():
    from turboquant.viz import below
    assert below(1.6e-7) == below(2.1e-7) == "< 1e-06"          # the two machines of issue #25
    assert below(3e-6, 1e-5) == "< 1e-05" and below(2e-5, 1e-5) == "2e-05"
    assert below(1.5) == "1.5" and below(-1e-9) == "< 1e-06"
    assert below(float("nan")) == "nan"                          # never a pass for NaN


def test_a_recorded_run_keeps_its_arithmetic_and_a_refused_update_names_what_changed():
    """``machine.arithmetic`` (CPU, SIMD level, BLAS with its version, MKL's cap) is what an
    eval setup records; when an update's fp32 rows differ from the recorded ones, the refusal
    names each difference, or says that the recorded run did not keep its arithmetic."""
    import copy

    from turboquant.machine import arithmetic, simd_level
    from turboquant.suite import update_run
    here = arithmetic()
    assert set(here) == {"cpu", "simd", "blas", "mkl_instructions"} and here["simd"] == simd_level()
    setup = {"model": "m", "corpus": "lee", "tokens": 512, "window": 256, "seeds": 1, "mlx": "0.1"}
    row = lambda nll: {"ppl": 2.0, "per_window": {"nll": nll, "n": [255, 255]}}
    recorded = {"setup": {**setup, "arithmetic": {**here, "blas": "libmkl_rt.so.2 2024.0.0"}},
                "results": {"fp32": row([1.0, 2.0])}}
    new = {"setup": {**setup, "arithmetic": here}, "results": {"fp32": row([1.0, 2.0000001]), "x": row([1.5, 2.5])}}
    with pytest.raises(ValueError, match=r"re-record the whole run \(blas: 'libmkl_rt.so.2 2024.0.0' there, "
                                         + re.escape(repr(here["blas"])) + " here\\)"):
        update_run(recorded, new)
    old = copy.deepcopy(recorded)
    del old["setup"]["arithmetic"]
    with pytest.raises(ValueError, match="does not say which CPU and BLAS computed it"):
        update_run(old, new)
    recorded["results"]["fp32"] = row([1.0, 2.0000001])                  # the same sums: paired
    assert set(update_run(recorded, new)["results"]) == {"fp32", "x"}
