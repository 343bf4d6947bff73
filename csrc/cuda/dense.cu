// CUDA kernels of a 16-bit decode step that torch runs as several small kernels or as a GEMM
// shaped for many rows (schemas: csrc/ops.cpp):
//
//   dense_gemv(x [M, K], w [N, K], float_out) -> x @ w^T, [M, N]   (M <= 4, float16 / bfloat16)
//     One warp per weight row n: lane l reads the 16-byte chunks l, l + 32, ... of the row,
//     eight in flight at once (streaming loads: every weight byte is read once a step), and
//     multiplies them with each of the M rows of x (read through L1) in float32; a warp shuffle
//     sums the lanes. float_out writes float32 (the logits of a 16-bit head), else x's dtype.
//     The engine times it against cuBLAS for each of its weight shapes at start-up and uses
//     whichever is faster (symphony/engine/cuda_kernels.py).
//   rms_norm, add_rms_norm: one block per row; the sum of squares in float32, the residual sum
//     rounded to x's dtype first (as torch's x + r is), the output rounded once. add_rms_norm
//     also takes a float32 residual stream x with a 16-bit r: the sum stays float32, the normed
//     output takes r's dtype. Rows of up to 8,192 values (a multiple of 8, 16-byte aligned) with
//     a 16-bit output go by 16-byte vectors held in registers; others by a scalar kernel.
//   silu_mul, rope_: one thread per output value / rotated pair, float32 math, rounded once.
//
// Every kernel takes float32, float16 or bfloat16 (dense_gemv: 16-bit only). Positions given to
// rope_ are not checked on the host (that would need a device sync): a position outside the
// table leaves its row unrotated instead of reading out of bounds.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include "../check.h"
#include "../checks.h"
#include "gemv.h"

namespace symphony {
namespace {

constexpr int kGemvWarps = 4;     // weight rows (warps) a block
constexpr int kGemvUnroll = 8;    // 16-byte chunks a lane has in flight
constexpr int kGemvMaxM = 4;

// ------------------------------------------------------------------ element conversions
template <typename T>
struct Conv;

template <>
struct Conv<float> {
  __device__ static float load(const float* p) { return *p; }
  __device__ static void store(float* p, float v) { *p = v; }
};

template <>
struct Conv<at::Half> {
  __device__ static float load(const at::Half* p) {
    return __half2float(__ushort_as_half(*reinterpret_cast<const unsigned short*>(p)));
  }
  __device__ static void store(at::Half* p, float v) {
    *reinterpret_cast<unsigned short*>(p) = __half_as_ushort(__float2half_rn(v));
  }
};

__device__ __forceinline__ unsigned short bf16_bits(float v) {  // round to nearest even
  uint32_t u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;             // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<unsigned short>(u >> 16);
}

template <>
struct Conv<at::BFloat16> {
  __device__ static float load(const at::BFloat16* p) {
    return __uint_as_float(uint32_t(*reinterpret_cast<const unsigned short*>(p)) << 16);
  }
  __device__ static void store(at::BFloat16* p, float v) {
    *reinterpret_cast<unsigned short*>(p) = bf16_bits(v);
  }
};

// The 8 values of a 16-byte chunk of float16 / bfloat16, widened.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& c, float* f);

template <>
__device__ __forceinline__ void unpack8<at::BFloat16>(const uint4& c, float* f) {
  const uint32_t w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

template <>
__device__ __forceinline__ void unpack8<at::Half>(const uint4& c, float* f) {
  const uint32_t w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] & 0xffffu)));
    f[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] >> 16)));
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// The sum of v over the block (blockDim.x a multiple of 32, at most 1024), in every thread.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float part[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();                       // part[] may still be read from a previous call
  if (lane == 0) part[warp] = v;
  __syncthreads();
  v = lane < warps ? part[lane] : 0.f;
  return warp_sum(v);
}

