"""Symphony's custom attention ops: loader, typed wrappers, fake impls and references.

The ops are C++/CUDA kernels in ``<repo>/csrc`` registered as ``torch.ops.symphony.*``
(schemas in ``csrc/ops.cpp``). They are compiled on first use with
``torch.utils.cpp_extension`` into a cache directory (``$SYMPHONY_BUILD_DIR`` or
``~/.cache/symphony/ops/<hash>``) and loaded into the process as a plain shared library.

KV page pool layout of one layer: ``k_cache`` / ``v_cache`` are
``[num_pages, page_size, n_kv_heads, head_dim]`` (views ``pool[layer, 0]`` / ``pool[layer, 1]``
of a contiguous pool). Cache slot ``s`` is page ``s // page_size``, offset ``s % page_size``.

``write_kv(k, v, k_cache, v_cache, slots)``
    ``k``, ``v``: ``[T, n_kv_heads, head_dim]``; ``slots``: int64 ``[T]``. Writes ``k[t]``,
    ``v[t]`` at slot ``slots[t]``; negative slots are skipped.

``paged_attention(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, scale) -> out``
    ``q``: ``[T, n_heads, head_dim]`` holding every sequence's query tokens back to back;
    ``page_table``: int32 ``[B, max_pages]``; ``cu_q_lens``: int32 ``[B + 1]`` (sequence b's
    queries are ``q[cu_q_lens[b]:cu_q_lens[b + 1]]``); ``kv_lens``: int32 ``[B]``, the number of
    cache slots of sequence b, its new tokens included. Query i of a sequence sees slots
    ``0 .. kv_len - q_len + i``; query head h uses kv head ``h // (n_heads // n_kv_heads)``.
    Returns ``softmax(scale * q k^T) v`` as ``[T, n_heads, head_dim]`` in q's dtype, computed
    with float32 accumulation.

q, k and v may be strided along the token dimension (slices of a fused qkv projection) as long
as each token's ``[heads, head_dim]`` block is contiguous.

Dtypes: float32, float16 and bfloat16, on the CPU and on CUDA; q, k, v and the caches share
one dtype, except that on the CPU a float32 q, k and v may go with float16 / bfloat16 caches (a
KV pool narrower than the activations, ``--kv-dtype``): ``write_kv`` then rounds each row to
the cache's dtype (nearest even, as ``.to()``) and ``paged_attention`` returns float32.
Otherwise ``write_kv`` copies rows bit-exactly. ``paged_attention`` computes the softmax and
its accumulations in float32 and rounds the output to q's dtype once. On the CPU, with float16 /
bfloat16 caches the decode kernel (sequences with at most 8 query rows per KV head) reads the
cache directly, widening a vector at a time; for the other (prefill-like) sequences the pages
they read are widened into float32 scratch pages, each distinct page once (never the whole
pool), for the float32 prefill kernel. Every widening is exact, so the result is the float32
kernel's on the same values, rounded (nearest even) to q's dtype.
"""
from __future__ import annotations

import logging
import sys
import threading

import torch

from .build import _build_and_load, _want_cuda, compile_cuda_object, csrc_dir  # noqa: F401
from .reference import (BF16_PATH, FIFTEEN_BIT_PATHS, paged_attention_reference, qdequant_reference, qlinear_reference,  # noqa: F401
                        quantize_act_reference, rope_reference, silu_mul_reference,
                        write_kv_reference)

__all__ = [
    "load",
    "write_kv",
    "paged_attention",
    "qlinear",
    "qdequant",
    "qcpu_features",
    "qlinear_path_for",
    "rms_norm",
    "add_rms_norm",
    "silu_mul",
    "rope_",
    "llama_layers",
    "dense_gemv",
    "dense_gemv_tc",
    "paged_attention_tiled",
    "paged_attention_bf16",
    "qlinear_reference",
    "BF16_PATH",
    "FIFTEEN_BIT_PATHS",
    "quantize_act_reference",
    "qdequant_reference",
    "write_kv_reference",
    "paged_attention_reference",
    "silu_mul_reference",
    "rope_reference",
    "cuda_available",
    "compile_cuda_object",
    "csrc_dir",
]

