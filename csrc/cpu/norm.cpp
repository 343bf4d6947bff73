// RMSNorm on the CPU, one op for what F.rms_norm does in ~10 small ATen ops (a single-stream
// decode step called it 61 times at ~50 us each: ~12% of the step; perf/RESULTS.md):
//   rms_norm(x [T, H], w [H], eps)         -> x * rsqrt(mean(x^2) + eps) * w
//   add_rms_norm(x, r, w, eps) -> (s, n)      s = x + r (the residual stream), n = rms_norm(s)
// float32 only (the Python side falls back to torch for other dtypes and devices); sums of
// squares in float32 with 16 partial sums, like torch's vectorized reduction up to order.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include "../check.h"

namespace symphony {
namespace {

void check_norm_args(const char* op, const at::Tensor& x, const at::Tensor& w) {
  SYM_CHECK(x.dim() == 2, op, ": x must be 2-D [T, H], got shape ", x.sizes());
  SYM_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, op,
              ": x and w must be float32, got ", x.scalar_type(), " and ", w.scalar_type());
  SYM_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, ": CPU tensors expected");
  SYM_CHECK(w.dim() == 1 && w.size(0) == x.size(1), op, ": w must be [H] = [", x.size(1),
              "], got ", w.sizes());
  SYM_CHECK(w.is_contiguous() && (x.size(1) <= 1 || x.stride(1) == 1), op,
              ": w and the rows of x must be contiguous");
}

// dst = src * rsqrt(mean(src^2) + eps) * w for one row of H values
inline void norm_row(const float* src, const float* w, float* dst, int64_t H, float eps) {
  float acc[16] = {0};
  int64_t h = 0;
  for (; h + 16 <= H; h += 16)
    for (int i = 0; i < 16; ++i) acc[i] += src[h + i] * src[h + i];
  float ss = 0.f;
  for (; h < H; ++h) ss += src[h] * src[h];
  for (int i = 0; i < 16; ++i) ss += acc[i];
  const float r = 1.f / std::sqrt(ss / float(H) + eps);
  for (h = 0; h < H; ++h) dst[h] = src[h] * r * w[h];
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_norm_args("symphony::rms_norm", x, w);
  const int64_t T = x.size(0), H = x.size(1);
  at::Tensor out = at::empty({T, H}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ld = x.stride(0);
  at::parallel_for(0, T, std::max<int64_t>(1, 32768 / std::max<int64_t>(H, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) norm_row(xp + t * ld, wp, op + t * H, H, float(eps));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& r,
                                                    const at::Tensor& w, double eps) {
  check_norm_args("symphony::add_rms_norm", x, w);
  check_norm_args("symphony::add_rms_norm", r, w);
  SYM_CHECK(r.sizes() == x.sizes(), "symphony::add_rms_norm: x and r shapes differ: ",
              x.sizes(), " vs ", r.sizes());
  const int64_t T = x.size(0), H = x.size(1);
  at::Tensor sum = at::empty({T, H}, x.options());
  at::Tensor out = at::empty({T, H}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* rp = r.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldr = r.stride(0);
  at::parallel_for(0, T, std::max<int64_t>(1, 32768 / std::max<int64_t>(H, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* s = sp + t * H;
      for (int64_t h = 0; h < H; ++h) s[h] = xp[t * ldx + h] + rp[t * ldr + h];
      norm_row(s, wp, op + t * H, H, float(eps));
    }
  });
  return {sum, out};
}

}  // namespace

TORCH_LIBRARY_IMPL(symphony, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("add_rms_norm", &add_rms_norm_cpu);
}

}  // namespace symphony
