// CUDA kernels of the symphony ops: write_kv and paged_attention (float32, float16, bfloat16).
//
// paged_attention: one thread block per (query token, kv head). The block stages the query
// rows of every query head of the GQA group in shared memory (as float, pre-scaled), then walks
// the sequence's visible keys in tiles of 32: the whole block loads a K/V tile (converted to
// float) into shared memory once, and each warp runs the online-softmax update for its query
// heads: lane j computes the score of key j of the tile, warp shuffles give the tile max and
// sum, and the lanes then accumulate P V over head_dim. All accumulation is float32.
//
// Table values are not validated on the host (that would need a device sync): the kernels
// clamp every index they derive from them, treat an out-of-range page id as an empty key and
// raise a device-side assertion, so they never read or write out of bounds.
// Only c10/cuda headers (not ATen/cuda/CUDAContext.h, which pulls in cuBLAS / cuSPARSE headers
// that minimal CUDA toolkits lack).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <cstdint>

#include "../checks.h"
#include "../check.h"

namespace symphony {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kKeyTile = 32;  // keys per tile: one per lane
constexpr float kLog2e = 1.4426950408889634f;

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  return static_cast<float>(x);
}

template <typename T>
__device__ __forceinline__ T from_float(float x) {
  return static_cast<T>(x);
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

struct AttnParams {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  void* out;
  const int32_t* page_table;
  const int32_t* cu_q_lens;
  const int32_t* kv_lens;
  int64_t q_stride;  // elements between tokens of q
  int64_t num_pages;
  int B, n_heads, n_kv_heads, group, head_dim, page_size, max_pages;
  float scale_log2;  // scale * log2(e)
};

// Shared memory (floats): q_s [G][D], o_s [G][D], k_s [32][D + 1], v_s [32][D], p_s [G][32],
// m_s [G], l_s [G].
__host__ __device__ inline int64_t attn_smem_floats(int G, int D) {
  return int64_t(2) * G * D + int64_t(kKeyTile) * (2 * D + 1) + int64_t(G) * kKeyTile + 2 * G;
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    paged_attention_kernel(const AttnParams p) {
  extern __shared__ float smem[];
  const int G = p.group, D = p.head_dim, Dp = D + 1;
  float* q_s = smem;
  float* o_s = q_s + G * D;
  float* k_s = o_s + G * D;
  float* v_s = k_s + kKeyTile * Dp;
  float* p_s = v_s + kKeyTile * D;
  float* m_s = p_s + G * kKeyTile;
  float* l_s = m_s + G;

  const int64_t t = blockIdx.x;  // query token
  const int g = blockIdx.y;      // kv head
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  // Sequence of token t: the largest b with cu_q_lens[b] <= t (skips empty sequences).
  int lo = 0, hi = p.B;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (p.cu_q_lens[mid] <= t) lo = mid;
    else hi = mid;
  }
  const int b = lo;
  const int64_t q_start = p.cu_q_lens[b];
  const int64_t q_len = int64_t(p.cu_q_lens[b + 1]) - q_start;
  const int64_t kv_len = p.kv_lens[b];
  // Query i of the sequence sees keys 0 .. kv_len - q_len + i.
  int64_t n_keys = kv_len - q_len + (t - q_start) + 1;
  const int64_t max_keys = int64_t(p.max_pages) * p.page_size;
  n_keys = n_keys < 0 ? 0 : (n_keys > max_keys ? max_keys : n_keys);

  const scalar_t* q = static_cast<const scalar_t*>(p.q) + t * p.q_stride + int64_t(g) * G * D;
  for (int idx = tid; idx < G * D; idx += kThreads) {
    q_s[idx] = to_float(q[idx]) * p.scale_log2;
    o_s[idx] = 0.0f;
  }
  for (int h = tid; h < G; h += kThreads) {
    m_s[h] = -INFINITY;
    l_s[h] = 0.0f;
  }

  const scalar_t* kc = static_cast<const scalar_t*>(p.k_cache);
  const scalar_t* vc = static_cast<const scalar_t*>(p.v_cache);
  const int32_t* pt = p.page_table + int64_t(b) * p.max_pages;
  const int64_t slot_stride = int64_t(p.n_kv_heads) * D;
  __syncthreads();

  for (int64_t j0 = 0; j0 < n_keys; j0 += kKeyTile) {
    const int nk = int(n_keys - j0 < kKeyTile ? n_keys - j0 : kKeyTile);
    // Stage the K/V tile: one warp per key row, lanes along head_dim (coalesced).
    for (int jj = warp; jj < kKeyTile; jj += kWarps) {
      const int64_t j = j0 + jj;
      const scalar_t* kr = nullptr;
      const scalar_t* vr = nullptr;
      if (jj < nk) {
        const int32_t page = pt[j / p.page_size];
        if (page >= 0 && page < p.num_pages) {
          const int64_t e = (int64_t(page) * p.page_size + j % p.page_size) * slot_stride + int64_t(g) * D;
          kr = kc + e;
          vr = vc + e;
        } else {
          CUDA_KERNEL_ASSERT(false && "symphony::paged_attention: page id out of range");
        }
      }
      for (int d = lane; d < D; d += 32) {
        k_s[jj * Dp + d] = kr ? to_float(kr[d]) : 0.0f;
        v_s[jj * D + d] = vr ? to_float(vr[d]) : 0.0f;
      }
    }
    __syncthreads();

    for (int h = warp; h < G; h += kWarps) {
      float s = -INFINITY;
      if (lane < nk) {
        const float* qh = q_s + h * D;
        const float* kr = k_s + lane * Dp;
        // Four independent accumulators break the FMA dependency chain.
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
        int d = 0;
        for (; d + 4 <= D; d += 4) {
          a0 = fmaf(qh[d], kr[d], a0);
          a1 = fmaf(qh[d + 1], kr[d + 1], a1);
          a2 = fmaf(qh[d + 2], kr[d + 2], a2);
          a3 = fmaf(qh[d + 3], kr[d + 3], a3);
        }
        for (; d < D; ++d) a0 = fmaf(qh[d], kr[d], a0);
        s = (a0 + a1) + (a2 + a3);
      }
      const float m_old = m_s[h];
      const float m_new = fmaxf(m_old, warp_max(s));  // finite: lane 0 always holds a key
      const float pj = lane < nk ? exp2f(s - m_new) : 0.0f;
      const float sum = warp_sum(pj);
      const float alpha = exp2f(m_old - m_new);  // 0 on the first tile (m_old = -inf)
      p_s[h * kKeyTile + lane] = pj;
      __syncwarp();
      for (int d = lane; d < D; d += 32) {
        float o = o_s[h * D + d] * alpha;
        for (int jj = 0; jj < nk; ++jj) o = fmaf(p_s[h * kKeyTile + jj], v_s[jj * D + d], o);
        o_s[h * D + d] = o;
      }
      __syncwarp();
      if (lane == 0) {
        m_s[h] = m_new;
        l_s[h] = l_s[h] * alpha + sum;
      }
      __syncwarp();
    }
    __syncthreads();  // the next tile overwrites k_s / v_s
  }
  __syncthreads();

  scalar_t* out = static_cast<scalar_t*>(p.out) + (t * p.n_heads + int64_t(g) * G) * D;
  for (int idx = tid; idx < G * D; idx += kThreads) {
    const float l = l_s[idx / D];
    out[idx] = from_float<scalar_t>(l > 0.0f ? o_s[idx] / l : 0.0f);
  }
}

template <typename scalar_t>
__global__ void write_kv_kernel(const scalar_t* __restrict__ k, const scalar_t* __restrict__ v,
                                int64_t k_stride, int64_t v_stride, scalar_t* __restrict__ k_cache,
                                scalar_t* __restrict__ v_cache, const int64_t* __restrict__ slots,
                                int64_t row, int64_t capacity) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0) return;
  if (slot >= capacity) {
    CUDA_KERNEL_ASSERT(false && "symphony::write_kv: slot out of range");
    return;
  }
  for (int64_t i = threadIdx.x; i < row; i += blockDim.x) {
    k_cache[slot * row + i] = k[t * k_stride + i];
    v_cache[slot * row + i] = v[t * v_stride + i];
  }
}