logger = logging.getLogger("symphony.ops")

_lock = threading.Lock()
_loaded = False
_cuda_built = False


# --------------------------------------------------------------------------------------------
# Build / load
# --------------------------------------------------------------------------------------------
def load() -> None:
    """Build (first use only) and load the ops. Idempotent and thread-safe.

    The CUDA kernels are included when torch sees a GPU and a CUDA toolkit is found
    (``SYMPHONY_NO_CUDA=1`` forces a CPU-only build); if that build fails, a CPU-only build
    is tried so that CPU inference still works.
    """
    global _loaded, _cuda_built
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        with_cuda = _want_cuda()
        if with_cuda:
            try:
                _build_and_load(True)
            except Exception as e:  # noqa: BLE001 - fall back to the CPU kernels, loudly
                logger.warning("symphony: building the CUDA ops failed (%s); falling back to a "
                               "CPU-only build", e)
                print(f"symphony: WARNING: building the CUDA ops failed ({e}); "
                      "falling back to CPU-only ops", file=sys.stderr, flush=True)
                with_cuda = False
        if not with_cuda:
            _build_and_load(False)
        _register_fakes()
        _cuda_built = with_cuda
        _loaded = True


def cuda_available() -> bool:
    """Whether the CUDA kernels were built into the loaded library."""
    load()
    return _cuda_built


# --------------------------------------------------------------------------------------------
# Ops
# --------------------------------------------------------------------------------------------
def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Write k[t], v[t] into k_cache / v_cache at slots[t] (negative slots skipped), in place."""
    if not _loaded:
        load()
    torch.ops.symphony.write_kv(k, v, k_cache, v_cache, slots)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_table: torch.Tensor, cu_q_lens: torch.Tensor, kv_lens: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Causal attention of packed queries over the paged KV cache; see the module docstring."""
    if not _loaded:
        load()
    return torch.ops.symphony.paged_attention(q, k_cache, v_cache, page_table, cu_q_lens,
                                              kv_lens, float(scale))


