// Paged attention with bfloat16 products on AMX tiles (csrc/cpu/attention_amx.cpp).
//
// For the sequences of a batch with many query rows (prompt chunks): Q K^T and P V run on the
// AMX tiles (TDPBF16PS: bfloat16 inputs, float32 sums), with Q, K, the softmax weights P and V
// rounded to bfloat16 (round to nearest even); the online softmax, its running max and sum and
// the output accumulator are float32. The caches (float32, bfloat16 or float16) are never
// converted in place: each sequence's K/V of each kv head is rounded once per call into a packed
// bfloat16 copy that every query tile reads (a bfloat16 cache's values copied as they are).
// Torch-free (raw pointers), so that it can be built and checked on its own.
#pragma once

#include <cstdint>
#include <functional>

namespace symphony {

enum class AmxCache : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

struct AmxAttention {
  const float* q;        // [T, n_heads, head_dim]; q_stride floats between tokens
  int64_t q_stride;
  const void* k_cache;   // [num_pages, page_size, n_kv_heads, head_dim], of element type cache
  const void* v_cache;
  int64_t n_heads, n_kv_heads, head_dim, page_size;
  const int32_t* page_table;  // [B, max_pages]
  int64_t max_pages;
  const int32_t* cu_q_lens;   // [B + 1]
  const int32_t* kv_lens;     // [B]
  float* out;                 // [T, n_heads, head_dim], contiguous
  float scale;
  AmxCache cache = AmxCache::kF32;
};

// Runs f(begin, end) over [0, n) in chunks on the caller's thread team (at::parallel_for in the
// ops library; a plain loop when built alone).
using ParallelFor = std::function<void(int64_t n, const std::function<void(int64_t, int64_t)>& f)>;

// Whether this CPU and OS run AMX bfloat16 tiles for this process: the CPU has AMX-TILE and
// AMX-BF16, the OS enables their state, and the process was granted the tile data (asked for
// once, by arch_prctl). False when built without AMX support.
bool amx_bf16_usable();

// Whether amx_attention takes a model of this head_dim (a multiple of 32, at most 256).
bool amx_attention_takes(int64_t head_dim);

// The attention of sequences seqs[0 .. n_seqs) of the batch (causal: query i of a sequence of
// q_len queries sees keys 0 .. kv_len - q_len + i), written to their rows of a.out; other rows
// of a.out are not touched. Requires amx_bf16_usable() and amx_attention_takes(head_dim).
void amx_attention(const AmxAttention& a, const int64_t* seqs, int64_t n_seqs, const ParallelFor& pfor);

}  // namespace symphony
