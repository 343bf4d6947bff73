// paged_attention_tiled: paged_attention's contract (csrc/ops.cpp) with kernels that read each
// key once per tile of queries (prompts) and spread short contexts over the device (decode),
// for float16 / bfloat16 with head_dim 64 or 128 and at most 8 query heads per KV head.
// `kernels` picks them: bit 1 the prefill kernel, bit 2 the decode kernel; a part not picked,
// or a shape they do not take, runs paged_attention's kernels (paged_attention.cu).
//
//   prefill (sequences of >= kMinQ query tokens), FlashAttention-2 over pages:
//     one block of 4 warps per (tile of queries, KV head). A tile is 64 / group query tokens of
//     one sequence times the group's query heads: 64 rows (token-major: row r is token r / G,
//     head r % G), 16 a warp, so a GQA group shares every K/V load. Keys go in tiles of
//     4096 / head_dim (64 or 32) through shared memory, the next tile's pages loaded into
//     registers while the tensor cores work on this one (mma.sync m16n8k16, float32
//     accumulation): S = Q K^T, masked causally per row, an online softmax in base 2 in
//     registers (a row's values live in the four lanes of a quad), P rounded to 16 bits,
//     O += P V. Tiles of a sequence run longest first. A prologue kernel numbers the tiles
//     (tile_start[b]: the first tile of sequence b), so the grid is sized from T alone and a
//     block finds its sequence by binary search.
//   decode (every other sequence), split keys:
//     one block per (query token, KV head, split); the split count follows from the shapes
//     alone (a CUDA graph replays one grid whatever the lengths), each split takes its share of
//     the actual keys in steps of whole block-steps. A key's row is read by head_dim / 8 lanes,
//     16 bytes each (K and V), U keys a lane group at once, scored against every query head of
//     the group; each lane group keeps its own online softmax, merged across the warp by
//     shuffles and across the warps in shared memory. Several splits write partials that a
//     combine kernel (a warp per row) merges.
//
// Table values are not validated on the host (that would need a device sync): an out-of-range
// page id reads as an empty key (and raises a device-side assertion), a token outside q is never
// read or written, so the kernels never touch memory out of bounds.
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

#include "../check.h"
#include "../checks.h"
#include "attention.h"
#include "mma.cuh"
#include "warp.cuh"

