// CUDA kernels of the symphony ops: write_kv and paged_attention (float32, float16, bfloat16).
//
// paged_attention (flash-decoding): one thread block per (query token, kv head, split). When
// there are too few (query token, kv head) pairs to fill the device (decode batches), each
// sequence's visible keys are shared among up to 32 blocks; each writes a partial output and its
// softmax (max, sum), and a second kernel merges them. The number of splits follows from the
// shapes only, so a captured CUDA graph stays valid for any lengths; each block takes its share
// of the sequence's actual keys (at least 64). Inside a block the keys go in tiles of 128: one
// thread per key looks up its row and scores it against every query head of the GQA group
// (16-byte loads, q pre-scaled in shared memory), a warp per head runs the online softmax, and
// the threads then read V in column pairs with the tile's keys shared among key groups. All
// accumulation is float32. These kernels are also paged_attention_tiled's for the shapes and
// parts its own do not take (paged_attention_general, attention.h); with skip_q they leave the
// rows of the sequences its prefill kernel writes (a partial sum of -1 tells the merge so).
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

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../checks.h"
#include "../check.h"
#include "attention.h"
#include "warp.cuh"

namespace symphony {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTile = 128;       // keys per tile: one per thread in the score pass
constexpr int kHeadBlock = 8;    // query heads a thread accumulates at once, in registers
constexpr int kMinChunk = 64;    // the fewest keys one split of a sequence takes
constexpr int kMaxSplits = 32;
constexpr float kLog2e = 1.4426950408889634f;

// Loads of one element, two neighbours, or one 16-byte vector, widened to float.
template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static constexpr int kVec = 4;
  __device__ static float one(const float* p) { return *p; }
  __device__ static float2 two(const float* p) { return *reinterpret_cast<const float2*>(p); }
  __device__ static void vec(const float* p, float* f) {
    const float4 x = *reinterpret_cast<const float4*>(p);
    f[0] = x.x; f[1] = x.y; f[2] = x.z; f[3] = x.w;
  }
};

__device__ __forceinline__ float half_bits(uint32_t h) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
}

template <>
struct Elem<at::Half> {
  static constexpr int kVec = 8;
  __device__ static float one(const at::Half* p) {
    return half_bits(*reinterpret_cast<const unsigned short*>(p));
  }
  __device__ static float2 two(const at::Half* p) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(p);
    return make_float2(half_bits(w & 0xffffu), half_bits(w >> 16));
  }
  __device__ static void vec(const at::Half* p, float* f) {
    const uint4 x = *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = half_bits(w[i] & 0xffffu);
      f[2 * i + 1] = half_bits(w[i] >> 16);
    }
  }
};

template <>
struct Elem<at::BFloat16> {  // bfloat16 is the top half of a float32
  static constexpr int kVec = 8;
  __device__ static float one(const at::BFloat16* p) {
    return __uint_as_float(uint32_t(*reinterpret_cast<const unsigned short*>(p)) << 16);
  }
  __device__ static float2 two(const at::BFloat16* p) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(p);
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  }
  __device__ static void vec(const at::BFloat16* p, float* f) {
    const uint4 x = *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
};

template <typename T>
__device__ __forceinline__ T from_float(float x) {
  return static_cast<T>(x);
}

struct AttnParams {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  void* out;
  float* part_o;   // [T, n_heads, splits, D] unnormalised partial outputs (splits > 1)
  float* part_ml;  // [T, n_heads, splits, 2] their running max (base 2) and sum
  const int32_t* page_table;
  const int32_t* cu_q_lens;
  const int32_t* kv_lens;
  int64_t q_stride;  // elements between tokens of q
  int64_t num_pages;
  int B, n_heads, n_kv_heads, group, head_dim, page_size, max_pages, splits;
  int skip_q;        // > 0: the tokens of sequences of at least skip_q queries are another kernel's
  float scale_log2;  // scale * log2(e)
};

// Key groups of the P.V pass: the threads that read one V column set split the tile's keys.
__host__ __device__ inline int attn_key_groups(int D, bool vec) {
  const int ncol = vec ? D / 2 : D;
  return ncol >= kThreads ? 1 : kThreads / ncol;
}

