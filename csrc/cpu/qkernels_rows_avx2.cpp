// qlinear paths 5 (int8 x) and 12 (15-bit x) on AVX2: the decode kernels, for a few rows of x
// (a single stream's step, a small batch). Each weight row is read once, in order, as a dot
// product with every row of x (vpmaddubsw + vpmaddwd), NB weight rows at a time sharing x's
// loads; no transposition, no gather.
//
// u4 weights take two groups a step (64 values, 32 bytes): the low nibbles of both groups are
// one register and the high nibbles another, so one load, one shift and two ands unpack them.
// x is stored in the matching order (quantize_act's permute64: values 32s+0..15, 32(s+1)+0..15,
// 32s+16..31, 32(s+1)+16..31), so lanes 0-3 of each product belong to group s and lanes 4-7 to
// group s + 1. Per step and weight row: int32 sums of the low and high halves, converted, scaled
// by x's block scales (a vector per half, shared by the NB rows), summed, and accumulated with
// the two groups' weight scales. i8 weights take one step of 32 values (one group of 32 or two
// of 16) in x's plain order; vpmaddubsw needs an unsigned operand, so it multiplies |w| by x
// with w's sign (vpsignb), which needs |x| <= 127 (both halves of 15-bit x are, below).
//
// 15-bit x (path 12; a.lo set): x = 128 hi + lo per value, hi and lo in -127..127 as
// quantize_act15_avx2 splits them (qkernels.h); one product each, combined with vpmaddwd by 128
// and by 1. u4 pairs stay within int16 (2 * 15 * 127); i8 pairs (2 * 128 * 127 = 32512) too.
//
// Scales and mins are read as the weight holds them: float32, or the file's float16 (widened
// exactly with F16C as they are loaded), and a u4 weight without mins gets its implied -8 *
// scale computed in place; the same bits as qlinear's widening pass (with_float_scales) gives
// the other kernels, without that pass over every scale of the matrix before each product.
//
// The result is W times the rounded x (qkernels.h), equal to rows_q8_scalar (path 4) for int8
// x and to path 11 for 15-bit x up to float32 summation order.
#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "qkernels.h"

namespace symphony {
namespace qcpu {
namespace {

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// The weights of the tile kAhead tiles on are prefetched as this one is read, a cache line at a
// time and at the same offset in each row: the NB rows of a tile are NB short streams (a row of
// a 576-wide u4 matrix is 288 bytes), which the hardware prefetcher alone follows late.
constexpr int64_t kAhead = 2;

// The int32 sums of 4-byte lanes of u (unsigned bytes) times x (signed bytes): int8 x (xh), or
// 15-bit x as 128 (u . xh) + (u . xl).
template <bool SPLIT>
inline __m256i dot(__m256i u, __m256i xh, __m256i xl) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (!SPLIT) return _mm256_madd_epi16(_mm256_maddubs_epi16(u, xh), ones);
  return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u, xh), _mm256_set1_epi16(128)),
                          _mm256_madd_epi16(_mm256_maddubs_epi16(u, xl), ones));
}

inline __m256i load32(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// dot with unsigned weights w and x's 32 bytes at `at` (its hi / lo halves for 15-bit x)
template <bool SPLIT>
inline __m256i dot_u(__m256i w, const QAct& a, int64_t at) {
  return dot<SPLIT>(w, load32(a.q + at), SPLIT ? load32(a.lo + at) : __m256i{});
}

// The same for signed weights w (|w| in aw): |w| times x with w's sign.
template <bool SPLIT>
inline __m256i dot_s(__m256i aw, __m256i w, const QAct& a, int64_t at) {
  return dot<SPLIT>(aw, _mm256_sign_epi8(load32(a.q + at), w),
                    SPLIT ? _mm256_sign_epi8(load32(a.lo + at), w) : __m256i{});
}

// Lanes 0-3: f[0], lanes 4-7: f[1] (one 8-byte broadcast and an in-lane permute).
inline __m256 pair_ps(const float* f) {
  const __m256 v = _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(f)));
  return _mm256_permutevar_ps(v, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

// The same from two float16 values (the file's scales, widened exactly).
inline __m256 pair_ps(const uint16_t* f) {
  int32_t two;
  std::memcpy(&two, f, sizeof two);
  const __m256 v = _mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(two)));
  return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