def paged_attention_bf16(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         page_table: torch.Tensor, cu_q_lens: torch.Tensor, kv_lens: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """`paged_attention` (same arguments and checks) with bfloat16 products where they pay (CPU
    only): on a CPU with AMX-BF16, the sequences of 32 or more query rows (tokens x GQA group)
    and rows x kv_len of at least 8,192 (prompt chunks) round q, K, V and the softmax weights to
    bfloat16 and multiply on the AMX tiles, with float32 sums, softmax and output (csrc/cpu/attention_amx.cpp;
    float32, bfloat16 or float16 caches); the other sequences, and every call with a q that is
    not float32, a head_dim not a multiple of 32 or on a CPU without AMX, run
    `paged_attention`. The attention of ``--activations int8``."""
    if not _loaded:
        load()
    return torch.ops.symphony.paged_attention_bf16(q, k_cache, v_cache, page_table, cu_q_lens,
                                                   kv_lens, float(scale))


def qlinear(x: torch.Tensor, qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
            kind: int, group: int, path: int = -1) -> torch.Tensor:
    """``x @ W^T`` for a quantized weight W (layout: ``csrc/quant.h``; x float32 ``[M, K]``).

    ``path`` (CPU only): -1 picks a kernel by M and the CPU's features whose result is the
    float32 product with the dequantized weight up to ~3e-5 of ``|x| @ |W|^T`` (15-bit
    activations below 64 rows on AVX-512 VNNI CPUs and below 32 on AVX2 ones without AVX-512
    (the row kernel 12 below 4 rows, the 8-row tiles 11 from there),
    float32 register kernels below 32 rows elsewhere, the dense GEMM beyond); -2 the best
    int8-activation kernel (for every M on AVX-512 VNNI; dense from 32 rows elsewhere); the others force one (one this CPU lacks raises):
    float32 register kernels 0 scalar, 1 AVX2, 2 AVX-512; 3 dequantize + torch GEMM;
    int8-activation kernels (x rounded to int8 per block of 16 values, integer dot products:
    the product of W with that rounded x, see ``qlinear_reference``) 4 scalar, 5 AVX2
    (``vpmaddubsw``, 4 weight rows at a time), 6 AVX-VNNI, 7 AVX-512 VNNI, 8 AVX-512 VNNI with 16 weight rows a
    register; 9 the same with x rounded to 15 bits (AVX-512 VNNI); 10 and 11 int8 and 15-bit
    x on AVX2 alone (``vpmaddubsw``, 8 weight rows a register); 12 x rounded to 15 bits in
    path 5's row kernel (AVX2). `qlinear_path_for` says
    which kernel a choice takes for a given M on this CPU. Once `calibrate.ensure` has run
    (at engine start), -1 and -2 take the paths it measured fastest on this CPU instead of
    the rule above (among the same candidates; see ``ops/calibrate.py``).
    """
    if not _loaded:
        load()
    return torch.ops.symphony.qlinear(x, qs, scales, mins, int(kind), int(group), int(path))


def qdequant(qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, kind: int,
             group: int) -> torch.Tensor:
    """The quantized weight W as float32 ``[N, K]``."""
    if not _loaded:
        load()
    return torch.ops.symphony.qdequant(qs, scales, mins, int(kind), int(group))


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the rows of x ``[T, H]`` (float32 on the CPU; float32, float16 or bfloat16 on
    CUDA, computed in float32) with a float32 weight w ``[H]``:
    ``x * rsqrt(mean(x^2) + eps) * w``, one op instead of F.rms_norm's ~10 small ones."""
    if not _loaded:
        load()
    return torch.ops.symphony.rms_norm(x, w, float(eps))


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm at once (dtypes as `rms_norm`; on CUDA s is
    rounded to x's dtype before the norm, as torch's ``x + r``): ``(s, rms_norm(s, w))``
    with ``s = x + r``, both ``[T, H]``. On CUDA x may also be a float32 residual stream and r
    16-bit: s stays float32 and the norm comes out in r's dtype."""
    if not _loaded:
        load()
    return torch.ops.symphony.add_rms_norm(x, r, w, float(eps))


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """The SwiGLU of a fused gate/up projection (float32 on the CPU; float32, float16 or
    bfloat16 on CUDA, computed in float32): ``gu [T, 2I]`` ->
    ``silu(gu[:, :I]) * gu[:, I:]``, ``[T, I]``; rows of gu may be strided. One op for four
    (two slices, silu, mul); its exp is within 2 ulp (``silu_mul_reference``)."""
    if not _loaded:
        load()
    return torch.ops.symphony.silu_mul(gu)


def rope_(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, heads: int) -> None:
    """Rotary embedding in place (x float32 on the CPU; float32, float16 or bfloat16 on CUDA,
    where a position outside the table leaves its row unrotated instead of raising): rotate
    the first ``heads`` heads of each row of ``x [T, N]`` (rows may be strided), head_dim =
    ``2 * table.shape[1]`` values each, pair ``(2i, 2i + 1)`` by the angle ``positions[t] * inv_freq[i]`` whose ``(cos, sin)`` is
    ``table[positions[t], i]`` (``table``: float32 ``[max_positions, head_dim / 2, 2]``, the
    complex ``e^{i pos freq}`` table viewed as real). The complex multiply of the model, in one
    op instead of ~10 (``rope_reference``)."""
    if not _loaded:
        load()
    torch.ops.symphony.rope_(x, positions, table, int(heads))


def dense_gemv(x: torch.Tensor, w: torch.Tensor, float_out: bool = False) -> torch.Tensor:
    """``x @ w^T`` for ``x [M, K]`` and a dense ``w [N, K]``: ``[M, N]``, float32 when
    ``float_out``, else x's dtype. On CUDA the decode GEMV (csrc/cuda/dense.cu): float16 or
    bfloat16 x and w alike, 1 to 4 rows, K a multiple of 8, rows of x contiguous and 16-byte
    aligned, w contiguous; float32 accumulation. On the CPU torch's float32 matmul (a reference).
    The engine uses it where it measured it faster than cuBLAS (``engine.cuda_kernels``)."""
    if not _loaded:
        load()
    return torch.ops.symphony.dense_gemv(x, w, bool(float_out))


def dense_gemv_tc(x: torch.Tensor, w: torch.Tensor, float_out: bool = False, splits: int = 0) -> torch.Tensor:
    """`dense_gemv` on tensor cores (csrc/cuda/gemv_tc.cu): ``x [M, K]`` of 1 to 8 rows times a
    dense ``w [N, K]``, each weight read once whatever M; float16 or bfloat16 x and w alike, K a
    multiple of 8, rows of x contiguous and 16-byte aligned, w contiguous, compute capability
    8.0 or later; float32 accumulation. ``splits``: warps that share a 16-row group's K (1, 2,
    4, 8; 0 chooses from the shape). On the CPU `dense_gemv`'s reference (the same checks of M
    and splits)."""
    if not _loaded:
        load()
    return torch.ops.symphony.dense_gemv_tc(x, w, bool(float_out), int(splits))


def paged_attention_tiled(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          page_table: torch.Tensor, cu_q_lens: torch.Tensor, kv_lens: torch.Tensor,
                          scale: float, kernels: int = 3) -> torch.Tensor:
    """`paged_attention` (same arguments, same result) with the CUDA kernels ``kernels`` picks
    (csrc/cuda/attention_tiled.cu): 1 the query-tiled tensor-core kernel for sequences of 32 or
    more query tokens (a prompt read against each key once per tile of queries), 2 the
    split-key decode kernel for the other sequences, 3 both, 0 neither. They take float16 /
    bfloat16 with head_dim 64 or 128 and at most 8 query heads per KV head; every other call,
    and the part not picked, runs `paged_attention`'s kernels. On the CPU it is
    `paged_attention`."""
    if not _loaded:
        load()
    return torch.ops.symphony.paged_attention_tiled(q, k_cache, v_cache, page_table, cu_q_lens,
                                                    kv_lens, float(scale), int(kernels))


def llama_layers(x: torch.Tensor, positions: torch.Tensor, rope_table: torch.Tensor,
                 kv_pool: torch.Tensor, slots: torch.Tensor, page_table: torch.Tensor,
                 cu_q_lens: torch.Tensor, kv_lens: torch.Tensor, norms: list[torch.Tensor],
                 mats: list[torch.Tensor], kinds: list[int], groups: list[int],
                 biases: list[torch.Tensor | None], n_heads: int, n_kv_heads: int, scale: float,
                 eps: float, qpath: int) -> torch.Tensor:
    """A Llama decoder layer stack in one op (float32, CPU): from the embeddings x ``[T, H]`` to
    the residual stream after the last layer, writing every layer's K/V into ``kv_pool``
    ``[L, 2, num_pages, page_size, n_kv_heads, head_dim]``. The same ops in the same order as
    ``PagedLlama``'s Python loop (so the same values), called from C++: per layer, wqkv (+ bias),
    ``rope_``, ``write_kv``, ``paged_attention``, wo, ``add_rms_norm``, w_gate_up, ``silu_mul``,
    w_down, ``add_rms_norm``. ``norms``: 2 per layer (attn, mlp); ``mats``: 4 matrices per layer
    (wqkv, wo, w_gate_up, w_down) as 3 tensors each, ``(qs, scales, mins)`` of a quantized one
    (``kinds``/``groups``: its kind and group; ``qlinear`` path ``qpath``) or ``(w, w, w)`` of a
    dense float32 ``[N, K]`` one (kind -1); ``biases``: bqkv per layer or None."""
    if not _loaded:
        load()
    return torch.ops.symphony.llama_layers(x, positions, rope_table, kv_pool, slots, page_table,
                                           cu_q_lens, kv_lens, norms, mats, kinds, groups, biases,
                                           int(n_heads), int(n_kv_heads), float(scale),
                                           float(eps), int(qpath))


def qcpu_features() -> dict[str, bool]:
    """Which SIMD paths of qlinear this CPU runs: ``avx2`` (paths 1, 5), ``avx512`` (2),
    ``avx_vnni`` (6), ``avx512_vnni`` (7, 8, 9), and ``amx_bf16``: AMX with bfloat16 tiles,
    where the rule takes path 13 (the dense bfloat16 GEMM) for int8-activation batches;
    ``amx_tiles``: the OS lets this process use them and the ops were built for them, so that
    `paged_attention_bf16` runs prompt chunks on them."""
    if not _loaded:
        load()
    bits = int(torch.ops.symphony.qcpu_features())
    return {"avx2": bool(bits & 1), "avx512": bool(bits & 2), "avx_vnni": bool(bits & 4),
            "avx512_vnni": bool(bits & 8), "amx_bf16": bool(bits & 16), "amx_tiles": bool(bits & 32)}


def qlinear_path_for(path: int, m: int, n: int, k: int, kind: int) -> int:
    """The kernel ``qlinear(..., path)`` runs on this CPU for ``m`` rows of x and an ``[n, k]``
    weight of ``kind`` (0 u4, 1 i8): the automatic choices (-1, -2) resolved, as qlinear
    itself resolves them (by the calibrated table when one is installed); a forced path is
    returned as it is."""
    if not _loaded:
        load()
    return int(torch.ops.symphony.qlinear_path_for(int(path), int(m), int(n), int(k), int(kind)))


# Fake (meta) implementations, for torch.compile / FakeTensor tracing. They can only be
# registered once the ops exist, so load() registers them; the C++ library also names this
# module (set_python_module) so that torch imports it when it needs them.
def _write_kv_fake(k, v, k_cache, v_cache, slots) -> None:
    torch._check(k.dim() == 3 and k.shape == v.shape)
    torch._check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape)
    torch._check(slots.dim() == 1 and slots.shape[0] == k.shape[0])
    return None


