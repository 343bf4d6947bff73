// CPU micro-kernels of qlinear, one set per instruction set (scalar, AVX2+FMA, AVX-512), chosen
// at run time by cpuid (qlinear.cpp). Each computes out[m, n] = sum_k x[m, k] * W[n, k] for all
// m < M and n0 <= n < n1, dequantizing W's groups into registers (float32 FMA, no activation
// quantization: the result is the float32 product with the dequantized weight, up to summation
// order).
#pragma once

#include <cstdint>
#include <type_traits>

#include "../quant.h"

namespace symphony {
namespace qcpu {

// A quantized weight, as raw pointers (see csrc/quant.h for the layout). Most kernels read float32
// scales and mins; a weight with float16 ones (scales16 set) reaches them through qlinear.cpp's
// with_float_scales, which widens a block of rows at a time into `scales` / `mins`. The row
// kernels rows_q8_avx512vnni and rows_q8_r4_avx2 read float16 ones as they are.
struct QView {
  const uint8_t* qs;     // [N, row_bytes]
  const float* scales;   // [N, n_groups]
  const float* mins;     // [N, n_groups] or nullptr
  int64_t N, K, group, n_groups, row_bytes;
  QKind kind;
  const uint16_t* scales16 = nullptr;  // float16 [N, n_groups] (then scales / mins are unset)
  const uint16_t* mins16 = nullptr;    // float16 [N, n_groups] or nullptr
};

// A weight's scales as S: float32 (w.scales) or float16 (w.scales16, raw bits): for the kernels
// that read float16 ones as they are.
template <class S>
inline const S* scales_of(const QView& w) {
  if constexpr (std::is_same_v<S, float>) return w.scales;
  else return w.scales16;
}

// x: float32 [M, K] (row stride ldx); out: float32 [M, ldo], columns n0..n1 written.
using RowsFn = void (*)(const QView& w, const float* x, int64_t ldx, int64_t M, float* out,
                        int64_t ldo, int64_t n0, int64_t n1);

void rows_scalar(const QView& w, const float* x, int64_t ldx, int64_t M, float* out, int64_t ldo,
                 int64_t n0, int64_t n1);
#if defined(__x86_64__) || defined(_M_X64)
void rows_avx2(const QView& w, const float* x, int64_t ldx, int64_t M, float* out, int64_t ldo,
               int64_t n0, int64_t n1);
void rows_avx512(const QView& w, const float* x, int64_t ldx, int64_t M, float* out, int64_t ldo,
                 int64_t n0, int64_t n1);
#endif

// Dequantize rows n0..n1 of w into dst (float32 [n1 - n0, K], row stride K); every variant
// computes fma(q, scale, min) (q * scale without mins), so all give the same bits.
using DequantFn = void (*)(const QView& w, float* dst, int64_t n0, int64_t n1);
void dequant_rows(const QView& w, float* dst, int64_t n0, int64_t n1);
#if defined(__x86_64__) || defined(_M_X64)
void dequant_rows_avx2(const QView& w, float* dst, int64_t n0, int64_t n1);
void dequant_rows_avx512(const QView& w, float* dst, int64_t n0, int64_t n1);
#endif

// ---------------------------------------------------------------------------------------------
// The int8-activation kernels (qlinear paths 4..7): x is quantized per block of 16 values,
//   d[m, b] = max |x[m, 16b : 16b + 16]| / 127,  qx = round_half_even(x * (1 / d))  (-127..127)
// (0 where d = 0), and each weight group's dot product is an integer dot product of q and qx:
//   out[m, n] = sum_g scales[n, g] * sum_{blocks b of g} d[m, b] * sum_{k in b} q[n, k] * qx[m, k]
//             + sum_g mins[n, g] * s[m, g],     s[m, g] = sum_{blocks b of g} d[m, b] * sum qx
// i.e. exactly W times the rounded x (d * qx), up to float32 summation order. The mins term
// takes the rounded x too (as llama.cpp's q8_1 does): with the exact sums, the rounding error
// would be weighted by scale * q (up to 15 scale for u4) instead of by W itself.

// x quantized for the int8 kernels. Rows are padded to a multiple of 64 values (pad: qx = 0,
// d = 0). The AVX-512 kernels want two variations of the byte layout (flags of quantize_act):
//   permute64: in each 64-value step, values 32s+0..15, 32(s+1)+0..15, 32s+16..31,
//              32(s+1)+16..31 (the order in which a u4 weight's nibbles unpack), and
//   bias128:   stored as qx + 128 (unsigned) so that vpdpbusd can take signed weights.
struct QAct {
  const int8_t* q;   // [M, ldq]
  const float* d;    // [M, ldq / 16] block scales (in value order, whatever the byte layout)
  const float* s;    // [M, n_groups] float sums of x per weight group, or nullptr (no mins)
  int64_t ldq;
  const int8_t* lo = nullptr;  // 15-bit x: q = hi, lo as its quantizer splits qx (below)
};

// Quantize x [M, K] (row stride ldx) into q [M, ldq], d [M, ldq / 16] and, if s is not null,
// s [M, K / group]. The rounding is fixed (see above), so every path sees the same qx.
void quantize_act(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t group, int8_t* q,
                  float* d, float* s, int64_t ldq, bool permute64, bool bias128);

// Where block b of 16 values goes in a quantized x row: in value order, or (permute64) the u4
// nibble order of its 64-value step (its 4 blocks stored as blocks 0, 2, 1, 3).
inline int64_t act_block_pos(int64_t b, bool permute64) {
  return permute64 ? (b & ~int64_t(3)) * 16 + ((b & 1) * 2 + ((b >> 1) & 1)) * 16 : b * 16;
}

// The 15-bit variant (path 9): d = max |x_block| / 16383, qx = round_half_even(x / d) in
// -16383..16383, stored split in two bytes, hi = qx >> 7 (-128..127) and lo = qx & 127 (0..127),
// so that qx = 128 * hi + lo and an integer dot product with it is two vpdpbusd. x is then
// rounded to 1/32766 of its block's largest value: products equal the float32 ones to ~3e-5
// of |x| |W|, where int8 rounds to 1/254. corr [M, ldq / 16] = -128 * (sum of qx over each
// block) (for i8 weights: see qkernels_t16_x86.cpp). quantize_act_avx512 does it. (Paths
// 10 - 12 split qx as hi = max(qx >> 7, -127), lo = qx - 128 hi instead: quantize_act_avx2.)
using RowsQ8Fn = void (*)(const QView& w, const QAct& a, int64_t M, float* out, int64_t ldo,
                          int64_t n0, int64_t n1);
void rows_q8_scalar(const QView& w, const QAct& a, int64_t M, float* out, int64_t ldo, int64_t n0,
                    int64_t n1);
#if defined(__x86_64__) || defined(_M_X64)
void rows_q8_avxvnni(const QView& w, const QAct& a, int64_t M, float* out, int64_t ldo, int64_t n0,
                     int64_t n1);
// (path 7, and 9 at one row: reads float16 scales and mins (w.scales16 / w.mins16) and a u4
// weight's implied mins as they are, with the same results as widened ones)
void rows_q8_avx512vnni(const QView& w, const QAct& a, int64_t M, float* out, int64_t ldo,
                        int64_t n0, int64_t n1);
// quantize_act (lo null: the same bits as the scalar code) or its 15-bit variant (lo not null)
// with AVX-512; corr as above; permute64 / bias128 as quantize_act's (bias128: hi only).
void quantize_act_avx512(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t group,
                         int8_t* hi, int8_t* lo, float* d, float* s, int32_t* corr, int64_t ldq,
                         bool permute64, bool bias128);
// Paths 8 and 9 (qkernels_t16_x86.cpp): 16 weight rows a tile, one row a lane; x plain (no
// permute64, no bias128), 15-bit if a.lo is set; xcorr [M, ldq / 16] = -128 * (sum of qx over
// each block), used for i8 weights. (Path 9 at one row runs rows_q8_avx512vnni on 15-bit x.)
void rows_q8_t16_avx512vnni(const QView& w, const QAct& a, const int32_t* xcorr, int64_t M,
                            float* out, int64_t ldo, int64_t n0, int64_t n1);
// Paths 10 and 11 (qkernels_t16_avx2.cpp): 8 weight rows a tile on AVX2 (vpmaddubsw), x plain
// (quantize_act without permute64 / bias128), 15-bit if a.lo is set, split by quantize_act_avx2
// as hi = max(qx >> 7, -127), lo = qx - 128 hi (both -127..127, see that file).
void rows_q8_t8_avx2(const QView& w, const QAct& a, int64_t M, float* out, int64_t ldo, int64_t n0,
                     int64_t n1);
// Paths 5 and 12 (qkernels_rows_avx2.cpp): the AVX2 row kernels, int8 x or 15-bit x (a.lo set,
// split as for paths 10 / 11); x in permute64 order for u4 weights, plain for i8 ones. They read
// float16 scales and mins (w.scales16 / w.mins16; needs F16C) and a u4 weight's implied mins
// (-8 * scale) as they are, with the same results as widened ones.
void rows_q8_r4_avx2(const QView& w, const QAct& a, int64_t M, float* out, int64_t ldo, int64_t n0,
                     int64_t n1);
// quantize_act with AVX2 (lo null: the same bits as the scalar code, permute64 as there, no
// bias128), or (lo not null) x rounded to 15 bits, hi = max(qx >> 7, -127) and lo = qx - 128 hi
// (both -127..127: vpsignb can give them an i8 weight's sign).
void quantize_act_avx2(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t group, int8_t* hi,
                       int8_t* lo, float* d, float* s, int64_t ldq, bool permute64);
#endif

}  // namespace qcpu
}  // namespace symphony
