"""Timing helpers: every speed claim is a ratio to a baseline measured in the same run."""
from __future__ import annotations

import time
from typing import Sequence

import mlx.core as mx

__all__ = ["decode_record", "generation_run", "time_call", "encode_decode_seconds", "affine_seconds", "matmul_gflops",
           "scoring_tokens_per_second", "blas_comparison", "decode_attention_seconds", "decode_attention_rows",
           "decode_codecs", "DECODE_HEADERS", "generation_tokens_per_second", "memory_bandwidth"]


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
                             seed: int = 0, slow: bool = True) -> dict:
    """Median seconds of one decode step's attention (B = 1, one query, float32) over T
    cached tokens, measured in the same run:

    ``sdpa_fp32``: mx.fast.scaled_dot_product_attention on full-precision K/V (the baseline);
    ``mlx_lm_q4``: mlx-lm's QuantizedKVCache path (quantized matmuls, 4 bits, groups of 64);
    ``from_codes``: ``attention_from_codes`` on this codec's K/V codes as the package runs it
    by default (the active kernel back-end, ``turboquant.kernels``);
    with ``slow``, also ``dequantize`` (decode the codes, then mx.fast SDPA) and
    ``from_codes_mx`` (the same attention with the kernels switched off).
    """
    import math
    from mlx_lm.models.base import quantized_scaled_dot_product_attention
    from .attention import attention_from_codes
    from .codes import CodeBuffer, CodesView
    from . import kernels
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    k = mx.random.normal((1, H, T, D), key=k1)
    v = mx.random.normal((1, H, T, D), key=k2)
    q = mx.random.normal((1, H, 1, D), key=k3)
    scale = 1 / math.sqrt(D)
    qk, qv = mx.quantize(k, 64, 4), mx.quantize(v, 64, 4)
    kv = CodesView(codec, CodeBuffer(codec.encode(k).arrays), mx.float32)
    vv = CodesView(codec, CodeBuffer(codec.encode(v).arrays), mx.float32)
    mx.eval(k, v, q, qk, qv, kv.buffer.fields, vv.buffer.fields)
    out = {
        "sdpa_fp32": time_call(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale), repeats=repeats),
        "mlx_lm_q4": time_call(lambda: quantized_scaled_dot_product_attention(
            q, qk, qv, scale=scale, mask=None, group_size=64, bits=4), repeats=repeats),
        "from_codes": time_call(lambda: attention_from_codes(q, kv, vv, scale=scale), repeats=repeats),
    }
    if slow:
        out["dequantize"] = time_call(lambda: mx.fast.scaled_dot_product_attention(
            q, kv.dequantize(), vv.dequantize(), scale=scale), repeats=repeats)
        with kernels.use(None):
            out["from_codes_mx"] = time_call(lambda: attention_from_codes(q, kv, vv, scale=scale), repeats=repeats)
    return out


DECODE_HEADERS = ["T", "codec", "bits", "fp32 SDPA ms", "mlx-lm q4", "dequantize + SDPA", "from codes, mx path",
                  "from codes (default)"]


def decode_codecs(D: int = 128) -> list:
    """The codecs ``turboquant bench decode`` times: TurboQuant_mse at 4, 3 and 2 bits and
    FibQuant (k = 2, N = 256: 4 bits per coordinate)."""
    from .codecs import FibQuant, TurboQuantMSE
    return [TurboQuantMSE(D, 4), TurboQuantMSE(D, 3), TurboQuantMSE(D, 2), FibQuant(D, 2, 256)]


