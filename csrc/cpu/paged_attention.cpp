// CPU kernels of the symphony ops: write_kv and paged_attention, float32, float16 and bfloat16.
//
// write_kv copies rows of the cache's dtype, and rounds float32 rows into a float16 / bfloat16
// cache (a KV pool narrower than the activations). paged_attention computes in float32; with
// float16 and bfloat16 caches (attention_half, at the end) the lanes kernel reads the cache
// directly and the pages that rows items read are first widened, each distinct page once, into
// float32 scratch pages; the output is rounded back to q's dtype once (a float32 q beside such a
// cache gets a float32 output). The pool is never converted.
//
// paged_attention splits the batch into work items (sequence, kv head, query tile[, kv chunk]).
// An item handles every query head of its GQA group at once, so each K/V row is read once per
// item, and runs a single-pass online softmax over the keys in tiles with float32 accumulation.
// Two micro-kernels, both written with GCC/Clang vector extensions (the build compiles with
// -O3 -march=native, so vf is one AVX-512 / AVX2 / SSE / NEON register):
//   * "rows"  (prefill-like items, many query rows): query rows lie across the vector lanes
//     (Q is transposed once per item), so Q K^T and P V are register-blocked outer products
//     that broadcast K / V scalars straight from the paged cache; no gather, no horizontal sums.
//   * "lanes" (decode-like items, a handful of query rows): head_dim lies across the lanes;
//     one dot product per (row, key), which wastes nothing when there are only 1-8 rows. It is
//     memory-bound, so it software-prefetches the next key tile's K/V rows (scattered pages
//     defeat the hardware prefetcher).
// Items run under at::parallel_for with dynamic (atomic counter) scheduling, largest first.
// When there are too few items to keep the threads busy (a long decode of one sequence, say),
// the key range of each item is split into chunks whose partial softmax states are merged.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "../checks.h"
#include "attention_amx.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace symphony {
namespace {

// ------------------------------------------------------------------------------------------
// Vector helpers
// ------------------------------------------------------------------------------------------
#if defined(__AVX512F__)
#define SYM_VEC_WIDTH 16
#elif defined(__AVX__)
#define SYM_VEC_WIDTH 8
#else
#define SYM_VEC_WIDTH 4
#endif

constexpr int W = SYM_VEC_WIDTH;
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

static inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
static inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
static inline vf vsplat(float s) { return vf{} + s; }
static inline vi visplat(int32_t s) { return vi{} + s; }
static inline vf vmax(vf a, vf b) { return a > b ? a : b; }

static inline float vhsum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(v);
#elif defined(__AVX__)
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
#else
  float s = 0.0f;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
#endif
}

static inline float vhmax(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(v);
#else
  float m = v[0];
  for (int i = 1; i < W; ++i) m = std::max(m, v[i]);
  return m;
#endif
}