template <typename F>
void dispatch_float_types(at::ScalarType st, const char* op, F&& f) {
  switch (st) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(at::Half{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    default: SYM_CHECK(false, op, ": unsupported dtype ", st);
  }
}

at::Tensor paged_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& page_table,
                                const at::Tensor& cu_q_lens, const at::Tensor& kv_lens,
                                double scale) {
  const AttnDims d = check_paged_attention_args(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens);
  SYM_CHECK(q.is_cuda(), "symphony::paged_attention: expected CUDA tensors");
  SYM_CHECK(d.T < (int64_t(1) << 31) && d.n_kv_heads <= 65535 && d.B < (int64_t(1) << 31) &&
                  d.max_pages < (int64_t(1) << 31) && d.page_size < (int64_t(1) << 31),
              "symphony::paged_attention: problem too large for the CUDA kernel");
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty({d.T, d.n_heads, d.head_dim}, q.options());
  if (d.T == 0) return out;

  const int64_t smem = attn_smem_floats(int(d.group), int(d.head_dim)) * int64_t(sizeof(float));
  if (smem > 48 * 1024) {
    int optin = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                          q.device().index()));
    SYM_CHECK(smem <= int64_t(optin), "symphony::paged_attention: head_dim ", d.head_dim,
                " with ", d.group, " query heads per kv head needs ", smem,
                " bytes of shared memory; the device allows ", optin);
  }

  AttnParams p;
  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.out = out.data_ptr();
  p.page_table = page_table.data_ptr<int32_t>();
  p.cu_q_lens = cu_q_lens.data_ptr<int32_t>();
  p.kv_lens = kv_lens.data_ptr<int32_t>();
  p.q_stride = q.stride(0);
  p.num_pages = d.num_pages;
  p.B = int(d.B);
  p.n_heads = int(d.n_heads);
  p.n_kv_heads = int(d.n_kv_heads);
  p.group = int(d.group);
  p.head_dim = int(d.head_dim);
  p.page_size = int(d.page_size);
  p.max_pages = int(d.max_pages);
  p.scale_log2 = float(scale) * kLog2e;

  const dim3 grid(unsigned(d.T), unsigned(d.n_kv_heads));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_types(q.scalar_type(), "symphony::paged_attention", [&](auto tag) {
    using scalar_t = decltype(tag);
    auto kernel = paged_attention_kernel<scalar_t>;
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          int(smem)));
    }
    kernel<<<grid, kThreads, size_t(smem), stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

