// Operator schemas of the symphony custom ops. The CPU kernels live in csrc/cpu/, the CUDA
// kernels in csrc/cuda/; FakeTensor (meta) implementations are registered from Python in
// symphony/kernel/ops.py, which also holds the pure-PyTorch reference implementations.
#include <torch/library.h>

TORCH_LIBRARY(symphony, m) {
  // Fake implementations live in this Python module; torch imports it when it needs them.
  m.set_python_module("symphony.kernel.ops");

  // Scatter k[t], v[t] ([n_kv_heads, head_dim] each) into k_cache / v_cache
  // ([num_pages, page_size, n_kv_heads, head_dim]) at slot slots[t] = page * page_size + offset.
  // Negative slots are skipped. Any dtype of float32 / float16 / bfloat16, k, v and the caches
  // alike (a row copy: bit-exact).
  m.def(
      "write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");

  // Causal attention of packed query tokens q [T, n_heads, head_dim] over paged K/V.
  // Sequence b owns queries q[cu_q_lens[b]:cu_q_lens[b+1]] and kv_lens[b] cache slots (its new
  // tokens included), stored in pages page_table[b, :]. Query i of a sequence with q_len
  // queries sees slots 0 .. kv_len - q_len + i. Returns [T, n_heads, head_dim] in q's dtype.
  // q and the caches share one dtype: float32, float16 or bfloat16, on the CPU and on CUDA.
  // Softmax and accumulation are float32, the output is rounded to q's dtype once. On the CPU,
  // float16 / bfloat16 caches are read directly by the decode kernel and widened page by page
  // (only the pages prefill-like sequences read, each once) for the prefill kernel.
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, "
      "Tensor cu_q_lens, Tensor kv_lens, float scale) -> Tensor");
}
