// dense_gemv_tc(x [M, K], w [N, K], float_out, splits) -> x @ w^T, [M, N]: the decode GEMV on
// tensor cores, for 1 to 8 rows of x (float16 / bfloat16; compute capability 8.0 and later).
//
// A warp owns 16 rows of w and multiplies them with every row of x at once: w is the A operand
// of mma.sync m16n8k16 (16 weight rows), x the B operand (its M rows are columns, the other
// 8 - M zero), so each weight byte is read once whatever M is, and the arithmetic is the tensor
// cores'. A lane reads 16 consecutive k of its two weight rows as two 16-byte loads each
// (streaming: every weight is read once a step); since a dot product does not care in which
// order k is summed, k-block kb (64 values) is fed to the four mma steps s in this order:
//
//   lane (grp, tq) holds k = 64 kb + 16 tq + 4 s + {0, 1} as A columns 2 tq, 2 tq + 1 and
//                       k = 64 kb + 16 tq + 4 s + {2, 3} as A columns 2 tq + 8, 2 tq + 9,
//
// and reads the same k of x row grp for its B rows, so A and B agree on every k and the four
// steps cover the 64 k exactly once (tests/unit/engine/cuda_emulation.py checks the mapping).
// Split-K: `splits` warps of a block share one 16-row group, each taking every splits-th
// k-block, and add their partial sums in shared memory; a block is 8 warps, 8 / splits groups.
// splits = 0 picks a count from the shape and the device (enough warps to cover the SMs).
// K must be a multiple of 8; rows past N and k past K read as zero.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../check.h"
#include "attention.h"
#include "gemv.h"
#include "mma.cuh"

namespace symphony {
namespace {

constexpr int kWarps = 8;
constexpr int kMaxRows = 8;

template <typename T>
__device__ __forceinline__ void store_out(T* p, float v);

template <>
__device__ __forceinline__ void store_out<float>(float* p, float v) { *p = v; }

template <>
__device__ __forceinline__ void store_out<at::Half>(at::Half* p, float v) {
  *reinterpret_cast<uint16_t*>(p) = uint16_t(mma::Bits<at::Half>::from_float(v));
}

template <>
__device__ __forceinline__ void store_out<at::BFloat16>(at::BFloat16* p, float v) {
  *reinterpret_cast<uint16_t*>(p) = uint16_t(mma::Bits<at::BFloat16>::from_float(v));
}

// This lane's values of k-block kb: two weight rows (16 k each, as two chunks) and x row grp.
struct KBlock {
  uint4 a[2], b[2], x[2];
};

template <typename T>
__device__ __forceinline__ void load_kblock(KBlock& kb_, int64_t kb, int tq, const T* wa, bool oka,
                                            const T* wb, bool okb, const T* xr, bool okx,
                                            int64_t K) {
  const int64_t k0 = kb * 64 + 16 * tq;
  const uint4 z = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const int64_t k = k0 + 8 * c;
    const bool in = k < K;                     // K % 8 == 0: a chunk is all in or all out
    kb_.a[c] = in && oka ? __ldcs(reinterpret_cast<const uint4*>(wa + k)) : z;
    kb_.b[c] = in && okb ? __ldcs(reinterpret_cast<const uint4*>(wb + k)) : z;
    kb_.x[c] = in && okx ? __ldg(reinterpret_cast<const uint4*>(xr + k)) : z;
  }
}

template <typename T>
__device__ __forceinline__ void mma_kblock(float (&c)[4], const KBlock& kb_) {
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const uint32_t a[4] = {mma::word(kb_.a, 2 * s), mma::word(kb_.b, 2 * s),
                           mma::word(kb_.a, 2 * s + 1), mma::word(kb_.b, 2 * s + 1)};
    mma::mma_16816<T>(c, a, mma::word(kb_.x, 2 * s), mma::word(kb_.x, 2 * s + 1));
  }
}

