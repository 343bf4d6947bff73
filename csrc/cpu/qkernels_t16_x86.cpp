// qlinear path 8: int8 activations, AVX-512 VNNI, 16 weight rows a tile, one weight row a lane.
//
// The other int8 kernels (path 7) hold 64 consecutive k of ONE weight row in a register, so
// every vpdpbusd is followed by a convert, a scale product and an FMA for that row, and each
// output needs a horizontal sum. Here a register holds 4 consecutive k of 16 weight rows (lane
// r = row n + r), and x's 4 bytes are broadcast: one vpdpbusd is 64 multiply-adds for 16
// outputs at once, the scales of a group are applied once per 16 rows, and the 16 results are
// stored with one instruction.
//
// The weights stay in the file's row-major layout (csrc/quant.h). A tile is prepared once:
// for each 16-byte chunk of its 16 rows, a 16 x 16 byte transpose at dword granularity (three
// 128-bit inserts and eight unpacks), nibbles split for u4 (chunk g of a u4 row is group g:
// low nibbles = its first 16 values, high = the last 16), signed bytes flipped to unsigned for
// i8 (vpdpbusd multiplies unsigned by signed; the +128 is taken back per x block from the
// integer sum of its qx: `xcorr`). The prepared tile (K bytes, plus a group's 16 scales and
// mins gathered) stays in L1 while every block of activation rows runs over it, so the
// transposes are paid once per weight, whatever M is.
//
// Accumulation (x quantized per block of 16, qkernels.h): per activation block b of row m,
//   isum = sum_k u[n, k] * qx[m, k] (+ xcorr[m, b] for i8),  f[m] += d[m, b] * isum,
// and per weight group g, acc[m] += scales[n, g] * f[m] (+ mins[n, g] * s[m, g]) — the same
// sums as rows_q8_scalar, in another float32 order.
#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "qkernels.h"

namespace symphony {
namespace qcpu {
namespace {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma")

constexpr int kMB = 8;  // activation rows a register block
typedef int32_t __attribute__((may_alias, aligned(1))) i32u;  // an unaligned dword of x

// The 16 x 16 byte block at byte offset `off` of the rows rp[0..15] -> t[d] (d = 0..3): lane r
// holds bytes 4d..4d+3 of row r.
inline void transpose16(const uint8_t* const* rp, int64_t off, __m512i (&t)[4]) {
  __m512i z[4];
  for (int i = 0; i < 4; ++i) {  // z[i], 128-bit lane L: row 4L + i
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[i] + off)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[4 + i] + off)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[8 + i] + off)), 2);
    z[i] = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rp[12 + i] + off)), 3);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
  t[0] = _mm512_unpacklo_epi64(t0, t2);
  t[1] = _mm512_unpackhi_epi64(t0, t2);
  t[2] = _mm512_unpacklo_epi64(t1, t3);
  t[3] = _mm512_unpackhi_epi64(t1, t3);
}

// Where run_block gets a tile's weights, a group at a time: wk[4 bb + d] (bb < group / 16 blocks
// of the group, d = 0..3: k 16 bb + 4d .. +3 of the 16 rows as unsigned bytes), and the 16
// rows' scale (sv) and min (mv) of the group.
//   Direct: straight from the rows (transposed, split, flipped as it goes): for M < kMB,
//           where each weight is used by one block of activation rows. Not for a whole block of
//           kMB: with the transposition's registers beside its 8 accumulators and 8 partial sums
//           it spills (1536 x 576 Q4_1, 8 rows, one thread on a Zen 4: 271 us direct, 169 us
//           buffered; 250 us at 12 rows).
//   Buffered: from a tile prepared once by `prepare` into an L1-resident buffer, for larger M.
struct Direct {
  const QView& w;
  const uint8_t* rp[16];       // the tile's rows (rows past the end repeat the last one)
  const uint8_t* next[16];     // the next tile's rows, prefetched as we go
  __m512i idx;                 // gather offsets of the 16 rows' scales / mins
  const float* sc;             // the tile's first row's scales and mins (mins: or nullptr)
  const float* mn;

  Direct(const QView& w_, int64_t n, int64_t rows)
      : w(w_), sc(w_.scales + n * w_.n_groups), mn(w_.mins ? w_.mins + n * w_.n_groups : nullptr) {
    alignas(64) int32_t ix[16];
    const int64_t nn = std::min<int64_t>(n + 16, w.N - 1);
    for (int r = 0; r < 16; ++r) {
      rp[r] = w.qs + (n + std::min<int64_t>(r, rows - 1)) * w.row_bytes;
      next[r] = w.qs + std::min<int64_t>(nn + r, w.N - 1) * w.row_bytes;
      ix[r] = int32_t(std::min<int64_t>(r, rows - 1) * w.n_groups);
    }
    idx = _mm512_load_si512(ix);
  }