namespace symphony {
namespace {

using mma::Bits;
using mma::pack2;

constexpr int kThreads = 128;  // 4 warps, both kernels
constexpr int kRows = 64;      // (query token, head) rows of a prefill tile
constexpr int kMinQ = 32;      // sequences of at least this many query tokens take the prefill kernel
constexpr float kLog2e = 1.4426950408889634f;

struct TiledParams {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  void* out;            // [T, n_heads, D]
  float* part_o;        // [T, n_heads, splits, D] unnormalised partial outputs (splits > 1)
  float* part_ml;       // [T, n_heads, splits, 2] their max (base 2) and sum
  const int32_t* page_table;
  const int32_t* cu_q_lens;
  const int32_t* kv_lens;
  const int32_t* tile_start;  // [B + 1]: sequence b's prefill tiles are tile_start[b] ..
  int64_t q_stride;     // elements between tokens of q
  int64_t num_pages;
  int64_t T;
  int B, n_heads, n_kv_heads, group, page_size, max_pages, splits;
  int tile_tokens;      // query tokens of a prefill tile: kRows / group
  int skip_long;        // decode: sequences of >= kMinQ queries are the prefill kernel's
  float scale_log2;     // scale * log2(e)
};

// 2^(m - ref) with an empty state (m = -inf) weighing 0; ref is -inf only when m is.
__device__ __forceinline__ float weight_of(float m, float ref) {
  return m == -INFINITY ? 0.0f : exp2f(m - ref);
}

// The largest b in [0, n) with starts[b] <= x (starts non-decreasing, starts[0] <= x).
__device__ __forceinline__ int find_last_le(const int32_t* starts, int n, int64_t x) {
  int lo = 0, hi = n;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (starts[mid] <= x) lo = mid;
    else hi = mid;
  }
  return lo;
}

// The K/V row offset (elements) of key j of a sequence, or -1 for a page id out of range.
__device__ __forceinline__ int64_t key_offset(const TiledParams& p, const int32_t* pt, int64_t j,
                                              int64_t slot_stride, int64_t head_off) {
  const int32_t page = pt[j / p.page_size];
  if (page < 0 || page >= p.num_pages) {
    CUDA_KERNEL_ASSERT(false && "symphony::paged_attention_tiled: page id out of range");
    return -1;
  }
  return (int64_t(page) * p.page_size + j % p.page_size) * slot_stride + head_off;
}

// ------------------------------------------------------------------ prefill
// tile_start[b] = the prefill tiles of the sequences before b; tile_start[B] = all of them. One
// block of 256 threads scans the sequences 256 at a time.
__global__ void __launch_bounds__(256)
    prefill_tiles_kernel(const int32_t* __restrict__ cu_q_lens, int B, int tile_tokens,
                         int32_t* __restrict__ tile_start) {
  __shared__ int32_t warp_total[8];
  __shared__ int32_t carry;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < B; base += 256) {
    const int b = base + tid;
    int n = 0;
    if (b < B) {
      const int q_len = cu_q_lens[b + 1] - cu_q_lens[b];
      n = q_len >= kMinQ ? (q_len + tile_tokens - 1) / tile_tokens : 0;
    }
    int x = n;  // inclusive scan within the warp
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, x, off);
      if (lane >= off) x += y;
    }
    if (lane == 31) warp_total[warp] = x;
    __syncthreads();
    if (warp == 0) {  // inclusive scan of the 8 warp totals
      int w = lane < 8 ? warp_total[lane] : 0;
#pragma unroll
      for (int off = 1; off < 8; off <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, w, off);
        if (lane >= off) w += y;
      }
      if (lane < 8) warp_total[lane] = w;
    }
    __syncthreads();
    const int excl = carry + (warp > 0 ? warp_total[warp - 1] : 0) + x - n;
    if (b < B) tile_start[b] = excl;
    __syncthreads();  // every thread has read carry and warp_total
    if (tid == 255) carry = excl + n;
    __syncthreads();
  }
  if (tid == 0) tile_start[B] = carry;
}

