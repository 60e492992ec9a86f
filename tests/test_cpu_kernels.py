"""The CPU back-end (``turboquant.kernels.cpu``): built on first use, on by default, equal to
the mx path.

Every branch of ``cpu.cpp`` is checked here: the AVX-512 build this machine uses
("native"), an AVX2 build ("x86-64-v3") and the portable one ("x86-64"), on x86 machines
that can run them; elsewhere the native build only.
"""
import platform
import warnings

import mlx.core as mx
import numpy as np
import pytest

from turboquant import kernels
from turboquant.attention import attention_from_codes, codes_attention
from turboquant.cache import TurboQuantKVCache
from turboquant.codecs import Centered, FibQuant, PolarQuant, TurboQuantMSE
from turboquant.codes import CodeBuffer, CodesView
from turboquant.kernels import cpu, emulate
from turboquant.models import tiny_model

pytestmark = pytest.mark.skipif(emulate.compiler() is None, reason="no C++ compiler: the CPU kernels cannot be built")

ARCHES = ["native"] + (["x86-64-v3", "x86-64"] if platform.machine() in ("x86_64", "AMD64") else [])


def _cpu_flags() -> str:
    try:
        return open("/proc/cpuinfo").read()
    except OSError:
        return ""


@pytest.fixture(scope="module", params=ARCHES)
def backend(request):
    if request.param == "x86-64-v3" and " avx2" not in _cpu_flags():
        pytest.skip("this CPU cannot run an AVX2 build")
    return cpu.CpuKernels(emulate.compiler(), request.param)


CODECS = {
    "mse1-d64": lambda: TurboQuantMSE(64, 1), "mse2-d128": lambda: TurboQuantMSE(128, 2),
    "mse3-d128": lambda: TurboQuantMSE(128, 3), "mse4-d64": lambda: TurboQuantMSE(64, 4),
    "mse4-d128": lambda: TurboQuantMSE(128, 4), "mse4-d256": lambda: TurboQuantMSE(256, 4),
    "mse4-d80": lambda: TurboQuantMSE(80, 4),          # D % 32 != 0: the 16-at-a-time branch
    "mse3-d40": lambda: TurboQuantMSE(40, 3),          # D % 16 != 0: one index at a time
    "mse5-haar": lambda: TurboQuantMSE(96, 5, rotation="haar"), "mse8": lambda: TurboQuantMSE(64, 8),
    "fib256": lambda: FibQuant(128, 2, 256), "fib2.5": lambda: FibQuant(64, k=2, bits=2.5),
    "fib-k4": lambda: FibQuant(80, k=4, n_codewords=300),
}


def _vectors(shape, seed):
    return mx.random.normal(shape, key=mx.random.key(seed)) * mx.linspace(0.2, 3.0, shape[-1])


def _codes(codec, B=2, H=2, T=1100, seed=0):
    """Codes of T tokens held as a cache holds them: a view of a longer buffer, sliced on T."""
    code = codec.encode(_vectors((B, H, T + 5, codec.dim), seed))
    return {f: a[:, :, :T] for f, a in code.arrays.items()}, code


@pytest.mark.parametrize("name", list(CODECS))
def test_scores_and_values_equal_mx_path(backend, name):
    codec = CODECS[name]()
    fields, code = _codes(codec)
    units = codec.decode_rotated(code)[:, :, :1100]
    q = _vectors((2, 2, 3, 2, codec.dim), 1)                 # 3 query heads per kv head, 2 queries
    ref = q @ mx.swapaxes(units, -1, -2)[:, :, None]
    got = backend.scores(codec.kernel_spec(), q, fields["idx"])
    assert got.shape == ref.shape
    assert mx.abs(got - ref).max().item() <= 1e-5 * mx.abs(ref).max().item()
    w = mx.softmax(ref, axis=-1) * mx.random.uniform(shape=(1100,), key=mx.random.key(2))
    ref_v = w @ units[:, :, None]
    got_v = backend.values(codec.kernel_spec(), w, fields["idx"])
    assert mx.abs(got_v - ref_v).max().item() <= 1e-5 * max(1.0, mx.abs(ref_v).max().item())


@pytest.mark.parametrize("name", list(CODECS))
def test_encode_equals_mx_path(backend, name):
    codec = CODECS[name]()
    x = _vectors((2, 3, 40, codec.dim), 3).at[..., 0, :].multiply(0.0)     # zero vectors too
    with kernels.use(None):
        ref = codec.encode(x)
    idx, norm = backend.encode(codec.kernel_spec(), x)
    # the rotation is a matrix product here and a fast transform there: a coordinate within
    # rounding of a threshold may fall the other way (none or almost none do)
    assert np.mean(np.array(idx) == np.array(ref["idx"])) >= 0.999
    assert np.array_equal(np.array(norm.astype(mx.float16)), np.array(ref["norm"]))
    assert idx.dtype == mx.uint8 and idx.shape == ref["idx"].shape