template <typename F>
void dispatch_types(at::ScalarType st, const char* op, F&& f) {
  switch (st) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(at::Half{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    default: SYM_CHECK(false, op, ": unsupported dtype ", st, " (float32, float16 or bfloat16)");
  }
}

// ------------------------------------------------------------------ dense_gemv
template <typename T, int MB>
__device__ __forceinline__ void gemv_chunk(const uint4& wc, const T* __restrict__ x, int64_t ldx,
                                           int M, int64_t k0, float* acc) {
  float w[8];
  unpack8<T>(wc, w);
#pragma unroll
  for (int m = 0; m < MB; ++m) {
    if (m < M) {
      float xv[8];
      unpack8<T>(*reinterpret_cast<const uint4*>(x + m * ldx + k0), xv);
      float s = acc[m];
#pragma unroll
      for (int j = 0; j < 8; ++j) s = fmaf(w[j], xv[j], s);
      acc[m] = s;
    }
  }
}

template <typename T, typename OutT, int MB>
__global__ void __launch_bounds__(kGemvWarps * 32)
gemv_kernel(const T* __restrict__ x, int64_t ldx, int M, const T* __restrict__ w, int64_t N,
            int64_t K, OutT* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const int64_t n = int64_t(blockIdx.x) * kGemvWarps + (threadIdx.x >> 5);
  if (n >= N) return;
  const uint4* row = reinterpret_cast<const uint4*>(w + n * K);
  const int64_t chunks = K >> 3;
  float acc[MB];
#pragma unroll
  for (int m = 0; m < MB; ++m) acc[m] = 0.f;
  int64_t c = lane;
  for (; c + 32 * (kGemvUnroll - 1) < chunks; c += 32 * kGemvUnroll) {
    uint4 wc[kGemvUnroll];
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) wc[u] = __ldcs(row + c + 32 * u);
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) gemv_chunk<T, MB>(wc[u], x, ldx, M, (c + 32 * u) * 8, acc);
  }
  for (; c < chunks; c += 32) gemv_chunk<T, MB>(__ldcs(row + c), x, ldx, M, c * 8, acc);
#pragma unroll
  for (int m = 0; m < MB; ++m) {
    const float s = warp_sum(acc[m]);
    if (lane == 0 && m < M) Conv<OutT>::store(out + m * N + n, s);
  }
}

at::Tensor dense_gemv_cuda(const at::Tensor& x, const at::Tensor& w, bool float_out) {
  check_gemv_args("symphony::dense_gemv", x, w, kGemvMaxM, (int64_t(1) << 31) * kGemvWarps);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  if (N == 0) return out;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const unsigned blocks = unsigned((N + kGemvWarps - 1) / kGemvWarps);
  const int64_t ldx = M == 1 ? K : x.stride(0);
  auto launch = [&](auto tag, auto out_tag) {
    using T = decltype(tag);
    using OutT = decltype(out_tag);
    const T* xp = static_cast<const T*>(x.data_ptr());
    const T* wp = static_cast<const T*>(w.data_ptr());
    OutT* op_ = static_cast<OutT*>(out.data_ptr());
    if (M == 1)
      gemv_kernel<T, OutT, 1><<<blocks, kGemvWarps * 32, 0, stream>>>(xp, ldx, 1, wp, N, K, op_);
    else if (M == 2)
      gemv_kernel<T, OutT, 2><<<blocks, kGemvWarps * 32, 0, stream>>>(xp, ldx, 2, wp, N, K, op_);
    else
      gemv_kernel<T, OutT, 4><<<blocks, kGemvWarps * 32, 0, stream>>>(xp, ldx, int(M), wp, N, K, op_);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (x.scalar_type() == at::kHalf) {
    if (float_out) launch(at::Half{}, float{}); else launch(at::Half{}, at::Half{});
  } else {
    if (float_out) launch(at::BFloat16{}, float{}); else launch(at::BFloat16{}, at::BFloat16{});
  }
  return out;
}

// ------------------------------------------------------------------ RMSNorm
// out[t] = s * rsqrt(mean(s^2) + eps) * w with s = x[t] (+ r[t], written to sum[t]). x and sum
// are TX, r and out TO: the same 16-bit type, or a float32 residual stream (TX = float) added
// to a 16-bit layer output, normed into the 16-bit input of the next matrix. The sum is
// rounded to TX before the norm, as torch's x + r is.
template <typename TX, typename TO>
__global__ void rms_norm_kernel(const TX* __restrict__ x, int64_t ldx, const TO* __restrict__ r,
                                int64_t ldr, const float* __restrict__ w, TX* __restrict__ sum,
                                TO* __restrict__ out, int64_t H, float eps) {
  const int64_t t = blockIdx.x;
  const TX* xr = x + t * ldx;
  const TO* rr = r ? r + t * ldr : nullptr;
  float ss = 0.f;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    float v = Conv<TX>::load(xr + h);
    if (rr) {
      TX s;
      Conv<TX>::store(&s, v + Conv<TO>::load(rr + h));
      sum[t * H + h] = s;
      v = Conv<TX>::load(&s);
    }
    ss = fmaf(v, v, ss);
  }
  const float scale = rsqrtf(block_sum(ss) / float(H) + eps);
  const TX* src = rr ? sum + t * H : xr;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x)
    Conv<TO>::store(out + t * H + h, Conv<TX>::load(src + h) * scale * w[h]);
}