// All lanes: f[0].
inline __m256 bcast_ps(const float* f) { return _mm256_broadcast_ss(f); }
inline __m256 bcast_ps(const uint16_t* f) { return _mm256_set1_ps(_cvtsh_ss(*f)); }

// n (1..8) scales from p, float32 or float16, in lanes 0..n-1 (the rest 0).
inline __m256 load8_ps(const float* p, int64_t n) {
  if (n == 8) return _mm256_loadu_ps(p);
  const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_maskload_ps(p, k);
}
inline __m256 load8_ps(const uint16_t* p, int64_t n) {
  if (n == 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  uint16_t t[8] = {};
  std::memcpy(t, p, size_t(n) * sizeof *p);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)));
}

// Lanes 0-3: f[0], lanes 4-7: f[2].
inline __m256 pair2_ps(const float* f) {
  const __m256 v = _mm256_castps128_ps256(_mm_loadu_ps(f));
  return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2));
}

// One step of the u4 kernel: weight bytes 32 st .. (two groups; TAIL: the last group alone, when
// K % 64 == 32: the permute64 layout puts its two x blocks at bytes 0 and 32 of the step).
template <int NB, int MB, bool TAIL, bool SPLIT, class S>
inline void step_u4(const QView& w, const QAct& a, const uint8_t* const (&row)[NB],
                    const S* const (&sc)[NB], int64_t m, int64_t st, __m256 (&acc)[NB][MB]) {
  const int64_t nb = a.ldq / 16;
  const __m256i nib = _mm256_set1_epi8(0x0F);
  __m256 xd_lo[MB], xd_hi[MB];
  for (int j = 0; j < MB; ++j) {
    const float* d = a.d + (m + j) * nb + 4 * st;
    xd_lo[j] = TAIL ? _mm256_set1_ps(d[0]) : pair2_ps(d);
    xd_hi[j] = TAIL ? _mm256_set1_ps(d[1]) : pair2_ps(d + 1);
  }
  for (int b = 0; b < NB; ++b) {
    const uint8_t* p = row[b] + st * 32;
    if ((st & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(p + kAhead * NB * w.row_bytes), _MM_HINT_T0);
    const __m256i v = TAIL ? _mm256_inserti128_si256(_mm256_setzero_si256(),
                                                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), 0)
                           : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i wl = _mm256_and_si256(v, nib), wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
    const __m256 ws = TAIL ? bcast_ps(sc[b] + 2 * st) : pair_ps(sc[b] + 2 * st);
    for (int j = 0; j < MB; ++j) {
      const int64_t at = (m + j) * a.ldq + st * 64;
      const __m256 lo = _mm256_mul_ps(_mm256_cvtepi32_ps(dot_u<SPLIT>(wl, a, at)), xd_lo[j]);
      const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u<SPLIT>(wh, a, at + 32)), xd_hi[j], lo);
      acc[b][j] = _mm256_fmadd_ps(t, ws, acc[b][j]);
    }
  }
}

// n (1..8) mins of weight row r from group g on: stored (float32 or float16), or a u4 weight's
// implied -8 * scale (exact, as with_float_scales in qlinear.cpp writes them out).
template <class S>
inline __m256 mins8(const QView& w, int64_t r, int64_t g, int64_t n) {
  const int64_t at = r * w.n_groups + g;
  if (w.mins) return load8_ps(w.mins + at, n);
  if (w.mins16) return load8_ps(w.mins16 + at, n);
  return _mm256_mul_ps(load8_ps(scales_of<S>(w) + at, n), _mm256_set1_ps(-8.f));
}

