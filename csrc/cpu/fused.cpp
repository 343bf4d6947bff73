// Fused element-wise ops of the decode step on the CPU, one op each for what the model did in
// several small ATen ops (each ~2-5 us of dispatch on a [1, ...] decode row, 30 layers a step):
//   silu_mul(gu [T, 2I])                    -> silu(gu[:, :I]) * gu[:, I:]         [T, I]
//   rope_(x [T, N], pos [T], table, heads)  rotates x[:, :heads * head_dim] in place
// float32 only (the Python side keeps torch's code for other dtypes and devices). The loops are
// plain C++ written so that the compiler vectorizes them for the build's -march (AVX-512 or AVX2
// where the CPU has it; the same code runs scalar elsewhere): no libm call in the hot loop.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <torch/library.h>

#include "fused.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include "../check.h"
#include "../checks.h"

namespace symphony {
namespace {

// exp(x) for x in [-87, 88] (the caller clamps), Cephes' expf: x = n ln2 + r with |r| <= ln2/2
// (Cody-Waite split of ln2), exp(r) by a degree-7 polynomial, 2^n from the exponent bits.
// Relative error <= 2 ulp on that range (tests/unit/engine/test_ops_fused.py checks against float64).
// Branch-free, so that a loop over it vectorizes.
inline float exp_clamped(float x) {
  constexpr float kRound = 12582912.f;                       // 1.5 * 2^23: round to nearest
  const float kf = x * 1.44269504088896341f + kRound;
  int32_t nbits;
  std::memcpy(&nbits, &kf, 4);
  const int32_t n = nbits - 0x4B400000;                      // the bits of kRound
  const float nf = kf - kRound;                              // round(x / ln2)
  const float r = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t sbits = (n + 127) << 23;                     // 2^n, n in [-126, 127]
  float s;
  std::memcpy(&s, &sbits, 4);
  return p * s;
}

// silu(g) * u = g / (1 + exp(-g)) * u, exp's argument clamped to [-87, 88]; silu(g) is 0 for
// g < -88 (where it is below 6e-37 in magnitude), so that huge negative gates give 0, not g / e^88.
// NaN propagates; silu(+inf) = +inf, silu(-inf) = 0.
inline void silu_mul_row(const float* __restrict g, const float* __restrict u, float* __restrict o,
                         int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float e = exp_clamped(std::min(std::max(-g[j], -87.f), 88.f));
    const float s = -g[j] > 88.f ? 0.f : g[j] / (1.f + e);
    o[j] = s * u[j];
  }
}

}  // namespace

at::Tensor silu_mul_cpu(const at::Tensor& gu) {
  constexpr const char* op = "symphony::silu_mul";
  SYM_CHECK(gu.dim() == 2, op, ": gu must be 2-D [T, 2 * I], got shape ", gu.sizes());
  SYM_CHECK(gu.scalar_type() == at::kFloat, op, ": gu must be float32, got ", gu.scalar_type());
  SYM_CHECK(gu.device().is_cpu(), op, ": gu must be a CPU tensor, got ", gu.device());
  SYM_CHECK(gu.size(1) % 2 == 0, op, ": gu's last dimension must be even (gate, up), got ",
              gu.size(1));
  SYM_CHECK(gu.size(1) <= 1 || gu.stride(1) == 1, op,
              ": the rows of gu must be contiguous (stride(1) == 1), got strides ", gu.strides());
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  at::Tensor out = at::empty({T, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op_ = out.data_ptr<float>();
  const int64_t ld = gu.stride(0);
  at::parallel_for(0, T, std::max<int64_t>(1, 32768 / std::max<int64_t>(I, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) silu_mul_row(gp + t * ld, gp + t * ld + I, op_ + t * I, I);
  });
  return out;
}

namespace {

// One head: (x[2i] + i x[2i+1]) * (cs[2i] + i cs[2i+1]), the complex multiply of model.py
inline void rope_head(float* __restrict x, const float* __restrict cs, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[2 * i], b = x[2 * i + 1], c = cs[2 * i], s = cs[2 * i + 1];
    x[2 * i] = a * c - b * s;
    x[2 * i + 1] = a * s + b * c;
  }
}

}  // namespace

void rope_inplace(at::Tensor& x, const at::Tensor& positions, const at::Tensor& table, int64_t heads) {
  constexpr const char* op = "symphony::rope_";
  SYM_CHECK(x.device().is_cpu() && table.device().is_cpu() && positions.device().is_cpu(), op,
              ": CPU tensors expected");
  SYM_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  const int64_t half = check_rope_args(op, x, positions, table, heads), head_dim = 2 * half;
  const int64_t T = x.size(0);
  const int64_t* pp = positions.data_ptr<int64_t>();
  const int64_t P = table.size(0);
  for (int64_t t = 0; t < T; ++t)
    SYM_CHECK(pp[t] >= 0 && pp[t] < P, op, ": positions[", t, "] = ", pp[t],
                " is outside the table's [0, ", P, ")");
  float* xp = x.data_ptr<float>();
  const float* tp = table.data_ptr<float>();
  const int64_t ld = x.stride(0);
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(heads * head_dim, 1)),
                   [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < heads; ++h) rope_head(xp + t * ld + h * head_dim, tp + pp[t] * head_dim, half);
  });
}

// x @ w^T in float32 (the CPU reference of the CUDA decode GEMV, csrc/cuda/dense.cu)
at::Tensor dense_gemv_cpu(const at::Tensor& x, const at::Tensor& w, bool float_out) {
  constexpr const char* op = "symphony::dense_gemv";
  SYM_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, ": CPU tensors expected");
  SYM_CHECK(x.dim() == 2 && w.dim() == 2, op, ": x must be [M, K] and w [N, K], got shapes ",
            x.sizes(), " and ", w.sizes());
  SYM_CHECK(w.size(1) == x.size(1), op, ": x has ", x.size(1), " columns but w has ", w.size(1));
  SYM_CHECK(x.scalar_type() == w.scalar_type() && at::isFloatingType(x.scalar_type()), op,
            ": x and w must share a floating-point dtype, got ", x.scalar_type(), " and ",
            w.scalar_type());
  at::Tensor y = at::matmul(x.to(at::kFloat), w.to(at::kFloat).t());
  return float_out ? y : y.to(x.scalar_type());
}

TORCH_LIBRARY_IMPL(symphony, CPU, m) {
  m.impl("dense_gemv", &dense_gemv_cpu);
  m.impl("silu_mul", &silu_mul_cpu);
  m.impl("rope_", &rope_inplace);
}

}  // namespace symphony
