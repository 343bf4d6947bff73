// The int8-activation row kernels of qlinear (qkernels.h: paths 6 AVX-VNNI, 7 AVX-512 VNNI).
// x arrives quantized to int8 per block of 32 (quantize_act); each weight group's product is an
// integer dot product, scaled once by scale * d and accumulated in float32. Every set is
// compiled for its own instruction set (target pragmas) and only called after a cpuid check, as
// in qkernels_x86.cpp.
#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include <algorithm>

#include "qkernels.h"

namespace symphony {
namespace qcpu {
namespace {

constexpr int64_t kPrefetchRows = 16;  // as in qkernels_x86.cpp


// ============================================================================================
// AVX-VNNI (vpdpbusd on 256-bit registers). One step is 32 values (two x blocks of 16).
// Unsigned x signed products: u4 weights are unsigned as they are; i8 weights give |w| and move
// their sign onto x (vpsignb). (AVX2 without VNNI: qkernels_rows_avx2.cpp.)
// ============================================================================================
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")

// Integer dot product of 4-byte groups: lane i = sum_{j<4} a[4i + j] * b[4i + j].
inline __m256i dot_avxvnni(__m256i a_u8, __m256i b_s8) {
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), a_u8, b_s8);
}

template <int NB, int MB>
inline void tile_avxvnni(const QView& w, const QAct& a, float* out, int64_t ldo, int64_t n,
                          int64_t m) {
  __m256 acc[NB][MB];
  for (int b = 0; b < NB; ++b)
    for (int j = 0; j < MB; ++j) acc[b][j] = _mm256_setzero_ps();
  const __m128i mask = _mm_set1_epi8(0x0F);
  const int64_t G = w.n_groups, nb = a.ldq / 16, steps = w.K / 32;
  const bool u4 = w.kind == kQU4, g16 = w.group == 16;
  for (int64_t st = 0; st < steps; ++st) {
    __m256i wv[NB];
    __m256 ws[NB];
    for (int b = 0; b < NB; ++b) {
      const uint8_t* row = w.qs + (n + b) * w.row_bytes;
      const float* sc = w.scales + (n + b) * G;
      if (u4) {
        const uint8_t* p = row + st * 16;
        if ((st & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchRows * w.row_bytes), _MM_HINT_T0);
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        wv[b] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
        ws[b] = _mm256_set1_ps(sc[st]);
      } else {
        const uint8_t* p = row + st * 32;
        if ((st & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchRows * w.row_bytes), _MM_HINT_T0);
        wv[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        ws[b] = g16 ? _mm256_set_m128(_mm_set1_ps(sc[2 * st + 1]), _mm_set1_ps(sc[2 * st]))
                    : _mm256_set1_ps(sc[st]);
      }
    }
    for (int j = 0; j < MB; ++j) {
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + (m + j) * a.ldq + st * 32));
      const float* dp = a.d + (m + j) * nb + 2 * st;   // lanes 0-3: block 2st, 4-7: 2st + 1
      const __m256 xd = _mm256_set_m128(_mm_broadcast_ss(dp + 1), _mm_broadcast_ss(dp));
      for (int b = 0; b < NB; ++b) {
        const __m256i isum = u4 ? dot_avxvnni(wv[b], xq)
                                : dot_avxvnni(_mm256_abs_epi8(wv[b]), _mm256_sign_epi8(xq, wv[b]));
        acc[b][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(ws[b], xd), acc[b][j]);
      }
    }
  }
  if (w.mins)  // + sum_g mins[n, g] * s[m, g], into the same accumulators
    for (int64_t g = 0; g < G; g += 8) {
      const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(std::min<int64_t>(G - g, 8))),
                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      __m256 mv[NB];
      for (int b = 0; b < NB; ++b) mv[b] = _mm256_maskload_ps(w.mins + (n + b) * G + g, k);
      for (int j = 0; j < MB; ++j) {
        const __m256 sv = _mm256_maskload_ps(a.s + (m + j) * G + g, k);
        for (int b = 0; b < NB; ++b) acc[b][j] = _mm256_fmadd_ps(mv[b], sv, acc[b][j]);
      }
    }
  for (int j = 0; j < MB; ++j)
    for (int b = 0; b < NB; ++b) {
      const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc[b][j]), _mm256_extractf128_ps(acc[b][j], 1));
      const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      out[(m + j) * ldo + n + b] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
    }
}

inline void rows_avxvnni(const QView& w, const QAct& a, int64_t M, float* out, int64_t ldo,
                          int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) tile_avxvnni<2, 4>(w, a, out, ldo, n, m);
    for (; m + 2 <= M; m += 2) tile_avxvnni<2, 2>(w, a, out, ldo, n, m);
    for (; m < M; ++m) tile_avxvnni<2, 1>(w, a, out, ldo, n, m);
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) tile_avxvnni<1, 1>(w, a, out, ldo, n, m);
}