@pytest.mark.parametrize("kv", [("mse4-d128", "mse4-d128"), ("mse2-d128", "mse2-d128"), ("mse3-d128", "mse3-d128"),
                                ("mse4-d64", "mse2-d128"), ("mse3-d128", "mse2-d128"),
                                ("fib256", "mse4-d128"), ("mse4-d256", "mse4-d256"), ("mse5-haar", "mse5-haar")])
@pytest.mark.parametrize("T, Tq", [(1, 1), (300, 1), (1100, 1), (700, 3)])
def test_fused_attention_equals_mx_path(backend, kv, T, Tq):
    kc, vc = CODECS[kv[0]](), CODECS[kv[1]]()
    if kc.dim != vc.dim:
        vc = TurboQuantMSE(kc.dim, 2, seed=5)
    kf, _ = _codes(kc, T=T, seed=4)
    vf, _ = _codes(vc, T=T, seed=5)
    q = _vectors((2, 6, Tq, kc.dim), 6)                      # GQA: 3 query heads per kv head
    keys = CodesView(kc, CodeBuffer(kf), mx.float32)
    values = CodesView(vc, CodeBuffer(vf), mx.float32)
    with kernels.use(None):
        ref = attention_from_codes(q, keys, values, scale=0.11)
    got = backend.attend(kc.kernel_spec(), kf, vc.kernel_spec(), vf, q.reshape(2, 2, 3, Tq, kc.dim), 0.11)
    got = got.reshape(ref.shape)
    assert mx.abs(got - ref).max().item() <= 2e-5 * max(1.0, mx.abs(ref).max().item())


def test_bad_inputs_are_refused_before_cpp_reads_them():
    b = kernels.active() if kernels.backend_name() == "cpu" else cpu.CpuKernels(emulate.compiler())
    codec = TurboQuantMSE(64, 4)
    fields, _ = _codes(codec, T=10)
    spec = codec.kernel_spec()
    with pytest.raises(ValueError, match="codes must be"):
        b.scores(spec, _vectors((2, 2, 1, 1, 64), 0), fields["idx"][..., :20])
    with pytest.raises(ValueError, match="q_rot must be"):
        b.scores(spec, _vectors((2, 2, 1, 1, 32), 0), fields["idx"])
    with pytest.raises(ValueError, match="disagree"):
        b.attend(spec, fields, spec, {f: a[:, :, :5] for f, a in fields.items()}, _vectors((2, 2, 1, 1, 64), 0), 1.0)
    with pytest.raises(ValueError, match="codes must be"):
        b.attend(spec, fields, TurboQuantMSE(64, 2).kernel_spec(), fields, _vectors((2, 2, 1, 1, 64), 0), 1.0)


def test_on_by_default_and_self_checked():
    if mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available()):
        pytest.skip("this machine has a GPU back-end: it is the default there")
    if kernels.env_mode() != "auto":
        pytest.skip("TURBOQUANT_KERNELS is set")
    assert kernels.backend_name() == "cpu"
    assert "self-check passed" in kernels.why()
    b = kernels.active()
    assert kernels.self_check(b) is None
    assert b.path.parent.name == "kernels" and b.path.exists()


FUSED = {"decode": True, "causal": False, "sink": False, "recent": False, "centered": True,
         "centered-values": True, "polar-values": False, "prefill-rows": False}