// One block per (prefill tile, KV head); see the file's comment. T is at::Half or at::BFloat16.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) prefill_tiled_kernel(const TiledParams p) {
  constexpr int BN = 4096 / D;                 // keys a tile
  constexpr int LD = D + 8;                    // shared row stride (16-bit values): no bank conflicts
  constexpr int CH = D / 8;                    // 16-byte chunks a key row
  constexpr int LOADS = BN * CH / kThreads;    // chunks of K (and of V) a thread loads a tile
  constexpr int NT = BN / 8;                   // 8-key column tiles of S
  constexpr int KS = D / 16;                   // k-steps of Q K^T
  constexpr int DT = D / 8;                    // 8-column tiles of O
  static_assert(LOADS * kThreads == BN * CH, "a tile's chunks split evenly among the threads");
  __shared__ __align__(16) uint16_t k_s[BN * LD];   // [key][d], 16-bit bits
  __shared__ __align__(16) uint16_t v_s[BN * LD];

  const int64_t tile = blockIdx.x;
  const int g = blockIdx.y;                    // KV head
  const int total = p.tile_start[p.B];
  if (tile >= total) return;
  const int b = find_last_le(p.tile_start, p.B, tile);
  const int64_t q_start = p.cu_q_lens[b];
  const int64_t q_len = int64_t(p.cu_q_lens[b + 1]) - q_start;
  const int n_tiles = p.tile_start[b + 1] - p.tile_start[b];
  const int64_t lt = n_tiles - 1 - (tile - p.tile_start[b]);   // the longest tiles first
  const int G = p.group;
  const int64_t i0 = lt * p.tile_tokens;                       // the tile's first query token
  const int64_t i1 = i0 + p.tile_tokens < q_len ? i0 + p.tile_tokens : q_len;
  const int64_t kv_len = p.kv_lens[b];
  const int64_t max_keys = int64_t(p.max_pages) * p.page_size;
  // Query i of the sequence sees keys 0 .. base + i; the tile's last query sees the most.
  const int64_t base = kv_len - q_len;
  int64_t n_keys = base + i1;
  n_keys = n_keys < 0 ? 0 : (n_keys > max_keys ? max_keys : n_keys);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int grp = lane >> 2, tq = lane & 3;
  // This thread's two rows of the tile (A-fragment rows grp and grp + 8 of its warp).
  const int rA = warp * 16 + grp, rB = rA + 8;
  const int n_rows = int(i1 - i0) * G;
  const int64_t tokA = q_start + i0 + rA / G, tokB = q_start + i0 + rB / G;
  const bool okA = rA < n_rows && tokA >= 0 && tokA < p.T;
  const bool okB = rB < n_rows && tokB >= 0 && tokB < p.T;
  const int hA = g * G + rA % G, hB = g * G + rB % G;
  // The last key each row sees (-1: none).
  const int64_t limA = okA ? base + i0 + rA / G : -1;
  const int64_t limB = okB ? base + i0 + rB / G : -1;

  // Q as A fragments, one per 16 columns of head_dim: rows rA / rB, columns 2 tq (+ 8).
  const uint16_t* qs = static_cast<const uint16_t*>(p.q);
  const uint16_t* qA = qs + (okA ? tokA * p.q_stride + int64_t(hA) * D : 0);
  const uint16_t* qB = qs + (okB ? tokB * p.q_stride + int64_t(hB) * D : 0);
  uint32_t qf[KS][4];
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    const int c = kk * 16 + 2 * tq;
    qf[kk][0] = okA ? *reinterpret_cast<const uint32_t*>(qA + c) : 0u;
    qf[kk][1] = okB ? *reinterpret_cast<const uint32_t*>(qB + c) : 0u;
    qf[kk][2] = okA ? *reinterpret_cast<const uint32_t*>(qA + c + 8) : 0u;
    qf[kk][3] = okB ? *reinterpret_cast<const uint32_t*>(qB + c + 8) : 0u;
  }

  float o[DT][4];
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
  float mA = -INFINITY, mB = -INFINITY, lA = 0.0f, lB = 0.0f;   // lA, lB: this lane's share

  const uint16_t* kc = static_cast<const uint16_t*>(p.k_cache);
  const uint16_t* vc = static_cast<const uint16_t*>(p.v_cache);
  const int32_t* pt = p.page_table + int64_t(b) * p.max_pages;
  const int64_t slot_stride = int64_t(p.n_kv_heads) * D;
  uint4 kr[LOADS], vr[LOADS];                  // the next tile, in flight

  // Loads tile j0's chunks into kr / vr (keys past n_keys and bad pages: zeros).
  auto load = [&](int64_t j0) {
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
      const int c = tid + i * kThreads, key = c / CH, ch = c % CH;
      const int64_t j = j0 + key;
      uint4 kz = make_uint4(0u, 0u, 0u, 0u), vz = kz;
      if (j < n_keys) {
        const int64_t off = key_offset(p, pt, j, slot_stride, int64_t(g) * D + ch * 8);
        if (off >= 0) {
          kz = *reinterpret_cast<const uint4*>(kc + off);
          vz = *reinterpret_cast<const uint4*>(vc + off);
        }
      }
      kr[i] = kz;
      vr[i] = vz;
    }
  };

  if (n_keys > 0) load(0);
  for (int64_t j0 = 0; j0 < n_keys; j0 += BN) {
    __syncthreads();                           // the last tile's readers are done with k_s / v_s
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
      const int c = tid + i * kThreads, key = c / CH, ch = c % CH;
      *reinterpret_cast<uint4*>(k_s + key * LD + ch * 8) = kr[i];
      *reinterpret_cast<uint4*>(v_s + key * LD + ch * 8) = vr[i];
    }
    __syncthreads();
    if (j0 + BN < n_keys) load(j0 + BN);       // in flight during the math below

    // S = Q K^T: column tile nt holds keys j0 + 8 nt .. + 7 (B fragment: K rows as columns).
    float s[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
      const uint16_t* kp = k_s + (nt * 8 + grp) * LD + 2 * tq;
#pragma unroll
      for (int kk = 0; kk < KS; ++kk) {
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(kp + kk * 16);
        const uint32_t b1 = *reinterpret_cast<const uint32_t*>(kp + kk * 16 + 8);
        mma::mma_16816<T>(s[nt], qf[kk], b0, b1);
      }
    }
    // Scale to base 2, mask causally, and each row's maximum (over the quad's four lanes).
    float mxA = -INFINITY, mxB = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t key = j0 + nt * 8 + 2 * tq + (e & 1);
        const int64_t lim = e < 2 ? limA : limB;
        const float v = key <= lim && key < n_keys ? s[nt][e] * p.scale_log2 : -INFINITY;
        s[nt][e] = v;
        if (e < 2) mxA = fmaxf(mxA, v);
        else mxB = fmaxf(mxB, v);
      }
    }
    mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 1));
    mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 2));
    mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 1));
    mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 2));
    const float nA = fmaxf(mA, mxA), nB = fmaxf(mB, mxB);
    const float uA = nA == -INFINITY ? 0.0f : nA, uB = nB == -INFINITY ? 0.0f : nB;
    const float alA = weight_of(mA, uA), alB = weight_of(mB, uB);
    mA = nA;
    mB = nB;
    // P = 2^(S - m), as A fragments of P V: k-step ks covers column tiles 2 ks and 2 ks + 1.
    uint32_t pf[NT / 2][4];
    float sumA = 0.0f, sumB = 0.0f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const float p0 = exp2f(s[nt][0] - uA), p1 = exp2f(s[nt][1] - uA);
      const float p2 = exp2f(s[nt][2] - uB), p3 = exp2f(s[nt][3] - uB);
      sumA += p0 + p1;
      sumB += p2 + p3;
      pf[nt / 2][(nt & 1) * 2] = pack2<T>(p0, p1);       // row rA: keys 2 tq (+ 8)
      pf[nt / 2][(nt & 1) * 2 + 1] = pack2<T>(p2, p3);   // row rB
    }
    lA = lA * alA + sumA;
    lB = lB * alB + sumB;