// The same for rows of H % 8 == 0 values, H <= kNormThreads * 8 * kNormVecs, every row 16-byte
// aligned, a 16-bit TO: 16-byte loads and stores, the row kept in registers between the two
// passes (the scalar kernel above reads it twice, one element at a time: ~6 us a row on an H200).
constexpr int kNormThreads = 256;
constexpr int kNormVecs = 4;

template <typename T>
__device__ __forceinline__ float round_to(float v) {
  T r;
  Conv<T>::store(&r, v);
  return Conv<T>::load(&r);
}

// 8 consecutive values widened, and written back rounded (16-byte aligned).
template <typename T>
__device__ __forceinline__ void load8(const T* p, float* f) {
  unpack8<T>(*reinterpret_cast<const uint4*>(p), f);
}

template <>
__device__ __forceinline__ void load8<float>(const float* p, float* f) {
  const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
  f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}

template <typename T>
__device__ __forceinline__ void store8(T* p, const float* f) {
  unsigned short h[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    T r;
    Conv<T>::store(&r, f[j]);
    h[j] = *reinterpret_cast<const unsigned short*>(&r);
  }
  *reinterpret_cast<uint4*>(p) =
      make_uint4(uint32_t(h[0]) | (uint32_t(h[1]) << 16), uint32_t(h[2]) | (uint32_t(h[3]) << 16),
                 uint32_t(h[4]) | (uint32_t(h[5]) << 16), uint32_t(h[6]) | (uint32_t(h[7]) << 16));
}

template <>
__device__ __forceinline__ void store8<float>(float* p, const float* f) {
  *reinterpret_cast<float4*>(p) = make_float4(f[0], f[1], f[2], f[3]);
  *reinterpret_cast<float4*>(p + 4) = make_float4(f[4], f[5], f[6], f[7]);
}

template <typename TX, typename TO>
__global__ void __launch_bounds__(kNormThreads)
rms_norm_vec_kernel(const TX* __restrict__ x, int64_t ldx, const TO* __restrict__ r, int64_t ldr,
                    const float* __restrict__ w, TX* __restrict__ sum, TO* __restrict__ out,
                    int64_t H, float eps) {
  const int64_t t = blockIdx.x;
  float v[kNormVecs][8];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kNormVecs; ++i) {
    const int64_t k = (int64_t(threadIdx.x) + int64_t(i) * kNormThreads) * 8;
    if (k < H) {
      load8<TX>(x + t * ldx + k, v[i]);
      if (r) {
        float rv[8];
        load8<TO>(r + t * ldr + k, rv);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[i][j] = round_to<TX>(v[i][j] + rv[j]);
        store8<TX>(sum + t * H + k, v[i]);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) ss = fmaf(v[i][j], v[i][j], ss);
    }
  }
  const float scale = rsqrtf(block_sum(ss) / float(H) + eps);
#pragma unroll
  for (int i = 0; i < kNormVecs; ++i) {
    const int64_t k = (int64_t(threadIdx.x) + int64_t(i) * kNormThreads) * 8;
    if (k < H) {
      const float4 w0 = *reinterpret_cast<const float4*>(w + k);
      const float4 w1 = *reinterpret_cast<const float4*>(w + k + 4);
      const float wf[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
      float o[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) o[j] = v[i][j] * scale * wf[j];
      store8<TO>(out + t * H + k, o);
    }
  }
}

