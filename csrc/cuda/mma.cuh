// Tensor-core helpers shared by the query-tiled attention (attention_tiled.cu) and the
// tensor-core GEMV (gemv_tc.cu): 16-bit element bits, packing, and one warp-wide
// mma.sync.m16n8k16 (float32 accumulation; sm_80 and later).
//
// Fragment layouts of mma.m16n8k16 with 16-bit inputs (PTX ISA, "Matrix Fragments for
// mma.m16n8k16 with floating point type"), for lane = 4 * grp + tq (grp = lane / 4, tq = lane % 4):
//
//   A (16 x 16, row-major), 4 registers of two 16-bit values (the lower index in the low half):
//     a[0] = A[grp    ][2 tq, 2 tq + 1]      a[2] = A[grp    ][2 tq + 8, 2 tq + 9]
//     a[1] = A[grp + 8][2 tq, 2 tq + 1]      a[3] = A[grp + 8][2 tq + 8, 2 tq + 9]
//   B (16 x 8, k by n), 2 registers:
//     b0 = B[2 tq, 2 tq + 1][grp]            b1 = B[2 tq + 8, 2 tq + 9][grp]
//   C, D (16 x 8, float32), 4 values:
//     c[0], c[1] = C[grp    ][2 tq, 2 tq + 1]
//     c[2], c[3] = C[grp + 8][2 tq, 2 tq + 1]
//
// tests/unit/engine/cuda_emulation.py emulates these layouts on the CPU to check the kernels'
// index arithmetic against plain references.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace symphony {
namespace mma {

// float <-> the bits of one 16-bit value of type T (at::Half or at::BFloat16).
template <typename T>
struct Bits;

template <>
struct Bits<at::BFloat16> {
  __device__ __forceinline__ static float to_float(uint32_t b) {
    return __uint_as_float((b & 0xffffu) << 16);
  }
  __device__ __forceinline__ static uint32_t from_float(float v) {  // round to nearest even
    uint32_t u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;              // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return u >> 16;
  }
};

template <>
struct Bits<at::Half> {
  __device__ __forceinline__ static float to_float(uint32_t b) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(b & 0xffffu)));
  }
  __device__ __forceinline__ static uint32_t from_float(float v) {
    return __half_as_ushort(__float2half_rn(v));
  }
};

// Two values as one register: lo in the low half (the lower index), hi in the high half.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return Bits<T>::from_float(lo) | (Bits<T>::from_float(hi) << 16);
}

// The 8 values of a 16-byte chunk, widened.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& c, float* f) {
  const uint32_t w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = Bits<T>::to_float(w[i]);
    f[2 * i + 1] = Bits<T>::to_float(w[i] >> 16);
  }
}

// Word i (0..7) of two 16-byte chunks read as 16 consecutive values: values 2i and 2i + 1.
__device__ __forceinline__ uint32_t word(const uint4 (&c)[2], int i) {
  const uint4& v = c[i >> 2];
  switch (i & 3) {
    case 0: return v.x;
    case 1: return v.y;
    case 2: return v.z;
    default: return v.w;
  }
}

// d += A B for one warp (layouts above); T is at::BFloat16 or at::Half.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<at::BFloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                        uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // the host launches these kernels on compute capability 8.0 and later only
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

template <>
__device__ __forceinline__ void mma_16816<at::Half>(float (&d)[4], const uint32_t (&a)[4],
                                                    uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Whether the device runs mma.sync.m16n8k16 on 16-bit inputs (compute capability 8.0 and later);
// asked once a device.
inline bool device_has_mma(int device) {
  static int major[64] = {0};
  if (device < 0 || device >= 64) return false;
  if (major[device] == 0) {
    int m = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&m, cudaDevAttrComputeCapabilityMajor, device));
    major[device] = m > 0 ? m : 1;
  }
  return major[device] >= 8;
}

}  // namespace mma
}  // namespace symphony