  void chunk(int64_t c, __m512i (&v)[4]) const {
    if ((c & 3) == 0)
      for (int r = 0; r < 16; ++r) _mm_prefetch(reinterpret_cast<const char*>(next[r] + c * 16), _MM_HINT_T0);
    transpose16(rp, c * 16, v);
  }

  void group(int64_t g, __m512i* wk, __m512& sv, __m512& mv) const {
    __m512i v[4];
    if (w.kind == kQU4) {  // chunk g = group g: low nibbles its first 16 values, high the last 16
      const __m512i lo4 = _mm512_set1_epi8(0x0F);
      chunk(g, v);
      for (int d = 0; d < 4; ++d) {
        wk[d] = _mm512_and_si512(v[d], lo4);
        wk[4 + d] = _mm512_and_si512(_mm512_srli_epi16(v[d], 4), lo4);
      }
    } else {
      const __m512i flip = _mm512_set1_epi8(char(0x80));
      for (int64_t bb = 0; bb < w.group / 16; ++bb) {
        chunk(g * (w.group / 16) + bb, v);
        for (int d = 0; d < 4; ++d) wk[4 * bb + d] = _mm512_xor_si512(v[d], flip);
      }
    }
    sv = _mm512_i32gather_ps(idx, sc + g, 4);
    if (mn) mv = _mm512_i32gather_ps(idx, mn + g, 4);
  }
};

struct Buffered {
  const QView& w;
  const __m512i* wb;  // [K / 16][4]
  const float* sc;    // [G][16]
  const float* mn;    // [G][16] (mins only)

  void group(int64_t g, __m512i* wk, __m512& sv, __m512& mv) const {
    const int64_t n4 = w.group / 16 * 4;
    for (int64_t i = 0; i < n4; ++i) wk[i] = wb[g * n4 + i];
    sv = _mm512_load_ps(sc + g * 16);
    if (mn) mv = _mm512_load_ps(mn + g * 16);
  }
};

// Fills the buffer of `Buffered` for the 16 rows from n (`rows` of them real).
inline void prepare(const QView& w, int64_t n, int64_t rows, __m512i* wb, float* sc, float* mn) {
  const Direct src(w, n, rows);
  const int64_t n4 = w.group / 16 * 4;
  for (int64_t g = 0; g < w.n_groups; ++g) {
    __m512 sv, mv;
    src.group(g, wb + g * n4, sv, mv);
    _mm512_store_ps(sc + g * 16, sv);
    if (mn) _mm512_store_ps(mn + g * 16, mv);
  }
}

