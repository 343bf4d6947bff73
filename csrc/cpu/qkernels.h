// CPU micro-kernels of qlinear, one set per instruction set (scalar, AVX2+FMA, AVX-512), chosen
// at run time by cpuid (qlinear.cpp). Each computes out[m, n] = sum_k x[m, k] * W[n, k] for all
// m < M and n0 <= n < n1, dequantizing W's groups into registers (float32 FMA, no activation
// quantization: the result is the float32 product with the dequantized weight, up to summation
// order).
#pragma once

#include <cstdint>

#include "../quant.h"

namespace symphony {
namespace qcpu {

// A quantized weight, as raw pointers (see csrc/quant.h for the layout).
struct QView {
  const uint8_t* qs;     // [N, row_bytes]
  const float* scales;   // [N, n_groups]
  const float* mins;     // [N, n_groups] or nullptr
  int64_t N, K, group, n_groups, row_bytes;
  QKind kind;
};

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

}  // namespace qcpu
}  // namespace symphony
