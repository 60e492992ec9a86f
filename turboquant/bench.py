"""Timing helpers: every speed claim is a ratio to a baseline measured in the same run."""
from __future__ import annotations

import time

import mlx.core as mx

__all__ = ["time_call", "encode_decode_seconds", "affine_seconds", "matmul_gflops",
           "scoring_tokens_per_second", "blas_comparison"]


def time_call(fn, *args, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall seconds of ``fn(*args)`` with its result evaluated (mx.eval)."""
    for _ in range(warmup):
        mx.eval(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn(*args))
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def encode_decode_seconds(codec, x: mx.array, repeats: int = 5) -> float:
    """Median seconds for ``codec.decode(codec.encode(x))``."""
    return time_call(lambda v: codec.decode(codec.encode(v)), x, repeats=repeats)


def affine_seconds(x: mx.array, bits: int, group_size: int = 64, repeats: int = 5) -> float:
    """Median seconds for ``mx.dequantize(*mx.quantize(x))``: mlx's affine baseline."""
    def run(v):
        w, s, b = mx.quantize(v, group_size=group_size, bits=bits)
        return mx.dequantize(w, s, b, group_size=group_size, bits=bits)
    return time_call(run, x, repeats=repeats)


def decode_attention_seconds(T: int, codec, H: int = 8, D: int = 128, repeats: int = 5,
                             seed: int = 0) -> dict:
    """Median seconds of one decode step's attention (B = 1, one query, float32) over T
    cached tokens, four ways measured in the same run:

    ``sdpa_fp32``: mx.fast.scaled_dot_product_attention on full-precision K/V;
    ``mlx_lm_q4``: mlx-lm's QuantizedKVCache path (quantized matmuls, 4 bits, groups of 64);
    ``dequantize``: decode this codec's K/V codes, then mx.fast SDPA;
    ``from_codes``: ``attention_from_codes`` on the same codes (through the fused kernels
    when a kernel back-end is active, ``turboquant.kernels``);
    ``from_codes_mx``: the same with the kernels switched off — only when one is active.
    """
    import math
    from mlx_lm.models.base import quantized_scaled_dot_product_attention
    from .attention import attention_from_codes
    from .codes import CodeBuffer, CodesView
    key = mx.random.key(seed)
    k1, k2, k3 = mx.random.split(key, 3)
    k = mx.random.normal((1, H, T, D), key=k1)
    v = mx.random.normal((1, H, T, D), key=k2)
    q = mx.random.normal((1, H, 1, D), key=k3)
    scale = 1 / math.sqrt(D)
    qk, qv = mx.quantize(k, 64, 4), mx.quantize(v, 64, 4)
    kv = CodesView(codec, CodeBuffer(codec.encode(k).arrays), mx.float32)
    vv = CodesView(codec, CodeBuffer(codec.encode(v).arrays), mx.float32)
    mx.eval(k, v, q, qk, qv, kv.buffer.fields, vv.buffer.fields)
    from . import kernels
    extra = {}
    if kernels.active() is not None:
        with kernels.use(None):
            extra["from_codes_mx"] = time_call(lambda: attention_from_codes(q, kv, vv, scale=scale), repeats=repeats)
    return extra | {
        "sdpa_fp32": time_call(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale), repeats=repeats),
        "mlx_lm_q4": time_call(lambda: quantized_scaled_dot_product_attention(
            q, qk, qv, scale=scale, mask=None, group_size=64, bits=4), repeats=repeats),
        "dequantize": time_call(lambda: mx.fast.scaled_dot_product_attention(
            q, kv.dequantize(), vv.dequantize(), scale=scale), repeats=repeats),
        "from_codes": time_call(lambda: attention_from_codes(q, kv, vv, scale=scale), repeats=repeats),
    }


DECODE_HEADERS = ["T", "codec", "fp32 SDPA ms", "mlx-lm q4 (x)", "dequantize (x)", "from codes, mx (x)",
                  "from codes, kernels (x)"]


def decode_attention_rows(tokens=(1024, 4096, 16384), repeats: int = 3) -> list[tuple]:
    """``decode_attention_seconds`` for TurboQuant_mse 4 bits and FibQuant (k = 2, N = 256)
    at each T, as rows for ``DECODE_HEADERS``: T, codec, SDPA ms, then ratios to SDPA; the
    kernels column is NaN when no kernel back-end is active."""
    from .codecs import FibQuant, TurboQuantMSE
    rows = []
    for T in tokens:
        for codec in (TurboQuantMSE(128, 4), FibQuant(128, 2, 256)):
            r = decode_attention_seconds(T, codec, repeats=repeats)
            b = r["sdpa_fp32"]
            fused = "from_codes_mx" in r
            rows.append((T, f"{codec.name} {codec.bits_per_coordinate:.3g}b", b * 1e3, r["mlx_lm_q4"] / b,
                         r["dequantize"] / b, r.get("from_codes_mx", r["from_codes"]) / b,
                         r["from_codes"] / b if fused else float("nan")))
    return rows


# ------------------------------------------------------------------ fast BLAS (Chapter 9)
_BLAS_PROBE = r"""
import json, sys, time
import turboquant, turboquant.blas as blas
import mlx.core as mx
from turboquant.bench import matmul_gflops, scoring_tokens_per_second
out = {"fast_blas": blas.status()["fast_blas"], "gflops": matmul_gflops()}
if sys.argv[1] == "1":
    from turboquant.models import load_default
    model, _ = load_default()
    out["tokens_per_s"] = scoring_tokens_per_second(model, int(sys.argv[2]))
print(json.dumps(out))
"""


def matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """float32 GFLOP/s of an (n × n) @ (n × n) matmul on the default device."""
    a = mx.random.normal((n, n), key=mx.random.key(0))
    b = mx.random.normal((n, n), key=mx.random.key(1))
    return 2 * n ** 3 / time_call(lambda x, y: x @ y, a, b, repeats=repeats) / 1e9


def scoring_tokens_per_second(model, n_tokens: int = 256) -> float:
    """Tokens per second of one full-sequence forward pass (scoring, as perplexity does)."""
    x = mx.arange(100, 100 + n_tokens)[None]
    return n_tokens / time_call(lambda t: model(t), x, repeats=3)


def blas_comparison(with_model: bool = True, n_tokens: int = 256) -> dict:
    """Matmul GFLOP/s (and model scoring tokens/s) with the fast BLAS and without, each in a
    fresh Python process of the same run (MKL must be loaded before mlx, so one process
    cannot measure both): {"fast": {...}, "reference": {...}}."""
    import json
    import os
    import subprocess
    import sys
    out = {}
    for label, flag in (("fast", "1"), ("reference", "0")):
        env = {**os.environ, "TURBOQUANT_FAST_BLAS": flag}
        r = subprocess.run([sys.executable, "-c", _BLAS_PROBE, "1" if with_model else "0", str(n_tokens)],
                           capture_output=True, text=True, env=env, timeout=900)
        if r.returncode:
            raise RuntimeError(f"BLAS probe failed: {r.stderr[-2000:]}")
        out[label] = json.loads(r.stdout.strip().splitlines()[-1])
    return out
