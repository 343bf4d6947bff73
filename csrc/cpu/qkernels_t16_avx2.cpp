// qlinear paths 10 (int8 x) and 11 (15-bit x): AVX2 only (no AVX-512, no VNNI: an AMD Zen 2/3),
// the "tile" design of paths 8 / 9 (qkernels_t16_x86.cpp) at half the width: a ymm holds 4
// consecutive k of 8 weight rows (lane r = row n + r), x's 4 bytes are broadcast, and one
// vpmaddubsw + vpmaddwd step is 32 multiply-adds for 8 outputs at once; the scales of a group
// are applied once per 8 rows and the 8 results stored with one instruction.
//
// The weights stay row-major (csrc/quant.h) and are transposed as they are read: 8 rows x 16
// bytes -> 4 ymm (dword d of the 8 rows). For one block of activation rows (M <= kRowsT8) the
// tile is transposed as it is used (`Tile8`); for more, once into a per-thread buffer (`Prepared8`:
// the unpacked bytes and the group's 8 scales / mins, G x 320 bytes) that every block of rows
// reads, so the transposes and the scale gathers are paid once a tile, not once a block of rows.
//
// vpmaddubsw multiplies unsigned bytes by signed ones and adds pairs into int16 with saturation:
//   * u4 weights (0..15) are the unsigned operand: |pair| <= 2 * 15 * 128, so the 4 steps of a
//     block of 16 are summed in int16 (<= 15360) before one vpmaddwd widens them;
//   * i8 weights cannot be made unsigned with +128 (255 * 127 * 2 saturates): the unsigned
//     operand is |w| (0..128; |-128| = 128 as a byte) and the signed one x with w's sign
//     (vpsignb), |pair| <= 2 * 128 * 127 = 32512, widened by vpmaddwd after each step. This
//     needs |x| <= 127 (the negation of -128 wraps), so the 15-bit x of this path is stored
//     split as hi = max(qx >> 7, -127), lo = qx - 128 hi (both -127..127; qx = 128 hi + lo),
//     not as quantize_act_avx512's qx & 127 (`quantize_act_avx2`).
//
// Accumulation per activation block b of row m and weight group g (x quantized per block of 16,
// qkernels.h): acc[m] += (d[m, b] * scales[n, g]) * isum, then acc[m] += mins[n, g] * s[m, g];
// the sums of rows_q8_scalar in another float32 order.
#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "qkernels.h"

namespace symphony {
namespace qcpu {
namespace {

#pragma GCC push_options
#pragma GCC target("avx2,fma")

constexpr int kRowsT8 = 4;  // activation rows a register block (16 ymm: 4 weights, acc, temps)
typedef int32_t __attribute__((may_alias, aligned(1))) dword_u;  // 4 bytes of x, unaligned

// Bytes off .. off + 15 of the rows rp[0..7] -> t[d]: 32-bit lane r = bytes 4d .. 4d + 3 of row r.
inline void transpose8x16(const uint8_t* const* rp, int64_t off, __m256i (&t)[4]) {
  __m256i z[4];  // z[i]: row i in the low 128 bits, row 4 + i in the high ones
  for (int i = 0; i < 4; ++i)
    z[i] = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(rp[4 + i] + off),
                               reinterpret_cast<const __m128i*>(rp[i] + off));
  // dwords interleaved by pairs of rows (01, 23), then by 64-bit halves: a 4 x 4 transpose of
  // dwords in each 128-bit half
  const __m256i p01[2] = {_mm256_unpacklo_epi32(z[0], z[1]), _mm256_unpackhi_epi32(z[0], z[1])};
  const __m256i p23[2] = {_mm256_unpacklo_epi32(z[2], z[3]), _mm256_unpackhi_epi32(z[2], z[3])};
  for (int h = 0; h < 2; ++h) {
    t[2 * h] = _mm256_unpacklo_epi64(p01[h], p23[h]);
    t[2 * h + 1] = _mm256_unpackhi_epi64(p01[h], p23[h]);
  }
}

// The 8 rows n .. n + 7 of a tile (rows past the weight's end repeat its last row), a group at a
// time: wk[4 bb + d] = k 16 bb + 4d .. + 3 of the group for the 8 rows (u4: the nibbles as
// bytes 0..15; i8: the signed bytes), and the group's 8 scales / mins.
struct Tile8 {
  const QView& w;
  const uint8_t* rp[8];
  const uint8_t* next;  // the next tile's first row: its rows follow it, prefetched as we go
  int64_t next_rows;    // how many (0 after the last tile)
  __m256i gidx;  // gather offsets: lane r -> (row of lane r - n) * n_groups
  int64_t n;

  Tile8(const QView& w_, int64_t n_, int64_t rows) : w(w_), n(n_) {
    alignas(32) int32_t ix[8];
    for (int r = 0; r < 8; ++r) {
      const int64_t rr = std::min<int64_t>(r, rows - 1);
      rp[r] = w.qs + (n + rr) * w.row_bytes;
      ix[r] = int32_t(rr * w.n_groups);
    }
    next = w.qs + std::min<int64_t>(n + 8, w.N) * w.row_bytes;
    next_rows = std::clamp<int64_t>(w.N - n - 8, 0, 8);
    gidx = _mm256_load_si256(reinterpret_cast<const __m256i*>(ix));
  }

