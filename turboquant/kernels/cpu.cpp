// Decode attention from packed codes on a CPU (turboquant.kernels.cpu; the Performance chapter).
//
// Two passes over the codes of a rotated-table codec (TurboQuant_mse: K = 1, a scalar table
// of N = 2^IB centroids shared by every coordinate; FibQuant: K >= 2, a vector codebook):
//
//   scores  s[h][r][t] = <q[h][r], c[i_t]>                       (unit scores, rotated frame)
//   values  o[h][r][:] = sum_t w[h][r][t] c[i_t]                  (rotated frame)
//
// for kv head h, query row r (the R query heads x Tq queries of that kv head) and token t.
// Each token's packed bytes are read once per pass and turned into its D coordinates in
// registers, with the table itself held in registers: for IB <= 4 and K = 1 the 2^IB
// centroids fit one AVX-512 register (16 floats; two AVX2 registers), and a permute looks
// up 16 (8) coordinates at once. This is the in-register-shuffle idea of fast-scan
// (Andre et al.), without its quantized tables: the scalar table is the same for every
// coordinate, so the query multiplies after the lookup and everything stays float32 and
// exact (same products as the reference, summed in a different order).
// Codes with an 8-bit index (8-bit scalar, FibQuant with N = 256) load their codewords from
// the table by index; anything else is unpacked one index at a time (portable C++).
//
// Threads (OpenMP) share out (head, block of BLOCK tokens) pairs; the value pass writes one
// partial sum per block and adds them in block order, so the result does not depend on the
// number of threads. Inputs are read in place (no copies): the code bytes of head h start
// at idx + h * head_stride, tokens NB bytes apart.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's own _mm512_undefined_* in its headers
#endif
#include <immintrin.h>
#endif

namespace {

constexpr int BLOCK = 512;
// Below this many coordinates read per pass (heads x tokens x D) one thread does the pass:
// waking the others costs more than they save on a short cache.
constexpr long long PAR_MIN = 1LL << 19;

#if defined(__AVX512F__)
constexpr const char* ISA = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
constexpr const char* ISA = "avx2";
#else
constexpr const char* ISA = "portable";
#endif

// The IB-bit index j of a packed row (little-endian bit stream), any IB in 1..16.
inline uint32_t read_index(const uint8_t* row, int j, int IB) {
  const int bit = j * IB, at = bit >> 3, sh = bit & 7;
  uint32_t word = row[at];
  if (sh + IB > 8) word |= (uint32_t)row[at + 1] << 8;
  if (sh + IB > 16) word |= (uint32_t)row[at + 2] << 16;
  return (word >> sh) & ((1u << IB) - 1u);
}

// Decoders: one token's D rotated coordinates c[i_t] into out[D].

// Scalar tables of IB <= 4 bits (K = 1, D % 16 == 0): 16 indices = 2*IB bytes at a time,
// looked up in the centroids held in registers.
template <int IB>
struct SmallScalar {
  int D, NB;
  const float* table;
#if defined(__AVX512F__)
  __m512 tab16;
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 tab_lo, tab_hi;
#endif

  SmallScalar(int D_, int N, const float* table_) : D(D_), NB(D_ * IB / 8), table(table_) {
    float t[16] = {0};
    for (int n = 0; n < N && n < 16; ++n) t[n] = table[n];
#if defined(__AVX512F__)
    tab16 = _mm512_loadu_ps(t);
#elif defined(__AVX2__) && defined(__FMA__)
    tab_lo = _mm256_loadu_ps(t);
    tab_hi = _mm256_loadu_ps(t + 8);
#endif
  }