// 2^x for x <= 0 (it is only called on (score - running max)); accurate to ~2 ulp.
// Inputs below -126 (including -inf) give exactly 0.
static inline vf vexp2(vf x) {
  const vi underflow = x < -126.0f;
  x = x < -126.0f ? vsplat(-126.0f) : x;
  x = x > 126.0f ? vsplat(126.0f) : x;
  const vf magic = vsplat(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to int
  const vf n = (x + magic) - magic;
  const vf f = x - n;  // in [-0.5, 0.5]
  // 2^f = e^(f ln 2), Taylor series to degree 6 (relative error < 1.3e-7 on [-0.5, 0.5]).
  vf p = vsplat(1.5403530393381606e-4f);
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf pow2n;
  std::memcpy(&pow2n, &bits, sizeof(pow2n));
  const vf r = p * pow2n;
  return underflow ? vsplat(0.0f) : r;
}

// ------------------------------------------------------------------------------------------
// Problem description and work items
// ------------------------------------------------------------------------------------------
struct Problem {
  const float* q;
  int64_t q_stride;  // elements between consecutive tokens of q
  const float* k_cache;
  const float* v_cache;
  int64_t n_heads, n_kv_heads, group, head_dim, page_size;
  int64_t slot_stride;  // n_kv_heads * head_dim
  const int32_t* page_table;
  int64_t max_pages;
  const int32_t* cu_q_lens;
  const int32_t* kv_lens;
  float* out;  // [T, n_heads, head_dim], contiguous
  float scale_log2;  // scale * log2(e): the kernels use exp2
  // float16 / bfloat16 caches (raw bits) and their own page table, read directly by the
  // lanes kernel; k_cache / v_cache / page_table then hold the widened pages of the
  // sequences that have rows items (see attention_half).
  const uint16_t* k16 = nullptr;
  const uint16_t* v16 = nullptr;
  const int32_t* page_table16 = nullptr;
  // sequences b with skip[b] != 0 are left out (another kernel writes their rows)
  const uint8_t* skip = nullptr;
};

struct Item {
  int32_t b, g;   // sequence, kv head
  int32_t i0, i1; // query range within the sequence
  int64_t kb, ke; // key range [kb, ke)
  int64_t part;   // -1: write the normalized output; else index of a partial-result slot
  int32_t lanes;  // 1: "lanes" kernel, 0: "rows" kernel
  double cost;
};

// Tile sizes.
#if SYM_VEC_WIDTH == 16
constexpr int kNR = 3;  // row vectors per rows-kernel block (3 x 16 = 48 query rows)
constexpr int kNJ = 8;  // keys per Q K^T register block
constexpr int kND = 8;  // head_dim entries per P V register block
#else
constexpr int kNR = 2;
constexpr int kNJ = 4;
constexpr int kND = 4;
#endif
constexpr int kTileRows = kNR * W;  // target query rows (tokens x group heads) per rows item
constexpr int kTK = 64;             // keys per online-softmax tile (multiple of kNJ and W)
constexpr int kLanesMaxRows = 8;    // items with at most this many rows use the lanes kernel
constexpr int64_t kSplitMinKeys = 256;  // smallest key chunk when splitting an item's keys
// ... for a decode (lanes) item: one key tile. A decode of one sequence has a handful of items (its
// kv heads: 3 for SmolLM2) and its keys' loads miss the caches as the weights stream through
// them: splitting them over the threads took a layer's attention from 22-26 to 16-18 us in the
// engine's decode at a context of 50-120 (AMD EPYC Zen 4, 2 threads).
constexpr int64_t kSplitMinKeysLanes = kTK;
// Below this total cost (attention_core's units) one thread does all: waking the others costs more.
constexpr double kSerialCost = 5e4;

struct Scratch {
  explicit Scratch(int64_t floats) {
    // 64-byte aligned, zeroed (padding rows of Qt must be zero).
    raw.reset(new float[floats + 16]());
    auto addr = reinterpret_cast<uintptr_t>(raw.get());
    base = reinterpret_cast<float*>((addr + 63) & ~uintptr_t(63));
  }
  std::unique_ptr<float[]> raw;
  float* base;
};

struct Partials {
  float* o;  // [n_parts][max_rows][head_dim]
  float* m;  // [n_parts][max_rows]
  float* l;  // [n_parts][max_rows]
  int64_t max_rows;
};

// Fill kp / vp with the addresses of keys j0 .. j0 + nk - 1 of sequence b, kv head g.
static inline void key_pointers(const Problem& P, int b, int g, int64_t j0, int nk,
                                const float** kp, const float** vp) {
  const int32_t* pt = P.page_table + int64_t(b) * P.max_pages;
  int64_t page_idx = j0 / P.page_size, off = j0 % P.page_size;
  const int64_t head_off = int64_t(g) * P.head_dim;
  for (int jj = 0; jj < nk; ++jj) {
    const int64_t slot = int64_t(pt[page_idx]) * P.page_size + off;
    const int64_t e = slot * P.slot_stride + head_off;
    kp[jj] = P.k_cache + e;
    vp[jj] = P.v_cache + e;
    if (++off == P.page_size) {
      off = 0;
      ++page_idx;
    }
  }
}

// Writes the result of an item: normalized output rows, or the partial softmax state.
// get(r, d) returns the unnormalized accumulator of row r.
template <typename Get>
static inline void emit(const Problem& P, const Item& it, int R, const float* m, const float* l,
                        Partials& parts, Get get) {
  const int64_t D = P.head_dim, G = P.group;
  if (it.part < 0) {
    const int64_t q0 = P.cu_q_lens[it.b] + it.i0;
    for (int r = 0; r < R; ++r) {
      const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
      float* o = P.out + ((q0 + r / G) * P.n_heads + it.g * G + r % G) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = get(r, d) * inv;
    }
  } else {
    float* po = parts.o + it.part * parts.max_rows * D;
    for (int r = 0; r < R; ++r) {
      parts.m[it.part * parts.max_rows + r] = m[r];
      parts.l[it.part * parts.max_rows + r] = l[r];
      for (int64_t d = 0; d < D; ++d) po[r * D + d] = get(r, d);
    }
  }
}

// ------------------------------------------------------------------------------------------
// "rows" kernel: query rows across the vector lanes.
// ------------------------------------------------------------------------------------------

// St[j][rows] = sum_d K_j[d] * Qt[d][rows] for NJ keys and NR row vectors.
template <int NJ, int NR>
static inline void qk_block(const float* Qt, int64_t Rp, const float* const* kp, int64_t D,
                            float* St) {
  vf acc[NJ][NR];
#pragma GCC unroll 16
  for (int j = 0; j < NJ; ++j)
#pragma GCC unroll 4
    for (int n = 0; n < NR; ++n) acc[j][n] = vf{};
  const float* k[NJ];
#pragma GCC unroll 16
  for (int j = 0; j < NJ; ++j) k[j] = kp[j];
  for (int64_t d = 0; d < D; ++d) {
    vf qv[NR];
#pragma GCC unroll 4
    for (int n = 0; n < NR; ++n) qv[n] = vload(Qt + d * Rp + n * W);
#pragma GCC unroll 16
    for (int j = 0; j < NJ; ++j) {
      const vf kb = vsplat(k[j][d]);
#pragma GCC unroll 4
      for (int n = 0; n < NR; ++n) acc[j][n] += kb * qv[n];
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < NJ; ++j)
#pragma GCC unroll 4
    for (int n = 0; n < NR; ++n) vstore(St + j * Rp + n * W, acc[j][n]);
}

// Ot[d0 + dd][rows] = alpha[rows] * Ot[d0 + dd][rows] + sum_j V_j[d0 + dd] * P[j][rows]
// for ND head_dim entries and NR row vectors.
template <int ND, int NR>
static inline void pv_block(float* Ot, int64_t Rp, const float* alpha, const float* Pt,
                            const float* const* vp, int64_t d0, int nk) {
  vf acc[ND][NR];
  vf al[NR];
#pragma GCC unroll 4
  for (int n = 0; n < NR; ++n) al[n] = vload(alpha + n * W);
#pragma GCC unroll 16
  for (int dd = 0; dd < ND; ++dd)
#pragma GCC unroll 4
    for (int n = 0; n < NR; ++n) acc[dd][n] = vload(Ot + dd * Rp + n * W) * al[n];
  for (int jj = 0; jj < nk; ++jj) {
    vf p[NR];
#pragma GCC unroll 4
    for (int n = 0; n < NR; ++n) p[n] = vload(Pt + jj * Rp + n * W);
    const float* v = vp[jj] + d0;
#pragma GCC unroll 16
    for (int dd = 0; dd < ND; ++dd) {
      const vf vb = vsplat(v[dd]);
#pragma GCC unroll 4
      for (int n = 0; n < NR; ++n) acc[dd][n] += vb * p[n];
    }
  }
#pragma GCC unroll 16
  for (int dd = 0; dd < ND; ++dd)
#pragma GCC unroll 4
    for (int n = 0; n < NR; ++n) vstore(Ot + dd * Rp + n * W, acc[dd][n]);
}

template <int NR>
static void pv_rows(float* Ot, int64_t Rp, const float* alpha, const float* Pt,
                    const float* const* vp, int64_t D, int nk) {
  int64_t d0 = 0;
  for (; d0 + kND <= D; d0 += kND) pv_block<kND, NR>(Ot + d0 * Rp, Rp, alpha, Pt, vp, d0, nk);
  for (; d0 + 2 <= D; d0 += 2) pv_block<2, NR>(Ot + d0 * Rp, Rp, alpha, Pt, vp, d0, nk);
  for (; d0 < D; ++d0) pv_block<1, NR>(Ot + d0 * Rp, Rp, alpha, Pt, vp, d0, nk);
}

static void rows_kernel(const Problem& P, const Item& it, float* scratch, Partials& parts) {
  const int64_t D = P.head_dim, G = P.group;
  const int nq = it.i1 - it.i0;
  const int R = nq * int(G);
  const int RV = (R + W - 1) / W;
  const int64_t Rp = int64_t(RV) * W;
  const int64_t q0 = P.cu_q_lens[it.b];
  const int64_t q_len = P.cu_q_lens[it.b + 1] - q0;
  const int64_t base = int64_t(P.kv_lens[it.b]) - q_len;

  // Scratch layout.
  float* Qt = scratch;             // [D][Rp]
  float* Ot = Qt + D * Rp;         // [D][Rp]
  float* St = Ot + D * Rp;         // [kTK][Rp]
  float* m = St + kTK * Rp;        // [Rp]
  float* l = m + Rp;               // [Rp]
  float* alpha = l + Rp;           // [Rp]
  int32_t* lim = reinterpret_cast<int32_t*>(alpha + Rp);  // [Rp]
  const float** kp = reinterpret_cast<const float**>(lim + Rp + 16);  // [kTK]
  const float** vp = kp + kTK;     // [kTK]
  float* zero_row = reinterpret_cast<float*>(vp + kTK);  // [D]

  for (int64_t d = 0; d < D; ++d) zero_row[d] = 0.0f;
  for (int r = 0; r < R; ++r) {
    const float* qr = P.q + (q0 + it.i0 + r / G) * P.q_stride + (it.g * G + r % G) * D;
    for (int64_t d = 0; d < D; ++d) Qt[d * Rp + r] = qr[d] * P.scale_log2;
    lim[r] = int32_t(base + it.i0 + r / G);  // last visible key of row r
  }
  for (int64_t r = R; r < Rp; ++r) {
    for (int64_t d = 0; d < D; ++d) Qt[d * Rp + r] = 0.0f;
    lim[r] = std::numeric_limits<int32_t>::max();
  }
  for (int64_t r = 0; r < Rp; ++r) {
    m[r] = kNegInf;
    l[r] = 0.0f;
  }
  std::memset(Ot, 0, sizeof(float) * D * Rp);

  const int64_t mask_from = base + it.i0 + 1;  // keys from here on are masked for some rows
  for (int64_t j0 = it.kb; j0 < it.ke; j0 += kTK) {
    const int nk = int(std::min<int64_t>(kTK, it.ke - j0));
    const int nkp = (nk + kNJ - 1) / kNJ * kNJ;
    key_pointers(P, it.b, it.g, j0, nk, kp, vp);
    for (int jj = nk; jj < nkp; ++jj) kp[jj] = vp[jj] = zero_row;

    // Scores, transposed: St[j][r] = (scale log2 e) q_r . k_j
    for (int jb = 0; jb < nkp; jb += kNJ) {
      int rv = 0;
      for (; rv + kNR <= RV; rv += kNR) qk_block<kNJ, kNR>(Qt + rv * W, Rp, kp + jb, D, St + jb * Rp + rv * W);
      if (RV - rv == 2) qk_block<kNJ, 2>(Qt + rv * W, Rp, kp + jb, D, St + jb * Rp + rv * W);
      else if (RV - rv == 1) qk_block<kNJ, 1>(Qt + rv * W, Rp, kp + jb, D, St + jb * Rp + rv * W);
    }
    // Causal mask and padding keys.
    for (int64_t j = std::max(j0, mask_from); j < j0 + nk; ++j) {
      const vi jv = visplat(int32_t(j));
      float* s = St + (j - j0) * Rp;
      for (int rv = 0; rv < RV; ++rv) {
        vi lv;
        std::memcpy(&lv, lim + rv * W, sizeof(lv));
        const vf sv = vload(s + rv * W);
        vstore(s + rv * W, jv > lv ? vsplat(kNegInf) : sv);
      }
    }
    for (int jj = nk; jj < nkp; ++jj)
      for (int64_t r = 0; r < Rp; ++r) St[jj * Rp + r] = kNegInf;

    // Online softmax update of the running max / sum; St becomes P.
    for (int rv = 0; rv < RV; ++rv) {
      const vf m_old = vload(m + rv * W);
      vf mx = m_old;
      for (int jj = 0; jj < nkp; ++jj) mx = vmax(mx, vload(St + jj * Rp + rv * W));
      const vf m_safe = mx == vsplat(kNegInf) ? vf{} : mx;
      const vf a = vexp2(m_old - m_safe);
      vf sum = vf{};
      for (int jj = 0; jj < nkp; ++jj) {
        const vf p = vexp2(vload(St + jj * Rp + rv * W) - m_safe);
        vstore(St + jj * Rp + rv * W, p);
        sum += p;
      }
      vstore(l + rv * W, vload(l + rv * W) * a + sum);
      vstore(m + rv * W, mx);
      vstore(alpha + rv * W, a);
    }

    // Ot = alpha * Ot + V^T P
    int rv = 0;
    for (; rv + kNR <= RV; rv += kNR)
      pv_rows<kNR>(Ot + rv * W, Rp, alpha + rv * W, St + rv * W, vp, D, nkp);
    if (RV - rv == 2) pv_rows<2>(Ot + rv * W, Rp, alpha + rv * W, St + rv * W, vp, D, nkp);
    else if (RV - rv == 1) pv_rows<1>(Ot + rv * W, Rp, alpha + rv * W, St + rv * W, vp, D, nkp);
  }

  emit(P, it, R, m, l, parts, [&](int r, int64_t d) { return Ot[d * Rp + r]; });
}

static int64_t rows_scratch_floats(int64_t D, int64_t Rp) {
  // Qt, Ot, St, m, l, alpha, lim, (pad), kp, vp (pointers: 2 floats each), zero_row
  return 2 * D * Rp + kTK * Rp + 4 * Rp + 16 + 4 * kTK + D + 64;
}

// ------------------------------------------------------------------------------------------
// Cache element types of the lanes kernel: a W-wide load that widens to float.
// ------------------------------------------------------------------------------------------
struct CacheF32 {
  using S = float;
  static const S* k(const Problem& P) { return P.k_cache; }
  static const S* v(const Problem& P) { return P.v_cache; }
  static const int32_t* table(const Problem& P) { return P.page_table; }
  static inline vf load(const S* p) { return vload(p); }
};

template <bool BF16>
static inline vf vload16(const uint16_t* p) {
  vf r;
#if defined(__AVX512F__)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  __m512 f;
  if constexpr (BF16) f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  else f = _mm512_cvtph_ps(h);
  std::memcpy(&r, &f, sizeof(r));
#elif defined(__AVX2__) && defined(__F16C__)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m256 f;
  if constexpr (BF16) f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  else f = _mm256_cvtph_ps(h);
  std::memcpy(&r, &f, sizeof(r));
#else
  for (int i = 0; i < W; ++i) {
    if constexpr (BF16) r[i] = float(c10::BFloat16(p[i], c10::BFloat16::from_bits()));
    else r[i] = float(c10::Half(p[i], c10::Half::from_bits()));
  }
#endif
  return r;
}

template <bool BF16>
struct Cache16 {
  using S = uint16_t;
  static const S* k(const Problem& P) { return P.k16; }
  static const S* v(const Problem& P) { return P.v16; }
  static const int32_t* table(const Problem& P) { return P.page_table16; }
  static inline vf load(const S* p) { return vload16<BF16>(p); }
};

enum class CacheKind { kF32, kBF16, kF16 };

// key_pointers for the lanes kernel, over the cache and table of element type E.
template <typename E>
static inline void key_pointers_e(const Problem& P, int b, int g, int64_t j0, int nk,
                                  const typename E::S** kp, const typename E::S** vp) {
  const int32_t* pt = E::table(P) + int64_t(b) * P.max_pages;
  const typename E::S* kc = E::k(P);
  const typename E::S* vc = E::v(P);
  int64_t page_idx = j0 / P.page_size, off = j0 % P.page_size;
  const int64_t head_off = int64_t(g) * P.head_dim;
  for (int jj = 0; jj < nk; ++jj) {
    const int64_t slot = int64_t(pt[page_idx]) * P.page_size + off;
    const int64_t e = slot * P.slot_stride + head_off;
    kp[jj] = kc + e;
    vp[jj] = vc + e;
    if (++off == P.page_size) {
      off = 0;
      ++page_idx;
    }
  }
}

#if SYM_VEC_WIDTH == 16
// Sixteen dot products at once: a[x] holds the 16 lane-wise partial sums of slot x; returns the
// 16 full sums, output lane 4 L + m holding slot L + 4 m (four levels of pairwise shuffles and
// adds: 45 instructions where 16 horizontal reductions take ~130); permuted by kReduce16Order,
// lane x holds slot x.
static inline __m512 reduce16(const vf* a) {
  __m512 c[8], g[4], i[2];
  for (int p = 0; p < 8; ++p) {  // lanes 0-7: slot 2p's halves summed, 8-15: slot 2p + 1's
    const __m512 x = reinterpret_cast<const __m512&>(a[2 * p]);
    const __m512 y = reinterpret_cast<const __m512&>(a[2 * p + 1]);
    c[p] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  for (int p = 0; p < 4; ++p)    // 128-bit lane L: slot 4p + L's four partial sums
    g[p] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * p], c[2 * p + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * p], c[2 * p + 1], 0xDD));
  for (int p = 0; p < 2; ++p) {  // lane L: (slot 8p + L, slot 8p + 4 + L), two partials each
    const __m512d x = _mm512_castps_pd(g[2 * p]), y = _mm512_castps_pd(g[2 * p + 1]);
    i[p] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(i[0], i[1], 0x88), _mm512_shuffle_ps(i[0], i[1], 0xDD));
}
static const __m512i kReduce16Order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
#endif