#pragma unroll
    for (int dt = 0; dt < DT; ++dt) {
      o[dt][0] *= alA;
      o[dt][1] *= alA;
      o[dt][2] *= alB;
      o[dt][3] *= alB;
    }
    // O += P V: B fragment rows are keys 2 tq, 2 tq + 1 (+ 8) of the k-step, column grp.
#pragma unroll
    for (int ks = 0; ks < NT / 2; ++ks) {
      const uint16_t* vp = v_s + (ks * 16 + 2 * tq) * LD + grp;
#pragma unroll
      for (int dt = 0; dt < DT; ++dt) {
        const uint16_t* v = vp + dt * 8;
        const uint32_t b0 = uint32_t(v[0]) | (uint32_t(v[LD]) << 16);
        const uint32_t b1 = uint32_t(v[8 * LD]) | (uint32_t(v[9 * LD]) << 16);
        mma::mma_16816<T>(o[dt], pf[ks], b0, b1);
      }
    }
  }

  // Each row's sum over the quad, then the normalised output (two values a store).
  lA += __shfl_xor_sync(0xffffffffu, lA, 1);
  lA += __shfl_xor_sync(0xffffffffu, lA, 2);
  lB += __shfl_xor_sync(0xffffffffu, lB, 1);
  lB += __shfl_xor_sync(0xffffffffu, lB, 2);
  const float invA = lA > 0.0f ? 1.0f / lA : 0.0f, invB = lB > 0.0f ? 1.0f / lB : 0.0f;
  uint16_t* out = static_cast<uint16_t*>(p.out);
  const int64_t row_stride = int64_t(p.n_heads) * D;