  inline void operator()(const uint8_t* row, float* out) const {
    constexpr uint32_t MASK = (1u << IB) - 1u;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (IB == 4 && D % 32 == 0) {  // 32 nibbles at a time: split, interleave, look up
      const __m128i low = _mm_set1_epi8(15);
      for (int g = 0; g < D / 32; ++g) {
        const __m128i x = _mm_loadu_si128((const __m128i*)(row + 16 * g));
        const __m128i lo = _mm_and_si128(x, low), hi = _mm_and_si128(_mm_srli_epi16(x, 4), low);
        const __m512i a = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));   // coordinates 32g .. 32g+15
        const __m512i b = _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi));   // 32g+16 .. 32g+31
        _mm512_storeu_ps(out + 32 * g, _mm512_permutexvar_ps(a, tab16));
        _mm512_storeu_ps(out + 32 * g + 16, _mm512_permutexvar_ps(b, tab16));
      }
      return;
    }
#endif
    for (int g = 0; g < D / 16; ++g) {
      // the 2*IB bytes of the group, read as one 8-byte load that stays inside the row
      // (ending at the row's end for the last groups); a shorter copy would stall store
      // forwarding
      uint64_t word = 0;
      const int at = 2 * g * IB;
      if (NB >= 8) {
        const int from = at + 8 <= NB ? at : NB - 8;
        std::memcpy(&word, row + from, 8);
        word >>= 8 * (at - from);
      } else {
        std::memcpy(&word, row + at, 2 * IB);
      }
#if defined(__AVX512F__)
      const __m512i sh_lo = _mm512_set_epi64(7 * IB, 6 * IB, 5 * IB, 4 * IB, 3 * IB, 2 * IB, IB, 0);
      const __m512i sh_hi = _mm512_set_epi64(15 * IB, 14 * IB, 13 * IB, 12 * IB, 11 * IB, 10 * IB, 9 * IB, 8 * IB);
      const __m512i w = _mm512_set1_epi64((long long)word);
      const __m256i lo = _mm512_cvtepi64_epi32(_mm512_srlv_epi64(w, sh_lo));
      const __m256i hi = _mm512_cvtepi64_epi32(_mm512_srlv_epi64(w, sh_hi));
      __m512i ix = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      ix = _mm512_and_si512(ix, _mm512_set1_epi32((int)MASK));
      _mm512_storeu_ps(out + 16 * g, _mm512_permutexvar_ps(ix, tab16));
#elif defined(__AVX2__) && defined(__FMA__)
      for (int half = 0; half < 2; ++half) {
        const uint32_t w32 = (uint32_t)(word >> (8 * IB * half));
        const __m256i sh = _mm256_set_epi32(7 * IB, 6 * IB, 5 * IB, 4 * IB, 3 * IB, 2 * IB, IB, 0);
        const __m256i ix = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w32), sh),
                                            _mm256_set1_epi32((int)MASK));
        __m256 v = _mm256_permutevar8x32_ps(tab_lo, ix);
        if (IB == 4) {
          const __m256 hi = _mm256_permutevar8x32_ps(tab_hi, ix);
          v = _mm256_blendv_ps(v, hi, _mm256_castsi256_ps(_mm256_slli_epi32(ix, 28)));
        }
        _mm256_storeu_ps(out + 16 * g + 8 * half, v);
      }
#else
      for (int i = 0; i < 16; ++i) out[16 * g + i] = table[(word >> (IB * i)) & MASK];
#endif
    }
  }
};

// One byte per block: scalar 8-bit tables, or a 256-codeword vector codebook (K = 2: each
// codeword pair moved as one 8-byte word; on this kind of CPU plain loads beat AVX-512
// gathers here, 14.6 against 19.1 ns per token).
struct ByteIndex {
  int D, K;
  const float* table;

  inline void operator()(const uint8_t* row, float* out) const {
    const int nb = D / K;
    if (K == 1) {
      for (int j = 0; j < nb; ++j) out[j] = table[row[j]];
      return;
    }
    if (K == 2) {  // a codeword pair moved as one 8-byte word
      for (int j = 0; j < nb; ++j) std::memcpy(out + 2 * j, table + 2 * (int)row[j], 8);
      return;
    }
    for (int j = 0; j < nb; ++j) {
      const float* c = table + (int)row[j] * K;
      for (int k = 0; k < K; ++k) out[j * K + k] = c[k];
    }
  }
};

// Any other width and block size: one index at a time.
struct AnyIndex {
  int D, K, IB;
  const float* table;