// ------------------------------------------------------------------------------------------
// "lanes" kernel: head_dim across the vector lanes, for items with few query rows (decode).
// E is the cache element type: float32 rows, or float16 / bfloat16 rows widened one vector at
// a time (half the bytes; decode is memory-bound). Per tile of keys: each row's scores (with
// AVX-512, 16 keys' dot products reduced together by reduce16), its online softmax, then P V
// for blocks of rows at once, so that each V row is read and widened once per block.
// ------------------------------------------------------------------------------------------
constexpr int kTKL = 64;  // keys per tile

template <int DV, typename E>
static void lanes_kernel(const Problem& P, const Item& it, float* scratch, Partials& parts) {
  using S = typename E::S;
  // vectors per 64-byte cache line
  constexpr int kVecsPerLine = int(64 / sizeof(S)) >= W ? int(64 / sizeof(S)) / W : 1;
  constexpr int64_t D = int64_t(DV) * W;
  // rows of a P V block: their accumulators (RB x DV vectors) stay in registers
  constexpr int RB = DV >= 16 ? 1 : (16 / DV > kLanesMaxRows ? kLanesMaxRows : 16 / DV);
  const int64_t G = P.group;
  const int nq = it.i1 - it.i0;
  const int R = nq * int(G);
  const int64_t q0 = P.cu_q_lens[it.b];
  const int64_t q_len = P.cu_q_lens[it.b + 1] - q0;
  const int64_t base = int64_t(P.kv_lens[it.b]) - q_len;

  float* O = scratch;                   // [kLanesMaxRows][D]
  float* sc = O + kLanesMaxRows * D;    // [kLanesMaxRows][kTKL]
  float* Qs = sc + kLanesMaxRows * kTKL;  // [kLanesMaxRows][D], scaled queries
  const S** kp = reinterpret_cast<const S**>(Qs + kLanesMaxRows * D);
  const S** vp = kp + kTKL;
  const S** kpn = vp + kTKL;  // next tile's rows, prefetched while this tile is processed
  const S** vpn = kpn + kTKL;
  float m[kLanesMaxRows], l[kLanesMaxRows], alpha[kLanesMaxRows];
  int n_vis_r[kLanesMaxRows];
  int64_t lim[kLanesMaxRows];

  for (int r = 0; r < R; ++r) {
    const float* qr = P.q + (q0 + it.i0 + r / G) * P.q_stride + (it.g * G + r % G) * D;
    for (int64_t d = 0; d < D; ++d) Qs[r * D + d] = qr[d] * P.scale_log2;
    for (int64_t d = 0; d < D; ++d) O[r * D + d] = 0.0f;
    lim[r] = base + it.i0 + r / G;
    m[r] = kNegInf;
    l[r] = 0.0f;
  }

  auto prefetch_next = [&](int jj) {
#pragma GCC unroll 16
    for (int c = 0; c < DV; c += kVecsPerLine) {
      __builtin_prefetch(kpn[jj] + c * W, 0, 2);
      __builtin_prefetch(vpn[jj] + c * W, 0, 2);
    }
  };

  if (it.kb < it.ke) key_pointers_e<E>(P, it.b, it.g, it.kb, int(std::min<int64_t>(kTKL, it.ke - it.kb)), kp, vp);
  for (int64_t j0 = it.kb; j0 < it.ke; j0 += kTKL) {
    const int nk = int(std::min<int64_t>(kTKL, it.ke - j0));
    const int nkp = (nk + W - 1) / W * W;
    const int nk_next = int(std::max<int64_t>(0, std::min<int64_t>(kTKL, it.ke - j0 - kTKL)));
    if (nk_next > 0) key_pointers_e<E>(P, it.b, it.g, j0 + kTKL, nk_next, kpn, vpn);
    int prefetched = 0;  // keys of the next tile prefetched so far (by row 0)
    for (int r = 0; r < R; ++r) {
      vf qv[DV];
#pragma GCC unroll 16
      for (int c = 0; c < DV; ++c) qv[c] = vload(Qs + r * D + c * W);
      float* s = sc + r * kTKL;
      // Keys past the row's causal limit (and the padding up to a whole vector) get -inf.
      const int n_vis = int(std::max<int64_t>(0, std::min<int64_t>(nk, lim[r] + 1 - j0)));
      n_vis_r[r] = n_vis;
      int jj = 0;
#if SYM_VEC_WIDTH == 16
      for (; jj + 16 <= n_vis; jj += 16) {
        const int pf = r == 0 ? std::min(jj + 16, nk_next) : 0;  // prefetch keys below pf
        vf a[16];
#pragma GCC unroll 16
        for (int x = 0; x < 16; ++x) {
          if (jj + x < pf) prefetch_next(jj + x);
          const S* k = kp[jj + x];
          a[x] = qv[0] * E::load(k);
#pragma GCC unroll 16
          for (int c = 1; c < DV; ++c) a[x] += qv[c] * E::load(k + c * W);
        }
        if (pf > prefetched) prefetched = pf;
        _mm512_storeu_ps(s + jj, _mm512_permutexvar_ps(kReduce16Order, reduce16(a)));
      }
#endif
      for (; jj + 2 <= n_vis; jj += 2) {
        if (r == 0)
          for (; prefetched < std::min(jj + 2, nk_next); ++prefetched) prefetch_next(prefetched);
        const S* k0 = kp[jj];
        const S* k1 = kp[jj + 1];
        vf a0 = qv[0] * E::load(k0), a1 = qv[0] * E::load(k1);
#pragma GCC unroll 16
        for (int c = 1; c < DV; ++c) {
          a0 += qv[c] * E::load(k0 + c * W);
          a1 += qv[c] * E::load(k1 + c * W);
        }
        s[jj] = vhsum(a0);
        s[jj + 1] = vhsum(a1);
      }
      for (; jj < n_vis; ++jj) {
        const S* k0 = kp[jj];
        vf a0 = qv[0] * E::load(k0);
#pragma GCC unroll 16
        for (int c = 1; c < DV; ++c) a0 += qv[c] * E::load(k0 + c * W);
        s[jj] = vhsum(a0);
      }
      for (; jj < nkp; ++jj) s[jj] = kNegInf;

      // Online softmax: s becomes the weights, alpha the rescaling of the row's output so far.
      vf mxv = vsplat(m[r]);
      for (int c = 0; c < nkp; c += W) mxv = vmax(mxv, vload(s + c));
      const float mx = vhmax(mxv);
      const float m_safe = mx == kNegInf ? 0.0f : mx;
      const float a = vexp2(vsplat(m[r] - m_safe))[0];
      vf sumv = vf{};
      for (int c = 0; c < nkp; c += W) {
        const vf p = vexp2(vload(s + c) - m_safe);
        vstore(s + c, p);
        sumv += p;
      }
      l[r] = l[r] * a + vhsum(sumv);
      m[r] = mx;
      alpha[r] = a;
    }
    for (; prefetched < nk_next; ++prefetched) prefetch_next(prefetched);   // past row 0's causal limit

    // O_r = alpha_r * O_r + sum_j p_rj V_j, RB rows at a time: each V row read once per block
    // (a row's weights past its causal limit are 0).
    for (int r0 = 0; r0 < R; r0 += RB) {
      const int rb = std::min(RB, R - r0);
      int nv = 0;
      for (int r = r0; r < r0 + rb; ++r) nv = std::max(nv, n_vis_r[r]);
      vf acc[RB][DV];
#pragma GCC unroll 16
      for (int rr = 0; rr < RB; ++rr)
        if (rr < rb)
#pragma GCC unroll 16
          for (int c = 0; c < DV; ++c) acc[rr][c] = vload(O + (r0 + rr) * D + c * W) * alpha[r0 + rr];
      for (int j = 0; j < nv; ++j) {
        const S* v = vp[j];
        vf vv[DV];
#pragma GCC unroll 16
        for (int c = 0; c < DV; ++c) vv[c] = E::load(v + c * W);
#pragma GCC unroll 16
        for (int rr = 0; rr < RB; ++rr)
          if (rr < rb) {
            const vf p = vsplat(sc[(r0 + rr) * kTKL + j]);
#pragma GCC unroll 16
            for (int c = 0; c < DV; ++c) acc[rr][c] += p * vv[c];
          }
      }
#pragma GCC unroll 16
      for (int rr = 0; rr < RB; ++rr)
        if (rr < rb)
#pragma GCC unroll 16
          for (int c = 0; c < DV; ++c) vstore(O + (r0 + rr) * D + c * W, acc[rr][c]);
    }
    std::swap(kp, kpn);
    std::swap(vp, vpn);
  }

  emit(P, it, R, m, l, parts, [&](int r, int64_t d) { return O[r * D + d]; });
}