  void group(int64_t g, __m256i (&wk)[8], __m256& sv, __m256& mv) const {
    // the weights are read 8 rows at a time across the tile (a stride the hardware prefetcher
    // follows poorly): fetch the next tile's lines for the same k, one line a row
    const int64_t gb = g * (w.kind == kQU4 ? 16 : w.group);  // byte offset of the group in a row
    if (gb % 64 < (w.kind == kQU4 ? 16 : w.group))
      for (int64_t r = 0; r < next_rows; ++r) _mm_prefetch(reinterpret_cast<const char*>(next + r * w.row_bytes + gb), _MM_HINT_T0);
    __m256i t[4];
    if (w.kind == kQU4) {  // chunk g = group g: its first 16 values in the low nibbles
      const __m256i nib = _mm256_set1_epi8(0x0F);
      transpose8x16(rp, g * 16, t);
      for (int d = 0; d < 4; ++d) {
        wk[d] = _mm256_and_si256(t[d], nib);
        wk[4 + d] = _mm256_and_si256(_mm256_srli_epi16(t[d], 4), nib);
      }
    } else {
      const int64_t bpg = w.group / 16;
      for (int64_t bb = 0; bb < bpg; ++bb) {
        transpose8x16(rp, (g * bpg + bb) * 16, t);
        for (int d = 0; d < 4; ++d) wk[4 * bb + d] = t[d];
      }
    }
    const float* sp = w.scales + n * w.n_groups + g;
    sv = _mm256_i32gather_ps(sp, gidx, 4);
    if (w.mins) mv = _mm256_i32gather_ps(w.mins + n * w.n_groups + g, gidx, 4);
  }
};

// A tile transposed once: for each group g, kWk ymm of weights (`Tile8::group`'s wk) and the 8
// scales and 8 mins; filled by `prepare8` (rows past the end repeat the last one).
constexpr int64_t kWk = 8;  // ymm of weights a group (groups of 32 or 16 values)
struct Prepared8 {
  const __m256i* wb;  // [G][kWk]
  const float* sm;    // [G][16]: 8 scales, then 8 mins
  int64_t n;

  void group(int64_t g, __m256i (&wk)[8], __m256& sv, __m256& mv) const {
    for (int64_t i = 0; i < kWk; ++i) wk[i] = _mm256_load_si256(wb + g * kWk + i);
    sv = _mm256_load_ps(sm + g * 16);
    mv = _mm256_load_ps(sm + g * 16 + 8);
  }
};

inline void prepare8(const Tile8& src, __m256i* wb, float* sm) {
  for (int64_t g = 0; g < src.w.n_groups; ++g) {
    __m256i wk[8] = {};
    __m256 sv, mv = _mm256_setzero_ps();
    src.group(g, wk, sv, mv);
    for (int64_t i = 0; i < kWk; ++i) _mm256_store_si256(wb + g * kWk + i, wk[i]);
    _mm256_store_ps(sm + g * 16, sv);
    _mm256_store_ps(sm + g * 16 + 8, mv);
  }
}

// The int32 dot products, per lane, of one block of 16: the 8 rows' wb[0..3] with x's 16 bytes
// (wa: |wb| for i8 weights, unused for u4).
template <bool I8>
inline __m256i block_dot(const __m256i* wa, const __m256i* wb, const int8_t* xb) {
  const dword_u* xd = reinterpret_cast<const dword_u*>(xb);
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (!I8) {  // u4: the four int16 partial sums fit, widen once
    __m256i p = _mm256_maddubs_epi16(wb[0], _mm256_set1_epi32(xd[0]));
    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(wb[1], _mm256_set1_epi32(xd[1])));
    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(wb[2], _mm256_set1_epi32(xd[2])));
    p = _mm256_add_epi16(p, _mm256_maddubs_epi16(wb[3], _mm256_set1_epi32(xd[3])));
    return _mm256_madd_epi16(p, ones);
  } else {  // i8: |w| times x with w's sign, widened step by step
    __m256i s = _mm256_setzero_si256();
    for (int d = 0; d < 4; ++d) {
      const __m256i xv = _mm256_sign_epi8(_mm256_set1_epi32(xd[d]), wb[d]);
      s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(wa[d], xv), ones));
    }
    return s;
  }
}