  inline void operator()(const uint8_t* row, float* out) const {
    for (int j = 0; j < D / K; ++j) {
      const float* c = table + read_index(row, j, IB) * K;
      for (int k = 0; k < K; ++k) out[j * K + k] = c[k];
    }
  }
};

inline float dot(const float* a, const float* b, int D) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int i = 0;
    for (; i + 32 <= D; i += 32) {
      acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
      acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
    }
    if (i < D) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  }
#endif
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < D; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float w, const float* x, float* y, int D) {
#pragma omp simd
  for (int i = 0; i < D; ++i) y[i] += w * x[i];
}

// IEEE half (the stored norms) to float.
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 1023u;
  uint32_t bits;
  if (e == 0) {
    if (m == 0) {
      bits = sign;
    } else {  // subnormal: m * 2^-24
      float f = (float)m * 5.9604644775390625e-8f;
      std::memcpy(&bits, &f, 4);
      bits |= sign;
    }
  } else if (e == 31) {
    bits = sign | 0x7f800000u | (m << 13);
  } else {
    bits = sign | ((e + 112u) << 23) | (m << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// x[i] <- exp(x[i]) for x <= 0 (scores minus their maximum), in a loop the compiler
// vectorizes: 2^n * 2^f with f in [-1/2, 1/2] and the degree-6 Taylor polynomial of 2^f.
// The polynomial is good to 2e-7; forming x * log2(e) in float loses more for large |x|
// (relative error up to ~3e-6 near -87, where the weights are below 1e-37 anyway).
// Below -87 the result is 0.
inline void exp_nonpositive(float* x, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) {
    const float v = x[i] < -87.0f ? -87.0f : x[i];
    const float t = v * 1.44269504088896341f;
    const float k = __builtin_floorf(t + 0.5f);
    const float f = t - k;
    const float p = 1.0f + f * (0.693147180559945f + f * (0.240226506959101f + f * (0.0555041086648216f +
                    f * (0.00961812910762848f + f * (0.00133335581464284f + f * 0.000154035303933816f)))));
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    x[i] = x[i] < -87.0f ? 0.0f : p * scale;
  }
}

// Calls body(h, u, t, c) for every token t of every (kv head h, block of BLOCK tokens) unit
// u, the units shared out among the threads; c holds token t's rotated coordinates c[i_t]
// (decoded into a per-thread buffer). The passes below differ only in their body.
template <class Dec, class Body>
void for_each_token(const Dec& dec, const uint8_t* idx, long long head_stride, int HK, int T, int D, int NB,
                    Body&& body) {
  const int nblk = (T + BLOCK - 1) / BLOCK;
  const long long units = (long long)HK * nblk;
#pragma omp parallel if ((long long)HK * T * D >= PAR_MIN)
  {
    std::vector<float> buf(D);
#pragma omp for schedule(static)
    for (long long u = 0; u < units; ++u) {
      const int h = (int)(u / nblk), b = (int)(u % nblk);
      const int t0 = b * BLOCK, t1 = t0 + BLOCK < T ? t0 + BLOCK : T;
      const uint8_t* codes = idx + h * head_stride;
      for (int t = t0; t < t1; ++t) {
        dec(codes + (long long)t * NB, buf.data());
        body(h, u, t, buf.data());
      }
    }
  }
}

template <class Dec>
void scores_pass(const Dec& dec, const float* q, const uint8_t* idx, long long head_stride,
                 int HK, int RT, int T, int D, int NB, float* out) {
  for_each_token(dec, idx, head_stride, HK, T, D, NB, [&](int h, long long, int t, const float* c) {
    for (int r = 0; r < RT; ++r)
      out[((long long)h * RT + r) * T + t] = dot(q + ((long long)h * RT + r) * D, c, D);
  });
}

template <class Dec>
void values_pass(const Dec& dec, const float* w, const uint8_t* idx, long long head_stride,
                 int HK, int RT, int T, int D, int NB, float* out) {
  const int nblk = (T + BLOCK - 1) / BLOCK;
  std::vector<float> part((size_t)HK * nblk * RT * D, 0.0f);
  for_each_token(dec, idx, head_stride, HK, T, D, NB, [&](int h, long long u, int t, const float* c) {
    for (int r = 0; r < RT; ++r) {
      const float wt = w[((long long)h * RT + r) * T + t];
      if (wt != 0.0f) axpy(wt, c, part.data() + ((size_t)u * RT + r) * D, D);
    }
  });
#pragma omp parallel for schedule(static) if ((long long)HK * T * D >= PAR_MIN)
  for (long long hr = 0; hr < (long long)HK * RT; ++hr) {  // partial sums, in block order
    const int h = (int)(hr / RT), r = (int)(hr % RT);
    float* o = out + (size_t)hr * D;
    for (int d = 0; d < D; ++d) o[d] = 0.0f;
    for (int b = 0; b < nblk; ++b) axpy(1.0f, part.data() + ((size_t)(h * nblk + b) * RT + r) * D, o, D);
  }
}

// One block's scores s[0..n) -> p = exp(s - m) in place; *m_out = m = max s, *l_out = sum p.
inline void block_softmax(float* s, int n, float* m_out, float* l_out) {
  float m = s[0];
  for (int i = 1; i < n; ++i) m = s[i] > m ? s[i] : m;
  for (int i = 0; i < n; ++i) s[i] -= m;
  exp_nonpositive(s, n);
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) sum += s[i];
  *m_out = m;
  *l_out = sum;
}