static int64_t lanes_scratch_floats(int64_t D) {
  return 2 * kLanesMaxRows * D + kLanesMaxRows * kTKL + 8 * kTKL + 64;
}

using KernelFn = void (*)(const Problem&, const Item&, float*, Partials&);

template <typename E>
static KernelFn lanes_kernel_for_e(int64_t D) {
  if (D % W != 0) return nullptr;
  switch (D / W) {
    case 1: return lanes_kernel<1, E>;
    case 2: return lanes_kernel<2, E>;
    case 4: return lanes_kernel<4, E>;
    case 8: return lanes_kernel<8, E>;
    case 16: return lanes_kernel<16, E>;
    default: return nullptr;
  }
}

static KernelFn lanes_kernel_for(int64_t D, CacheKind kind) {
  switch (kind) {
    case CacheKind::kBF16: return lanes_kernel_for_e<Cache16<true>>(D);
    case CacheKind::kF16: return lanes_kernel_for_e<Cache16<false>>(D);
    default: return lanes_kernel_for_e<CacheF32>(D);
  }
}

// Whether every item of a sequence with q_len queries runs the lanes kernel (the item
// builder in attention_core decides the same way).
static inline bool all_lanes(KernelFn lanes_fn, int64_t q_len, int64_t group) {
  return lanes_fn != nullptr && q_len * group <= kLanesMaxRows;
}