def decode_attention_rows(tokens=(1024, 4096, 16384), repeats: int = 3, codecs=None,
                          slow_up_to: int = 16384, progress=None) -> list[tuple]:
    """``decode_attention_seconds`` per T and codec (``decode_codecs`` by default), as rows
    for ``DECODE_HEADERS``: T, codec, bits per coordinate, SDPA ms, then each method's
    **speed-up over fp32 SDPA** (SDPA seconds / its seconds: > 1 is faster). The two slow
    columns (dequantize, the mx path) are NaN above ``slow_up_to`` tokens."""
    rows = []
    codecs = decode_codecs() if codecs is None else codecs
    for T in tokens:
        for codec in codecs:
            r = decode_attention_seconds(T, codec, repeats=repeats, slow=T <= slow_up_to)
            b = r["sdpa_fp32"]
            speed = lambda key: b / r[key] if key in r else float("nan")  # noqa: E731
            rows.append((T, codec.name, codec.bits_per_coordinate, b * 1e3, speed("mlx_lm_q4"),
                         speed("dequantize"), speed("from_codes_mx"), speed("from_codes")))
            if progress is not None:
                progress(rows[-1])
    return rows


def generation_tokens_per_second(model, caches: dict, prompt: mx.array, new_tokens: int = 16,
                                 chunk: int = 512, progress=None) -> dict:
    """Greedy decoding speed after a long prompt, for several caches in the same run.

    ``caches`` maps a label to a prompt cache (a list, one per layer; TurboQuant caches are
    read through ``codes_attention``, as ``turboquant generate`` does). Each cache is
    prefilled with ``prompt`` (1-D token ids) in chunks, not timed; then the caches take
    their ``new_tokens`` single-token steps **interleaved** (one step of each in turn, each
    evaluated before the next), so that a machine whose speed drifts during the run slows
    all of them alike. Per label: tokens/s from the median step, and from the total."""
    import time
    from .attention import codes_attention
    state = {}
    with codes_attention(model):
        for label, cache in caches.items():
            if progress is not None:
                progress(f"{label}: prefilling {prompt.shape[0]} tokens")
            for s in range(0, prompt.shape[0], chunk):
                logits = model(prompt[None, s:s + chunk], cache=cache)
                mx.eval(logits, [c.state for c in cache])
            y = mx.argmax(logits[0, -1])
            mx.eval(y)
            state[label] = [cache, y, []]
        for _ in range(new_tokens):
            for label, st in state.items():
                t = time.perf_counter()
                logits = model(st[1].reshape(1, 1), cache=st[0])
                st[1] = mx.argmax(logits[0, -1])
                mx.eval(st[1])
                st[2].append(time.perf_counter() - t)
    out = {}
    for label, (_, _, steps) in state.items():
        median = sorted(steps)[len(steps) // 2]
        out[label] = {"tokens_per_s": 1 / median, "tokens_per_s_total": len(steps) / sum(steps),
                      "median_step_s": median, "context": int(prompt.shape[0]), "new_tokens": new_tokens}
    return out


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


def memory_bandwidth(n: int = 8192, repeats: int = 5) -> float:
    """GB/s of a float32 matrix–vector product with an (n × n) matrix (256 MB at n = 8192):
    the matrix is read once, as decoding reads its weights, so bytes / seconds is the
    bandwidth decode can use."""
    w = mx.random.normal((n, n), key=mx.random.key(0))
    x = mx.random.normal((1, n), key=mx.random.key(1))
    mx.eval(w, x)
    return w.nbytes / time_call(lambda a, b: a @ b, x, w, repeats=repeats) / 1e9


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


def decode_record(rows: list, repeats: int) -> dict:
    """``turboquant bench decode --out``'s JSON record: the rows of ``decode_attention_rows``
    with the back-end, why it is active, and the machine."""
    import os
    import platform
    from . import kernels
    return {"kind": "decode attention", "headers": DECODE_HEADERS, "rows": rows,
            "backend": kernels.backend_name(), "why": kernels.why(), "repeats": repeats,
            "machine": platform.machine(), "cpu_count": os.cpu_count(), "bandwidth_gb_s": memory_bandwidth()}


def generation_run(model: str = "smollm2-135m", context: int = 8192, new_tokens: int = 32,
                   bits: Sequence[int] = (4,), corpus: str = "lee", progress=None, pre_rope: bool = False,
                   turned_mean: bool = False, profile_bits: Sequence[float] = (), profile=True) -> dict:
    """``turboquant bench generate``: greedy tokens/s after ``context`` tokens of ``corpus``,
    an fp32 mlx-lm cache against TurboQuant_mse caches at each of ``bits`` (attention from
    codes), interleaved (``generation_tokens_per_second``). With ``pre_rope``, also the same
    codecs with keys coded before RoPE (``turboquant.prerope``: decoded and turned back at
    every step). With ``turned_mean``, also the same codecs with centred keys (a mean learned
    after RoPE: the budgets' rule) and with the key mean learned before RoPE and turned with
    the position (``prerope.turned_mean``), both read from codes. With ``profile_bits``, also
    the model's calibrated profile at each of those budgets (``make_prompt_cache(bits=b,
    profile=profile)``; ``profile`` True: the model's shipped one, or a dict or path):
    calibrated coders decode every held key and value at each step (no query table), and a
    profile entry fitted before RoPE turns the decoded keys back too. A JSON-able record: the
    runs, the model, the back-end and the machine."""
    import os
    import platform
    from mlx_lm.models.cache import make_prompt_cache as mlx_cache
    from . import kernels
    from .budget import codecs_for
    from .codecs.scalar import TurboQuantMSE
    from .data import load_text
    from .evaluation import encode_text
    from .memory import cache_count
    from .models import load
    from .prompt_cache import make_prompt_cache
    for b in bits:
        TurboQuantMSE(64, b)                                  # bad bits fail before a model loads
    for b in profile_bits:
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not b > 0:
            raise ValueError(f"profile_bits must be positive budgets in bits per coordinate, got {b!r}")
    net, tokenizer = load(model)
    ids = encode_text(tokenizer, load_text(corpus), context)
    if len(ids) < context:
        raise ValueError(f"the {corpus} corpus has only {len(ids)} tokens, fewer than --context {context}")
    caches = {"fp32 cache (mlx-lm KVCache)": mlx_cache(net)}
    for b in bits:
        key, value = codecs_for(b, b)
        caches[f"TurboQuant_mse {b}-bit K/V, attention from codes ({kernels.backend_name()})"] = \
            make_prompt_cache(net, key_codec=key, value_codec=value)
        if pre_rope:
            caches[f"TurboQuant_mse {b}-bit K/V, keys before RoPE (decoded at every step)"] = \
                make_prompt_cache(net, key_codec=key, value_codec=value, pre_rope=True)
        if turned_mean:
            centred, value = codecs_for(b, b, center_keys=True)
            caches[f"TurboQuant_mse {b}-bit K/V, centred keys (mean after RoPE), from codes"] = \
                make_prompt_cache(net, key_codec=centred, value_codec=value, sink_tokens=1)
            caches[f"TurboQuant_mse {b}-bit K/V, key mean before RoPE turned to each position, from codes"] = \
                make_prompt_cache(net, key_codec=centred, value_codec=value, sink_tokens=1, turned_mean=True)
    for b in profile_bits:
        from .prerope import PreRopeCache
        cache = make_prompt_cache(net, bits=b, profile=profile)
        where = "keys before RoPE, " if isinstance(cache[0], PreRopeCache) else ""
        caches[f"profile {b:g} bits ({where}decoded at every step)"] = cache
    if progress:
        progress(f"then {new_tokens} greedy steps per cache, interleaved")
    runs = generation_tokens_per_second(net, caches, mx.array(ids, dtype=mx.int32), new_tokens, progress=progress)
    return {"kind": "greedy generation", "model": model, "context": context, "new_tokens": new_tokens,
            "pre_rope": pre_rope, "turned_mean": turned_mean, "profile_bits": list(profile_bits),
            "corpus": corpus, "runs": runs,
            "layers": cache_count(net), "backend": kernels.backend_name(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "bandwidth_gb_s": memory_bandwidth()}
