// The decoder layer stack of PagedLlama.forward in one op (float32, CPU): the same ops in the same
// order (qlinear or at::linear, rope_, write_kv, paged_attention, add_rms_norm, silu_mul), called
// from C++ through the dispatcher instead of from Python. A single-stream decode step of
// SmolLM2-135M spent ~2.6 ms of its ~15 ms outside the matrix products, nearly all of it the
// Python side of ~35 calls per layer (1-2 us each); here they cost ~0.2 us each.
//
//   llama_layers(x [T, H], positions [T], rope_table [P, head_dim/2, 2], kv_pool, slots,
//                page_table, cu_q_lens, kv_lens, norms, mats, kinds, groups, biases,
//                n_heads, n_kv_heads, scale, eps, qpath) -> x after the last layer [T, H]
//
// kv_pool  [L, 2, num_pages, page_size, n_kv_heads, head_dim] (KVPool.pool), written in place:
//          float32, or bfloat16 / float16 (K and V rounded as write_kv writes them).
// norms    2L tensors [H]: attn_norm, mlp_norm of each layer.
// mats     12L tensors, 4 matrices a layer (wqkv, wo, w_gate_up, w_down), 3 tensors each:
//          (qs, scales, mins) of a QWeight with kinds[j] = its kind and groups[j] its group, or
//          (w, w, w) of a dense float32 one, w [N, K], with kinds[j] = -1 (at::linear).
// biases   L optional tensors: bqkv of each layer (Qwen2) or None.
// qpath    the qlinear path of every quantized product (QWeight.linear's: -1 or -2 normally); -2
//          (--activations int8) also takes paged_attention_bf16 for the attention.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include "fused.h"

#include <cstdint>
#include <optional>
#include <tuple>
#include "../check.h"

namespace symphony {

namespace {

template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                   const at::Tensor& mins, int64_t kind, int64_t group, int64_t path) {
  static const auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&, int64_t, int64_t, int64_t)>("symphony::qlinear");
  return op.call(x, qs, scales, mins, kind, group, path);
}

void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slots) {
  static const auto op = find_op<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                                      const at::Tensor&)>("symphony::write_kv");
  op.call(k, v, k_cache, v_cache, slots);
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& page_table, const at::Tensor& cu_q_lens,
                           const at::Tensor& kv_lens, double scale, bool bf16) {
  using Fn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, double);
  static const auto exact = find_op<Fn>("symphony::paged_attention");
  static const auto products16 = find_op<Fn>("symphony::paged_attention_bf16");
  return (bf16 ? products16 : exact).call(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, scale);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r,
                                                const at::Tensor& w, double eps) {
  static const auto op = find_op<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>("symphony::add_rms_norm");
  return op.call(x, r, w, eps);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  static const auto op =
      find_op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("symphony::rms_norm");
  return op.call(x, w, eps);
}

struct Mats {
  at::TensorList mats;
  at::IntArrayRef kinds, groups;
  int64_t path;

  // x @ W_j^T for matrix j (0 .. 4L - 1), with bias when given
  at::Tensor linear(const at::Tensor& x, int64_t j, const std::optional<at::Tensor>& bias = {}) const {
    const at::Tensor& a = mats[3 * j];
    if (kinds[j] < 0) return at::linear(x, a, bias);
    at::Tensor y = qlinear(x, a, mats[3 * j + 1], mats[3 * j + 2], kinds[j], groups[j], path);
    if (!bias) return y;
    SYM_CHECK(bias->dim() == 1 && bias->size(0) == y.size(1), "symphony::llama_layers: bias of matrix ",
                j, " must be [", y.size(1), "], got ", bias->sizes());
    return y.add_(*bias);
  }
};