// Activation rows m .. m + MB - 1 against the tile, over the whole K, stored to out (the first
// `rows` columns from n).
template <int MB, bool I8, bool MINS, bool SPLIT, class Src>
inline void tile_rows(const QView& w, const Src& src, const QAct& a, int64_t m, float* out, int64_t ldo,
                      int64_t rows, const __m256i& keep) {
  const int64_t G = w.n_groups, nb = a.ldq / 16, bpg = w.group / 16;
  __m256 acc[MB] = {};
  for (int64_t g = 0; g < G; ++g) {
    __m256i wk[8];
    __m256 sv = _mm256_setzero_ps(), mv = sv;
    src.group(g, wk, sv, mv);
    for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {  // the group's blocks of 16
      const __m256i* wb = wk + 4 * (b - g * bpg);
      __m256i wa[4];  // |w| (i8), once for the MB rows and both halves of 15-bit x
      if constexpr (I8)
        for (int d = 0; d < 4; ++d) wa[d] = _mm256_abs_epi8(wb[d]);
      for (int j = 0; j < MB; ++j) {
        const int64_t xo = (m + j) * a.ldq + b * 16;
        __m256i isum = block_dot<I8>(wa, wb, a.q + xo);
        if constexpr (SPLIT)  // 15-bit x: 128 * (w . hi) + (w . lo)
          isum = _mm256_add_epi32(_mm256_slli_epi32(isum, 7), block_dot<I8>(wa, wb, a.lo + xo));
        const __m256 ds = _mm256_mul_ps(_mm256_set1_ps(a.d[(m + j) * nb + b]), sv);
        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), ds, acc[j]);
      }
    }
    if constexpr (MINS)
      for (int j = 0; j < MB; ++j) acc[j] = _mm256_fmadd_ps(mv, _mm256_set1_ps(a.s[(m + j) * G + g]), acc[j]);
  }
  for (int j = 0; j < MB; ++j) {
    float* o = out + (m + j) * ldo + src.n;
    if (rows == 8) _mm256_storeu_ps(o, acc[j]);
    else _mm256_maskstore_ps(o, keep, acc[j]);
  }
}

// Every row of x against one tile (src: `Tile8` or `Prepared8`), kRowsT8 rows at a time.
template <bool I8, bool MINS, bool SPLIT, class Src>
void tile_all_rows(const QView& w, const Src& src, const QAct& a, int64_t M, float* out, int64_t ldo,
                   int64_t rows, const __m256i& keep) {
  int64_t m = 0;
  for (; m + kRowsT8 <= M; m += kRowsT8) tile_rows<kRowsT8, I8, MINS, SPLIT>(w, src, a, m, out, ldo, rows, keep);
  if (M - m == 3) tile_rows<3, I8, MINS, SPLIT>(w, src, a, m, out, ldo, rows, keep);
  else if (M - m == 2) tile_rows<2, I8, MINS, SPLIT>(w, src, a, m, out, ldo, rows, keep);
  else if (M - m == 1) tile_rows<1, I8, MINS, SPLIT>(w, src, a, m, out, ldo, rows, keep);
}

template <bool I8, bool MINS, bool SPLIT>
void tiles_of(const QView& w, const QAct& a, int64_t M, float* out, int64_t ldo, int64_t n0,
              int64_t n1) {
  // the prepared tile (M > kRowsT8), per thread, 32-byte aligned: G x kWk ymm of weights, then
  // G x 16 floats
  static thread_local std::vector<uint8_t> buf;
  const bool prepared = M > kRowsT8;
  __m256i* wb = nullptr;
  float* sm = nullptr;
  if (prepared) {
    buf.resize(size_t(w.n_groups) * (kWk + 2) * 32 + 32);
    wb = reinterpret_cast<__m256i*>(buf.data() + (32 - reinterpret_cast<uintptr_t>(buf.data()) % 32) % 32);
    sm = reinterpret_cast<float*>(wb + w.n_groups * kWk);
  }
  for (int64_t n = n0; n < n1; n += 8) {
    const int64_t rows = std::min<int64_t>(8, n1 - n);
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(rows)),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const Tile8 tile(w, n, rows);
    if (prepared) {
      prepare8(tile, wb, sm);
      const Prepared8 src{wb, sm, n};
      tile_all_rows<I8, MINS, SPLIT>(w, src, a, M, out, ldo, rows, keep);
    } else {
      tile_all_rows<I8, MINS, SPLIT>(w, tile, a, M, out, ldo, rows, keep);
    }
  }
}

template <bool SPLIT>
void tiles_kind(const QView& w, const QAct& a, int64_t M, float* out, int64_t ldo, int64_t n0,
                int64_t n1) {
  const bool mins = w.mins != nullptr;
  if (w.kind == kQI8) {
    if (mins) tiles_of<true, true, SPLIT>(w, a, M, out, ldo, n0, n1);
    else tiles_of<true, false, SPLIT>(w, a, M, out, ldo, n0, n1);
  } else {
    if (mins) tiles_of<false, true, SPLIT>(w, a, M, out, ldo, n0, n1);
    else tiles_of<false, false, SPLIT>(w, a, M, out, ldo, n0, n1);
  }
}

#pragma GCC pop_options

}  // namespace

__attribute__((target("avx2,fma"))) void rows_q8_t8_avx2(const QView& w, const QAct& a, int64_t M,
                                                         float* out, int64_t ldo, int64_t n0,
                                                         int64_t n1) {
  if (a.lo) tiles_kind<true>(w, a, M, out, ldo, n0, n1);
  else tiles_kind<false>(w, a, M, out, ldo, n0, n1);
}

}  // namespace qcpu
}  // namespace symphony

#endif  // x86-64