// Shared memory, in floats: q [G][D], o [G][D], s [G][kTile], red [KG][kHeadBlock][D],
// m, l, alpha [G], then kTile int64 K/V row offsets (8-byte aligned).
struct SmemLayout {
  int64_t o, s, red, m, l, a, off, bytes;
};

__host__ __device__ inline SmemLayout attn_smem(int G, int D, int KG) {
  SmemLayout L;
  L.o = int64_t(G) * D;
  L.s = L.o + int64_t(G) * D;
  L.red = L.s + int64_t(G) * kTile;
  L.m = L.red + int64_t(KG) * kHeadBlock * D;
  L.l = L.m + G;
  L.a = L.l + G;
  L.off = (L.a + G + 1) & ~int64_t(1);
  L.bytes = L.off * int64_t(sizeof(float)) + int64_t(kTile) * int64_t(sizeof(int64_t));
  return L;
}

// One block per (query token, kv head, split). The block walks its split's keys in tiles of
// kTile: every thread finds one key's row from the page table, then scores that key against
// all G query heads of the group (16-byte loads on the vector path); each warp turns its heads'
// scores into probabilities (online softmax, base 2); then the threads read V column pairs,
// the tile's keys shared among KG groups, and the block folds the group sums into the running
// output. With one split the block writes the normalised output; with several it writes an
// unnormalised partial and its (max, sum), which paged_attention_combine merges.
template <typename scalar_t, bool kVecPath>
__global__ void __launch_bounds__(kThreads)
    paged_attention_kernel(const AttnParams p) {
  using E = Elem<scalar_t>;
  extern __shared__ float smem[];
  const int G = p.group, D = p.head_dim;
  constexpr int CW = kVecPath ? 2 : 1;
  const int ncol = D / CW;
  const int KG = attn_key_groups(D, kVecPath);
  const SmemLayout L = attn_smem(G, D, KG);
  float* q_s = smem;
  float* o_s = smem + L.o;
  float* s_s = smem + L.s;
  float* red = smem + L.red;
  float* m_s = smem + L.m;
  float* l_s = smem + L.l;
  float* a_s = smem + L.a;
  int64_t* off_s = reinterpret_cast<int64_t*>(smem + L.off);

  const int64_t t = blockIdx.x;  // query token
  const int g = blockIdx.y;      // kv head
  const int split = blockIdx.z, S = p.splits;
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
  if (p.skip_q > 0 && q_len >= p.skip_q) {  // attention_tiled.cu's prefill kernel takes it
    if (S > 1) {                            // a sum of -1 tells the combine kernel to leave the row
      for (int h = tid; h < p.group; h += kThreads)
        p.part_ml[((t * p.n_heads + int64_t(g) * p.group + h) * S + split) * 2 + 1] = -1.0f;
    }
    return;
  }
  const int64_t kv_len = p.kv_lens[b];
  // Query i of the sequence sees keys 0 .. kv_len - q_len + i.
  int64_t n_keys = kv_len - q_len + (t - q_start) + 1;
  const int64_t max_keys = int64_t(p.max_pages) * p.page_size;
  n_keys = n_keys < 0 ? 0 : (n_keys > max_keys ? max_keys : n_keys);

  // This split's keys: the sequence's actual length shared evenly, at least kMinChunk each.
  int64_t k_begin = 0, k_end = n_keys;
  if (S > 1) {
    int64_t chunk = (n_keys + S - 1) / S;
    chunk = (chunk + kMinChunk - 1) / kMinChunk * kMinChunk;
    k_begin = int64_t(split) * chunk;
    k_end = k_begin + chunk < n_keys ? k_begin + chunk : n_keys;
  }
  const int64_t head0 = t * p.n_heads + int64_t(g) * G;  // first query head of the group
  if (k_begin >= k_end) {  // no keys: an empty output, or an empty partial
    if (S == 1) {
      scalar_t* out = static_cast<scalar_t*>(p.out) + head0 * D;
      for (int idx = tid; idx < G * D; idx += kThreads) out[idx] = from_float<scalar_t>(0.0f);
    } else {
      for (int h = tid; h < G; h += kThreads) {
        float* ml = p.part_ml + ((head0 + h) * S + split) * 2;
        ml[0] = -INFINITY;
        ml[1] = 0.0f;
      }
    }
    return;
  }

  const scalar_t* q = static_cast<const scalar_t*>(p.q) + t * p.q_stride + int64_t(g) * G * D;
  for (int idx = tid; idx < G * D; idx += kThreads) {
    q_s[idx] = static_cast<float>(q[idx]) * p.scale_log2;
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
  // P.V thread roles: column set c (CW elements) and key group kg.
  const int kg = ncol >= kThreads ? 0 : tid / ncol;
  const int c_first = ncol >= kThreads ? tid : tid % ncol;
  const int c_step = ncol >= kThreads ? kThreads : ncol;

  for (int64_t j0 = k_begin; j0 < k_end; j0 += kTile) {
    const int nk = int(k_end - j0 < kTile ? k_end - j0 : kTile);
    __syncthreads();  // the previous tile is done with off_s / s_s / red
    if (tid < nk) {   // kThreads == kTile: one key per thread
      const int64_t j = j0 + tid;
      const int32_t page = pt[j / p.page_size];
      int64_t off = -1;
      if (page >= 0 && page < p.num_pages) {
        off = (int64_t(page) * p.page_size + j % p.page_size) * slot_stride + int64_t(g) * D;
      } else {
        CUDA_KERNEL_ASSERT(false && "symphony::paged_attention: page id out of range");
      }
      off_s[tid] = off;
      // Scores against every query head of the group (an unusable row scores 0, adds no V).
      for (int h0 = 0; h0 < G; h0 += kHeadBlock) {
        const int nh = G - h0 < kHeadBlock ? G - h0 : kHeadBlock;
        float acc[kHeadBlock];
#pragma unroll
        for (int hh = 0; hh < kHeadBlock; ++hh) acc[hh] = 0.0f;
        if (off >= 0) {
          const scalar_t* kr = kc + off;
          if constexpr (kVecPath) {
            for (int d0 = 0; d0 < D; d0 += E::kVec) {
              float kf[E::kVec];
              E::vec(kr + d0, kf);
#pragma unroll
              for (int hh = 0; hh < kHeadBlock; ++hh) {
                if (hh < nh) {
                  const float* qh = q_s + (h0 + hh) * D + d0;
#pragma unroll
                  for (int e = 0; e < E::kVec; ++e) acc[hh] = fmaf(qh[e], kf[e], acc[hh]);
                }
              }
            }
          } else {
            for (int d = 0; d < D; ++d) {
              const float kf = E::one(kr + d);
#pragma unroll
              for (int hh = 0; hh < kHeadBlock; ++hh)
                if (hh < nh) acc[hh] = fmaf(q_s[(h0 + hh) * D + d], kf, acc[hh]);
            }
          }
        }
#pragma unroll
        for (int hh = 0; hh < kHeadBlock; ++hh)
          if (hh < nh) s_s[(h0 + hh) * kTile + tid] = acc[hh];
      }
    }
    __syncthreads();

    // Online softmax: one warp per query head.
    for (int h = warp; h < G; h += kWarps) {
      float* sh = s_s + h * kTile;
      float mx = -INFINITY;
      for (int jj = lane; jj < nk; jj += 32) mx = fmaxf(mx, sh[jj]);
      mx = warp_max(mx);
      const float m_old = m_s[h];
      const float m_new = fmaxf(m_old, mx);  // finite: the tile holds at least one key
      float sum = 0.0f;
      for (int jj = lane; jj < nk; jj += 32) {
        const float pj = exp2f(sh[jj] - m_new);
        sh[jj] = pj;
        sum += pj;
      }
      sum = warp_sum(sum);
      if (lane == 0) {
        const float alpha = exp2f(m_old - m_new);  // 0 on the first tile (m_old = -inf)
        a_s[h] = alpha;
        m_s[h] = m_new;
        l_s[h] = l_s[h] * alpha + sum;
      }
    }
    __syncthreads();

    // P.V, kHeadBlock query heads at a time.
    for (int h0 = 0; h0 < G; h0 += kHeadBlock) {
      const int nh = G - h0 < kHeadBlock ? G - h0 : kHeadBlock;
      if (kg < KG) {
        for (int c = c_first; c < ncol; c += c_step) {
          float acc0[kHeadBlock], acc1[kHeadBlock];
#pragma unroll
          for (int hh = 0; hh < kHeadBlock; ++hh) acc0[hh] = acc1[hh] = 0.0f;
#pragma unroll 4
          for (int jj = kg; jj < nk; jj += KG) {
            const int64_t off = off_s[jj];
            if (off < 0) continue;
            float v0, v1 = 0.0f;
            if constexpr (kVecPath) {
              const float2 v = E::two(vc + off + 2 * c);
              v0 = v.x;
              v1 = v.y;
            } else {
              v0 = E::one(vc + off + c);
            }
#pragma unroll
            for (int hh = 0; hh < kHeadBlock; ++hh) {
              if (hh < nh) {
                const float pj = s_s[(h0 + hh) * kTile + jj];
                acc0[hh] = fmaf(pj, v0, acc0[hh]);
                if constexpr (kVecPath) acc1[hh] = fmaf(pj, v1, acc1[hh]);
              }
            }
          }
#pragma unroll
          for (int hh = 0; hh < kHeadBlock; ++hh) {
            if (hh < nh) {
              float* r = red + (int64_t(kg) * kHeadBlock + hh) * D + c * CW;
              r[0] = acc0[hh];
              if constexpr (kVecPath) r[1] = acc1[hh];
            }
          }
        }
      }
      __syncthreads();
      for (int idx = tid; idx < nh * D; idx += kThreads) {
        const int hh = idx / D, d = idx - hh * D, h = h0 + hh;
        float sum = 0.0f;
        for (int k = 0; k < KG; ++k) sum += red[(int64_t(k) * kHeadBlock + hh) * D + d];
        o_s[h * D + d] = fmaf(o_s[h * D + d], a_s[h], sum);
      }
      __syncthreads();
    }
  }

  if (S == 1) {
    scalar_t* out = static_cast<scalar_t*>(p.out) + head0 * D;
    for (int idx = tid; idx < G * D; idx += kThreads) {
      const float l = l_s[idx / D];
      out[idx] = from_float<scalar_t>(l > 0.0f ? o_s[idx] / l : 0.0f);
    }
  } else {
    for (int idx = tid; idx < G * D; idx += kThreads) {
      const int h = idx / D, d = idx - h * D;
      p.part_o[((head0 + h) * S + split) * D + d] = o_s[idx];
    }
    for (int h = tid; h < G; h += kThreads) {
      float* ml = p.part_ml + ((head0 + h) * S + split) * 2;
      ml[0] = m_s[h];
      ml[1] = l_s[h];
    }
  }
}

// Merges the splits of one (query token, head): out = sum_s o_s 2^(m_s - M) / sum_s l_s 2^(m_s - M).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    paged_attention_combine(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                            scalar_t* __restrict__ out, int S, int D) {
  __shared__ float w_s[kMaxSplits];
  __shared__ float inv_l;
  const int64_t th = blockIdx.x;  // token * n_heads + head
  const float* ml = part_ml + th * S * 2;
  if (ml[1] < 0.0f) return;       // another kernel's row (skip_q)
  if (threadIdx.x == 0) {
    float M = -INFINITY;
    for (int s = 0; s < S; ++s)
      if (ml[2 * s + 1] > 0.0f) M = fmaxf(M, ml[2 * s]);
    float L = 0.0f;
    for (int s = 0; s < S; ++s) {
      const float w = ml[2 * s + 1] > 0.0f ? exp2f(ml[2 * s] - M) : 0.0f;
      w_s[s] = w;
      L = fmaf(ml[2 * s + 1], w, L);
    }
    inv_l = L > 0.0f ? 1.0f / L : 0.0f;
  }
  __syncthreads();
  const float* po = part_o + th * S * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.0f;
    for (int s = 0; s < S; ++s)
      if (w_s[s] != 0.0f) acc = fmaf(po[int64_t(s) * D + d], w_s[s], acc);
    out[th * D + d] = from_float<scalar_t>(acc * inv_l);
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

}  // namespace

