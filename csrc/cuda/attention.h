// What the CUDA attention files share: paged_attention.cu's general kernels (any float dtype,
// head size and group), which attention_tiled.cu falls back to and runs beside its own.
#pragma once

#include <ATen/core/Tensor.h>

#include "../checks.h"

namespace symphony {

// The multiprocessors of a CUDA device (asked once a device).
int device_sm_count(int device);

// Splits of each sequence's keys (at most 32): enough blocks for about four an SM, from the
// shapes alone (a CUDA graph replays the same grid whatever the lengths), each at least
// min_chunk keys of the longest possible sequence; each block then takes its share of its
// sequence's actual keys.
int key_splits(const AttnDims& d, int sms, int min_chunk);

// TORCH_CHECKs the limits of the CUDA kernels' index types.
void check_attention_size(const AttnDims& d, const char* op);

// paged_attention's CUDA kernels on checked arguments (d), into out [T, n_heads, head_dim]
// (contiguous, q's dtype). skip_q > 0 leaves the query tokens of every sequence of at least
// skip_q queries untouched (another kernel writes them); 0 computes every token.
void paged_attention_general(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& page_table,
                             const at::Tensor& cu_q_lens, const at::Tensor& kv_lens, double scale,
                             const AttnDims& d, at::Tensor& out, int skip_q);

}  // namespace symphony