// acc[j] for activation rows m .. m + MB - 1 over the whole K, stored to out (masked to `keep`).
template <int MB, bool I8, bool MINS, bool SPLIT, class Src>
inline void run_block(const QView& w, const QAct& a, const int32_t* xcorr, const Src& src,
                      int64_t m, float* out, int64_t ldo, int64_t n, __mmask16 keep) {
  const int64_t G = w.n_groups, nb = a.ldq / 16, bpg = w.group / 16;  // blocks a group
  __m512 acc[MB];
  for (int j = 0; j < MB; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i wk[8];
    __m512 sv, mv = _mm512_setzero_ps();
    src.group(g, wk, sv, mv);
    __m512 f[MB];
    for (int64_t bb = 0; bb < bpg; ++bb) {
      const int64_t b = g * bpg + bb;
      const __m512i w0 = wk[4 * bb], w1 = wk[4 * bb + 1], w2 = wk[4 * bb + 2], w3 = wk[4 * bb + 3];
      for (int j = 0; j < MB; ++j) {
        // x's 16 values of the block, 4 at a time, each dword broadcast straight from memory (a
        // load: vpbroadcastd from a general register or vpshufd would take the shuffle port)
        const int64_t xo = (m + j) * a.ldq + b * 16;
        const i32u* xq = reinterpret_cast<const i32u*>(a.q + xo);
        __m512i s = I8 && !SPLIT ? _mm512_set1_epi32(xcorr[(m + j) * nb + b]) : _mm512_setzero_si512();
        s = _mm512_dpbusd_epi32(s, w0, _mm512_set1_epi32(xq[0]));
        s = _mm512_dpbusd_epi32(s, w1, _mm512_set1_epi32(xq[1]));
        s = _mm512_dpbusd_epi32(s, w2, _mm512_set1_epi32(xq[2]));
        s = _mm512_dpbusd_epi32(s, w3, _mm512_set1_epi32(xq[3]));
        if constexpr (SPLIT) {  // 15-bit x: 128 * (u . hi) + (u . lo)
          const i32u* xl = reinterpret_cast<const i32u*>(a.lo + xo);
          s = _mm512_slli_epi32(s, 7);
          if constexpr (I8) s = _mm512_add_epi32(s, _mm512_set1_epi32(xcorr[(m + j) * nb + b]));
          s = _mm512_dpbusd_epi32(s, w0, _mm512_set1_epi32(xl[0]));
          s = _mm512_dpbusd_epi32(s, w1, _mm512_set1_epi32(xl[1]));
          s = _mm512_dpbusd_epi32(s, w2, _mm512_set1_epi32(xl[2]));
          s = _mm512_dpbusd_epi32(s, w3, _mm512_set1_epi32(xl[3]));
        }
        const __m512 dv = _mm512_set1_ps(a.d[(m + j) * nb + b]);
        f[j] = bb == 0 ? _mm512_mul_ps(_mm512_cvtepi32_ps(s), dv)
                       : _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), dv, f[j]);
      }
    }
    if constexpr (MINS) {
      for (int j = 0; j < MB; ++j)
        acc[j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.s[(m + j) * G + g]), _mm512_fmadd_ps(f[j], sv, acc[j]));
    } else {
      for (int j = 0; j < MB; ++j) acc[j] = _mm512_fmadd_ps(f[j], sv, acc[j]);
    }
  }
  for (int j = 0; j < MB; ++j) _mm512_mask_storeu_ps(out + (m + j) * ldo + n, keep, acc[j]);
}

// Rows m .. M - 1 of x against one tile: blocks of kMB, then the rest.
template <bool I8, bool MINS, bool SPLIT, class Src>
inline void run_rows(const QView& w, const QAct& a, const int32_t* xcorr, const Src& src, int64_t m,
                     int64_t M, float* out, int64_t ldo, int64_t n, __mmask16 keep) {
#define SYMPHONY_T16_BLOCK(mb) run_block<mb, I8, MINS, SPLIT>(w, a, xcorr, src, m, out, ldo, n, keep)
  for (; m + kMB <= M; m += kMB) SYMPHONY_T16_BLOCK(kMB);
  switch (M - m) {
    case 7: SYMPHONY_T16_BLOCK(7); break;
    case 6: SYMPHONY_T16_BLOCK(6); break;
    case 5: SYMPHONY_T16_BLOCK(5); break;
    case 4: SYMPHONY_T16_BLOCK(4); break;
    case 3: SYMPHONY_T16_BLOCK(3); break;
    case 2: SYMPHONY_T16_BLOCK(2); break;
    case 1: SYMPHONY_T16_BLOCK(1); break;
    default: break;
  }
#undef SYMPHONY_T16_BLOCK
}

template <bool I8, bool MINS, bool SPLIT>
inline void run_tile(const QView& w, const QAct& a, const int32_t* xcorr, int64_t M, float* out,
                     int64_t ldo, int64_t n, int64_t rows, uint8_t* buf) {
  const __mmask16 keep = rows == 16 ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1);
  if (M < kMB) {  // each weight used once: no buffer
    run_rows<I8, MINS, SPLIT>(w, a, xcorr, Direct(w, n, rows), 0, M, out, ldo, n, keep);
    return;
  }
  const size_t wbytes = size_t(w.K) / 16 * 4 * 64, sbytes = size_t(w.n_groups) * 16 * 4;
  const Buffered src{w, reinterpret_cast<const __m512i*>(buf), reinterpret_cast<const float*>(buf + wbytes),
                     MINS ? reinterpret_cast<const float*>(buf + wbytes + sbytes) : nullptr};
  prepare(w, n, rows, reinterpret_cast<__m512i*>(buf), reinterpret_cast<float*>(buf + wbytes),
          MINS ? reinterpret_cast<float*>(buf + wbytes + sbytes) : nullptr);
  run_rows<I8, MINS, SPLIT>(w, a, xcorr, src, 0, M, out, ldo, n, keep);
}