@pytest.mark.parametrize("case", list(FUSED))
def test_attention_from_codes_default_equals_mx_path(case, monkeypatch):
    """Whatever path attention from codes takes by default (the one-call kernel for a decode
    step; scores and value kernels around mx softmax otherwise; decoding for other codecs)
    it equals the mx path — and the one-call kernel is taken exactly when it should be."""
    if kernels.backend_name() != "cpu":
        pytest.skip("the CPU kernels are not the active back-end here")
    calls = []
    real = cpu.CpuKernels.attend
    monkeypatch.setattr(cpu.CpuKernels, "attend", lambda self, *a: calls.append(1) or real(self, *a))
    D, T = 64, 700
    kc = TurboQuantMSE(D, 4)
    vc = PolarQuant(D) if case == "polar-values" else TurboQuantMSE(D, 3)
    if case == "centered":
        kc = Centered(kc).fit_once(_vectors((1, 2, 64, D), 9) + 1.0)
    if case == "centered-values":
        vc = Centered(vc).fit_once(_vectors((1, 2, 64, D), 9) - 2.0)
    cache = TurboQuantKVCache(kc, vc, fp_window=16 if case == "recent" else 0,
                              sink_tokens=4 if case == "sink" else 0)
    k = _vectors((2, 2, T, D), 7) + (1.0 if case == "centered" else 0.0)
    v = _vectors((2, 2, T, D), 8) - (2.0 if case == "centered-values" else 0.0)
    from turboquant.cache import returning_codes
    with returning_codes():
        keys, values = cache.update_and_fetch(k, v)
    Tq = {"causal": 3, "prefill-rows": 8}.get(case, 1)        # prefill-rows: 3 · 8 rows per kv head
    q = _vectors((2, 6, Tq, D), 10)
    mask = "causal" if case == "causal" else None
    with kernels.use(None):
        ref = attention_from_codes(q, keys, values, scale=0.125, mask=mask)
    calls.clear()
    got = attention_from_codes(q, keys, values, scale=0.125, mask=mask)
    assert mx.abs(got - ref).max().item() <= 2e-5 * max(1.0, mx.abs(ref).max().item())
    assert bool(calls) == FUSED[case]


def test_generation_by_default_matches_mx_path():
    if kernels.backend_name() != "cpu":
        pytest.skip("the CPU kernels are not the active back-end here")
    model = tiny_model(seed=3, hidden_size=256, num_heads=4, num_kv_heads=2)     # head size 64
    prompt = mx.array([[1, 5, 9, 2, 7, 3, 8, 4] * 8])
    out = {}
    for name, ctx in (("default", kernels.use(kernels.active())), ("mx", kernels.use(None))):
        with ctx, codes_attention(model):
            cache = [TurboQuantKVCache(TurboQuantMSE(64, 4)) for _ in model.layers]
            logits = model(prompt, cache=cache)
            toks = [mx.argmax(logits[0, -1]).item()]
            for _ in range(8):
                logits = model(mx.array([[toks[-1]]]), cache=cache)
                toks.append(mx.argmax(logits[0, -1]).item())
            out[name] = (toks, logits)
    assert out["default"][0] == out["mx"][0]
    assert mx.abs(out["default"][1] - out["mx"][1]).max().item() < 1e-3


def test_no_compiler_warns_once_and_uses_mx_path(monkeypatch):
    monkeypatch.setattr(emulate, "compiler", lambda: None)
    kernels.cpu_kernels_backend.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no C.. compiler"):
            assert kernels.cpu_kernels_backend() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert kernels.cpu_kernels_backend() is None        # memoised: no second warning
        if kernels.gpu_backend() is None and kernels.env_mode() == "auto":
            assert kernels.active() is None and "no C++ compiler" in kernels.why()
    finally:
        kernels.cpu_kernels_backend.cache_clear()


def test_failed_self_check_is_not_adopted(monkeypatch):
    monkeypatch.setattr(cpu, "self_check", lambda b: "scores differ by 1")
    kernels.cpu_kernels_backend.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="not adopted .scores differ by 1"):
            assert kernels.cpu_kernels_backend() is None
    finally:
        kernels.cpu_kernels_backend.cache_clear()


def test_built_per_cpu_and_source(tmp_path, monkeypatch):
    monkeypatch.setenv("TURBOQUANT_CACHE", str(tmp_path))
    path, _ = cpu.build(emulate.compiler())
    assert path.parent == tmp_path / "kernels" and path.exists()
    assert cpu.build(emulate.compiler()) == (path, "")      # cached: not rebuilt
    monkeypatch.setattr(cpu, "machine_signature", lambda: "another CPU")
    assert cpu.build(emulate.compiler())[0] != path          # a binary is never shared across CPUs


def test_encode_goes_to_the_kernels_only_for_decode_steps(monkeypatch):
    """A decode step's few vectors are encoded by the kernels; a prefill chunk by the mx path,
    bit for bit the reference's (what every prefilled measurement relies on)."""
    if kernels.backend_name() != "cpu":
        pytest.skip("the CPU kernels are not the active back-end here")
    calls = []
    real = cpu.CpuKernels.encode
    monkeypatch.setattr(cpu.CpuKernels, "encode", lambda self, *a: calls.append(1) or real(self, *a))
    codec = TurboQuantMSE(64, 4)
    step, chunk = _vectors((1, 3, 1, 64), 20), _vectors((1, 3, 128, 64), 21)
    got = codec.encode(chunk)
    assert not calls
    with kernels.use(None):
        ref = codec.encode(chunk)
    assert np.array_equal(np.array(got["idx"]), np.array(ref["idx"]))
    codec.encode(step)
    assert calls == [1]