// out[m + j, n + b] for b < NB, j < MB: x rows m.., weight rows n... KIND 0: u4; 1: i8 groups
// of 32; 2: i8 groups of 16.
template <int NB, int MB, int KIND, bool SPLIT, class S>
inline void tile(const QView& w, const QAct& a, float* out, int64_t ldo, int64_t n, int64_t m) {
  const int64_t G = w.n_groups, nb = a.ldq / 16;
  const uint8_t* row[NB];
  const S* sc[NB];
  for (int b = 0; b < NB; ++b) {
    row[b] = w.qs + (n + b) * w.row_bytes;
    sc[b] = scales_of<S>(w) + (n + b) * G;
  }
  __m256 acc[NB][MB];
  for (int b = 0; b < NB; ++b)
    for (int j = 0; j < MB; ++j) acc[b][j] = _mm256_setzero_ps();
  if constexpr (KIND == 0) {
    const int64_t full = w.K / 64;
    for (int64_t st = 0; st < full; ++st) step_u4<NB, MB, false, SPLIT, S>(w, a, row, sc, m, st, acc);
    if (w.K % 64) step_u4<NB, MB, true, SPLIT, S>(w, a, row, sc, m, full, acc);
  } else {
    const int64_t steps = w.K / 32;
    for (int64_t st = 0; st < steps; ++st) {
      __m256 xd[MB];
      for (int j = 0; j < MB; ++j) xd[j] = pair_ps(a.d + (m + j) * nb + 2 * st);
      for (int b = 0; b < NB; ++b) {
        const uint8_t* p = row[b] + st * 32;
        if ((st & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(p + kAhead * NB * w.row_bytes), _MM_HINT_T0);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        const __m256i av = _mm256_abs_epi8(v);
        const __m256 ws = KIND == 1 ? bcast_ps(sc[b] + st) : pair_ps(sc[b] + 2 * st);
        for (int j = 0; j < MB; ++j) {
          const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(dot_s<SPLIT>(av, v, a, (m + j) * a.ldq + st * 32)), xd[j]);
          acc[b][j] = _mm256_fmadd_ps(t, ws, acc[b][j]);
        }
      }
    }
  }
  if (KIND == 0 || w.mins || w.mins16)  // + sum_g mins[n, g] * s[m, g] (u4: stored or implied)
    for (int64_t g = 0; g < G; g += 8) {
      const int64_t c = std::min<int64_t>(G - g, 8);
      __m256 mv[NB];
      for (int b = 0; b < NB; ++b) mv[b] = mins8<S>(w, n + b, g, c);
      for (int j = 0; j < MB; ++j) {
        const __m256 sv = load8_ps(a.s + (m + j) * G + g, c);
        for (int b = 0; b < NB; ++b) acc[b][j] = _mm256_fmadd_ps(mv[b], sv, acc[b][j]);
      }
    }
  for (int j = 0; j < MB; ++j) {
    float r[NB];
    for (int b = 0; b < NB; ++b) {
      const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc[b][j]), _mm256_extractf128_ps(acc[b][j], 1));
      const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      r[b] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
    }
    std::memcpy(out + (m + j) * ldo + n, r, sizeof r);
  }
}

template <int KIND, bool SPLIT, class S>
void rows_kind(const QView& w, const QAct& a, int64_t M, float* out, int64_t ldo, int64_t n0,
               int64_t n1) {
  int64_t n = n0;
  if (M == 1) {
    for (; n + 4 <= n1; n += 4) tile<4, 1, KIND, SPLIT, S>(w, a, out, ldo, n, 0);
  } else {
    for (; n + 2 <= n1; n += 2) {
      int64_t m = 0;
      for (; m + 2 <= M; m += 2) tile<2, 2, KIND, SPLIT, S>(w, a, out, ldo, n, m);
      if (m < M) tile<2, 1, KIND, SPLIT, S>(w, a, out, ldo, n, m);
    }
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) tile<1, 1, KIND, SPLIT, S>(w, a, out, ldo, n, m);
}

template <bool SPLIT, class S>
void rows_scaled(const QView& w, const QAct& a, int64_t M, float* out, int64_t ldo, int64_t n0,
                 int64_t n1) {
  if (w.kind == kQU4) rows_kind<0, SPLIT, S>(w, a, M, out, ldo, n0, n1);
  else if (w.group == 32) rows_kind<1, SPLIT, S>(w, a, M, out, ldo, n0, n1);
  else rows_kind<2, SPLIT, S>(w, a, M, out, ldo, n0, n1);
}

