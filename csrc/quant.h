// Quantized weights: the in-memory layout shared by the CPU and CUDA kernels, and the argument
// checks of qlinear / qdequant (schemas in csrc/ops.cpp).
//
// A quantized weight W [N, K] (N output rows, K inputs) is three tensors:
//
//   kind 0, "u4"  qs     uint8 [N, K/2]     group g of row n is the 16 bytes qs[n, 16g : 16g+16];
//                                            byte j holds element 32g+j (low nibble) and element
//                                            32g+16+j (high nibble), unsigned 0..15; group = 32.
//   kind 1, "i8"  qs     int8  [N, K]       one signed byte per element; group = 16 or 32.
//                 scales float32 or float16 [N, K/group]
//                 mins   the same dtype [N, K/group], or empty: no offset for i8, -8 * scale for
//                        u4 (Q4_0's q - 8, kept as the file keeps it: no bytes for the mins)
//
//   W[n, k] = scales[n, k/group] * q[n, k] + mins[n, k/group]
//
// Every GGUF format we load maps onto one of the two exactly (symphony/engine/quant.py does the
// repacking): Q4_0 (min = -8 d), Q4_1, Q4_K (scale d*sc, min -dmin*m: both exact in float32)
// are u4; Q8_0, Q5_K (0..31) and Q6_K (-32..31, group 16) are i8. Q4_0, Q4_1 and Q8_0 keep the
// file's float16 scales (and Q4_1's mins) as they are: 2 bytes a group, not 4, of what a decode
// step reads. Float16 scales and u4 weights without mins are CPU layouts: the AVX2 row kernels
// (the decode paths 5 and 12) read them as they are; the other CPU kernels widen the scales
// (exactly) and write out the implied mins, a block of rows at a time, before the same code
// runs; the CUDA kernels take float32 scales and mins.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include "check.h"

namespace symphony {

enum QKind : int64_t { kQU4 = 0, kQI8 = 1 };

struct QDims {
  int64_t N, K, group, n_groups;
  QKind kind;
  bool has_min;
  bool half;  // float16 scales and mins
};

inline void check_qkind(const char* op, int64_t kind) {
  SYM_CHECK(kind == kQU4 || kind == kQI8, op, ": kind must be 0 (u4) or 1 (i8), got ", kind);
}

inline QDims check_qweight(const char* op, const at::Tensor& qs, const at::Tensor& scales,
                           const at::Tensor& mins, int64_t kind, int64_t group) {
  check_qkind(op, kind);
  SYM_CHECK(qs.dim() == 2, op, ": qs must be 2-D [N, packed K], got shape ", qs.sizes());
  SYM_CHECK(qs.is_contiguous() && scales.is_contiguous() && mins.is_contiguous(), op,
              ": qs, scales and mins must be contiguous");
  const int64_t N = qs.size(0);
  int64_t K;
  if (kind == kQU4) {
    SYM_CHECK(qs.scalar_type() == at::kByte, op, ": u4 qs must be uint8, got ", qs.scalar_type());
    SYM_CHECK(group == 32, op, ": u4 weights have groups of 32, got ", group);
    K = qs.size(1) * 2;
  } else {
    SYM_CHECK(qs.scalar_type() == at::kChar, op, ": i8 qs must be int8, got ", qs.scalar_type());
    SYM_CHECK(group == 16 || group == 32, op, ": i8 groups must be 16 or 32, got ", group);
    K = qs.size(1);
  }
  SYM_CHECK(K > 0 && K % 32 == 0, op, ": K must be a positive multiple of 32, got ", K);
  const int64_t G = K / group;
  SYM_CHECK(scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf, op,
            ": scales must be float32 or float16, got ", scales.scalar_type());
  SYM_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == G, op,
              ": scales must be [N, K/group] = [", N, ", ", G, "], got ", scales.sizes());
  const bool has_min = mins.numel() > 0;  // u4 without mins: -8 * scale (Q4_0)
  if (has_min) {
    SYM_CHECK(mins.sizes() == scales.sizes(), op, ": mins shape ", mins.sizes(),
                " differs from scales shape ", scales.sizes());
    SYM_CHECK(mins.scalar_type() == scales.scalar_type(), op, ": mins must have the scales' dtype (",
              scales.scalar_type(), "), got ", mins.scalar_type());
  }
  SYM_CHECK(scales.device() == qs.device() && mins.device() == qs.device(), op,
              ": qs, scales and mins must be on one device");
  return {N, K, group, G, static_cast<QKind>(kind), has_min, scales.scalar_type() == at::kHalf};
}

}  // namespace symphony