#pragma GCC pop_options

// ============================================================================================
// AVX-512 VNNI: a step is 64 values (four x blocks), one vpdpbusd a weight row and x row.
//   u4: the 32 bytes of two groups unpack to [low nibbles | high nibbles]; x is stored in that
//       order (permute64), so lanes 0-3 and 8-11 belong to the first group, 4-7 and 12-15 to
//       the second.
//   i8: weights are signed, so x is stored unsigned as qx + 128 (bias128) and each dot product
//       starts from -128 * sum(w) of its lane (one more vpdpbusd a weight row, not a product).
// ============================================================================================
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma")

// Up to 16 scales or mins from p (mask k) as float32 lanes 0..15: float32 as they are, float16
// (a GGUF file's own, S = uint16_t) widened exactly as they are loaded.
inline __m512 load16_ps(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
inline __m512 load16_ps(const uint16_t* p, __mmask16 k) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p));
}

// KIND 0: u4, 1: i8 groups of 32, 2: i8 groups of 16. SPLIT: 15-bit x (a.q = hi, biased for
// i8 like 8-bit x; a.lo = lo, 0..127, never biased: it is the unsigned operand for i8 weights).
// S: the scales' type (float, or uint16_t for float16 ones read as they are).
template <int NB, int MB, bool TAIL, int KIND, bool SPLIT, class S>
inline void step_512(const QView& w, const QAct& a, int64_t n, int64_t m, int64_t st,
                     __m512 (&acc)[NB][MB]) {
  const __m512i zero = _mm512_setzero_si512();
  // which weight group of the step lane i belongs to (u4: lanes 0-3 and 8-11 the first group),
  // and which x block of 16: in value order for i8, blocks 0, 2, 1, 3 for u4 (permute64)
  const __m512i idx_u4 = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i idx_g32 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i idx_g16 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i idx_xu4 = _mm512_set_epi32(3, 3, 3, 3, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0, 0, 0);
  const __m512i idx_x = KIND == 0 ? idx_xu4 : idx_g16;
  const int64_t G = w.n_groups, nb = a.ldq / 16;
  __m512i wv[NB], nwc[NB];
  __m512 ws[NB];
  for (int b = 0; b < NB; ++b) {
    const S* sc = scales_of<S>(w) + (n + b) * G;
    if constexpr (KIND == 0) {
      const uint8_t* p = w.qs + (n + b) * w.row_bytes + st * 32;
      if ((st & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchRows * w.row_bytes), _MM_HINT_T0);
      const __m256i v = TAIL ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))
                             : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      const __m256i mask = _mm256_set1_epi8(0x0F);
      wv[b] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, mask)),
                                 _mm256_and_si256(_mm256_srli_epi16(v, 4), mask), 1);
      ws[b] = _mm512_permutexvar_ps(idx_u4, load16_ps(sc + 2 * st, TAIL ? 1 : 3));
    } else {
      const uint8_t* p = w.qs + (n + b) * w.row_bytes + st * 64;
      _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchRows * w.row_bytes), _MM_HINT_T0);
      wv[b] = TAIL ? _mm512_maskz_loadu_epi8(0xFFFFFFFFull, p) : _mm512_loadu_si512(p);
      nwc[b] = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, _mm512_set1_epi8(char(0x80)), wv[b]));
      if constexpr (KIND == 1)
        ws[b] = _mm512_permutexvar_ps(idx_g32, load16_ps(sc + 2 * st, TAIL ? 1 : 3));
      else
        ws[b] = _mm512_permutexvar_ps(idx_g16, load16_ps(sc + 4 * st, TAIL ? 3 : 15));
    }
  }
  for (int j = 0; j < MB; ++j) {
    const __m512i xq = _mm512_loadu_si512(a.q + (m + j) * a.ldq + st * 64);
    __m512i xl = zero;
    if constexpr (SPLIT) xl = _mm512_loadu_si512(a.lo + (m + j) * a.ldq + st * 64);
    const __m512 xd = _mm512_permutexvar_ps(idx_x, _mm512_castps128_ps512(_mm_loadu_ps(a.d + (m + j) * nb + 4 * st)));
    for (int b = 0; b < NB; ++b) {
      __m512i isum = KIND == 0 ? _mm512_dpbusd_epi32(zero, wv[b], xq)
                               : _mm512_dpbusd_epi32(nwc[b], xq, wv[b]);
      if constexpr (SPLIT)  // 128 * (w . hi) + (w . lo)
        isum = KIND == 0 ? _mm512_dpbusd_epi32(_mm512_slli_epi32(isum, 7), wv[b], xl)
                         : _mm512_dpbusd_epi32(_mm512_slli_epi32(isum, 7), xl, wv[b]);
      acc[b][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(ws[b], xd), acc[b][j]);
    }
  }
}

