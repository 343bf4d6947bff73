// AVX2+FMA and AVX-512 micro-kernels of qlinear (see qkernels.h). Each set is compiled for its
// own instruction set with a target pragma whatever the build's -march, and is only called after
// a cpuid check (qlinear.cpp), so one build serves an AVX2-only EPYC and an AVX-512 Xeon alike.
//
// Blocking: NB weight rows x MB activation rows per register tile. For each group the NB rows
// are dequantized into registers once (q -> float, * scale + min) and reused for the MB rows of
// x; the NB * MB accumulators are independent FMA chains. The weight rows of a block stay in L1
// while the m-blocks stream x from L1/L2.
#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include "qkernels.h"

namespace symphony {
namespace qcpu {
namespace {

// Software prefetch of the rows this many rows ahead (the next tiles), a cache line at a time:
// the hardware prefetcher alone left a GEMV over a large matrix at ~40% of the bandwidth.
constexpr int64_t kPrefetchRows = 16;

// ============================================================================================
// AVX-512
// ============================================================================================
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")

template <int NB, int MB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))) inline void
u4_tile_512(const QView& w, const float* x, int64_t ldx, float* out, int64_t ldo, int64_t n,
            int64_t m) {
  __m512 acc[NB][MB];
  for (int b = 0; b < NB; ++b)
    for (int j = 0; j < MB; ++j) acc[b][j] = _mm512_setzero_ps();
  const __m128i mask = _mm_set1_epi8(0x0F);
  const int64_t G = w.n_groups;
  for (int64_t g = 0; g < G; ++g) {
    __m512 wl[NB], wh[NB];
    for (int b = 0; b < NB; ++b) {
      const uint8_t* p = w.qs + (n + b) * w.row_bytes + g * 16;
      if ((g & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchRows * w.row_bytes), _MM_HINT_T0);
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, mask)));
      const __m512 hi =
          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask)));
      const __m512 s = _mm512_set1_ps(w.scales[(n + b) * G + g]);
      const __m512 mn = _mm512_set1_ps(w.mins[(n + b) * G + g]);
      wl[b] = _mm512_fmadd_ps(lo, s, mn);
      wh[b] = _mm512_fmadd_ps(hi, s, mn);
    }
    for (int j = 0; j < MB; ++j) {
      const float* xr = x + (m + j) * ldx + g * 32;
      const __m512 x0 = _mm512_loadu_ps(xr);
      const __m512 x1 = _mm512_loadu_ps(xr + 16);
      for (int b = 0; b < NB; ++b) {
        acc[b][j] = _mm512_fmadd_ps(wl[b], x0, acc[b][j]);
        acc[b][j] = _mm512_fmadd_ps(wh[b], x1, acc[b][j]);
      }
    }
  }
  for (int j = 0; j < MB; ++j)
    for (int b = 0; b < NB; ++b) out[(m + j) * ldo + n + b] = _mm512_reduce_add_ps(acc[b][j]);
}

template <int NB, int MB, bool HAS_MIN>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))) inline void
i8_tile_512(const QView& w, const float* x, int64_t ldx, float* out, int64_t ldo, int64_t n,
            int64_t m) {
  __m512 acc[NB][MB];
  for (int b = 0; b < NB; ++b)
    for (int j = 0; j < MB; ++j) acc[b][j] = _mm512_setzero_ps();
  const int64_t G = w.n_groups, C = w.K / 16, shift = w.group == 32 ? 1 : 0;
  for (int64_t c = 0; c < C; ++c) {
    const int64_t g = c >> shift;
    __m512 wv[NB];
    for (int b = 0; b < NB; ++b) {
      const int8_t* p = reinterpret_cast<const int8_t*>(w.qs) + (n + b) * w.row_bytes + c * 16;
      if ((c & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchRows * w.row_bytes), _MM_HINT_T0);
      const __m512 q = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
      const __m512 s = _mm512_set1_ps(w.scales[(n + b) * G + g]);
      if constexpr (HAS_MIN)
        wv[b] = _mm512_fmadd_ps(q, s, _mm512_set1_ps(w.mins[(n + b) * G + g]));
      else
        wv[b] = _mm512_mul_ps(q, s);
    }
    for (int j = 0; j < MB; ++j) {
      const __m512 xv = _mm512_loadu_ps(x + (m + j) * ldx + c * 16);
      for (int b = 0; b < NB; ++b) acc[b][j] = _mm512_fmadd_ps(wv[b], xv, acc[b][j]);
    }
  }
  for (int j = 0; j < MB; ++j)
    for (int b = 0; b < NB; ++b) out[(m + j) * ldo + n + b] = _mm512_reduce_add_ps(acc[b][j]);
}

template <int NB, int MB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))) inline void tile_512(
    const QView& w, const float* x, int64_t ldx, float* out, int64_t ldo, int64_t n, int64_t m) {
  if (w.kind == kQU4)
    u4_tile_512<NB, MB>(w, x, ldx, out, ldo, n, m);
  else if (w.mins)
    i8_tile_512<NB, MB, true>(w, x, ldx, out, ldo, n, m);
  else
    i8_tile_512<NB, MB, false>(w, x, ldx, out, ldo, n, m);
}