bool is16(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// Whether the vector kernel takes these rows: a 16-bit output, 16-byte aligned rows.
bool norm_vec_ok(const at::Tensor& x, const at::Tensor* r, const at::Tensor& w, at::ScalarType out) {
  const int64_t H = x.size(1);
  auto aligned = [](const at::Tensor& a) {
    return reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0 && (a.size(0) <= 1 || a.stride(0) % 8 == 0);
  };
  return is16(out) && H % 8 == 0 && H <= int64_t(kNormThreads) * 8 * kNormVecs && aligned(x) &&
         (r == nullptr || aligned(*r)) && reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0;
}

// Launches the vector or the scalar kernel for TX rows x (+ TO rows r) into sum (TX), out (TO).
template <typename TX, typename TO>
void launch_norm(bool vec, const at::Tensor& x, const at::Tensor* r, const at::Tensor& w,
                 at::Tensor* sum, at::Tensor& out, double eps, cudaStream_t stream) {
  const int64_t T = x.size(0), H = x.size(1);
  const TX* xp = static_cast<const TX*>(x.data_ptr());
  const TO* rp = r ? static_cast<const TO*>(r->data_ptr()) : nullptr;
  TX* sp = sum ? static_cast<TX*>(sum->data_ptr()) : nullptr;
  TO* op = static_cast<TO*>(out.data_ptr());
  const int64_t ldr = r ? r->stride(0) : 0;
  if (vec) {
    rms_norm_vec_kernel<TX, TO><<<unsigned(T), kNormThreads, 0, stream>>>(
        xp, x.stride(0), rp, ldr, w.data_ptr<float>(), sp, op, H, float(eps));
  } else {
    int threads = 32;
    while (threads < 256 && threads < H) threads *= 2;
    rms_norm_kernel<TX, TO><<<unsigned(T), threads, 0, stream>>>(
        xp, x.stride(0), rp, ldr, w.data_ptr<float>(), sp, op, H, float(eps));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_norm(const char* op, const at::Tensor& x, const at::Tensor& w) {
  SYM_CHECK(x.is_cuda() && w.is_cuda() && x.device() == w.device(), op,
            ": x and w must be CUDA tensors on one device, got ", x.device(), " and ", w.device());
  SYM_CHECK(x.dim() == 2, op, ": x must be 2-D [T, H], got shape ", x.sizes());
  SYM_CHECK(w.scalar_type() == at::kFloat, op, ": w must be float32, got ", w.scalar_type());
  SYM_CHECK(w.dim() == 1 && w.size(0) == x.size(1), op, ": w must be [H] = [", x.size(1),
            "], got ", w.sizes());
  SYM_CHECK(w.is_contiguous() && (x.size(1) <= 1 || x.stride(1) == 1), op,
            ": w and the rows of x must be contiguous");
  SYM_CHECK(x.size(0) < (int64_t(1) << 31), op, ": too many rows: ", x.size(0));
}

at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_norm("symphony::rms_norm", x, w);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t T = x.size(0), H = x.size(1);
  at::Tensor out = at::empty({T, H}, x.options());
  if (T == 0 || H == 0) return out;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool vec = norm_vec_ok(x, nullptr, w, x.scalar_type());
  dispatch_types(x.scalar_type(), "symphony::rms_norm", [&](auto tag) {
    using T_ = decltype(tag);
    launch_norm<T_, T_>(vec, x, nullptr, w, nullptr, out, eps, stream);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cuda(const at::Tensor& x, const at::Tensor& r,
                                                     const at::Tensor& w, double eps) {
  constexpr const char* op = "symphony::add_rms_norm";
  check_norm(op, x, w);
  check_norm(op, r, w);
  SYM_CHECK(r.sizes() == x.sizes(), op, ": x and r shapes differ: ", x.sizes(), " vs ", r.sizes());
  const bool mixed = x.scalar_type() == at::kFloat && is16(r.scalar_type());
  SYM_CHECK(r.scalar_type() == x.scalar_type() || mixed, op,
            ": r must have x's dtype, or x be float32 and r 16-bit; got ", x.scalar_type(), " and ",
            r.scalar_type());
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t T = x.size(0), H = x.size(1);
  at::Tensor sum = at::empty({T, H}, x.options());
  at::Tensor out = at::empty({T, H}, r.options());
  if (T == 0 || H == 0) return {sum, out};
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool vec = norm_vec_ok(x, &r, w, r.scalar_type());
  dispatch_types(r.scalar_type(), op, [&](auto tag) {
    using TO = decltype(tag);
    if (mixed) {
      if constexpr (!std::is_same_v<TO, float>) launch_norm<float, TO>(vec, x, &r, w, &sum, out, eps, stream);
    } else {
      launch_norm<TO, TO>(vec, x, &r, w, &sum, out, eps, stream);
    }
  });
  return {sum, out};
}

// ------------------------------------------------------------------ SwiGLU
template <typename T>
__global__ void silu_mul_kernel(const T* __restrict__ gu, int64_t ld, T* __restrict__ out,
                                int64_t T_, int64_t I) {
  const int64_t total = T_ * I;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / I, j = i - t * I;
    const float g = Conv<T>::load(gu + t * ld + j), u = Conv<T>::load(gu + t * ld + I + j);
    const float s = -g > 88.f ? 0.f : g / (1.f + expf(fminf(-g, 88.f)));
    Conv<T>::store(out + i, s * u);
  }
}

at::Tensor silu_mul_cuda(const at::Tensor& gu) {
  constexpr const char* op = "symphony::silu_mul";
  SYM_CHECK(gu.is_cuda(), op, ": gu must be a CUDA tensor, got ", gu.device());
  SYM_CHECK(gu.dim() == 2, op, ": gu must be 2-D [T, 2 * I], got shape ", gu.sizes());
  SYM_CHECK(gu.size(1) % 2 == 0, op, ": gu's last dimension must be even (gate, up), got ",
            gu.size(1));
  SYM_CHECK(gu.size(1) <= 1 || gu.stride(1) == 1, op,
            ": the rows of gu must be contiguous (stride(1) == 1), got strides ", gu.strides());
  const c10::cuda::CUDAGuard guard(gu.device());
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  at::Tensor out = at::empty({T, I}, gu.options());
  if (T * I == 0) return out;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t blocks = std::min<int64_t>((T * I + 255) / 256, 65535);
  dispatch_types(gu.scalar_type(), op, [&](auto tag) {
    using T_ = decltype(tag);
    silu_mul_kernel<T_><<<unsigned(blocks), 256, 0, stream>>>(
        static_cast<const T_*>(gu.data_ptr()), gu.stride(0), static_cast<T_*>(out.data_ptr()), T, I);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

// ------------------------------------------------------------------ RoPE
template <typename T>
__global__ void rope_kernel(T* __restrict__ x, int64_t ld, const int64_t* __restrict__ pos,
                            const float* __restrict__ table, int64_t P, int64_t T_, int64_t heads,
                            int64_t half) {
  const int64_t total = T_ * heads * half;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / (heads * half), rem = i - t * heads * half;
    const int64_t h = rem / half, j = rem - h * half;
    const int64_t p = pos[t];
    if (p < 0 || p >= P) continue;
    T* e = x + t * ld + h * 2 * half + 2 * j;
    const float a = Conv<T>::load(e), b = Conv<T>::load(e + 1);
    const float c = table[(p * half + j) * 2], s = table[(p * half + j) * 2 + 1];
    Conv<T>::store(e, a * c - b * s);
    Conv<T>::store(e + 1, a * s + b * c);
  }
}

void rope_cuda(at::Tensor& x, const at::Tensor& positions, const at::Tensor& table, int64_t heads) {
  constexpr const char* op = "symphony::rope_";
  SYM_CHECK(x.is_cuda() && positions.device() == x.device() && table.device() == x.device(), op,
            ": x, positions and table must be on one CUDA device");
  const int64_t half = check_rope_args(op, x, positions, table, heads);
  const int64_t T = x.size(0);
  const int64_t total = T * heads * half;
  if (total == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t blocks = std::min<int64_t>((total + 255) / 256, 65535);
  dispatch_types(x.scalar_type(), op, [&](auto tag) {
    using T_ = decltype(tag);
    rope_kernel<T_><<<unsigned(blocks), 256, 0, stream>>>(
        static_cast<T_*>(x.data_ptr()), x.stride(0), positions.data_ptr<int64_t>(),
        table.data_ptr<float>(), table.size(0), T, heads, half);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(symphony, CUDA, m) {
  m.impl("dense_gemv", &dense_gemv_cuda);
  m.impl("rms_norm", &rms_norm_cuda);
  m.impl("add_rms_norm", &add_rms_norm_cuda);
  m.impl("silu_mul", &silu_mul_cuda);
  m.impl("rope_", &rope_cuda);
}

}  // namespace symphony
