// Argument checks shared by the CPU and CUDA implementations of the symphony ops.
//
// Layout contract (see csrc/ops.cpp for the schemas):
//   k_cache, v_cache : [num_pages, page_size, n_kv_heads, head_dim], contiguous
//   q                : [T, n_heads, head_dim]      (token stride free, each [heads, dim] block contiguous)
//   k, v             : [T, n_kv_heads, head_dim]   (same)
//   slots            : int64 [T]
//   page_table       : int32 [B, max_pages], contiguous
//   cu_q_lens        : int32 [B + 1], contiguous
//   kv_lens          : int32 [B], contiguous
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include "check.h"

namespace symphony {

// True when t's [dim1, dim2] block is dense row-major: the token (dim 0) stride may be anything
// (for example q, k or v sliced out of a fused qkv projection).
inline bool rows_dense(const at::Tensor& t) {
  return t.dim() == 3 && (t.size(2) <= 1 || t.stride(2) == 1) &&
         (t.size(1) <= 1 || t.stride(1) == t.size(2));
}

inline void check_same_device(const char* op, const at::Tensor& ref, const char* ref_name,
                              const at::Tensor& t, const char* name) {
  SYM_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ", ref_name,
              " is on ", ref.device(), "; all tensors must be on the same device");
}

inline void check_float_dtype(const char* op, const at::Tensor& t, const char* name) {
  const auto st = t.scalar_type();
  SYM_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16, op, ": ", name,
              " must be float32, float16 or bfloat16, got ", st);
}

inline void check_kv_cache(const char* op, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  SYM_CHECK(k_cache.dim() == 4, op,
              ": k_cache must be 4-D [num_pages, page_size, n_kv_heads, head_dim], got shape ",
              k_cache.sizes());
  SYM_CHECK(v_cache.sizes() == k_cache.sizes(), op, ": v_cache shape ", v_cache.sizes(),
              " differs from k_cache shape ", k_cache.sizes());
  SYM_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), op, ": v_cache dtype ",
              v_cache.scalar_type(), " differs from k_cache dtype ", k_cache.scalar_type());
  check_same_device(op, k_cache, "k_cache", v_cache, "v_cache");
  check_float_dtype(op, k_cache, "k_cache");
  SYM_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), op,
              ": k_cache and v_cache must be contiguous (views pool[layer, 0] / pool[layer, 1] "
              "of a contiguous pool)");
  SYM_CHECK(k_cache.size(1) > 0 && k_cache.size(2) > 0 && k_cache.size(3) > 0, op,
              ": page_size, n_kv_heads and head_dim must be positive, got k_cache shape ",
              k_cache.sizes());
}

struct WriteKvDims {
  int64_t T, n_kv_heads, head_dim, num_pages, page_size;
};

// A float32 q (paged_attention) or k / v (write_kv) beside a float16 / bfloat16 cache: the
// CPU kernels take it when the caller allows (`mixed`), a KV pool narrower than the activations.
inline bool narrower_cache(const at::Tensor& t, const at::Tensor& cache) {
  return t.scalar_type() == at::kFloat &&
         (cache.scalar_type() == at::kBFloat16 || cache.scalar_type() == at::kHalf);
}

inline WriteKvDims check_write_kv_args(const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       const at::Tensor& slots, bool mixed = false) {
  constexpr const char* op = "symphony::write_kv";
  check_kv_cache(op, k_cache, v_cache);
  SYM_CHECK(k.dim() == 3, op, ": k must be 3-D [T, n_kv_heads, head_dim], got shape ", k.sizes());
  SYM_CHECK(v.sizes() == k.sizes(), op, ": v shape ", v.sizes(), " differs from k shape ",
              k.sizes());
  SYM_CHECK(k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3), op, ": k is ",
              k.sizes(), " but the cache holds [n_kv_heads, head_dim] = [", k_cache.size(2), ", ",
              k_cache.size(3), "]");
  SYM_CHECK(k.scalar_type() == v.scalar_type() &&
                (k.scalar_type() == k_cache.scalar_type() || (mixed && narrower_cache(k, k_cache))),
              op, ": k/v dtypes (", k.scalar_type(), ", ", v.scalar_type(),
              ") must equal the cache dtype ", k_cache.scalar_type(),
              mixed ? " (or be float32 beside a float16 / bfloat16 cache)" : "");
  SYM_CHECK(rows_dense(k) && rows_dense(v), op,
              ": k and v must have contiguous [n_kv_heads, head_dim] rows (stride(2) == 1 and "
              "stride(1) == head_dim); got strides ",
              k.strides(), " and ", v.strides());
  SYM_CHECK(slots.dim() == 1 && slots.size(0) == k.size(0), op, ": slots must be 1-D [T] with T = ",
              k.size(0), ", got shape ", slots.sizes());
  SYM_CHECK(slots.scalar_type() == at::kLong, op, ": slots must be int64, got ",
              slots.scalar_type());
  SYM_CHECK(slots.is_contiguous(), op, ": slots must be contiguous");
  check_same_device(op, k_cache, "k_cache", k, "k");
  check_same_device(op, k_cache, "k_cache", v, "v");
  check_same_device(op, k_cache, "k_cache", slots, "slots");
  return {k.size(0), k_cache.size(2), k_cache.size(3), k_cache.size(0), k_cache.size(1)};
}