#pragma unroll
  for (int dt = 0; dt < DT; ++dt) {
    const int c = dt * 8 + 2 * tq;
    if (okA)
      *reinterpret_cast<uint32_t*>(out + tokA * row_stride + int64_t(hA) * D + c) =
          pack2<T>(o[dt][0] * invA, o[dt][1] * invA);
    if (okB)
      *reinterpret_cast<uint32_t*>(out + tokB * row_stride + int64_t(hB) * D + c) =
          pack2<T>(o[dt][2] * invB, o[dt][3] * invB);
  }
}

// ------------------------------------------------------------------ decode
// Keys a block takes per step: 4 warps x (32 / (D / 8)) lane groups x U keys each.
template <int D, int U>
constexpr int decode_step_keys() {
  return 4 * (32 / (D / 8)) * U;
}

// One block per (query token, KV head, split); see the file's comment. MG: the largest group
// the instance takes (registers are sized for it); U: keys a lane group loads at once.
template <typename T, int D, int MG, int U>
__global__ void __launch_bounds__(kThreads) decode_split_kernel(const TiledParams p) {
  constexpr int L = D / 8;                     // lanes a key row (16 bytes each)
  constexpr int KPW = 32 / L;                  // lane groups a warp
  constexpr int STEP = decode_step_keys<D, U>();
  __shared__ float red_o[4][MG][D];
  __shared__ float red_m[4][MG], red_l[4][MG];

  const int64_t t = blockIdx.x;
  const int g = blockIdx.y;
  const int split = blockIdx.z, S = p.splits;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int sub = lane % L, slot = lane / L;   // 16-byte chunk of a row; lane group in the warp
  const int G = p.group;

  const int b = find_last_le(p.cu_q_lens, p.B, t);
  const int64_t q_start = p.cu_q_lens[b];
  const int64_t q_len = int64_t(p.cu_q_lens[b + 1]) - q_start;
  if (p.skip_long && q_len >= kMinQ) {         // the prefill kernel's
    if (S > 1) {                               // a sum of -1 tells the combine kernel to leave it
      for (int h = tid; h < G; h += kThreads)
        p.part_ml[((t * p.n_heads + int64_t(g) * G + h) * S + split) * 2 + 1] = -1.0f;
    }
    return;
  }
  const int64_t kv_len = p.kv_lens[b];
  int64_t n_keys = kv_len - q_len + (t - q_start) + 1;
  const int64_t max_keys = int64_t(p.max_pages) * p.page_size;
  n_keys = n_keys < 0 ? 0 : (n_keys > max_keys ? max_keys : n_keys);
  int64_t k_begin = 0, k_end = n_keys;
  if (S > 1) {                                 // this split's share, whole block-steps
    int64_t chunk = (n_keys + S - 1) / S;
    chunk = (chunk + STEP - 1) / STEP * STEP;
    k_begin = int64_t(split) * chunk;
    k_end = k_begin + chunk < n_keys ? k_begin + chunk : n_keys;
  }
  const int64_t head0 = t * p.n_heads + int64_t(g) * G;   // (token, first head of the group)
  if (k_begin >= k_end) {                      // no keys: a zero output, or an empty partial
    if (S == 1) {
      uint16_t* out = static_cast<uint16_t*>(p.out) + head0 * D;
      for (int i = tid; i < G * D; i += kThreads) out[i] = 0;
    } else {
      for (int h = tid; h < G; h += kThreads) {
        float* ml = p.part_ml + ((head0 + h) * S + split) * 2;
        ml[0] = -INFINITY;
        ml[1] = 0.0f;
      }
    }
    return;
  }

  // q of each head of the group: this lane's 8 columns, scaled to base 2.
  float qf[MG][8];
  const T* qrow = static_cast<const T*>(p.q) + t * p.q_stride + int64_t(g) * G * D + sub * 8;
#pragma unroll
  for (int h = 0; h < MG; ++h) {
    if (h < G) {
      mma::unpack8<T>(*reinterpret_cast<const uint4*>(qrow + h * D), qf[h]);
#pragma unroll
      for (int e = 0; e < 8; ++e) qf[h][e] *= p.scale_log2;
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) qf[h][e] = 0.0f;
    }
  }
  float acc[MG][8], m[MG], l[MG];