// ------------------------------------------------------------------------------------------
// Ops
// ------------------------------------------------------------------------------------------
// The problem of a checked batch (check_attention_tables_cpu): q rows token-strided by
// q_stride floats, out contiguous [T, n_heads, head_dim]. The caller sets caches and tables.
static Problem make_problem(const AttnDims& dims, const float* q, int64_t q_stride,
                            const int32_t* cu, const int32_t* kvl, float* out, double scale) {
  Problem P;
  P.q = q;
  P.q_stride = q_stride;
  P.k_cache = nullptr;
  P.v_cache = nullptr;
  P.n_heads = dims.n_heads;
  P.n_kv_heads = dims.n_kv_heads;
  P.group = dims.group;
  P.head_dim = dims.head_dim;
  P.page_size = dims.page_size;
  P.slot_stride = dims.n_kv_heads * dims.head_dim;
  P.page_table = nullptr;
  P.max_pages = dims.max_pages;
  P.cu_q_lens = cu;
  P.kv_lens = kvl;
  P.out = out;
  P.scale_log2 = float(scale * 1.4426950408889634);
  return P;
}

// The kernel proper (T > 0). The rows kernel reads the float32 caches (P.k_cache, P.v_cache,
// P.page_table); the lanes kernel reads the caches of kind lanes_cache.
static void attention_core(const AttnDims& dims, const Problem& P, CacheKind lanes_cache) {
  const int32_t* cu = P.cu_q_lens;
  const int32_t* kvl = P.kv_lens;
  const int64_t G = dims.group, D = dims.head_dim;
  const KernelFn lanes_fn = lanes_kernel_for(D, lanes_cache);
  const int64_t tile_tokens = std::max<int64_t>(1, kTileRows / G);

  // Work items: (sequence, kv head, query tile).
  std::vector<Item> items;
  int64_t max_rows = 1;
  for (int64_t b = 0; b < dims.B; ++b) {
    const int64_t q_len = int64_t(cu[b + 1]) - cu[b];
    if (q_len == 0 || (P.skip != nullptr && P.skip[b])) continue;
    const int64_t base = int64_t(kvl[b]) - q_len;
    const bool whole_lanes = all_lanes(lanes_fn, q_len, G);
    const int64_t step = whole_lanes ? q_len : tile_tokens;
    // The partial tile goes first: it has the fewest keys.
    int64_t i0 = 0;
    while (i0 < q_len) {
      int64_t n = (i0 == 0 && q_len % step != 0) ? q_len % step : step;
      const int64_t i1 = i0 + n;
      const int64_t R = n * G;
      const bool lanes = lanes_fn != nullptr && R <= kLanesMaxRows;
      const int64_t Rp = (R + W - 1) / W * W;
      max_rows = std::max(max_rows, R);
      for (int64_t g = 0; g < dims.n_kv_heads; ++g) {
        Item it;
        it.b = int32_t(b);
        it.g = int32_t(g);
        it.i0 = int32_t(i0);
        it.i1 = int32_t(i1);
        it.kb = 0;
        it.ke = base + i1;
        it.part = -1;
        it.lanes = lanes ? 1 : 0;
        it.cost = double(lanes ? 2 * R : Rp) * double(it.ke) * double(D) + 2000.0;
        items.push_back(it);
      }
      i0 = i1;
    }
  }

  const int64_t n_threads = at::get_num_threads();
  // Too few items for the threads: split each item's keys into chunks, merged afterwards.
  std::vector<Item> work;
  std::vector<std::pair<int64_t, int64_t>> merges;  // per original item: (first part, n parts)
  const int64_t want = 4 * n_threads;
  const bool split = n_threads > 1 && int64_t(items.size()) < want;
  int64_t n_parts = 0;
  if (split) {
    const int64_t per_item = (want + int64_t(items.size()) - 1) / int64_t(items.size());
    for (const Item& it : items) {
      const int64_t keys = it.ke - it.kb;
      int64_t n = std::min<int64_t>(per_item, keys / (it.lanes ? kSplitMinKeysLanes : kSplitMinKeys));
      if (n <= 1) {
        work.push_back(it);
        merges.emplace_back(-1, 0);
        continue;
      }
      int64_t chunk = (keys + n - 1) / n;
      chunk = (chunk + kTK - 1) / kTK * kTK;
      const int64_t first = n_parts;
      for (int64_t k0 = it.kb; k0 < it.ke; k0 += chunk) {
        Item c = it;
        c.kb = k0;
        c.ke = std::min(it.ke, k0 + chunk);
        c.part = n_parts++;
        c.cost = it.cost * double(c.ke - c.kb) / double(keys);
        work.push_back(c);
      }
      merges.emplace_back(first, n_parts - first);
    }
  } else {
    work = items;
  }

  std::vector<float> part_buf;
  Partials parts{nullptr, nullptr, nullptr, max_rows};
  if (n_parts > 0) {
    part_buf.resize(size_t(n_parts) * max_rows * (D + 2));
    parts.o = part_buf.data();
    parts.m = parts.o + n_parts * max_rows * D;
    parts.l = parts.m + n_parts * max_rows;
  }

  // Largest items first; threads pull items from a shared counter.
  std::vector<int64_t> order(work.size());
  double total_cost = 0.0;
  for (size_t i = 0; i < work.size(); ++i) {
    order[i] = int64_t(i);
    total_cost += work[i].cost;
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return work[a].cost > work[b].cost; });

  const int64_t max_rows_p = (max_rows + W - 1) / W * W;
  const int64_t scratch_floats =
      std::max(rows_scratch_floats(D, max_rows_p), lanes_scratch_floats(D));
  std::atomic<int64_t> next{0};
  const int64_t n_work = int64_t(work.size());
  auto worker = [&](int64_t, int64_t) {
    Scratch s(scratch_floats);
    for (;;) {
      const int64_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= n_work) break;
      const Item& it = work[order[i]];
      if (it.lanes) lanes_fn(P, it, s.base, parts);
      else rows_kernel(P, it, s.base, parts);
    }
  };
  if (n_threads <= 1 || n_work <= 1 || total_cost < kSerialCost) {
    worker(0, 1);
  } else {
    at::parallel_for(0, std::min(n_threads, n_work), 1, worker);
  }

  // Merge the key chunks of split items.
  if (n_parts > 0) {
    for (size_t idx = 0; idx < items.size(); ++idx) {
      const auto [first, n] = merges[idx];
      if (n == 0) continue;
      const Item& it = items[idx];
      const int R = (it.i1 - it.i0) * int(G);
      std::vector<float> w(size_t(n), 0.0f);
      std::vector<float> acc(size_t(D), 0.0f);
      for (int r = 0; r < R; ++r) {
        float M = kNegInf;
        for (int64_t p = 0; p < n; ++p) M = std::max(M, parts.m[(first + p) * max_rows + r]);
        float L = 0.0f;
        for (int64_t p = 0; p < n; ++p) {
          const float mp = parts.m[(first + p) * max_rows + r];
          w[p] = mp == kNegInf ? 0.0f : std::exp2(mp - M);
          L += w[p] * parts.l[(first + p) * max_rows + r];
        }
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t p = 0; p < n; ++p) {
          const float* po = parts.o + ((first + p) * max_rows + r) * D;
          for (int64_t d = 0; d < D; ++d) acc[d] += w[p] * po[d];
        }
        const float inv = L > 0.0f ? 1.0f / L : 0.0f;
        const int64_t tok = cu[it.b] + it.i0 + r / G;
        float* o = P.out + (tok * dims.n_heads + it.g * G + r % G) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * inv;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------
// float16 / bfloat16: widen what the batch reads to float32, then run the float32 kernel.
// ------------------------------------------------------------------------------------------

// dst[i] = float(src[i]) for n float16 (BF16 = false) or bfloat16 (BF16 = true) values, given
// as raw bits. Both conversions are exact.
template <bool BF16>
static void widen(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    __m512 f;
    if constexpr (BF16) f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    else f = _mm512_cvtph_ps(h);
    _mm512_storeu_ps(dst + i, f);
  }
#elif defined(__AVX2__) && defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    __m256 f;
    if constexpr (BF16) f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    else f = _mm256_cvtph_ps(h);
    _mm256_storeu_ps(dst + i, f);
  }
#endif
  for (; i < n; ++i) {
    if constexpr (BF16) dst[i] = float(c10::BFloat16(src[i], c10::BFloat16::from_bits()));
    else dst[i] = float(c10::Half(src[i], c10::Half::from_bits()));
  }
}

