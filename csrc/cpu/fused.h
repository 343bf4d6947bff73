// The CPU kernels of the fused element-wise ops (csrc/cpu/fused.cpp), for llama_layers
// (csrc/cpu/layers.cpp) to call directly; schemas and semantics in csrc/ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace symphony {

// silu(gu[:, :I]) * gu[:, I:] of gu float32 [T, 2I] -> [T, I]
at::Tensor silu_mul_cpu(const at::Tensor& gu);

// RoPE of the first `heads` heads of each row of x float32 [T, N], in place
void rope_inplace(at::Tensor& x, const at::Tensor& positions, const at::Tensor& table, int64_t heads);

}  // namespace symphony