at::Tensor llama_layers_cpu(const at::Tensor& x0, const at::Tensor& positions, const at::Tensor& rope_table,
                            at::Tensor& kv_pool, const at::Tensor& slots, const at::Tensor& page_table,
                            const at::Tensor& cu_q_lens, const at::Tensor& kv_lens, at::TensorList norms,
                            at::TensorList mats, at::IntArrayRef kinds, at::IntArrayRef groups,
                            const c10::List<std::optional<at::Tensor>>& biases, int64_t n_heads,
                            int64_t n_kv_heads, double scale, double eps, int64_t qpath) {
  constexpr const char* op = "symphony::llama_layers";
  const int64_t L = kv_pool.dim() == 6 ? kv_pool.size(0) : -1;
  SYM_CHECK(L >= 0 && kv_pool.size(1) == 2, op,
              ": kv_pool must be [L, 2, num_pages, page_size, n_kv_heads, head_dim], got shape ",
              kv_pool.sizes());
  SYM_CHECK(int64_t(norms.size()) == 2 * L && int64_t(mats.size()) == 12 * L &&
                  int64_t(kinds.size()) == 4 * L && int64_t(groups.size()) == 4 * L &&
                  int64_t(biases.size()) == L,
              op, ": for ", L, " layers expected 2L norms, 12L mats, 4L kinds and groups and L biases; "
              "got ", norms.size(), ", ", mats.size(), ", ", kinds.size(), ", ", groups.size(), ", ",
              biases.size());
  SYM_CHECK(x0.dim() == 2 && x0.scalar_type() == at::kFloat && x0.device().is_cpu(), op,
              ": x must be a float32 CPU tensor [T, H], got ", x0.scalar_type(), " ", x0.sizes());
  SYM_CHECK(kv_pool.scalar_type() == at::kFloat || kv_pool.scalar_type() == at::kBFloat16 ||
                kv_pool.scalar_type() == at::kHalf,
            op, ": kv_pool must be float32, bfloat16 or float16, got ", kv_pool.scalar_type());
  const int64_t T = x0.size(0), head_dim = kv_pool.size(5);
  SYM_CHECK(kv_pool.size(4) == n_kv_heads && n_heads > 0, op, ": kv_pool holds ", kv_pool.size(4),
              " kv heads, n_kv_heads is ", n_kv_heads, " (n_heads ", n_heads, ")");
  const int64_t q_size = n_heads * head_dim, kv_size = n_kv_heads * head_dim;
  const Mats W{mats, kinds, groups, qpath};
  at::Tensor x = x0;
  if (L == 0) return x;
  at::Tensor h = rms_norm(x, norms[0], eps);
  for (int64_t i = 0; i < L; ++i) {
    at::Tensor qkv = W.linear(h, 4 * i, biases.get(i));                 // [T, q_size + 2 kv_size]
    SYM_CHECK(qkv.dim() == 2 && qkv.size(1) == q_size + 2 * kv_size && qkv.is_contiguous(), op,
                ": layer ", i, ": wqkv gives ", qkv.sizes(), ", expected [T, ", q_size + 2 * kv_size, "]");
    rope_inplace(qkv, positions, rope_table, n_heads + n_kv_heads);     // q and k rotated
    const at::Tensor heads = qkv.view({T, n_heads + 2 * n_kv_heads, head_dim});
    at::Tensor k_cache = kv_pool.select(0, i).select(0, 0);           // [pages, page_size, kv, d]
    at::Tensor v_cache = kv_pool.select(0, i).select(0, 1);
    write_kv(heads.narrow(1, n_heads, n_kv_heads), heads.narrow(1, n_heads + n_kv_heads, n_kv_heads),
             k_cache, v_cache, slots);
    const at::Tensor o = paged_attention(heads.narrow(1, 0, n_heads), k_cache, v_cache, page_table,
                                         cu_q_lens, kv_lens, scale, qpath == -2);  // [T, n_heads, head_dim]
    std::tie(x, h) = add_rms_norm(x, W.linear(o.view({T, q_size}), 4 * i + 1), norms[2 * i + 1], eps);
    const at::Tensor act = silu_mul_cpu(W.linear(h, 4 * i + 2));        // [T, intermediate]
    const at::Tensor down = W.linear(act, 4 * i + 3);                   // [T, H]
    if (i + 1 < L)
      std::tie(x, h) = add_rms_norm(x, down, norms[2 * i + 2], eps);
    else
      x = at::add(x, down);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_IMPL(symphony, CPU, m) { m.impl("llama_layers", &llama_layers_cpu); }

}  // namespace symphony