// float16 / bfloat16 caches. The lanes kernel (decode-like items) reads them directly, widening
// one vector at a time. For sequences with rows items (prefill-like), the pages they read are
// widened, each distinct page once (forks share pages), into float32 scratch caches
// [n_distinct, page_size, n_kv_heads, head_dim] and their page-table rows remapped onto them;
// the pool itself is never converted. q is widened, the output is computed in float32 and
// rounded (to nearest even) to q's dtype once. All conversions to float32 are exact, so the
// result is the float32 kernel's on the same values, rounded once.
static at::Tensor attention_half(const AttnDims& dims, const at::Tensor& q,
                                 const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const int32_t* pt, const int32_t* cu, const int32_t* kvl,
                                 double scale, const uint8_t* skip = nullptr,
                                 at::Tensor* into = nullptr) {
  const bool bf16 = k_cache.scalar_type() == at::kBFloat16;
  const CacheKind kind = bf16 ? CacheKind::kBF16 : CacheKind::kF16;
  const KernelFn lanes_fn = lanes_kernel_for(dims.head_dim, kind);
  auto widened = [&](int64_t b) {  // sequence b has rows items: it reads widened pages
    const int64_t q_len = int64_t(cu[b + 1]) - cu[b];
    return q_len > 0 && !(skip && skip[b]) && !all_lanes(lanes_fn, q_len, dims.group);
  };
  auto n_pages_of = [&](int64_t b) {
    return (int64_t(kvl[b]) + dims.page_size - 1) / dims.page_size;
  };
  std::vector<int32_t> pages;
  for (int64_t b = 0; b < dims.B; ++b) {
    if (widened(b))
      pages.insert(pages.end(), pt + b * dims.max_pages, pt + b * dims.max_pages + n_pages_of(b));
  }
  std::sort(pages.begin(), pages.end());
  pages.erase(std::unique(pages.begin(), pages.end()), pages.end());
  const int64_t n_distinct = int64_t(pages.size());

  // Remapped table of the widened sequences; other entries (never read) stay 0.
  std::vector<int32_t> table;
  at::Tensor kf, vf;
  const int64_t page_elems = dims.page_size * dims.n_kv_heads * dims.head_dim;
  const at::TensorOptions f32 = q.options().dtype(at::kFloat);
  if (n_distinct > 0) {
    table.assign(size_t(dims.B * dims.max_pages), 0);
    for (int64_t b = 0; b < dims.B; ++b) {
      if (!widened(b)) continue;
      for (int64_t p = 0, n = n_pages_of(b); p < n; ++p) {
        const int32_t page = pt[b * dims.max_pages + p];
        table[b * dims.max_pages + p] =
            int32_t(std::lower_bound(pages.begin(), pages.end(), page) - pages.begin());
      }
    }
    kf = at::empty({n_distinct, page_elems}, f32);
    vf = at::empty({n_distinct, page_elems}, f32);
    const uint16_t* ks = static_cast<const uint16_t*>(k_cache.data_ptr());
    const uint16_t* vs = static_cast<const uint16_t*>(v_cache.data_ptr());
    float* kd = kf.data_ptr<float>();
    float* vd = vf.data_ptr<float>();
    const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / page_elems);
    at::parallel_for(0, n_distinct, grain, [&](int64_t p0, int64_t p1) {
      for (int64_t i = p0; i < p1; ++i) {
        const int64_t src = int64_t(pages[i]) * page_elems;
        if (bf16) {
          widen<true>(ks + src, kd + i * page_elems, page_elems);
          widen<true>(vs + src, vd + i * page_elems, page_elems);
        } else {
          widen<false>(ks + src, kd + i * page_elems, page_elems);
          widen<false>(vs + src, vd + i * page_elems, page_elems);
        }
      }
    });
  }

  // q rows are dense (checked): a float32 q is read in place, another is widened once.
  const at::Tensor qf = q.scalar_type() == at::kFloat ? q : q.to(at::kFloat).contiguous();
  at::Tensor out = into ? *into : at::empty({dims.T, dims.n_heads, dims.head_dim}, f32);
  Problem P = make_problem(dims, qf.data_ptr<float>(), qf.stride(0), cu, kvl,
                           out.data_ptr<float>(), scale);
  P.skip = skip;
  if (n_distinct > 0) {
    P.k_cache = kf.data_ptr<float>();
    P.v_cache = vf.data_ptr<float>();
    P.page_table = table.data();
  }
  P.k16 = static_cast<const uint16_t*>(k_cache.data_ptr());
  P.v16 = static_cast<const uint16_t*>(v_cache.data_ptr());
  P.page_table16 = pt;
  attention_core(dims, P, kind);
  return out.scalar_type() == q.scalar_type() ? out : out.to(q.scalar_type());
}