void write_kv_cuda(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                   at::Tensor& v_cache, const at::Tensor& slots) {
  const WriteKvDims d = check_write_kv_args(k, v, k_cache, v_cache, slots);
  SYM_CHECK(k_cache.is_cuda(), "symphony::write_kv: expected CUDA tensors");
  SYM_CHECK(d.T < (int64_t(1) << 31), "symphony::write_kv: too many tokens");
  if (d.T == 0) return;
  const c10::cuda::CUDAGuard guard(k_cache.device());
  const int64_t row = d.n_kv_heads * d.head_dim;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_types(k_cache.scalar_type(), "symphony::write_kv", [&](auto tag) {
    using scalar_t = decltype(tag);
    write_kv_kernel<scalar_t><<<unsigned(d.T), 128, 0, stream>>>(
        static_cast<const scalar_t*>(k.data_ptr()), static_cast<const scalar_t*>(v.data_ptr()),
        k.stride(0), v.stride(0), static_cast<scalar_t*>(k_cache.data_ptr()),
        static_cast<scalar_t*>(v_cache.data_ptr()), slots.data_ptr<int64_t>(), row,
        d.num_pages * d.page_size);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(symphony, CUDA, m) {
  m.impl("write_kv", &write_kv_cuda);
  m.impl("paged_attention", &paged_attention_cuda);
}

}  // namespace symphony