template <bool SPLIT>
inline void run_tile_kind(const QView& w, const QAct& a, const int32_t* xcorr, int64_t M,
                          float* out, int64_t ldo, int64_t n, int64_t rows, uint8_t* buf) {
  const bool i8 = w.kind == kQI8, mins = w.mins != nullptr;
  if (i8 && mins) run_tile<true, true, SPLIT>(w, a, xcorr, M, out, ldo, n, rows, buf);
  else if (i8) run_tile<true, false, SPLIT>(w, a, xcorr, M, out, ldo, n, rows, buf);
  else if (mins) run_tile<false, true, SPLIT>(w, a, xcorr, M, out, ldo, n, rows, buf);
  else run_tile<false, false, SPLIT>(w, a, xcorr, M, out, ldo, n, rows, buf);
}

#pragma GCC pop_options

}  // namespace

// quantize_act and its 15-bit variant (qkernels.h) with AVX-512: one block of 16 values a register.
// The same float32 operations as the scalar code (max |x|, amax / qmax, 1 / d, x * (1 / d),
// clamp, round half to even by the default MXCSR mode), so the same bits; `corr` (if not null)
// gets -128 * (sum of qx) of each block.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))) void quantize_act_avx512(
    const float* x, int64_t ldx, int64_t M, int64_t K, int64_t group, int8_t* hi, int8_t* lo,
    float* d, float* s, int32_t* corr, int64_t ldq, bool permute64, bool bias128) {
  const int64_t nb = ldq / 16, G = K / group, kb = K / 16;
  const float qmax = lo ? 16383.f : 127.f;
  const __m512 vmax = _mm512_set1_ps(qmax), vmin = _mm512_set1_ps(-qmax);
  const __m512i low7 = _mm512_set1_epi32(127);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * ldx;
    float* sr = s ? s + m * G : nullptr;
    if (sr) std::fill(sr, sr + G, 0.f);
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t pos = act_block_pos(b, permute64);
      int8_t* h = hi + m * ldq + pos;
      float dv = 0.f;
      int32_t sum = 0;
      if (b < kb) {
        const __m512 v = _mm512_loadu_ps(xr + b * 16);
        const float amax = _mm512_reduce_max_ps(_mm512_abs_ps(v));
        dv = amax / qmax;
        const float id = dv != 0.f ? 1.f / dv : 0.f;
        const __m512 r = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v, _mm512_set1_ps(id)), vmin), vmax);
        const __m512i q = _mm512_cvtps_epi32(r);  // round half to even (MXCSR default)
        sum = _mm512_reduce_add_epi32(q);
        const __m512i top = lo ? _mm512_srai_epi32(q, 7) : q;
        __m128i hb = _mm512_cvtepi32_epi8(top);
        if (bias128) hb = _mm_xor_si128(hb, _mm_set1_epi8(char(0x80)));  // + 128 mod 256
        _mm_storeu_si128(reinterpret_cast<__m128i*>(h), hb);
        if (lo)
          _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + m * ldq + pos),
                           _mm512_cvtepi32_epi8(_mm512_and_si512(q, low7)));
        if (sr) sr[b * 16 / group] += dv * float(sum);
      } else {
        std::memset(h, bias128 ? 0x80 : 0, 16);
        if (lo) std::memset(lo + m * ldq + pos, 0, 16);
      }
      d[m * nb + b] = dv;
      if (corr) corr[m * nb + b] = -128 * sum;
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma"))) void
rows_q8_t16_avx512vnni(const QView& w, const QAct& a, const int32_t* xcorr, int64_t M, float* out,
                       int64_t ldo, int64_t n0, int64_t n1) {
  // the prepared tile (M >= kMB): K bytes of weights (as 64-byte registers) and 2 x G x 16
  // floats, per thread, in one 64-byte-aligned buffer
  static thread_local std::vector<uint8_t> buf;
  uint8_t* base = nullptr;
  if (M >= kMB) {
    buf.resize(size_t(w.K) / 16 * 4 * 64 + 2 * size_t(w.n_groups) * 16 * 4 + 64);
    base = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
  }
  for (int64_t n = n0; n < n1; n += 16) {
    const int64_t rows = std::min<int64_t>(16, n1 - n);
    if (a.lo) run_tile_kind<true>(w, a, xcorr, M, out, ldo, n, rows, base);
    else run_tile_kind<false>(w, a, xcorr, M, out, ldo, n, rows, base);
  }
}

}  // namespace qcpu
}  // namespace symphony

#endif  // x86-64
