"""The paged Llama forward pass: one pass over a batch of pred() calls.

All the attention bookkeeping travels in an explicit `BatchMeta` (no global
state).  Tokens of every sequence in the batch are packed into one dimension
``T``; sequence b owns rows ``cu_q_lens[b]:cu_q_lens[b+1]``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import ops, quant
from .cuda_kernels import CudaKernels
from .quant import QWeight, embedding, linear
from .config import ModelConfig, RopeScaling
from .kv_cache import KVPool
from .weights import ModelWeights
from .tp.group import STEP


@dataclass
class BatchMeta:
    tokens: torch.Tensor      # [T] int64 token ids
    positions: torch.Tensor   # [T] int64 RoPE positions
    slots: torch.Tensor       # [T] int64 page * page_size + offset, where each token's K/V goes
    page_table: torch.Tensor  # [B, max_pages] int32
    cu_q_lens: torch.Tensor   # [B + 1] int32 query offsets
    kv_lens: torch.Tensor     # [B] int32 slots per sequence, new tokens included
    logit_rows: torch.Tensor  # [R] int64 rows of T whose next-token logits are wanted
    fresh_prefill: bool = False  # one sequence whose cache held nothing before this pass

    _FIELDS = ("tokens", "positions", "slots", "page_table", "cu_q_lens", "kv_lens", "logit_rows")

    def pack(self) -> tuple[list[int], torch.Tensor]:
        """(sizes, one int64 tensor): what a tensor-parallel step sends the other ranks."""
        B, P = self.page_table.shape
        sizes = [self.tokens.numel(), B, P, self.logit_rows.numel(), int(self.fresh_prefill)]
        return sizes, torch.cat([getattr(self, f).reshape(-1).to(torch.int64).cpu() for f in self._FIELDS])

    @classmethod
    def unpack(cls, sizes: list[int], payload: torch.Tensor, device: torch.device) -> "BatchMeta":
        """The `BatchMeta` `pack` packed, on ``device``."""
        T, B, P, R, fresh = sizes[:5]
        t = payload.to(device).split([T, T, T, B * P, B + 1, B, R])
        i32 = torch.int32
        return cls(tokens=t[0], positions=t[1], slots=t[2], page_table=t[3].to(i32).view(B, P),
                   cu_q_lens=t[4].to(i32), kv_lens=t[5].to(i32), logit_rows=t[6], fresh_prefill=bool(fresh))


def rope_inv_freq(config: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """[head_dim/2] float32 inverse frequencies, with the model's scaling applied."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s: RopeScaling = config.rope_scaling
    if s.kind == "linear":
        inv = inv / s.factor
    elif s.kind == "llama3":
        low_wavelen = s.original_context_length / s.low_freq_factor
        high_wavelen = s.original_context_length / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (s.original_context_length / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor)
        scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = torch.where(mid, (1 - smooth) * inv / s.factor + smooth * inv, scaled)
    if freq_factors is not None:  # GGUF llama3 files ship the factors as a tensor
        inv = inv / freq_factors.to(torch.float64).cpu()
    return inv.to(torch.float32)