#pragma unroll
  for (int h = 0; h < MG; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[h][e] = 0.0f;
  }

  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  const int32_t* pt = p.page_table + int64_t(b) * p.max_pages;
  const int64_t slot_stride = int64_t(p.n_kv_heads) * D;
  const int64_t head_off = int64_t(g) * D + sub * 8;

  for (int64_t js = k_begin; js < k_end; js += STEP) {
    // This lane group's U consecutive keys of the step.
    const int64_t jb = js + int64_t(warp * KPW + slot) * U;
    uint4 kq[U], vq[U];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t j = jb + u;
      kq[u] = vq[u] = make_uint4(0u, 0u, 0u, 0u);
      ok[u] = false;
      if (j < k_end) {
        const int64_t off = key_offset(p, pt, j, slot_stride, head_off);
        if (off >= 0) {
          kq[u] = *reinterpret_cast<const uint4*>(kc + off);
          vq[u] = *reinterpret_cast<const uint4*>(vc + off);
          ok[u] = true;
        }
      }
    }
    // Scores: this lane's 8 columns, summed over the group's L lanes.
    float sc[U][MG];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[8];
      mma::unpack8<T>(kq[u], kf);
#pragma unroll
      for (int h = 0; h < MG; ++h) {
        float d = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) d = fmaf(qf[h][e], kf[e], d);
#pragma unroll
        for (int off = L / 2; off > 0; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
        sc[u][h] = ok[u] ? d : -INFINITY;
      }
    }
    // Online softmax over the U keys, per head.
#pragma unroll
    for (int h = 0; h < MG; ++h) {
      float mx = sc[0][h];
#pragma unroll
      for (int u = 1; u < U; ++u) mx = fmaxf(mx, sc[u][h]);
      const float mn = fmaxf(m[h], mx);
      const float use = mn == -INFINITY ? 0.0f : mn;
      const float al = weight_of(m[h], use);
      m[h] = mn;
      float sum = 0.0f;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        sc[u][h] = exp2f(sc[u][h] - use);       // -inf (no key) -> 0
        sum += sc[u][h];
      }
      l[h] = l[h] * al + sum;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[h][e] *= al;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float vf[8];
      mma::unpack8<T>(vq[u], vf);
#pragma unroll
      for (int h = 0; h < MG; ++h)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[h][e] = fmaf(sc[u][h], vf[e], acc[h][e]);
    }
  }

  // Merge the warp's lane groups (lanes sub, sub + L, ...), then the warps in shared memory.
#pragma unroll
  for (int off = L; off < 32; off <<= 1) {
#pragma unroll
    for (int h = 0; h < MG; ++h) {
      const float mo = __shfl_xor_sync(0xffffffffu, m[h], off);
      const float lo = __shfl_xor_sync(0xffffffffu, l[h], off);
      const float mn = fmaxf(m[h], mo);
      const float use = mn == -INFINITY ? 0.0f : mn;
      const float a = weight_of(m[h], use), ao = weight_of(mo, use);
      l[h] = l[h] * a + lo * ao;
      m[h] = mn;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float other = __shfl_xor_sync(0xffffffffu, acc[h][e], off);
        acc[h][e] = acc[h][e] * a + other * ao;
      }
    }
  }
  if (slot == 0) {
#pragma unroll
    for (int h = 0; h < MG; ++h) {
      if (h < G) {
#pragma unroll
        for (int e = 0; e < 8; ++e) red_o[warp][h][sub * 8 + e] = acc[h][e];
        if (sub == 0) {
          red_m[warp][h] = m[h];
          red_l[warp][h] = l[h];
        }
      }
    }
  }
  __syncthreads();
  for (int i = tid; i < G * D; i += kThreads) {
    const int h = i / D, d = i - h * D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < 4; ++w) M = fmaxf(M, red_m[w][h]);
    const float use = M == -INFINITY ? 0.0f : M;
    float sum = 0.0f, o = 0.0f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float a = weight_of(red_m[w][h], use);
      sum = fmaf(red_l[w][h], a, sum);
      o = fmaf(red_o[w][h][d], a, o);
    }
    if (S == 1) {
      static_cast<uint16_t*>(p.out)[(head0 + h) * D + d] =
          uint16_t(Bits<T>::from_float(sum > 0.0f ? o / sum : 0.0f));
    } else {
      p.part_o[((head0 + h) * S + split) * D + d] = o;
      if (d == 0) {
        float* ml = p.part_ml + ((head0 + h) * S + split) * 2;
        ml[0] = M;
        ml[1] = sum;
      }
    }
  }
}

