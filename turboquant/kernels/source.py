"""One kernel body per operation, shared by Metal, CUDA and a C++ emulation (Chapter 11).

Each body is the inside of a function that one GPU thread runs. It uses only what Metal
Shading Language, CUDA C++ and C++17 have in common — ``int``, ``float``, ``uint8_t``,
``uint32_t``, fixed-size local arrays, loops and indices (no pointer variables: Metal
would need an address space on them) — plus three names each back-end defines in its
prelude: ``tq_gid`` (the thread's index in the grid), ``TQ_SQRT`` and ``TQ_BIG``.
Compile-time constants (``D``, ``K``, …) arrive as template arguments.

Codes are the package's format (``turboquant.packing``): per vector, D/K block indices of
``IB`` bits laid end to end, little-endian, in ``NB`` bytes. Scalar TurboQuant is the
case K = 1 with the N = 2^b centroids as a (N, 1) table; FibQuant is K = k with its
(N, k) codewords.

The three kernels (one thread each per …):

- ``encode`` (… row and group of G blocks, G·IB a multiple of 8 bits so groups own whole
  bytes; NG groups per row): ν = ‖x‖, y = Π x / ν for the group's coordinates, per block
  the nearest codeword (K = 1: the cell count #{t : y > t} over the Lloyd–Max
  thresholds, exactly the reference's rule; K > 1: argmin ‖c‖² − 2⟨y, c⟩, first minimum),
  packed into bytes as they fill. Inputs x (rows, D), rot (D, D) = Π, bounds (N−1,),
  table (N·K,), c2 (N,), meta [rows·NG]; outputs idx (rows, NB) uint8, norm (rows,) float32.
- ``scores`` (… query row, key): ⟨Πq, c[i_t]⟩ read from the packed bytes, no unpacked
  or dequantized copy. Inputs q (rows, D) rotated and scaled, idx (kv rows · T, NB), table,
  meta [rows·T, T]; rows are ordered (B, H_kv, RT) with RT = query heads per kv head ×
  queries, so a query row reads kv row ``row / RT``. Output scores (rows, T).
- ``values`` (… query row, token span, coordinate): Σ_t w_t c[i_t]_d over one of S spans
  of the tokens, in the rotated frame, with w = softmax weights × value norms computed
  before; the S partial sums are added afterwards in a fixed order (split-T, so a long
  cache gives enough threads). Inputs w (rows, T), idx, table, meta [rows·S·D, T, S];
  output out (rows, S, D).

The softmax, masks, norms, exact sink/recent tokens and the final inverse rotation stay
mx operations (``turboquant.attention``): they touch T or D numbers per query, while the
kernels are the passes over all T·D codes.
"""
from __future__ import annotations

__all__ = ["BODIES", "INPUTS", "OUTPUTS", "TEMPLATES", "METAL_PRELUDE", "CUDA_PRELUDE",
           "CPP_PRELUDE", "THREAD_INDEX", "cuda_translation_unit"]

_READ_CODE = """    {
      const int bit = j * IB;
      const int at = base + (bit >> 3);
      const int sh = bit & 7;
      uint32_t word = (uint32_t)idx[at];
      if (sh + IB > 8) word |= ((uint32_t)idx[at + 1]) << 8;
      if (sh + IB > 16) word |= ((uint32_t)idx[at + 2]) << 16;
      code = (word >> sh) & ((1u << IB) - 1u);
    }
"""

ENCODE = """
  const int total = meta[0];
  if ((int)tq_gid >= total) return;
  const int row = (int)tq_gid / NG;
  const int g = (int)tq_gid - row * NG;
  const int xb = row * D;
  float ss = 0.0f;
  for (int j = 0; j < D; ++j) {
    const float v = x[xb + j];
    ss += v * v;
  }
  const float nrm = TQ_SQRT(ss);
  const float inv = nrm > 0.0f ? 1.0f / nrm : 1.0f;
  if (g == 0) norm[row] = nrm;
  const int blk0 = g * G;
  const int blk1 = (blk0 + G < D / K) ? blk0 + G : D / K;
  uint32_t acc = 0u;
  int nacc = 0;
  int ob = row * NB + g * (G * IB / 8);
  for (int blk = blk0; blk < blk1; ++blk) {
    float y[K];
    for (int c = 0; c < K; ++c) {
      const int i = blk * K + c;
      float s = 0.0f;
      for (int j = 0; j < D; ++j) s += rot[i * D + j] * x[xb + j];
      y[c] = s * inv;
    }
    uint32_t code = 0u;
    if (K == 1) {
      for (int t = 0; t < N - 1; ++t) code += (y[0] > bounds[t]) ? 1u : 0u;
    } else {
      float best = TQ_BIG;
      for (int n = 0; n < N; ++n) {
        float d = c2[n];
        for (int c = 0; c < K; ++c) d -= 2.0f * y[c] * table[n * K + c];
        if (d < best) { best = d; code = (uint32_t)n; }
      }
    }
    acc |= code << nacc;
    nacc += IB;
    while (nacc >= 8) {
      idx[ob] = (uint8_t)(acc & 255u);
      ob += 1;
      acc >>= 8;
      nacc -= 8;
    }
  }
  if (nacc > 0) idx[ob] = (uint8_t)(acc & 255u);
"""