// Query row hr (head h, row r) of the output from its blocks' partials, in block order.
inline void merge(long long hr, int RT, int nblk, int D, const float* acc, const float* mx_, const float* l,
                  float* out) {
  const int h = (int)(hr / RT), r = (int)(hr % RT);
  float M = -3.402823e38f;
  for (int b = 0; b < nblk; ++b) {
    const float m = mx_[((size_t)h * nblk + b) * RT + r];
    M = m > M ? m : M;
  }
  float* o = out + (size_t)hr * D;
  for (int d = 0; d < D; ++d) o[d] = 0.0f;
  float L = 0.0f;
  for (int b = 0; b < nblk; ++b) {
    const size_t at = ((size_t)h * nblk + b) * RT + r;
    float e = mx_[at] - M;
    exp_nonpositive(&e, 1);
    L += e * l[at];
    axpy(e, acc + at * D, o, D);
  }
  const float inv = 1.0f / L;
  for (int d = 0; d < D; ++d) o[d] *= inv;
}

// Decode attention in one pass over both caches (flash-decoding on a CPU): each (head,
// block of BLOCK tokens) unit computes its scores (unit scores x key norms), their maximum
// m, p = exp(s - m), l = sum p and acc = sum p * value norm * c[v_t]; the units of a head
// are merged in block order: out = sum_b e^(m_b - M) acc_b / sum_b e^(m_b - M) l_b.
template <class KDec, class VDec>
void attend_pass(const KDec& kd, const VDec& vd, const float* q, const uint8_t* kidx, long long khs,
                 const uint16_t* knorm, long long knhs, const uint8_t* vidx, long long vhs,
                 const uint16_t* vnorm, long long vnhs, int HK, int RT, int T, int D, int KNB, int VNB,
                 float* out) {
  const int nblk = (T + BLOCK - 1) / BLOCK;
  const long long units = (long long)HK * nblk;
  std::vector<float> acc((size_t)units * RT * D), mx_((size_t)units * RT), l((size_t)units * RT);
#pragma omp parallel if ((long long)HK * T * D >= PAR_MIN)
  {
    std::vector<float> buf(D), sc((size_t)RT * BLOCK);
#pragma omp for schedule(static)
    for (long long u = 0; u < units; ++u) {
      const int h = (int)(u / nblk), b = (int)(u % nblk);
      const int t0 = b * BLOCK, n = (t0 + BLOCK < T ? t0 + BLOCK : T) - t0;
      const float* qh = q + (long long)h * RT * D;
      const uint8_t* kc = kidx + h * khs;
      const uint16_t* kn = knorm + h * knhs;
      for (int i = 0; i < n; ++i) {
        kd(kc + (long long)(t0 + i) * KNB, buf.data());
        const float nk = half_to_float(kn[t0 + i]);
        for (int r = 0; r < RT; ++r) sc[(size_t)r * BLOCK + i] = dot(qh + (long long)r * D, buf.data(), D) * nk;
      }
      float* a = acc.data() + (size_t)u * RT * D;
      for (int r = 0; r < RT; ++r) {
        block_softmax(sc.data() + (size_t)r * BLOCK, n, &mx_[(size_t)u * RT + r], &l[(size_t)u * RT + r]);
        for (int d = 0; d < D; ++d) a[(size_t)r * D + d] = 0.0f;
      }
      const uint8_t* vc = vidx + h * vhs;
      const uint16_t* vn = vnorm + h * vnhs;
      for (int i = 0; i < n; ++i) {
        vd(vc + (long long)(t0 + i) * VNB, buf.data());
        const float nv = half_to_float(vn[t0 + i]);
        for (int r = 0; r < RT; ++r) axpy(sc[(size_t)r * BLOCK + i] * nv, buf.data(), a + (size_t)r * D, D);
      }
    }
#pragma omp for schedule(static)
    for (long long hr = 0; hr < (long long)HK * RT; ++hr) merge(hr, RT, nblk, D, acc.data(), mx_.data(), l.data(), out);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The common case in registers: scalar keys and values of the same width IB in {2, 3, 4},
// D in {64, 128, 256}. Each token's coordinates are looked up 16 at a time (4 bits: split
// nibbles, interleave, permute; 2 and 3 bits: shift a 64-bit word into 16 lanes, permute)
// and used straight from registers: dotted with the query for the scores, accumulated
// into D/16 register accumulators for the values. Same arithmetic as attend_pass.
template <int D, int IB>
void attend_small(const float* ktab, const float* vtab, const float* q, const uint8_t* kidx, long long khs,
                  const uint16_t* knorm, long long knhs, const uint8_t* vidx, long long vhs,
                  const uint16_t* vnorm, long long vnhs, int HK, int RT, int T, float* out) {
  constexpr int G = D / 16, NB = D * IB / 8;
  const int nblk = (T + BLOCK - 1) / BLOCK;
  const long long units = (long long)HK * nblk;
  std::vector<float> acc((size_t)units * RT * D), mx_((size_t)units * RT), l((size_t)units * RT);
  float kpad[16] = {0}, vpad[16] = {0};                 // 2^IB centroids, padded to a register
  for (int n = 0; n < (1 << IB); ++n) {
    kpad[n] = ktab[n];
    vpad[n] = vtab[n];
  }
  const __m512 kt = _mm512_loadu_ps(kpad), vt = _mm512_loadu_ps(vpad);
  const __m128i low = _mm_set1_epi8(15);
  const __m512i sh_lo = _mm512_set_epi64(7 * IB, 6 * IB, 5 * IB, 4 * IB, 3 * IB, 2 * IB, IB, 0);
  const __m512i sh_hi = _mm512_set_epi64(15 * IB, 14 * IB, 13 * IB, 12 * IB, 11 * IB, 10 * IB, 9 * IB, 8 * IB);
  const __m512i mask = _mm512_set1_epi32((1 << IB) - 1);
  auto look = [&](const uint8_t* row, __m512 tab, __m512* v) {
    if (IB == 4) {
      for (int g = 0; g < D / 32; ++g) {
        const __m128i x = _mm_loadu_si128((const __m128i*)(row + 16 * g));
        const __m128i lo = _mm_and_si128(x, low), hi = _mm_and_si128(_mm_srli_epi16(x, 4), low);
        v[2 * g] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), tab);
        v[2 * g + 1] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)), tab);
      }
      return;
    }
    for (int g = 0; g < G; ++g) {  // 16 indices in 2*IB bytes, read by one load inside the row
      const int at = 2 * g * IB, from = at + 8 <= NB ? at : NB - 8;
      uint64_t word;
      std::memcpy(&word, row + from, 8);
      const __m512i w = _mm512_set1_epi64((long long)(word >> (8 * (at - from))));
      const __m256i a = _mm512_cvtepi64_epi32(_mm512_srlv_epi64(w, sh_lo));
      const __m256i b = _mm512_cvtepi64_epi32(_mm512_srlv_epi64(w, sh_hi));
      const __m512i ix = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1), mask);
      v[g] = _mm512_permutexvar_ps(ix, tab);
    }
  };