template <bool SPLIT>
void rows_split(const QView& w, const QAct& a, int64_t M, float* out, int64_t ldo, int64_t n0,
                int64_t n1) {
  if (w.scales16) rows_scaled<SPLIT, uint16_t>(w, a, M, out, ldo, n0, n1);
  else rows_scaled<SPLIT, float>(w, a, M, out, ldo, n0, n1);
}

// One block of 16 values: d = amax / qmax, q = round_half_even(x / d) (x * (1 / d), as the
// scalar quantizers compute it), returned as 16 int32 in two registers (value order).
inline float quantize_block(const float* xb, float qmax, __m256i& q0, __m256i& q1) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 8);
  const __m256 m8 = _mm256_max_ps(_mm256_andnot_ps(sign, x0), _mm256_andnot_ps(sign, x1));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float dv = _mm_cvtss_f32(m4) / qmax, id = dv != 0.f ? 1.f / dv : 0.f;
  const __m256 iv = _mm256_set1_ps(id);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256 lim = _mm256_set1_ps(qmax);
  q0 = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_round_ps(_mm256_mul_ps(x0, iv), kRound), -lim), lim));
  q1 = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_round_ps(_mm256_mul_ps(x1, iv), kRound), -lim), lim));
  return dv;
}

// 16 int32 (each in -127..127) -> 16 bytes at dst, in order.
inline void store16(int8_t* dst, __m256i q0, __m256i q1) {
  const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8);  // 16 int16 in order
  const __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(w16), _mm256_extracti128_si256(w16, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), b);
}

inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

#pragma GCC pop_options

}  // namespace

__attribute__((target("avx2,fma,f16c"))) void rows_q8_r4_avx2(const QView& w, const QAct& a, int64_t M,
                                                         float* out, int64_t ldo, int64_t n0,
                                                         int64_t n1) {
  if (a.lo) rows_split<true>(w, a, M, out, ldo, n0, n1);
  else rows_split<false>(w, a, M, out, ldo, n0, n1);
}

__attribute__((target("avx2,fma"))) void quantize_act_avx2(const float* x, int64_t ldx, int64_t M,
                                                           int64_t K, int64_t group, int8_t* hi,
                                                           int8_t* lo, float* d, float* s,
                                                           int64_t ldq, bool permute64) {
  const int64_t nb = ldq / 16, G = K / group;
  const float qmax = lo ? 16383.f : 127.f;
  for (int64_t m = 0; m < M; ++m) {
    if (s) std::fill(s + m * G, s + (m + 1) * G, 0.f);
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t at = m * ldq + act_block_pos(b, permute64);
      if (b * 16 >= K) {  // the pad: q = 0, d = 0
        std::memset(hi + at, 0, 16);
        if (lo) std::memset(lo + at, 0, 16);
        d[m * nb + b] = 0.f;
        continue;
      }
      __m256i q0, q1;
      const float dv = quantize_block(x + m * ldx + b * 16, qmax, q0, q1);
      d[m * nb + b] = dv;
      if (s) s[m * G + b * 16 / group] += dv * float(hsum(_mm256_add_epi32(q0, q1)));
      if (!lo) {
        store16(hi + at, q0, q1);
      } else {  // hi = max(q >> 7, -127), lo = q - 128 hi
        const __m256i floor = _mm256_set1_epi32(-127);
        const __m256i h0 = _mm256_max_epi32(_mm256_srai_epi32(q0, 7), floor);
        const __m256i h1 = _mm256_max_epi32(_mm256_srai_epi32(q1, 7), floor);
        store16(hi + at, h0, h1);
        store16(lo + at, _mm256_sub_epi32(q0, _mm256_slli_epi32(h0, 7)),
                _mm256_sub_epi32(q1, _mm256_slli_epi32(h1, 7)));
      }
    }
  }
}

}  // namespace qcpu
}  // namespace symphony

#endif  // x86-64