def _paged_attention_fake(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, scale):
    torch._check(q.dim() == 3)
    torch._check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape)
    torch._check(page_table.dim() == 2 and kv_lens.dim() == 1 and cu_q_lens.dim() == 1)
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _qlinear_fake(x, qs, scales, mins, kind, group, path=-1):
    torch._check(x.dim() == 2 and qs.dim() == 2)
    return torch.empty((x.shape[0], qs.shape[0]), dtype=torch.float32, device=x.device)


def _qdequant_fake(qs, scales, mins, kind, group):
    torch._check(qs.dim() == 2)
    k = qs.shape[1] * (2 if kind == 0 else 1)
    return torch.empty((qs.shape[0], k), dtype=torch.float32, device=qs.device)


def _rms_norm_fake(x, w, eps):
    torch._check(x.dim() == 2 and w.dim() == 1)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _add_rms_norm_fake(x, r, w, eps):
    torch._check(x.dim() == 2 and r.shape == x.shape and w.dim() == 1)
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(x.shape, dtype=x.dtype, device=x.device))


def _silu_mul_fake(gu):
    torch._check(gu.dim() == 2 and gu.shape[1] % 2 == 0)
    return torch.empty((gu.shape[0], gu.shape[1] // 2), dtype=gu.dtype, device=gu.device)


def _rope_fake(x, positions, table, heads) -> None:
    torch._check(x.dim() == 2 and positions.dim() == 1 and table.dim() == 3)
    return None


def _dense_gemv_fake(x, w, float_out):
    torch._check(x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1])
    return torch.empty((x.shape[0], w.shape[0]), dtype=torch.float32 if float_out else x.dtype,
                       device=x.device)


def _dense_gemv_tc_fake(x, w, float_out, splits=0):
    return _dense_gemv_fake(x, w, float_out)


def _paged_attention_tiled_fake(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, scale, kernels=3):
    return _paged_attention_fake(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, scale)


# CPU implementations of the CUDA-first ops: the ops they stand in for, after the same checks.
def _dense_gemv_tc_cpu(x, w, float_out, splits=0):
    if x.dim() == 2 and not 1 <= x.shape[0] <= 8:
        raise RuntimeError(f"symphony::dense_gemv_tc: x must have 1 to 8 rows, got {x.shape[0]}")
    if splits not in (0, 1, 2, 4, 8):
        raise RuntimeError(f"symphony::dense_gemv_tc: splits must be 0 (chosen from the shape), 1, 2, "
                           f"4 or 8, got {splits}")
    return torch.ops.symphony.dense_gemv(x, w, float_out)


def _paged_attention_tiled_cpu(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, scale, kernels=3):
    if not 0 <= kernels <= 3:
        raise RuntimeError(f"symphony::paged_attention_tiled: kernels must be 0 to 3 (1: the query-tiled "
                           f"prefill kernel, 2: the split decode kernel, 3: both), got {kernels}")
    return torch.ops.symphony.paged_attention(q, k_cache, v_cache, page_table, cu_q_lens, kv_lens, scale)


_cpu_lib = None


def _llama_layers_fake(x, positions, rope_table, kv_pool, slots, page_table, cu_q_lens, kv_lens,
                       norms, mats, kinds, groups, biases, n_heads, n_kv_heads, scale, eps, qpath):
    torch._check(x.dim() == 2 and kv_pool.dim() == 6)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


_fakes_registered = False


def _ops_exist() -> bool:
    try:
        torch.ops.symphony.write_kv
        torch.ops.symphony.paged_attention
    except (AttributeError, RuntimeError):
        return False
    return True


def _register_fakes() -> None:
    global _fakes_registered
    if _fakes_registered:
        return
    torch.library.register_fake("symphony::write_kv", _write_kv_fake)
    torch.library.register_fake("symphony::paged_attention", _paged_attention_fake)
    torch.library.register_fake("symphony::paged_attention_bf16", _paged_attention_fake)
    torch.library.register_fake("symphony::qlinear", _qlinear_fake)
    torch.library.register_fake("symphony::qdequant", _qdequant_fake)
    torch.library.register_fake("symphony::rms_norm", _rms_norm_fake)
    torch.library.register_fake("symphony::add_rms_norm", _add_rms_norm_fake)
    torch.library.register_fake("symphony::silu_mul", _silu_mul_fake)
    torch.library.register_fake("symphony::rope_", _rope_fake)
    torch.library.register_fake("symphony::llama_layers", _llama_layers_fake)
    torch.library.register_fake("symphony::dense_gemv", _dense_gemv_fake)
    torch.library.register_fake("symphony::dense_gemv_tc", _dense_gemv_tc_fake)
    torch.library.register_fake("symphony::paged_attention_tiled", _paged_attention_tiled_fake)
    global _cpu_lib
    _cpu_lib = torch.library.Library("symphony", "IMPL")   # kept: the registrations live with it
    _cpu_lib.impl("dense_gemv_tc", _dense_gemv_tc_cpu, "CPU")
    _cpu_lib.impl("paged_attention_tiled", _paged_attention_tiled_cpu, "CPU")
    _fakes_registered = True


if _ops_exist():  # the library was loaded by other means before this module was imported
    _register_fakes()