struct AttnDims {
  int64_t T, n_heads, n_kv_heads, head_dim, group, num_pages, page_size, B, max_pages;
};

inline AttnDims check_paged_attention_args(const at::Tensor& q, const at::Tensor& k_cache,
                                           const at::Tensor& v_cache, const at::Tensor& page_table,
                                           const at::Tensor& cu_q_lens, const at::Tensor& kv_lens,
                                           bool mixed = false) {
  constexpr const char* op = "symphony::paged_attention";
  check_kv_cache(op, k_cache, v_cache);
  SYM_CHECK(q.dim() == 3, op, ": q must be 3-D [T, n_heads, head_dim], got shape ", q.sizes());
  SYM_CHECK(q.scalar_type() == k_cache.scalar_type() || (mixed && narrower_cache(q, k_cache)), op,
              ": q dtype ", q.scalar_type(), " must equal the cache dtype ", k_cache.scalar_type(),
              mixed ? " (or be float32 beside a float16 / bfloat16 cache)" : "");
  SYM_CHECK(q.size(2) == k_cache.size(3), op, ": q head_dim ", q.size(2),
              " differs from the cache head_dim ", k_cache.size(3));
  const int64_t n_heads = q.size(1), n_kv_heads = k_cache.size(2);
  SYM_CHECK(n_heads > 0 && n_heads % n_kv_heads == 0, op, ": n_heads (", n_heads,
              ") must be a positive multiple of n_kv_heads (", n_kv_heads, ")");
  SYM_CHECK(rows_dense(q), op,
              ": q must have contiguous [n_heads, head_dim] rows (stride(2) == 1 and stride(1) == "
              "head_dim); got strides ",
              q.strides());
  SYM_CHECK(page_table.dim() == 2, op, ": page_table must be 2-D [B, max_pages], got shape ",
              page_table.sizes());
  SYM_CHECK(page_table.scalar_type() == at::kInt, op, ": page_table must be int32, got ",
              page_table.scalar_type());
  SYM_CHECK(cu_q_lens.scalar_type() == at::kInt, op, ": cu_q_lens must be int32, got ",
              cu_q_lens.scalar_type());
  SYM_CHECK(kv_lens.scalar_type() == at::kInt, op, ": kv_lens must be int32, got ",
              kv_lens.scalar_type());
  const int64_t B = page_table.size(0);
  SYM_CHECK(B > 0 || q.size(0) == 0, op, ": q has ", q.size(0),
              " tokens but the batch has no sequences (page_table has 0 rows)");
  SYM_CHECK(cu_q_lens.dim() == 1 && cu_q_lens.size(0) == B + 1, op,
              ": cu_q_lens must be 1-D [B + 1] with B = ", B, " (page_table rows), got shape ",
              cu_q_lens.sizes());
  SYM_CHECK(kv_lens.dim() == 1 && kv_lens.size(0) == B, op, ": kv_lens must be 1-D [B] with B = ",
              B, " (page_table rows), got shape ", kv_lens.sizes());
  SYM_CHECK(page_table.is_contiguous() && cu_q_lens.is_contiguous() && kv_lens.is_contiguous(),
              op, ": page_table, cu_q_lens and kv_lens must be contiguous");
  check_same_device(op, q, "q", k_cache, "k_cache");
  check_same_device(op, q, "q", page_table, "page_table");
  check_same_device(op, q, "q", cu_q_lens, "cu_q_lens");
  check_same_device(op, q, "q", kv_lens, "kv_lens");
  SYM_CHECK(k_cache.numel() < (int64_t(1) << 62), op, ": cache too large");
  return {q.size(0),       n_heads,         n_kv_heads,        q.size(2),        n_heads / n_kv_heads,
          k_cache.size(0), k_cache.size(1), B,                 page_table.size(1)};
}