template <int NB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))) inline void
mloop_512(const QView& w, const float* x, int64_t ldx, int64_t M, float* out, int64_t ldo,
          int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile_512<NB, 4>(w, x, ldx, out, ldo, n, m);
  for (; m + 2 <= M; m += 2) tile_512<NB, 2>(w, x, ldx, out, ldo, n, m);
  for (; m < M; ++m) tile_512<NB, 1>(w, x, ldx, out, ldo, n, m);
}

#pragma GCC pop_options

// ============================================================================================
// AVX2 + FMA (8 floats a register: a u4 group is two halves of 16)
// ============================================================================================
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

template <int NB, int MB>
__attribute__((target("avx2,fma"))) inline void u4_tile_256(const QView& w, const float* x,
                                                            int64_t ldx, float* out, int64_t ldo,
                                                            int64_t n, int64_t m) {
  __m256 acc[NB][MB];
  for (int b = 0; b < NB; ++b)
    for (int j = 0; j < MB; ++j) acc[b][j] = _mm256_setzero_ps();
  const __m128i mask = _mm_set1_epi8(0x0F);
  const int64_t G = w.n_groups;
  for (int64_t g = 0; g < G; ++g) {
    for (int h = 0; h < 2; ++h) {  // h = 0: low nibbles (elements 0..15), 1: high (16..31)
      __m256 w0[NB], w1[NB];
      for (int b = 0; b < NB; ++b) {
        const uint8_t* p = w.qs + (n + b) * w.row_bytes + g * 16;
        if (h == 0 && (g & 3) == 0)
          _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchRows * w.row_bytes), _MM_HINT_T0);
        __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        v = _mm_and_si128(h ? _mm_srli_epi16(v, 4) : v, mask);
        const __m256 s = _mm256_set1_ps(w.scales[(n + b) * G + g]);
        const __m256 mn = _mm256_set1_ps(w.mins[(n + b) * G + g]);
        w0[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), s, mn);
        w1[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))),
                                s, mn);
      }
      for (int j = 0; j < MB; ++j) {
        const float* xr = x + (m + j) * ldx + g * 32 + h * 16;
        const __m256 x0 = _mm256_loadu_ps(xr);
        const __m256 x1 = _mm256_loadu_ps(xr + 8);
        for (int b = 0; b < NB; ++b) {
          acc[b][j] = _mm256_fmadd_ps(w0[b], x0, acc[b][j]);
          acc[b][j] = _mm256_fmadd_ps(w1[b], x1, acc[b][j]);
        }
      }
    }
  }
  for (int j = 0; j < MB; ++j)
    for (int b = 0; b < NB; ++b) {
      const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc[b][j]),
                                   _mm256_extractf128_ps(acc[b][j], 1));
      const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      out[(m + j) * ldo + n + b] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
    }
}

template <int NB, int MB, bool HAS_MIN>
__attribute__((target("avx2,fma"))) inline void i8_tile_256(const QView& w, const float* x,
                                                            int64_t ldx, float* out, int64_t ldo,
                                                            int64_t n, int64_t m) {
  __m256 acc[NB][MB];
  for (int b = 0; b < NB; ++b)
    for (int j = 0; j < MB; ++j) acc[b][j] = _mm256_setzero_ps();
  const int64_t G = w.n_groups, C = w.K / 16, shift = w.group == 32 ? 1 : 0;
  for (int64_t c = 0; c < C; ++c) {
    const int64_t g = c >> shift;
    __m256 w0[NB], w1[NB];
    for (int b = 0; b < NB; ++b) {
      const int8_t* p = reinterpret_cast<const int8_t*>(w.qs) + (n + b) * w.row_bytes + c * 16;
      if ((c & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchRows * w.row_bytes), _MM_HINT_T0);
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
      const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
      const __m256 s = _mm256_set1_ps(w.scales[(n + b) * G + g]);
      if constexpr (HAS_MIN) {
        const __m256 mn = _mm256_set1_ps(w.mins[(n + b) * G + g]);
        w0[b] = _mm256_fmadd_ps(q0, s, mn);
        w1[b] = _mm256_fmadd_ps(q1, s, mn);
      } else {
        w0[b] = _mm256_mul_ps(q0, s);
        w1[b] = _mm256_mul_ps(q1, s);
      }
    }
    for (int j = 0; j < MB; ++j) {
      const float* xr = x + (m + j) * ldx + c * 16;
      const __m256 x0 = _mm256_loadu_ps(xr);
      const __m256 x1 = _mm256_loadu_ps(xr + 8);
      for (int b = 0; b < NB; ++b) {
        acc[b][j] = _mm256_fmadd_ps(w0[b], x0, acc[b][j]);
        acc[b][j] = _mm256_fmadd_ps(w1[b], x1, acc[b][j]);
      }
    }
  }
  for (int j = 0; j < MB; ++j)
    for (int b = 0; b < NB; ++b) {
      const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc[b][j]),
                                   _mm256_extractf128_ps(acc[b][j], 1));
      const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      out[(m + j) * ldo + n + b] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
    }
}