def residual_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a model's residual stream: float32 for a 16-bit model (each layer's output is
    added without rounding; only the norms' outputs, the matrices' inputs, are 16-bit: a
    bfloat16 stream rounds 2 x n_layers times, to steps of 1/128 of its size, and flipped
    SmolLM2's near-tie first answer token on a GPU, perf/RESULTS.md "GPU"), else the model's."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _mm_float32_out(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch.mm gives float32 output from ``dtype`` inputs on ``device`` (CUDA, torch
    2.8 and later)."""
    if device.type != "cuda":
        return False
    try:
        a = torch.ones(2, 8, device=device, dtype=dtype)
        out = torch.mm(a, a.t(), out_dtype=torch.float32)
        return out.dtype == torch.float32 and float(out[0, 0]) == 8.0
    except (TypeError, RuntimeError, NotImplementedError):
        return False


class PagedLlama:
    """A Llama-family decoder whose attention reads and writes the paged KV pool."""

    def __init__(self, weights: ModelWeights, device: torch.device, dtype: torch.dtype,
                 float32_head: bool = True, tp=None):
        """``tp``: this rank's `tp.group.TPGroup` when ``weights`` are one rank's shard
        (tensor parallelism): o and down are summed over the ranks, and rank 0
        sends each step to the others first."""
        self.config = weights.config
        self.tp = tp
        self.w = weights.to(device, dtype)
        self.device, self.dtype = device, dtype
        self.residual_dtype = residual_dtype(dtype)
        # float32_head: the final norm and lm_head run in float32 whatever the model dtype
        # (bfloat16 logits step by 0.125 near 20 and tie close candidates: SmolLM2's greedy
        # answer changes; perf/RESULTS.md). It costs a float32 copy of lm_head, read every
        # step; otherwise the head runs in the model dtype and its logits are widened.
        self.head_dtype = torch.float32 if float32_head else dtype
        # (a quantized lm_head computes in float32 anyway: no copy)
        self.lm_head = (self.w.lm_head if self.head_dtype == dtype or isinstance(self.w.lm_head, QWeight)
                        else weights.lm_head.to(device, self.head_dtype))
        # A 16-bit head on CUDA still returns float32 logits: cuBLAS accumulates in float32
        # and writes float32 (torch.mm's out_dtype), so no rounding to 0.125 steps and no extra
        # weight bytes. Where torch lacks it, the head's output is rounded and widened.
        self.head_f32_out = (self.head_dtype != torch.float32 and not isinstance(self.lm_head, QWeight)
                             and _mm_float32_out(device, self.head_dtype))
        c = self.config
        inv = rope_inv_freq(c, weights.rope_freq_factors)
        angles = torch.outer(torch.arange(c.max_context, dtype=torch.float32), inv)
        # [max_context, head_dim/2] complex64: e^{i * pos * freq}
        self.rope = torch.polar(torch.ones_like(angles), angles).to(device)
        # float32 on the CPU: RoPE and SwiGLU by the fused C++ ops (csrc/cpu/fused.cpp) on the
        # same table as real (cos, sin) pairs, [max_context, head_dim/2, 2]; torch's code otherwise
        self.rope_table = torch.view_as_real(self.rope)
        # On a GPU: our CUDA kernels where they were checked (element-wise) and measured faster
        # (the GEMVs of a few rows, the attention kernels) at start-up, before any graph is
        # captured (cuda_kernels.py)
        self.kernels = CudaKernels.build(
            device, dtype, c, [m for lw in self.w.layers for m in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)],
            self.lm_head if self.head_f32_out else None, self._head_torch)
        self.fused_elementwise = (device.type == "cpu" and dtype == torch.float32) or self.kernels.elementwise
        # float32 norm weights for the fused RMSNorm ops (converted once, not every call)
        self._norm32 = {id(t): t.float() for lw in self.w.layers for t in (lw.attn_norm, lw.mlp_norm)}
        self._norm32[id(self.w.norm)] = self.w.norm.float()
        # ... and on the CPU the whole layer stack is one C++ op (ops.llama_layers: the same ops
        # without ~35 Python calls a layer) on these lists of the layers' tensors; None: the
        # Python loop (not with tensor parallelism: its all-reduces sit between the ops)
        self.layer_stack = (self._stack_args() if self.fused_elementwise and device.type == "cpu"
                            and tp is None else None)
        self.scale = 1.0 / math.sqrt(c.head_dim)
        # A prompt into an empty file attends by scaled_dot_product_attention (flash attention)
        # on a GPU. Not on the CPU: there our paged kernel took 0.89-0.96x of SDPA's time for
        # SmolLM2 prompts of 512 and 1,500 tokens (perf/bench_prefill.py), and SDPA's 16-bit
        # CPU kernel rounds the probabilities. Tests switch it on to check it.
        self.fused_prefill = device.type == "cuda"

    @torch.inference_mode()
    def forward(self, meta: BatchMeta, kv: KVPool, head: bool = True) -> torch.Tensor | None:
        """Write the batch's K/V into the pool; return [R, vocab] float32 logits
        (``head`` False: the other ranks of a tensor-parallel group need none)."""
        c, w = self.config, self.w
        if self.tp is not None and self.tp.rank == 0:
            self.tp.send(STEP, *meta.pack())
        x = embedding(meta.tokens, w.embed, self.dtype)            # [T, hidden]
        if self.layer_stack is not None and not (meta.fresh_prefill and self.fused_prefill):
            # quant.qlinear_path(): the path QWeight.linear would ask qlinear for
            x = ops.llama_layers(x, meta.positions, self.rope_table, kv.pool, meta.slots,
                                 meta.page_table, meta.cu_q_lens, meta.kv_lens, *self.layer_stack,
                                 c.n_heads, c.n_kv_heads, self.scale, c.rms_eps,
                                 quant.qlinear_path())                # [T, hidden]
        else:
            x = self._layers(x, meta, kv)
        if self.tp is not None:
            self.tp.finish(x)                                       # a GPU rank's hang shows here
        if not head:
            return None
        x = x.index_select(0, meta.logit_rows)                      # [R, hidden]
        x = self._norm(x, w.norm).to(self.head_dtype)
        if self.head_f32_out:
            return self.kernels.head(x, self.lm_head, self._head_torch)  # [R, vocab] float32
        return linear(x, self.lm_head).float()                      # [R, vocab]

    @staticmethod
    def _head_torch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """float32 logits of a 16-bit head by cuBLAS (float32 accumulation and output)."""
        return torch.mm(x, w.t(), out_dtype=torch.float32)

    def _linear(self, x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ w^T (+ bias)``: our GEMV where it was chosen, else `quant.linear`."""
        if bias is None and isinstance(w, torch.Tensor) and self.kernels.gemv:
            return self.kernels.linear(x, w)
        return linear(x, w, bias)

    def _layers(self, x: torch.Tensor, meta: BatchMeta, kv: KVPool) -> torch.Tensor:
        """The decoder layers in Python: embeddings x ``[T, hidden]`` -> the residual stream
        after the last layer; writes every layer's K/V into the pool."""
        c, w = self.config, self.w
        T = meta.tokens.shape[0]
        rot = None if self.fused_elementwise else self.rope[meta.positions].unsqueeze(1)  # [T, 1, head_dim/2]
        x = x.to(self.residual_dtype)
        h = self._norm(x, w.layers[0].attn_norm).to(self.dtype) if w.layers else x
        for i, lw in enumerate(w.layers):
            qkv = self._linear(h, lw.wqkv, None if lw.bqkv is None else lw.bqkv.to(h.dtype))
            q, k, v = self._rotate(qkv, meta.positions, rot)        # [T, heads, head_dim] each
            k_cache, v_cache = kv.layer(i)
            ops.write_kv(k, v, k_cache, v_cache, meta.slots)         # token-strided views are fine
            if meta.fresh_prefill and self.fused_prefill:   # nothing cached before: fused causal attention
                o = self._causal_attention(q, k, v)
            elif q.device.type == "cpu" and quant.int8_activations():   # bfloat16 products (AMX)
                o = ops.paged_attention_bf16(q, k_cache, v_cache, meta.page_table, meta.cu_q_lens,
                                             meta.kv_lens, self.scale)
            else:
                o = self.kernels.paged_attention(q, k_cache, v_cache, meta.page_table, meta.cu_q_lens,
                                                 meta.kv_lens, self.scale)  # [T, n_heads, head_dim]
            attn = self._linear(o.reshape(T, c.q_size), lw.wo)
            if self.tp is not None:                                 # row-parallel: sum the ranks' parts
                self.tp.all_reduce(attn)
            x, h = self._add_norm(x, attn, lw.mlp_norm)
            gu = self._linear(h, lw.w_gate_up)                      # [T, 2 * intermediate]
            down = self._linear(self._swiglu(gu), lw.w_down)
            if self.tp is not None:
                self.tp.all_reduce(down)
            if i + 1 < len(w.layers):                               # the residual and the next norm
                x, h = self._add_norm(x, down, w.layers[i + 1].attn_norm)
            else:
                x = x + down                                        # [T, hidden]
        return x

    def _stack_args(self) -> tuple[list, list, list, list, list] | None:
        """``(norms, mats, kinds, groups, biases)`` of every layer for ``ops.llama_layers``, or
        None when a matrix is neither quantized nor a float32 tensor (no copies: the lists hold
        the layers' own tensors)."""
        norms, mats, kinds, groups, biases = [], [], [], [], []
        for lw in self.w.layers:
            norms += [lw.attn_norm.float(), lw.mlp_norm.float()]
            for m in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down):
                if isinstance(m, QWeight):
                    mats += [m.qs, m.scales, m.mins]
                    kinds.append(m.kind)
                    groups.append(m.group)
                elif m.dtype == torch.float32:
                    mats += [m, m, m]                               # kind -1: at::linear(x, m)
                    kinds.append(-1)
                    groups.append(0)
                else:
                    return None
            biases.append(None if lw.bqkv is None else lw.bqkv.float())
        return norms, mats, kinds, groups, biases

    def _rotate(self, qkv: torch.Tensor, positions: torch.Tensor,
                rot: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[T, n_heads, head_dim]``, k and v ``[T, n_kv_heads, head_dim]`` of the fused
        projection qkv ``[T, q_size + 2 * kv_size]``, q and k rotated by RoPE (positions [T];
        rot: their complex factors ``[T, 1, head_dim/2]``, None on the fused path)."""
        c = self.config
        T, qk_heads = qkv.shape[0], c.n_heads + c.n_kv_heads
        if rot is None:                  # float32 CPU: rotate q and k in place, then views
            ops.rope_(qkv, positions, self.rope_table, qk_heads)
            return qkv.view(T, -1, c.head_dim).split([c.n_heads, c.n_kv_heads, c.n_kv_heads], dim=1)
        # [T, n_heads + n_kv_heads, head_dim/2] as complex: rotate q and k at once
        qk = torch.view_as_complex(
            qkv[:, : c.q_size + c.kv_size].float().reshape(T, qk_heads, c.head_dim // 2, 2))
        qk = torch.view_as_real(qk * rot).reshape(T, qk_heads, c.head_dim).to(qkv.dtype)
        v = qkv[:, c.q_size + c.kv_size:].view(T, c.n_kv_heads, c.head_dim)
        return qk[:, : c.n_heads], qk[:, c.n_heads:], v

    def _swiglu(self, gu: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of the fused gate/up projection gu ``[T, 2 * intermediate]``."""
        if self.fused_elementwise:
            return ops.silu_mul(gu)
        i = self.config.intermediate_size
        return F.silu(gu[:, :i]) * gu[:, i:]

    def _fused_norm(self, x: torch.Tensor) -> bool:
        """Whether our RMSNorm ops take x (float32 on the CPU, any dtype on a GPU whose kernels
        were checked; torch's otherwise)."""
        if x.dim() != 2:
            return False
        if x.device.type == "cpu":
            return x.dtype == torch.float32
        return self.kernels.elementwise

    def _w32(self, weight: torch.Tensor) -> torch.Tensor:
        """A norm's weight as float32 (the model's own converted once)."""
        w32 = self._norm32.get(id(weight))
        return weight.float() if w32 is None else w32

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of the rows of x ``[T, hidden]`` (the model's eps)."""
        if self._fused_norm(x):
            return ops.rms_norm(x, self._w32(weight), self.config.rms_eps)
        return F.rms_norm(x, (self.config.hidden_size,), weight.to(x.dtype), self.config.rms_eps)

    def _add_norm(self, x: torch.Tensor, r: torch.Tensor,
                  weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and the following RMSNorm: ``(x + r, norm(x + r))``, ``[T, hidden]``;
        the sum in x's dtype (the residual stream's), the norm in r's (the model's)."""
        if self._fused_norm(x) and (r.dtype == x.dtype or x.is_cuda):
            return ops.add_rms_norm(x, r, self._w32(weight), self.config.rms_eps)
        s = x + r
        return s, F.rms_norm(s, (self.config.hidden_size,), weight.to(s.dtype),
                             self.config.rms_eps).to(r.dtype)

    def _causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of a whole prompt over its own K/V ([T, heads, head_dim]
        each) by ``scaled_dot_product_attention`` (flash attention on a GPU): the
        same result as the paged kernel when the file was empty, without
        walking the pages."""
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=self.scale,
            enable_gqa=self.config.n_heads != self.config.n_kv_heads)   # [1, n_heads, T, head_dim]
        return o[0].transpose(0, 1)