// n (mask k) mins of weight row r from group g on: stored (float32 or float16), or a u4 weight's
// implied -8 * scale (exact, as with_float_scales in qlinear.cpp writes them out).
template <class S>
inline __m512 mins16(const QView& w, int64_t r, int64_t g, __mmask16 k) {
  const int64_t at = r * w.n_groups + g;
  if (w.mins) return load16_ps(w.mins + at, k);
  if (w.mins16) return load16_ps(w.mins16 + at, k);
  return _mm512_mul_ps(load16_ps(scales_of<S>(w) + at, k), _mm512_set1_ps(-8.f));
}

template <int NB, int MB, int KIND, bool SPLIT, class S>
inline void tile_kind_512(const QView& w, const QAct& a, float* out, int64_t ldo, int64_t n,
                          int64_t m) {
  __m512 acc[NB][MB];
  for (int b = 0; b < NB; ++b)
    for (int j = 0; j < MB; ++j) acc[b][j] = _mm512_setzero_ps();
  const int64_t full = w.K / 64;
  for (int64_t st = 0; st < full; ++st) step_512<NB, MB, false, KIND, SPLIT, S>(w, a, n, m, st, acc);
  if (w.K % 64) step_512<NB, MB, true, KIND, SPLIT, S>(w, a, n, m, full, acc);
  const int64_t G = w.n_groups;
  if (KIND == 0 || w.mins || w.mins16)  // + sum_g mins[n, g] * s[m, g] (u4: stored or implied)
    for (int64_t g = 0; g < G; g += 16) {
      const __mmask16 k = G - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (G - g)) - 1);
      __m512 mv[NB];
      for (int b = 0; b < NB; ++b) mv[b] = mins16<S>(w, n + b, g, k);
      for (int j = 0; j < MB; ++j) {
        const __m512 sv = _mm512_maskz_loadu_ps(k, a.s + (m + j) * G + g);
        for (int b = 0; b < NB; ++b) acc[b][j] = _mm512_fmadd_ps(mv[b], sv, acc[b][j]);
      }
    }
  for (int j = 0; j < MB; ++j)
    for (int b = 0; b < NB; ++b) out[(m + j) * ldo + n + b] = _mm512_reduce_add_ps(acc[b][j]);
}

template <int NB, int MB, bool SPLIT, class S>
inline void tile_split_512(const QView& w, const QAct& a, float* out, int64_t ldo, int64_t n, int64_t m) {
  if (w.kind == kQU4)
    tile_kind_512<NB, MB, 0, SPLIT, S>(w, a, out, ldo, n, m);
  else if (w.group == 32)
    tile_kind_512<NB, MB, 1, SPLIT, S>(w, a, out, ldo, n, m);
  else
    tile_kind_512<NB, MB, 2, SPLIT, S>(w, a, out, ldo, n, m);
}

template <int NB, int MB, class S>
inline void tile_512(const QView& w, const QAct& a, float* out, int64_t ldo, int64_t n, int64_t m) {
  if (a.lo)
    tile_split_512<NB, MB, true, S>(w, a, out, ldo, n, m);
  else
    tile_split_512<NB, MB, false, S>(w, a, out, ldo, n, m);
}

template <class S>
inline void rows_512(const QView& w, const QAct& a, int64_t M, float* out, int64_t ldo, int64_t n0,
                     int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) tile_512<4, 4, S>(w, a, out, ldo, n, m);
    for (; m + 2 <= M; m += 2) tile_512<4, 2, S>(w, a, out, ldo, n, m);
    for (; m < M; ++m) tile_512<4, 1, S>(w, a, out, ldo, n, m);
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) tile_512<1, 1, S>(w, a, out, ldo, n, m);
}

#pragma GCC pop_options

}  // namespace

__attribute__((target("avx2,fma,avxvnni"))) void rows_q8_avxvnni(const QView& w, const QAct& a,
                                                                 int64_t M, float* out,
                                                                 int64_t ldo, int64_t n0,
                                                                 int64_t n1) {
  rows_avxvnni(w, a, M, out, ldo, n0, n1);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma"))) void
rows_q8_avx512vnni(const QView& w, const QAct& a, int64_t M, float* out, int64_t ldo, int64_t n0,
                   int64_t n1) {
  if (w.scales16)
    rows_512<uint16_t>(w, a, M, out, ldo, n0, n1);
  else
    rows_512<float>(w, a, M, out, ldo, n0, n1);
}

}  // namespace qcpu
}  // namespace symphony

#endif  // x86-64
