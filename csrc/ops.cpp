// Operator schemas of the symphony custom ops. The CPU kernels live in csrc/cpu/, the CUDA
// kernels in csrc/cuda/; FakeTensor (meta) implementations are registered from Python in
// symphony/engine/ops/, which also holds the pure-PyTorch reference implementations.
#include <torch/library.h>

TORCH_LIBRARY(symphony, m) {
  // Fake implementations live in this Python module; torch imports it when it needs them.
  m.set_python_module("symphony.engine.ops");

  // Scatter k[t], v[t] ([n_kv_heads, head_dim] each) into k_cache / v_cache
  // ([num_pages, page_size, n_kv_heads, head_dim]) at slot slots[t] = page * page_size + offset.
  // Negative slots are skipped. Any dtype of float32 / float16 / bfloat16, k, v and the caches
  // alike (a row copy: bit-exact); on the CPU also float32 k, v into float16 / bfloat16 caches
  // (rounded to nearest even, as .to() rounds: a KV pool narrower than the activations).
  m.def(
      "write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");

  // Causal attention of packed query tokens q [T, n_heads, head_dim] over paged K/V.
  // Sequence b owns queries q[cu_q_lens[b]:cu_q_lens[b+1]] and kv_lens[b] cache slots (its new
  // tokens included), stored in pages page_table[b, :]. Query i of a sequence with q_len
  // queries sees slots 0 .. kv_len - q_len + i. Returns [T, n_heads, head_dim] in q's dtype.
  // q and the caches share one dtype: float32, float16 or bfloat16, on the CPU and on CUDA; on
  // the CPU q may also be float32 beside float16 / bfloat16 caches (the output then float32).
  // Softmax and accumulation are float32, the output is rounded to q's dtype once. On the CPU,
  // float16 / bfloat16 caches are read directly by the decode kernel and widened page by page
  // (only the pages prefill-like sequences read, each once) for the prefill kernel.
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, "
      "Tensor cu_q_lens, Tensor kv_lens, float scale) -> Tensor");
  // paged_attention_bf16: paged_attention's arguments and result shape, with bfloat16 products
  // (CPU): sequences of 32 or more query rows (tokens x GQA group; rows x kv_len >= 8192) round q, K, V and the softmax
  // weights to bfloat16 and multiply on the AMX tiles (float32 sums, softmax and output;
  // csrc/cpu/attention_amx.cpp; the caches float32, bfloat16 or float16); the rest, and
  // everything on a CPU without AMX-BF16, with a q that is not float32 or a head_dim not a
  // multiple of 32, is paged_attention's. For the layer stack
  // of --activations int8, whose matrices are bfloat16 products on such a CPU already.
  m.def(
      "paged_attention_bf16(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, "
      "Tensor cu_q_lens, Tensor kv_lens, float scale) -> Tensor");

  // Quantized weights (layout in csrc/quant.h): W [N, K] is qs (uint8 [N, K/2] for kind 0 "u4",
  // int8 [N, K] for kind 1 "i8"), scales float32 [N, K/group] and mins (same shape, or empty);
  // W[n, k] = scales[n, k/group] * q[n, k] + mins[n, k/group].
  // qlinear: x float32 [M, K] -> x @ W^T, float32 [M, N]. path: -1 picks a kernel by M whose
  // result is the float32 product up to ~3e-5 of |x| |W| (15-bit x on AVX-512 VNNI and on AVX2
  // without AVX-512, else float),
  // -2 an int8-activation one (x rounded per block of 16), both a dense GEMM for large M
  // (csrc/cpu/qlinear.cpp resolve_path); 0 scalar, 1 AVX2, 2 AVX-512 (float register kernels),
  // 3 dequantize + torch GEMM, 4 int8 scalar, 5 int8 AVX2, 6 int8 AVX-VNNI, 7 int8 AVX-512 VNNI,
  // 8 int8 AVX-512 VNNI 16-row tiles, 9 15-bit AVX-512 VNNI, 10 int8 AVX2 8-row tiles, 11 15-bit
  // AVX2 8-row tiles, 12 15-bit AVX2 row kernel force one (CPU; CUDA ignores it).
  m.def(
      "qlinear(Tensor x, Tensor qs, Tensor scales, Tensor mins, int kind, int group, "
      "int path=-1) -> Tensor");
  // qdequant: W as float32 [N, K].
  m.def("qdequant(Tensor qs, Tensor scales, Tensor mins, int kind, int group) -> Tensor");
  // qcpu_features() -> int is defined in csrc/cpu/qlinear.cpp (no tensor arguments).

  // RMSNorm of the rows of x [T, H] float32 with weight w [H] (CPU; csrc/cpu/norm.cpp):
  // x * rsqrt(mean(x^2) + eps) * w. add_rms_norm also adds the residual first:
  // returns (x + r, rms_norm(x + r)).
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor r, Tensor w, float eps) -> (Tensor, Tensor)");

  // Fused element-wise ops of the decode step, float32 (CPU; csrc/cpu/fused.cpp).
  // silu_mul: gu [T, 2I] (the fused gate/up projection) -> silu(gu[:, :I]) * gu[:, I:], [T, I].
  m.def("silu_mul(Tensor gu) -> Tensor");
  // rope_: rotates, in place, the first `heads` heads of head_dim = 2 * table.size(1) values of
  // each row x[t] ([T, N]): pair (2i, 2i+1) as the complex x[2i] + i x[2i+1] times
  // table[positions[t], i] = (cos, sin) of positions[t] * inv_freq[i] (table [P, head_dim/2, 2]).
  m.def("rope_(Tensor(a!) x, Tensor positions, Tensor table, int heads) -> ()");
  // dense_gemv: x [M, K] @ w [N, K]^T for a few rows (M <= 4 on CUDA), float32 out when
  // float_out, else x's dtype. CUDA: 16-bit x and w, the decode GEMV (csrc/cuda/dense.cu);
  // CPU: torch's matmul in float32, for reference.
  m.def("dense_gemv(Tensor x, Tensor w, bool float_out) -> Tensor");
  // dense_gemv_tc: x [M, K] @ w [N, K]^T for 1 to 8 rows on tensor cores (CUDA, 16-bit x and w,
  // compute capability >= 8.0; csrc/cuda/gemv_tc.cu), splits: warps sharing a row group's K
  // (0: chosen from the shape; 1, 2, 4, 8). CPU: dense_gemv's reference (registered from Python).
  m.def("dense_gemv_tc(Tensor x, Tensor w, bool float_out, int splits=0) -> Tensor");
  // paged_attention_tiled: paged_attention's arguments and result, with the CUDA kernels that
  // `kernels` picks (csrc/cuda/attention_tiled.cu): 1 the query-tiled tensor-core kernel for
  // sequences of >= 32 query tokens, 2 the split-key decode kernel for the others, 3 both, 0
  // neither (paged_attention's kernels do the rest, and every shape the new ones do not take).
  // CPU: paged_attention itself (registered from Python).
  m.def(
      "paged_attention_tiled(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, "
      "Tensor cu_q_lens, Tensor kv_lens, float scale, int kernels=3) -> Tensor");
  // llama_layers: PagedLlama's decoder layer stack in one op (float32 CPU; csrc/cpu/layers.cpp
  // documents the arguments): x [T, H] -> x after the last layer; writes K/V into kv_pool.
  m.def(
      "llama_layers(Tensor x, Tensor positions, Tensor rope_table, Tensor(a!) kv_pool, Tensor slots, "
      "Tensor page_table, Tensor cu_q_lens, Tensor kv_lens, Tensor[] norms, Tensor[] mats, "
      "int[] kinds, int[] groups, Tensor?[] biases, int n_heads, int n_kv_heads, float scale, "
      "float eps, int qpath) -> Tensor");
}