#pragma omp parallel if ((long long)HK * T * D >= PAR_MIN)
  {
    std::vector<float> sc((size_t)RT * BLOCK);
#pragma omp for schedule(static)
    for (long long u = 0; u < units; ++u) {
      const int h = (int)(u / nblk), b = (int)(u % nblk);
      const int t0 = b * BLOCK, n = (t0 + BLOCK < T ? t0 + BLOCK : T) - t0;
      const float* qh = q + (long long)h * RT * D;
      const uint8_t* kc = kidx + h * khs + (long long)t0 * NB;
      const uint16_t* kn = knorm + h * knhs + t0;
      __m512 v[G];
      for (int i = 0; i < n; ++i) {
        look(kc + (long long)i * NB, kt, v);
        const float nk = half_to_float(kn[i]);
        for (int r = 0; r < RT; ++r) {
          __m512 s0 = _mm512_mul_ps(v[0], _mm512_loadu_ps(qh + r * D));
          __m512 s1 = _mm512_mul_ps(v[1], _mm512_loadu_ps(qh + r * D + 16));
          for (int g = 2; g < G; g += 2) {
            s0 = _mm512_fmadd_ps(v[g], _mm512_loadu_ps(qh + r * D + 16 * g), s0);
            s1 = _mm512_fmadd_ps(v[g + 1], _mm512_loadu_ps(qh + r * D + 16 * g + 16), s1);
          }
          sc[(size_t)r * BLOCK + i] = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) * nk;
        }
      }
      float* a = acc.data() + (size_t)u * RT * D;
      for (int r = 0; r < RT; ++r)
        block_softmax(sc.data() + (size_t)r * BLOCK, n, &mx_[(size_t)u * RT + r], &l[(size_t)u * RT + r]);
      const uint8_t* vc = vidx + h * vhs + (long long)t0 * NB;
      const uint16_t* vn = vnorm + h * vnhs + t0;
      for (int r = 0; r < RT; ++r) {   // one query row at a time: its D/16 accumulators stay in registers
        __m512 o[G];
        for (int g = 0; g < G; ++g) o[g] = _mm512_setzero_ps();
        const float* sr = sc.data() + (size_t)r * BLOCK;
        for (int i = 0; i < n; ++i) {
          look(vc + (long long)i * NB, vt, v);
          const __m512 w = _mm512_set1_ps(sr[i] * half_to_float(vn[i]));
          for (int g = 0; g < G; ++g) o[g] = _mm512_fmadd_ps(w, v[g], o[g]);
        }
        for (int g = 0; g < G; ++g) _mm512_storeu_ps(a + (size_t)r * D + 16 * g, o[g]);
      }
    }