// Value checks of the (host-resident) tables: cheap, O(B * max_pages). Guarantees that the
// kernels never index outside q, the tables or the caches.
inline void check_attention_tables_cpu(const AttnDims& d, const int32_t* page_table,
                                       const int32_t* cu_q_lens, const int32_t* kv_lens) {
  constexpr const char* op = "symphony::paged_attention";
  SYM_CHECK(cu_q_lens[0] == 0, op, ": cu_q_lens[0] must be 0, got ", cu_q_lens[0]);
  SYM_CHECK(cu_q_lens[d.B] == d.T, op, ": cu_q_lens[B] = ", cu_q_lens[d.B],
              " must equal the number of query tokens T = q.size(0) = ", d.T);
  for (int64_t b = 0; b < d.B; ++b) {
    const int64_t q_len = int64_t(cu_q_lens[b + 1]) - cu_q_lens[b];
    SYM_CHECK(q_len >= 0, op, ": cu_q_lens must be non-decreasing, but cu_q_lens[", b + 1,
                "] = ", cu_q_lens[b + 1], " < cu_q_lens[", b, "] = ", cu_q_lens[b]);
    const int64_t kv_len = kv_lens[b];
    SYM_CHECK(kv_len >= q_len, op, ": sequence ", b, " has kv_len ", kv_len, " < q_len ", q_len,
                " (kv_lens must count the new tokens, already written with write_kv)");
    const int64_t n_pages = (kv_len + d.page_size - 1) / d.page_size;
    SYM_CHECK(n_pages <= d.max_pages, op, ": sequence ", b, " has kv_len ", kv_len, ", needing ",
                n_pages, " pages of ", d.page_size, " slots, but page_table has only ", d.max_pages,
                " columns");
    const int32_t* row = page_table + b * d.max_pages;
    for (int64_t p = 0; p < n_pages; ++p) {
      SYM_CHECK(row[p] >= 0 && row[p] < d.num_pages, op, ": page_table[", b, ", ", p, "] = ",
                  row[p], " is out of range [0, ", d.num_pages, ")");
    }
  }
}

inline void check_slots_cpu(const WriteKvDims& d, const int64_t* slots) {
  const int64_t capacity = d.num_pages * d.page_size;
  for (int64_t t = 0; t < d.T; ++t) {
    SYM_CHECK(slots[t] < capacity, "symphony::write_kv: slots[", t, "] = ", slots[t],
                " is out of range: the cache holds ", d.num_pages, " pages x ", d.page_size,
                " = ", capacity, " slots (negative slots are skipped)");
  }
}

// rope_(x [T, N], positions [T], table [P, head_dim / 2, 2], heads): the checks the CPU and CUDA
// kernels share (each adds its device and dtype checks); returns head_dim / 2.
inline int64_t check_rope_args(const char* op, const at::Tensor& x, const at::Tensor& positions,
                               const at::Tensor& table, int64_t heads) {
  SYM_CHECK(x.dim() == 2, op, ": x must be 2-D [T, N], got shape ", x.sizes());
  SYM_CHECK(table.scalar_type() == at::kFloat, op, ": table must be float32, got ", table.scalar_type());
  SYM_CHECK(table.dim() == 3 && table.size(2) == 2 && table.is_contiguous(), op,
            ": table must be a contiguous [max_positions, head_dim / 2, 2] (cos, sin) table, "
            "got shape ", table.sizes());
  const int64_t T = x.size(0), half = table.size(1), head_dim = 2 * half;
  SYM_CHECK(heads >= 0 && heads * head_dim <= x.size(1), op, ": ", heads, " heads of ", head_dim,
            " values do not fit in rows of ", x.size(1));
  SYM_CHECK(x.size(1) <= 1 || x.stride(1) == 1, op,
            ": the rows of x must be contiguous (stride(1) == 1), got strides ", x.strides());
  SYM_CHECK(positions.dim() == 1 && positions.size(0) == T, op,
            ": positions must be 1-D [T] with T = ", T, ", got shape ", positions.sizes());
  SYM_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), op,
            ": positions must be contiguous int64, got ", positions.scalar_type());
  return half;
}

}  // namespace symphony