template <typename T, typename OutT, int SPLITS>
__global__ void __launch_bounds__(kWarps * 32)
    gemv_tc_kernel(const T* __restrict__ x, int64_t ldx, int M, const T* __restrict__ w,
                   int64_t N, int64_t K, OutT* __restrict__ out) {
  constexpr int GROUPS = kWarps / SPLITS;      // 16-row groups a block
  __shared__ float red[SPLITS > 1 ? kWarps : 1][32][4];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int grp = lane >> 2, tq = lane & 3;
  const int rg = warp / SPLITS, sp = warp % SPLITS;
  const int64_t n0 = (int64_t(blockIdx.x) * GROUPS + rg) * 16;
  const int64_t ra = n0 + grp, rb = ra + 8;
  const bool oka = ra < N, okb = rb < N, okx = grp < M;
  const T* wa = w + (oka ? ra : 0) * K;
  const T* wb = w + (okb ? rb : 0) * K;
  const T* xr = x + (okx ? grp : 0) * ldx;
  const int64_t kblocks = (K + 63) / 64;

  float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  int64_t kb = sp;
  for (; kb + SPLITS < kblocks; kb += 2 * SPLITS) {   // two k-blocks in flight
    KBlock p0, p1;
    load_kblock<T>(p0, kb, tq, wa, oka, wb, okb, xr, okx, K);
    load_kblock<T>(p1, kb + SPLITS, tq, wa, oka, wb, okb, xr, okx, K);
    mma_kblock<T>(c, p0);
    mma_kblock<T>(c, p1);
  }
  if (kb < kblocks) {
    KBlock p0;
    load_kblock<T>(p0, kb, tq, wa, oka, wb, okb, xr, okx, K);
    mma_kblock<T>(c, p0);
  }
  if constexpr (SPLITS > 1) {                  // the group's warps add up in shared memory
#pragma unroll
    for (int i = 0; i < 4; ++i) red[warp][lane][i] = c[i];
    __syncthreads();
    if (sp != 0) return;
#pragma unroll
    for (int s = 1; s < SPLITS; ++s)
#pragma unroll
      for (int i = 0; i < 4; ++i) c[i] += red[warp + s][lane][i];
  }
  // C: rows ra (c[0], c[1]) and rb (c[2], c[3]) of w, columns (rows of x) 2 tq, 2 tq + 1.
  const int m0 = 2 * tq, m1 = m0 + 1;
  if (oka && m0 < M) store_out<OutT>(out + m0 * N + ra, c[0]);
  if (oka && m1 < M) store_out<OutT>(out + m1 * N + ra, c[1]);
  if (okb && m0 < M) store_out<OutT>(out + m0 * N + rb, c[2]);
  if (okb && m1 < M) store_out<OutT>(out + m1 * N + rb, c[3]);
}

// The split count for splits = 0: warps enough for 16 an SM where the row groups are fewer.
int auto_splits(int64_t N, int64_t K, int sms) {
  const int64_t groups = (N + 15) / 16, kblocks = (K + 63) / 64;
  int s = 1;
  while (s < kWarps && groups * s < int64_t(16) * sms && kblocks >= 4 * s) s *= 2;
  return s;
}

template <typename T, typename OutT>
void launch(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, int splits,
            cudaStream_t stream) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t ldx = M == 1 ? K : x.stride(0);
  const T* xp = static_cast<const T*>(x.data_ptr());
  const T* wp = static_cast<const T*>(w.data_ptr());
  OutT* op = static_cast<OutT*>(out.data_ptr());
  const int64_t rows_a_block = int64_t(16) * (kWarps / splits);
  const unsigned blocks = unsigned((N + rows_a_block - 1) / rows_a_block);
  const int m = int(M);
  switch (splits) {
    case 1: gemv_tc_kernel<T, OutT, 1><<<blocks, kWarps * 32, 0, stream>>>(xp, ldx, m, wp, N, K, op); break;
    case 2: gemv_tc_kernel<T, OutT, 2><<<blocks, kWarps * 32, 0, stream>>>(xp, ldx, m, wp, N, K, op); break;
    case 4: gemv_tc_kernel<T, OutT, 4><<<blocks, kWarps * 32, 0, stream>>>(xp, ldx, m, wp, N, K, op); break;
    default: gemv_tc_kernel<T, OutT, 8><<<blocks, kWarps * 32, 0, stream>>>(xp, ldx, m, wp, N, K, op); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor dense_gemv_tc_cuda(const at::Tensor& x, const at::Tensor& w, bool float_out,
                              int64_t splits) {
  constexpr const char* op = "symphony::dense_gemv_tc";
  check_gemv_args(op, x, w, kMaxRows, int64_t(1) << 31);
  SYM_CHECK(splits == 0 || splits == 1 || splits == 2 || splits == 4 || splits == 8, op,
            ": splits must be 0 (chosen from the shape), 1, 2, 4 or 8, got ", splits);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const c10::cuda::CUDAGuard guard(x.device());
  const int dev = x.device().index();
  SYM_CHECK(mma::device_has_mma(dev), op, ": needs compute capability 8.0 or later (tensor-core "
            "mma on 16-bit inputs)");
  at::Tensor out = at::empty({M, N}, x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  if (N == 0) return out;
  const int s = splits > 0 ? int(splits) : auto_splits(N, K, device_sm_count(dev));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (x.scalar_type() == at::kHalf) {
    if (float_out) launch<at::Half, float>(x, w, out, s, stream);
    else launch<at::Half, at::Half>(x, w, out, s, stream);
  } else {
    if (float_out) launch<at::BFloat16, float>(x, w, out, s, stream);
    else launch<at::BFloat16, at::BFloat16>(x, w, out, s, stream);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(symphony, CUDA, m) {
  m.impl("dense_gemv_tc", &dense_gemv_tc_cuda);
}

}  // namespace symphony