// Merges the splits of each (query token, head) row: a warp per row, a lane per split for the
// weights 2^(m_s - M), then the lanes over the columns.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    combine_kernel(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                   uint16_t* __restrict__ out, int S, int D, int64_t rows) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * (kThreads / 32) + (threadIdx.x >> 5);
  if (row >= rows) return;
  const float* ml = part_ml + row * S * 2;
  if (ml[1] < 0.0f) return;                    // a prefill row (the decode kernel left it)
  float mv = -INFINITY, lv = 0.0f;
  if (lane < S) {
    lv = ml[2 * lane + 1];
    mv = lv > 0.0f ? ml[2 * lane] : -INFINITY;
    if (!(lv > 0.0f)) lv = 0.0f;
  }
  const float M = warp_max(mv);
  const float use = M == -INFINITY ? 0.0f : M;
  const float w = weight_of(mv, use);
  const float sum = warp_sum(lv * w);
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  const float* po = part_o + row * S * D;
  for (int d0 = 0; d0 < D; d0 += 32) {
    const int d = d0 + lane;
    float acc = 0.0f;
    for (int s = 0; s < S; ++s) {
      const float ws = __shfl_sync(0xffffffffu, w, s);
      if (ws != 0.0f && d < D) acc = fmaf(po[int64_t(s) * D + d], ws, acc);
    }
    if (d < D) out[row * D + d] = uint16_t(Bits<T>::from_float(acc * inv));
  }
}

// ------------------------------------------------------------------ host
// Whether these kernels take the call: 16-bit, head_dim 64 or 128, a group of at most 8, 16-byte
// aligned caches and q rows (q's token stride a multiple of 8 values).
bool tiled_fits(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const AttnDims& d) {
  const auto st = q.scalar_type();
  const auto aligned = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; };
  return (st == at::kHalf || st == at::kBFloat16) && (d.head_dim == 64 || d.head_dim == 128) &&
         d.group >= 1 && d.group <= 8 && aligned(q) && aligned(k_cache) && aligned(v_cache) &&
         (d.T <= 1 || q.stride(0) % 8 == 0);
}