#pragma omp for schedule(static)
    for (long long hr = 0; hr < (long long)HK * RT; ++hr) merge(hr, RT, nblk, D, acc.data(), mx_.data(), l.data(), out);
  }
}
#endif

// Calls f(decoder) with the decoder for a table of this shape.
template <class F>
void with_decoder(int D, int K, int IB, int N, const float* table, F&& f) {
  if (K == 1 && IB <= 4 && D % 16 == 0) {
    switch (IB) {
      case 1: f(SmallScalar<1>(D, N, table)); return;
      case 2: f(SmallScalar<2>(D, N, table)); return;
      case 3: f(SmallScalar<3>(D, N, table)); return;
      default: f(SmallScalar<4>(D, N, table)); return;
    }
  }
  if (IB == 8) {
    f(ByteIndex{D, K, table});
    return;
  }
  f(AnyIndex{D, K, IB, table});
}

}  // namespace

extern "C" {

const char* tq_isa() { return ISA; }

// q (HK, RT, D) float32; codes of head h at idx + h*head_stride, token t at + t*NB;
// table (N, K) float32; out (HK, RT, T) float32 unit scores.
void tq_scores(const float* q, const uint8_t* idx, long long head_stride, const float* table,
               int HK, int RT, int T, int D, int K, int IB, int N, int NB, float* out) {
  with_decoder(D, K, IB, N, table, [&](const auto& dec) { scores_pass(dec, q, idx, head_stride, HK, RT, T, D, NB, out); });
}

// w (HK, RT, T) float32 (softmax weights x norms); out (HK, RT, D) float32.
void tq_values(const float* w, const uint8_t* idx, long long head_stride, const float* table,
               int HK, int RT, int T, int D, int K, int IB, int N, int NB, float* out) {
  with_decoder(D, K, IB, N, table, [&](const auto& dec) { values_pass(dec, w, idx, head_stride, HK, RT, T, D, NB, out); });
}

// Encode: x (rows, D) float32 -> norms (rows,) float32 and packed indices (rows, NB) uint8.
// nu = |x|, u = x / nu (zero stays zero), y = rot u with rot (D, D) row-major (the
// rotation as a matrix), then per block the cell count #{t : y > bounds[t]} (K = 1, the
// reference's rule) or the first nearest codeword by |c|^2 - 2 <y, c> (K > 1), packed
// little-endian as the package's pack() does.
void tq_encode(const float* x, const float* rot, const float* bounds, const float* table, const float* c2,
               int rows, int D, int K, int IB, int N, int NB, uint8_t* idx, float* norm) {
#pragma omp parallel if ((long long)rows * D * D >= (1LL << 22))
  {
    std::vector<float> u(D), y(D);
#pragma omp for schedule(static)
    for (int r = 0; r < rows; ++r) {
      const float* xr = x + (size_t)r * D;
      float ss = 0.0f;
      for (int j = 0; j < D; ++j) ss += xr[j] * xr[j];
      const float nrm = std::sqrt(ss);
      norm[r] = nrm;
      const float div = nrm > 0.0f ? nrm : 1.0f;
      for (int j = 0; j < D; ++j) u[j] = xr[j] / div;
      for (int i = 0; i < D; ++i) y[i] = dot(rot + (size_t)i * D, u.data(), D);
      uint8_t* out = idx + (size_t)r * NB;
      uint64_t acc = 0;
      int nacc = 0, ob = 0;
      for (int blk = 0; blk < D / K; ++blk) {
        uint32_t code = 0;
        if (K == 1) {
          for (int t = 0; t < N - 1; ++t) code += y[blk] > bounds[t] ? 1u : 0u;
        } else {
          float best = 3.402823e38f;
          for (int n = 0; n < N; ++n) {
            float d = 0.0f;
            for (int c = 0; c < K; ++c) d += y[blk * K + c] * table[n * K + c];
            d = c2[n] - 2.0f * d;
            if (d < best) {
              best = d;
              code = (uint32_t)n;
            }
          }
        }
        acc |= (uint64_t)code << nacc;
        nacc += IB;
        while (nacc >= 8) {
          out[ob++] = (uint8_t)(acc & 255u);
          acc >>= 8;
          nacc -= 8;
        }
      }
      if (nacc > 0) out[ob++] = (uint8_t)(acc & 255u);
      while (ob < NB) out[ob++] = 0;
    }
  }
}

// Decode: the codes of HK heads x T tokens into their rotated coordinates c[i_t],
// out (HK, T, D) float32 (what a prefill block multiplies with its many queries).
void tq_decode(const uint8_t* idx, long long head_stride, const float* table, int HK, int T, int D, int K,
               int IB, int N, int NB, float* out) {
  with_decoder(D, K, IB, N, table, [&](const auto& dec) {
#pragma omp parallel for schedule(static) if ((long long)HK * T * D >= PAR_MIN)
    for (long long u = 0; u < (long long)HK * T; ++u) {
      const int h = (int)(u / T), t = (int)(u % T);
      dec(idx + h * head_stride + (long long)t * NB, out + (size_t)u * D);
    }
  });
}

// Decode attention: q (HK, RT, D) float32, scaled and rotated by the key codec; key codes
// and fp16 norms of head h at kidx + h*khs and knorm + h*knhs (token t at + t*KNB, + t),
// likewise the values; key table (KN, KK), value table (VN, VK); out (HK, RT, D) float32 in
// the value codec's rotated frame.
void attend_rotated(const float* q, const uint8_t* kidx, long long khs, const uint16_t* knorm, long long knhs,
                    const float* ktable, int KK, int KIB, int KN, int KNB,
                    const uint8_t* vidx, long long vhs, const uint16_t* vnorm, long long vnhs,
                    const float* vtable, int VK, int VIB, int VN, int VNB,
                    int HK, int RT, int T, int D, float* out) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (KK == 1 && VK == 1 && KIB == VIB && KIB >= 2 && KIB <= 4 && KN == (1 << KIB) && VN == (1 << VIB) &&
      (D == 64 || D == 128 || D == 256)) {
    using Fn = void (*)(const float*, const float*, const float*, const uint8_t*, long long, const uint16_t*,
                        long long, const uint8_t*, long long, const uint16_t*, long long, int, int, int, float*);
    static const Fn table[3][3] = {{attend_small<64, 2>, attend_small<64, 3>, attend_small<64, 4>},
                                   {attend_small<128, 2>, attend_small<128, 3>, attend_small<128, 4>},
                                   {attend_small<256, 2>, attend_small<256, 3>, attend_small<256, 4>}};
    table[D == 64 ? 0 : D == 128 ? 1 : 2][KIB - 2](ktable, vtable, q, kidx, khs, knorm, knhs, vidx, vhs, vnorm,
                                                    vnhs, HK, RT, T, out);
    return;
  }
#endif
  with_decoder(D, KK, KIB, KN, ktable, [&](const auto& kd) {
    with_decoder(D, VK, VIB, VN, vtable, [&](const auto& vd) {
      attend_pass(kd, vd, q, kidx, khs, knorm, knhs, vidx, vhs, vnorm, vnhs, HK, RT, T, D, KNB, VNB, out);
    });
  });
}