int device_sm_count(int device) {
  static int counts[64] = {0};
  if (device < 0 || device >= 64) return 132;
  if (counts[device] == 0) {
    int n = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    counts[device] = n > 0 ? n : 1;
  }
  return counts[device];
}

namespace {

}  // namespace

int key_splits(const AttnDims& d, int sms, int min_chunk) {
  const int64_t blocks = d.T * d.n_kv_heads;
  const int64_t want = int64_t(4) * sms;
  if (blocks >= want) return 1;
  int64_t s = (want + blocks - 1) / blocks;
  const int64_t by_keys = (d.max_pages * d.page_size + min_chunk - 1) / min_chunk;
  s = s < kMaxSplits ? s : kMaxSplits;
  s = s < by_keys ? s : by_keys;
  return s > 1 ? int(s) : 1;
}

void paged_attention_general(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& page_table,
                             const at::Tensor& cu_q_lens, const at::Tensor& kv_lens, double scale,
                             const AttnDims& d, at::Tensor& out, int skip_q) {
  if (d.T == 0) return;
  AttnParams p;
  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.out = out.data_ptr();
  p.part_o = nullptr;
  p.part_ml = nullptr;
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
  p.skip_q = skip_q;
  p.scale_log2 = float(scale) * kLog2e;
  p.splits = key_splits(d, device_sm_count(q.device().index()), kMinChunk);
  at::Tensor part_o, part_ml;
  if (p.splits > 1) {
    const auto f32 = q.options().dtype(at::kFloat);
    part_o = at::empty({d.T, d.n_heads, p.splits, d.head_dim}, f32);
    part_ml = at::empty({d.T, d.n_heads, p.splits, 2}, f32);
    p.part_o = part_o.data_ptr<float>();
    p.part_ml = part_ml.data_ptr<float>();
  }

  const dim3 grid(unsigned(d.T), unsigned(d.n_kv_heads), unsigned(p.splits));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float_types(q.scalar_type(), "symphony::paged_attention", [&](auto tag) {
    using scalar_t = decltype(tag);
    // 16-byte loads of K when every row starts on a 16-byte boundary.
    const bool vec = d.head_dim % Elem<scalar_t>::kVec == 0 &&
                     reinterpret_cast<uintptr_t>(p.k_cache) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(p.v_cache) % 16 == 0;
    const int KG = attn_key_groups(int(d.head_dim), vec);
    const int64_t smem = attn_smem(int(d.group), int(d.head_dim), KG).bytes;
    if (smem > 48 * 1024) {
      int optin = 0;
      C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                            q.device().index()));
      SYM_CHECK(smem <= int64_t(optin), "symphony::paged_attention: head_dim ", d.head_dim,
                  " with ", d.group, " query heads per kv head needs ", smem,
                  " bytes of shared memory; the device allows ", optin);
    }
    auto kernel = vec ? paged_attention_kernel<scalar_t, true> : paged_attention_kernel<scalar_t, false>;
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          int(smem)));
    }
    kernel<<<grid, kThreads, size_t(smem), stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (p.splits > 1) {
      paged_attention_combine<scalar_t><<<unsigned(d.T * d.n_heads), kThreads, 0, stream>>>(
          p.part_o, p.part_ml, static_cast<scalar_t*>(p.out), p.splits, int(d.head_dim));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
}

void check_attention_size(const AttnDims& d, const char* op) {
  SYM_CHECK(d.T < (int64_t(1) << 31) && d.n_kv_heads <= 65535 && d.B < (int64_t(1) << 31) &&
                d.max_pages < (int64_t(1) << 31) && d.page_size < (int64_t(1) << 31),
            op, ": problem too large for the CUDA kernel");
}

namespace {

at::Tensor paged_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& page_table,
                                const at::Tensor& cu_q_lens, const at::Tensor& kv_lens,
                                double scale) {
  const AttnDims d = check_paged_attention_args(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens);
  SYM_CHECK(q.is_cuda(), "symphony::paged_attention: expected CUDA tensors");
  check_attention_size(d, "symphony::paged_attention");
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty({d.T, d.n_heads, d.head_dim}, q.options());
  paged_attention_general(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, scale, d, out, 0);
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