SCORES = """
  const int total = meta[0];
  if ((int)tq_gid >= total) return;
  const int T = meta[1];
  const int qrow = (int)tq_gid / T;
  const int t = (int)tq_gid - qrow * T;
  const int kvrow = qrow / RT;
  const int qb = qrow * D;
  const int base = (kvrow * T + t) * NB;
  float s = 0.0f;
  for (int j = 0; j < D / K; ++j) {
    uint32_t code = 0u;
""" + _READ_CODE + """    for (int c = 0; c < K; ++c) s += q[qb + j * K + c] * table[code * K + c];
  }
  scores[tq_gid] = s;
"""

VALUES = """
  const int total = meta[0];
  if ((int)tq_gid >= total) return;
  const int T = meta[1];
  const int S = meta[2];
  const int qrow = (int)tq_gid / (S * D);
  const int rest = (int)tq_gid - qrow * (S * D);
  const int part = rest / D;
  const int d = rest - part * D;
  const int kvrow = qrow / RT;
  const int j = d / K;
  const int c = d - j * K;
  const int span = (T + S - 1) / S;
  const int t0 = part * span;
  const int t1 = (t0 + span < T) ? t0 + span : T;
  float acc = 0.0f;
  for (int t = t0; t < t1; ++t) {
    const int base = (kvrow * T + t) * NB;
    uint32_t code = 0u;
""" + _READ_CODE + """    acc += w[qrow * T + t] * table[code * K + c];
  }
  out[tq_gid] = acc;
"""

BODIES = {"encode": ENCODE, "scores": SCORES, "values": VALUES}
INPUTS = {"encode": ["x", "rot", "bounds", "table", "c2", "meta"],
          "scores": ["q", "idx", "table", "meta"],
          "values": ["w", "idx", "table", "meta"]}
OUTPUTS = {"encode": ["idx", "norm"], "scores": ["scores"], "values": ["out"]}
TEMPLATES = {"encode": ("D", "K", "N", "IB", "NB", "G", "NG"), "scores": ("D", "K", "IB", "NB", "RT"),
             "values": ("D", "K", "IB", "NB", "RT")}
# C types of the inputs and outputs, in order (float32 → float, uint8 → uint8_t, int32 → int32_t)
CTYPES = {"encode": (["float", "float", "float", "float", "float", "int32_t"], ["uint8_t", "float"]),
          "scores": (["float", "uint8_t", "float", "int32_t"], ["float"]),
          "values": (["float", "uint8_t", "float", "int32_t"], ["float"])}

# The first line of every body: where the thread is. Metal's generator adds the
# ``thread_position_in_grid`` attribute only when the source names it, so it stays here.
THREAD_INDEX = {"metal": "  const uint tq_gid = thread_position_in_grid.x;\n",
                "cuda": "  const unsigned int tq_gid = blockIdx.x * blockDim.x + threadIdx.x;\n"}

METAL_PRELUDE = "#define TQ_SQRT(v) metal::sqrt(v)\n#define TQ_BIG 3.402823e38f\n"
CUDA_PRELUDE = "#define TQ_SQRT(v) sqrtf(v)\n#define TQ_BIG 3.402823e38f\n"
CPP_PRELUDE = ("#include <cmath>\n#include <cstdint>\n"
               "#define TQ_SQRT(v) std::sqrt(v)\n#define TQ_BIG 3.402823e38f\n")


def cuda_translation_unit(op: str, template: dict, name: str = "tq_kernel",
                          mlx_header: str = '#include "mlx/backend/cuda/device/utils.cuh"') -> str:
    """The CUDA source mlx 0.32's ``mx.fast.cuda_kernel`` generates for ``op`` (its
    ``build_kernel`` layout: default header, our header, a ``__global__`` function in
    ``mlx::core::cu`` with const input pointers then outputs, template ints as
    ``constexpr int``, then the body). ``mlx_header`` replaces mlx's own device header so
    the unit can be compiled with nvcc outside mlx (tests pass a small stand-in)."""
    ins, outs = CTYPES[op]
    params = [f"    const {t}* {n}" for t, n in zip(ins, INPUTS[op])]
    params += [f"    {t}* {n}" for t, n in zip(outs, OUTPUTS[op])]
    consts = "".join(f"  constexpr int {k} = {int(template[k])};\n" for k in TEMPLATES[op])
    return (f"{mlx_header}\n\n#include <cooperative_groups.h>\n\n"
            "#define inf cuda::std::numeric_limits<float>::infinity()\n\n"
            f"{CUDA_PRELUDE}namespace mlx::core::cu {{\n\nnamespace cg = cooperative_groups;\n\n"
            f"__global__ void {name}(\n" + ",\n".join(params) + ") {\n" + consts + "\n"
            + THREAD_INDEX["cuda"] + BODIES[op] + "\n}\n\n} // namespace mlx::core::cu\n")