// The float32 kernels into out, on a checked float32 batch with T > 0, leaving out the
// sequences b with skip[b] != 0 (nullptr: none).
static void attention_f32(const AttnDims& dims, const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const int32_t* pt, const int32_t* cu,
                          const int32_t* kvl, double scale, at::Tensor& out, const uint8_t* skip) {
  Problem P = make_problem(dims, q.data_ptr<float>(), q.stride(0), cu, kvl, out.data_ptr<float>(), scale);
  P.k_cache = k_cache.data_ptr<float>();
  P.v_cache = v_cache.data_ptr<float>();
  P.page_table = pt;
  P.skip = skip;
  attention_core(dims, P, CacheKind::kF32);
}

// paged_attention on a checked batch (arguments and tables).
static at::Tensor attention_checked(const AttnDims& dims, const at::Tensor& q, const at::Tensor& k_cache,
                                    const at::Tensor& v_cache, const int32_t* pt, const int32_t* cu,
                                    const int32_t* kvl, double scale) {
  if (dims.T == 0) return at::empty({dims.T, dims.n_heads, dims.head_dim}, q.options());
  if (k_cache.scalar_type() != at::kFloat) return attention_half(dims, q, k_cache, v_cache, pt, cu, kvl, scale);
  at::Tensor out = at::empty({dims.T, dims.n_heads, dims.head_dim}, q.options());
  attention_f32(dims, q, k_cache, v_cache, pt, cu, kvl, scale, out, nullptr);
  return out;
}