template <int NB, int MB>
__attribute__((target("avx2,fma"))) inline void tile_256(const QView& w, const float* x,
                                                         int64_t ldx, float* out, int64_t ldo,
                                                         int64_t n, int64_t m) {
  if (w.kind == kQU4)
    u4_tile_256<NB, MB>(w, x, ldx, out, ldo, n, m);
  else if (w.mins)
    i8_tile_256<NB, MB, true>(w, x, ldx, out, ldo, n, m);
  else
    i8_tile_256<NB, MB, false>(w, x, ldx, out, ldo, n, m);
}

#pragma GCC pop_options

}  // namespace

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))) void dequant_rows_avx512(
    const QView& w, float* dst, int64_t n0, int64_t n1) {
  const int64_t G = w.n_groups;
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    float* d = dst + (n - n0) * w.K;
    const uint8_t* q = w.qs + n * w.row_bytes;
    const float* sc = w.scales + n * G;
    const float* mn = w.mins ? w.mins + n * G : nullptr;
    if (w.kind == kQU4) {
      for (int64_t g = 0; g < G; ++g) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * 16));
        const __m512 s = _mm512_set1_ps(sc[g]), o = _mm512_set1_ps(mn[g]);
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, mask)));
        const __m512 hi =
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask)));
        _mm512_storeu_ps(d + g * 32, _mm512_fmadd_ps(lo, s, o));
        _mm512_storeu_ps(d + g * 32 + 16, _mm512_fmadd_ps(hi, s, o));
      }
    } else {
      const int shift = w.group == 32 ? 1 : 0;
      for (int64_t c = 0; c < w.K / 16; ++c) {
        const int64_t g = c >> shift;
        const __m512 x = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c * 16))));
        const __m512 s = _mm512_set1_ps(sc[g]);
        _mm512_storeu_ps(d + c * 16, mn ? _mm512_fmadd_ps(x, s, _mm512_set1_ps(mn[g]))
                                        : _mm512_mul_ps(x, s));
      }
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))) void rows_avx512(
    const QView& w, const float* x, int64_t ldx, int64_t M, float* out, int64_t ldo, int64_t n0,
    int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) mloop_512<4>(w, x, ldx, M, out, ldo, n);
  for (; n < n1; ++n) mloop_512<1>(w, x, ldx, M, out, ldo, n);
}

__attribute__((target("avx2,fma"))) void dequant_rows_avx2(const QView& w, float* dst,
                                                           int64_t n0, int64_t n1) {
  const int64_t G = w.n_groups;
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    float* d = dst + (n - n0) * w.K;
    const uint8_t* q = w.qs + n * w.row_bytes;
    const float* sc = w.scales + n * G;
    const float* mn = w.mins ? w.mins + n * G : nullptr;
    if (w.kind == kQU4) {
      for (int64_t g = 0; g < G; ++g) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * 16));
        const __m256 s = _mm256_set1_ps(sc[g]), o = _mm256_set1_ps(mn[g]);
        for (int h = 0; h < 2; ++h) {
          const __m128i b = _mm_and_si128(h ? _mm_srli_epi16(v, 4) : v, mask);
          const __m256 a0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
          const __m256 a1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)));
          _mm256_storeu_ps(d + g * 32 + h * 16, _mm256_fmadd_ps(a0, s, o));
          _mm256_storeu_ps(d + g * 32 + h * 16 + 8, _mm256_fmadd_ps(a1, s, o));
        }
      }
    } else {
      const int shift = w.group == 32 ? 1 : 0;
      for (int64_t c = 0; c < w.K / 16; ++c) {
        const int64_t g = c >> shift;
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c * 16));
        const __m256 s = _mm256_set1_ps(sc[g]);
        const __m256 o = mn ? _mm256_set1_ps(mn[g]) : _mm256_setzero_ps();
        _mm256_storeu_ps(d + c * 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), s, o));
        _mm256_storeu_ps(d + c * 16 + 8, _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))), s, o));
      }
    }
  }
}

__attribute__((target("avx2,fma"))) void rows_avx2(const QView& w, const float* x, int64_t ldx,
                                                   int64_t M, float* out, int64_t ldo, int64_t n0,
                                                   int64_t n1) {
  // 16 ymm registers: 4 rows x 1 activation row for GEMV, 2 x 2 for batches.
  int64_t n = n0;
  if (M == 1) {
    for (; n + 4 <= n1; n += 4) tile_256<4, 1>(w, x, ldx, out, ldo, n, 0);
  } else {
    for (; n + 2 <= n1; n += 2) {
      int64_t m = 0;
      for (; m + 2 <= M; m += 2) tile_256<2, 2>(w, x, ldx, out, ldo, n, m);
      for (; m < M; ++m) tile_256<2, 1>(w, x, ldx, out, ldo, n, m);
    }
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) tile_256<1, 1>(w, x, ldx, out, ldo, n, m);
}

}  // namespace qcpu
}  // namespace symphony

#endif  // x86-64