template <typename T, int D>
void launch_prefill(TiledParams p, const at::Tensor& cu_q_lens, cudaStream_t stream) {
  const at::Tensor starts = at::empty({p.B + 1}, cu_q_lens.options());
  p.tile_start = starts.data_ptr<int32_t>();
  prefill_tiles_kernel<<<1, 256, 0, stream>>>(p.cu_q_lens, p.B, p.tile_tokens,
                                               const_cast<int32_t*>(p.tile_start));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // At most T / tile_tokens tiles plus one partial tile a prefill sequence (>= kMinQ tokens each).
  const int64_t grid = (p.T + p.tile_tokens - 1) / p.tile_tokens + p.T / kMinQ + 1;
  prefill_tiled_kernel<T, D><<<dim3(unsigned(grid), unsigned(p.n_kv_heads)), kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int D>
void launch_decode(TiledParams p, const at::Tensor& q, int sms, const AttnDims& d,
                   cudaStream_t stream) {
  constexpr int kStepSmall = decode_step_keys<D, 4>(), kStepLarge = decode_step_keys<D, 2>();
  const bool small = p.group <= 4;
  p.splits = key_splits(d, sms, small ? kStepSmall : kStepLarge);   // a block-step of keys at least
  at::Tensor part_o, part_ml;
  if (p.splits > 1) {
    const auto f32 = q.options().dtype(at::kFloat);
    part_o = at::empty({d.T, d.n_heads, p.splits, d.head_dim}, f32);
    part_ml = at::empty({d.T, d.n_heads, p.splits, 2}, f32);
    p.part_o = part_o.data_ptr<float>();
    p.part_ml = part_ml.data_ptr<float>();
  }
  const dim3 grid(unsigned(d.T), unsigned(d.n_kv_heads), unsigned(p.splits));
  if (small) decode_split_kernel<T, D, 4, 4><<<grid, kThreads, 0, stream>>>(p);
  else decode_split_kernel<T, D, 8, 2><<<grid, kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (p.splits > 1) {
    const int64_t rows = d.T * d.n_heads;
    const int64_t blocks = (rows + kThreads / 32 - 1) / (kThreads / 32);
    combine_kernel<T><<<unsigned(blocks), kThreads, 0, stream>>>(
        p.part_o, p.part_ml, static_cast<uint16_t*>(p.out), p.splits, int(d.head_dim), rows);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

at::Tensor paged_attention_tiled_cuda(const at::Tensor& q, const at::Tensor& k_cache,
                                      const at::Tensor& v_cache, const at::Tensor& page_table,
                                      const at::Tensor& cu_q_lens, const at::Tensor& kv_lens,
                                      double scale, int64_t kernels) {
  constexpr const char* op = "symphony::paged_attention_tiled";
  const AttnDims d = check_paged_attention_args(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens);
  SYM_CHECK(q.is_cuda(), op, ": expected CUDA tensors");
  SYM_CHECK(kernels >= 0 && kernels <= 3, op,
            ": kernels must be 0 to 3 (1: the query-tiled prefill kernel, 2: the split decode "
            "kernel, 3: both), got ", kernels);
  check_attention_size(d, op);
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty({d.T, d.n_heads, d.head_dim}, q.options());
  if (d.T == 0) return out;
  const int dev = q.device().index();
  const bool fits = tiled_fits(q, k_cache, v_cache, d);
  const bool prefill = (kernels & 1) && fits && d.T >= kMinQ && mma::device_has_mma(dev);
  const bool decode = (kernels & 2) && fits;
  const int skip = prefill ? kMinQ : 0;

  TiledParams p;
  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.out = out.data_ptr();
  p.part_o = nullptr;
  p.part_ml = nullptr;
  p.page_table = page_table.data_ptr<int32_t>();
  p.cu_q_lens = cu_q_lens.data_ptr<int32_t>();
  p.kv_lens = kv_lens.data_ptr<int32_t>();
  p.tile_start = nullptr;
  p.q_stride = q.stride(0);
  p.num_pages = d.num_pages;
  p.T = d.T;
  p.B = int(d.B);
  p.n_heads = int(d.n_heads);
  p.n_kv_heads = int(d.n_kv_heads);
  p.group = int(d.group);
  p.page_size = int(d.page_size);
  p.max_pages = int(d.max_pages);
  p.splits = 1;
  p.tile_tokens = kRows / int(d.group);
  p.skip_long = skip > 0;
  p.scale_log2 = float(scale) * kLog2e;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  auto run = [&](auto tag) {
    using T = decltype(tag);
    if (prefill) {
      if (d.head_dim == 64) launch_prefill<T, 64>(p, cu_q_lens, stream);
      else launch_prefill<T, 128>(p, cu_q_lens, stream);
    }
    if (decode) {
      const int sms = device_sm_count(dev);
      if (d.head_dim == 64) launch_decode<T, 64>(p, q, sms, d, stream);
      else launch_decode<T, 128>(p, q, sms, d, stream);
    }
  };
  if (prefill || decode) {
    if (q.scalar_type() == at::kHalf) run(at::Half{});
    else run(at::BFloat16{});
  }
  if (!decode) paged_attention_general(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, scale, d, out, skip);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(symphony, CUDA, m) {
  m.impl("paged_attention_tiled", &paged_attention_tiled_cuda);
}

}  // namespace symphony
