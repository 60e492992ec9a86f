"""Timing helpers: every speed claim is a ratio to a baseline measured in the same run."""
from __future__ import annotations

import time

import mlx.core as mx

__all__ = ["time_call", "encode_decode_seconds", "affine_seconds"]


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
