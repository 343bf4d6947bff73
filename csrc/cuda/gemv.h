// The argument checks of the decode GEMVs (dense_gemv in dense.cu, dense_gemv_tc in gemv_tc.cu).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "../check.h"

namespace symphony {

// x [M, K] (1 <= M <= max_rows, rows contiguous and 16-byte aligned) and w [N, K] (contiguous,
// 16-byte aligned), both float16 or both bfloat16 on one CUDA device, K a positive multiple of 8,
// N below max_n.
inline void check_gemv_args(const char* op, const at::Tensor& x, const at::Tensor& w, int64_t max_rows,
                            int64_t max_n) {
  SYM_CHECK(x.is_cuda() && w.is_cuda() && x.device() == w.device(), op,
            ": x and w must be CUDA tensors on one device, got ", x.device(), " and ", w.device());
  SYM_CHECK(x.dim() == 2 && w.dim() == 2, op, ": x must be [M, K] and w [N, K], got shapes ",
            x.sizes(), " and ", w.sizes());
  SYM_CHECK(x.scalar_type() == w.scalar_type() &&
                (x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16),
            op, ": x and w must both be float16 or both bfloat16, got ", x.scalar_type(), " and ",
            w.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  SYM_CHECK(M >= 1 && M <= max_rows, op, ": x must have 1 to ", max_rows, " rows, got ", M);
  SYM_CHECK(w.size(1) == K, op, ": x has ", K, " columns but w has ", w.size(1));
  SYM_CHECK(K % 8 == 0 && K > 0, op, ": K must be a positive multiple of 8, got ", K);
  SYM_CHECK(w.is_contiguous(), op, ": w must be contiguous");
  SYM_CHECK(x.stride(1) == 1 && (M == 1 || x.stride(0) % 8 == 0), op,
            ": the rows of x must be contiguous and start 16-byte aligned, got strides ", x.strides());
  SYM_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
                reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
            op, ": x and w must start on a 16-byte boundary");
  SYM_CHECK(N < max_n, op, ": too many rows in w: ", N);
}

}  // namespace symphony