at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& page_table,
                               const at::Tensor& cu_q_lens, const at::Tensor& kv_lens,
                               double scale) {
  // Dtypes: float32, float16 or bfloat16, the same for q and the caches, or a float32 q beside
  // float16 / bfloat16 caches (checked); the output has q's dtype.
  const AttnDims dims = check_paged_attention_args(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens,
                                                   /*mixed=*/true);
  const int32_t* pt = page_table.data_ptr<int32_t>();
  const int32_t* cu = cu_q_lens.data_ptr<int32_t>();
  const int32_t* kvl = kv_lens.data_ptr<int32_t>();
  check_attention_tables_cpu(dims, pt, cu, kvl);
  return attention_checked(dims, q, k_cache, v_cache, pt, cu, kvl, scale);
}

// paged_attention_bf16: the sequences with at least kAmxMinRows query rows (tokens x GQA group)
// and kAmxMinWork row-key pairs (a 16-token prompt alone costs the tiles more to set up than
// the float32 kernels take) on the AMX tiles with bfloat16 products (attention_amx.cpp), the
// others by the kernels above (float32, or attention_half for float16 / bfloat16 caches); all of
// it by paged_attention where the CPU has no AMX-BF16, q is not float32 or the head_dim is not a
// multiple of 32. Below that many rows the float32 kernels cost about what rounding the
// sequence's whole context to bfloat16 costs, which every AMX call pays first.
constexpr int64_t kAmxMinRows = 32, kAmxMinWork = 8192;

at::Tensor paged_attention_bf16_cpu(const at::Tensor& q, const at::Tensor& k_cache,
                                    const at::Tensor& v_cache, const at::Tensor& page_table,
                                    const at::Tensor& cu_q_lens, const at::Tensor& kv_lens,
                                    double scale) {
  const AttnDims dims = check_paged_attention_args(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens,
                                                   /*mixed=*/true);
  const int32_t* pt = page_table.data_ptr<int32_t>();
  const int32_t* cu = cu_q_lens.data_ptr<int32_t>();
  const int32_t* kvl = kv_lens.data_ptr<int32_t>();
  check_attention_tables_cpu(dims, pt, cu, kvl);
  if (dims.T == 0 || q.scalar_type() != at::kFloat || !amx_bf16_usable() || !amx_attention_takes(dims.head_dim))
    return attention_checked(dims, q, k_cache, v_cache, pt, cu, kvl, scale);
  std::vector<uint8_t> tiled(size_t(dims.B), 0);
  std::vector<int64_t> seqs;
  for (int64_t b = 0; b < dims.B; ++b) {
    const int64_t rows = (int64_t(cu[b + 1]) - cu[b]) * dims.group;
    if (rows >= kAmxMinRows && rows * kvl[b] >= kAmxMinWork) {
      tiled[size_t(b)] = 1;
      seqs.push_back(b);
    }
  }
  const at::ScalarType cache_type = k_cache.scalar_type();
  at::Tensor out = at::empty({dims.T, dims.n_heads, dims.head_dim}, q.options());
  if (int64_t(seqs.size()) < dims.B) {
    if (cache_type == at::kFloat) attention_f32(dims, q, k_cache, v_cache, pt, cu, kvl, scale, out, tiled.data());
    else attention_half(dims, q, k_cache, v_cache, pt, cu, kvl, scale, tiled.data(), &out);
  }
  if (!seqs.empty()) {
    const AmxCache cache = cache_type == at::kFloat      ? AmxCache::kF32
                           : cache_type == at::kBFloat16 ? AmxCache::kBF16
                                                         : AmxCache::kF16;
    const AmxAttention a{q.data_ptr<float>(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                         dims.n_heads, dims.n_kv_heads, dims.head_dim, dims.page_size, pt, dims.max_pages,
                         cu, kvl, out.data_ptr<float>(), float(scale), cache};
    amx_attention(a, seqs.data(), int64_t(seqs.size()),
                  [](int64_t n, const std::function<void(int64_t, int64_t)>& f) {
                    const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
                    if (threads <= 1) f(0, n);
                    else at::parallel_for(0, threads, 1, [&](int64_t b0, int64_t b1) {
                      f(b0 * n / threads, b1 * n / threads);
                    });
                  });
  }
  return out;
}

// n float32 values rounded (to nearest even, as torch's .to()) into float16 / bfloat16 bits.
template <bool BF16>
static void narrow(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512 f = _mm512_loadu_ps(src + i);
    __m256i h;
    if constexpr (BF16) {
      // bits + 0x7fff + (bit 16), then the top half; NaN keeps a quiet NaN (0x7fc0 | sign)
      const __m512i x = _mm512_castps_si512(f);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
      __m512i r = _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
      const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
      r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(0x40)));
      h = _mm512_cvtepi32_epi16(r);
    } else {
      h = _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), h);
  }
#endif
  for (; i < n; ++i) {
    if constexpr (BF16) dst[i] = c10::BFloat16(src[i]).x;
    else dst[i] = c10::Half(src[i]).x;
  }
}

void write_kv_cpu(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                  at::Tensor& v_cache, const at::Tensor& slots) {
  // k / v of the cache's dtype are copied; float32 rows into a float16 / bfloat16 cache (a KV
  // pool narrower than the activations) are rounded to it on the way.
  const WriteKvDims d = check_write_kv_args(k, v, k_cache, v_cache, slots, /*mixed=*/true);
  const int64_t* sl = slots.data_ptr<int64_t>();
  check_slots_cpu(d, sl);
  if (d.T == 0) return;
  const int64_t n = d.n_kv_heads * d.head_dim;
  const bool rounds = k.scalar_type() != k_cache.scalar_type();
  const bool bf16 = k_cache.scalar_type() == at::kBFloat16;
  const int64_t es = k.element_size(), ces = k_cache.element_size();
  const int64_t row_bytes = n * ces;
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t ks = k.stride(0) * es, vs = v.stride(0) * es;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(n * es, 1));
  at::parallel_for(0, d.T, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t slot = sl[t];
      if (slot < 0) continue;
      if (!rounds) {
        std::memcpy(kc + slot * row_bytes, kp + t * ks, size_t(row_bytes));
        std::memcpy(vc + slot * row_bytes, vp + t * vs, size_t(row_bytes));
        continue;
      }
      const float* kr = reinterpret_cast<const float*>(kp + t * ks);
      const float* vr = reinterpret_cast<const float*>(vp + t * vs);
      uint16_t* kd = reinterpret_cast<uint16_t*>(kc + slot * row_bytes);
      uint16_t* vd = reinterpret_cast<uint16_t*>(vc + slot * row_bytes);
      if (bf16) {
        narrow<true>(kr, kd, n);
        narrow<true>(vr, vd, n);
      } else {
        narrow<false>(kr, kd, n);
        narrow<false>(vr, vd, n);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(symphony, CPU, m) {
  m.impl("write_kv", &write_kv_cpu);
  m.impl("paged_attention", &paged_attention_cpu);
  m.impl("paged_attention_bf16", &paged_attention_bf16_cpu);
}

}  // namespace symphony
