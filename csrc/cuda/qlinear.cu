// CUDA kernels of the quantized-weight ops (layout: csrc/quant.h; schemas: csrc/ops.cpp).
//
//   qlinear, M <= kGemvMaxM (decode): a dequantizing GEMV. One warp per weight row n; lane l
//     takes the 16-byte chunks l, l + 32, ... of the row (a u4 group of 32 weights, or 16 i8
//     weights), dequantizes them in registers and accumulates x[m, k] * W[n, k] for every m;
//     a warp shuffle sums the lanes. Only the quantized bytes are read.
//   qlinear, larger M (prefill): W dequantized to float32 [N, K] by qdequant's kernel, then
//     torch's GEMM (at::mm -> cuBLAS).
//   qdequant: one thread per 16-byte chunk.
// The `path` argument of qlinear selects CPU kernels and is ignored here.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <cstdint>

#include "../quant.h"
#include "../check.h"

namespace symphony {
namespace {

constexpr int kGemvMaxM = 8;
constexpr int kWarpsPerBlock = 4;

struct QArgs {
  const uint8_t* qs;
  const float* scales;
  const float* mins;  // nullptr: no offset
  int64_t N, K, group, n_groups, row_bytes;
  int kind;
};

// The 16 weights (i8) or 32 weights (u4) of chunk c of row n, as floats.
__device__ __forceinline__ int chunk_weights(const QArgs& a, int64_t n, int64_t c, float* w) {
  const uint4 raw = *reinterpret_cast<const uint4*>(a.qs + n * a.row_bytes + c * 16);
  const uint8_t* b = reinterpret_cast<const uint8_t*>(&raw);
  if (a.kind == kQU4) {
    const float s = a.scales[n * a.n_groups + c], o = a.mins[n * a.n_groups + c];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      w[j] = fmaf(float(b[j] & 0x0F), s, o);
      w[16 + j] = fmaf(float(b[j] >> 4), s, o);
    }
    return 32;
  }
  const int64_t g = (c * 16) / a.group;
  const float s = a.scales[n * a.n_groups + g];
  const float o = a.mins ? a.mins[n * a.n_groups + g] : 0.f;
#pragma unroll
  for (int j = 0; j < 16; ++j) w[j] = fmaf(float(static_cast<int8_t>(b[j])), s, o);
  return 16;
}

template <int MB>
__global__ void qgemv_kernel(QArgs a, const float* __restrict__ x, int64_t ldx, int64_t M,
                             float* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const int64_t n = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (n >= a.N) return;
  const int64_t per_chunk = a.kind == kQU4 ? 32 : 16;
  const int64_t n_chunks = a.K / per_chunk;
  float acc[MB];
#pragma unroll
  for (int m = 0; m < MB; ++m) acc[m] = 0.f;
  float w[32];
  for (int64_t c = lane; c < n_chunks; c += 32) {
    const int cnt = chunk_weights(a, n, c, w);
    const int64_t k0 = c * per_chunk;
#pragma unroll
    for (int m = 0; m < MB; ++m) {
      if (m < M) {
        const float* xr = x + m * ldx + k0;
        float s = 0.f;
        for (int j = 0; j < cnt; ++j) s = fmaf(w[j], xr[j], s);
        acc[m] += s;
      }
    }
  }
#pragma unroll
  for (int m = 0; m < MB; ++m) {
    float v = acc[m];
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    if (lane == 0 && m < M) out[m * a.N + n] = v;
  }
}

__global__ void qdequant_kernel(QArgs a, float* __restrict__ out) {
  const int64_t per_chunk = a.kind == kQU4 ? 32 : 16;
  const int64_t n_chunks = a.K / per_chunk;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= a.N * n_chunks) return;
  const int64_t n = i / n_chunks, c = i % n_chunks;
  float w[32];
  const int cnt = chunk_weights(a, n, c, w);
  float* o = out + n * a.K + c * per_chunk;
  for (int j = 0; j < cnt; ++j) o[j] = w[j];
}

QArgs args_of(const at::Tensor& qs, const at::Tensor& scales, const at::Tensor& mins,
              const QDims& d) {
  SYM_CHECK(!d.half && (d.has_min || d.kind != kQU4), "symphony::qlinear / qdequant on CUDA: ",
            d.half ? "the scales are float16" : "a u4 weight without mins", ", a CPU layout; "
            "QWeight.to widens the scales to float32 and writes the mins out when it moves a weight "
            "to a GPU");
  return {static_cast<const uint8_t*>(qs.data_ptr()), scales.data_ptr<float>(),
          d.has_min ? mins.data_ptr<float>() : nullptr,
          d.N, d.K, d.group, d.n_groups, qs.size(1), static_cast<int>(d.kind)};
}

void launch_dequant(const QArgs& a, float* out, cudaStream_t stream) {
  const int64_t chunks = a.N * (a.K / (a.kind == kQU4 ? 32 : 16));
  if (chunks == 0) return;
  const int threads = 256;
  qdequant_kernel<<<(chunks + threads - 1) / threads, threads, 0, stream>>>(a, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor qdequant_cuda(const at::Tensor& qs, const at::Tensor& scales, const at::Tensor& mins,
                         int64_t kind, int64_t group) {
  const QDims d = check_qweight("symphony::qdequant", qs, scales, mins, kind, group);
  const c10::cuda::CUDAGuard guard(qs.device());
  at::Tensor out = at::empty({d.N, d.K}, scales.options());
  launch_dequant(args_of(qs, scales, mins, d), out.data_ptr<float>(),
                 c10::cuda::getCurrentCUDAStream());
  return out;
}

at::Tensor qlinear_cuda(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                        const at::Tensor& mins, int64_t kind, int64_t group, int64_t path) {
  constexpr const char* op = "symphony::qlinear";
  const QDims d = check_qweight(op, qs, scales, mins, kind, group);
  SYM_CHECK(path >= -1 && path <= 3, op, ": path must be in -1..3, got ", path);
  SYM_CHECK(x.dim() == 2, op, ": x must be 2-D [M, K], got shape ", x.sizes());
  SYM_CHECK(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  SYM_CHECK(x.size(1) == d.K, op, ": x has ", x.size(1), " columns but the weight has K = ", d.K);
  SYM_CHECK(x.device() == qs.device(), op, ": x is on ", x.device(), " but the weight on ",
              qs.device());
  SYM_CHECK(x.size(1) <= 1 || x.stride(1) == 1, op, ": x rows must be contiguous");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, d.N}, x.options());
  if (M == 0 || d.N == 0) return out;
  const QArgs a = args_of(qs, scales, mins, d);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (M > kGemvMaxM) {
    at::Tensor w = at::empty({d.N, d.K}, scales.options());
    launch_dequant(a, w.data_ptr<float>(), stream);
    return at::mm(x, w.t());
  }
  const dim3 grid((d.N + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const dim3 block(32 * kWarpsPerBlock);
  const float* xp = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  if (M <= 1)
    qgemv_kernel<1><<<grid, block, 0, stream>>>(a, xp, x.stride(0), M, o);
  else if (M <= 4)
    qgemv_kernel<4><<<grid, block, 0, stream>>>(a, xp, x.stride(0), M, o);
  else
    qgemv_kernel<kGemvMaxM><<<grid, block, 0, stream>>>(a, xp, x.stride(0), M, o);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(symphony, CUDA, m) {
  m.impl("qlinear", &qlinear_cuda);
  m.impl("qdequant", &qdequant_cuda);
}

}  // namespace symphony