// The same from unrotated queries: q (HK, RT, D) as the model gives them; the kernel scales
// them, rotates them by the key codec's rotation krot (D, D), attends, and rotates the
// output back with the value codec's vrot^T, so out (HK, RT, D) is the attention output.
void tq_attend(const float* q, float scale, const float* krot, const float* vrot,
               const uint8_t* kidx, long long khs, const uint16_t* knorm, long long knhs,
               const float* ktable, int KK, int KIB, int KN, int KNB,
               const uint8_t* vidx, long long vhs, const uint16_t* vnorm, long long vnhs,
               const float* vtable, int VK, int VIB, int VN, int VNB,
               int HK, int RT, int T, int D, float* out) {
  const size_t rows = (size_t)HK * RT;
  std::vector<float> qr(rows * D), orot(rows * D), qs(D);
  for (size_t r = 0; r < rows; ++r) {
    for (int j = 0; j < D; ++j) qs[j] = q[r * D + j] * scale;
    for (int i = 0; i < D; ++i) qr[r * D + i] = dot(krot + (size_t)i * D, qs.data(), D);
  }
  attend_rotated(qr.data(), kidx, khs, knorm, knhs, ktable, KK, KIB, KN, KNB, vidx, vhs, vnorm, vnhs,
                 vtable, VK, VIB, VN, VNB, HK, RT, T, D, orot.data());
  for (size_t r = 0; r < rows; ++r) {
    float* o = out + r * D;
    for (int j = 0; j < D; ++j) o[j] = 0.0f;
    for (int i = 0; i < D; ++i) axpy(orot[r * D + i], vrot + (size_t)i * D, o, D);
  }
}

}  // extern "C"
