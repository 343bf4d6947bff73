"""A plain PyTorch Llama forward pass with a contiguous (non-paged) KV cache.

It is the yardstick for the paged engine: tests compare logits against it and
the benchmarks time its decode loop as the "plain PyTorch" baseline.  It shares
nothing with the paged path but the weights and the RoPE frequencies: RoPE is
done with cos/sin on even/odd pairs (not complex numbers), GQA by repeating K/V
heads, attention by ``scaled_dot_product_attention`` with an explicit mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .model import residual_dtype, rope_inv_freq
from .weights import ModelWeights


@dataclass
class ReferenceCache:
    k: torch.Tensor       # [n_layers, max_len, n_kv_heads, head_dim]
    v: torch.Tensor       # [n_layers, max_len, n_kv_heads, head_dim]
    length: int = 0


class ReferenceLlama:
    def __init__(self, weights: ModelWeights, device="cpu", dtype=torch.float32, kv_dtype=None):
        """``kv_dtype``: the cache's dtype (default ``dtype``); a narrower one rounds K and V as
        they are stored, as the engine's narrower KV pool does."""
        self.config = weights.config
        weights = weights.dequantized()   # quantized matrices: the same values, as float32
        self.w = weights.to(torch.device(device), dtype)
        self.device, self.dtype = torch.device(device), dtype
        self.kv_dtype = kv_dtype or dtype
        # float32 final norm and head in every dtype, and a float32 residual stream for a 16-bit
        # model (the norms' outputs, the matrices' inputs, in dtype), as the paged model does
        self.residual_dtype = residual_dtype(dtype)
        self.lm_head = self.w.lm_head if dtype == torch.float32 else weights.lm_head.to(self.device, torch.float32)
        self.inv_freq = rope_inv_freq(self.config, weights.rope_freq_factors).to(self.device)

    def new_cache(self, max_len: int) -> ReferenceCache:
        c = self.config
        shape = (c.n_layers, max_len, c.n_kv_heads, c.head_dim)
        return ReferenceCache(torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                              torch.zeros(shape, dtype=self.kv_dtype, device=self.device))

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [n, heads, head_dim]; pairs (2i, 2i+1) rotate by pos * inv_freq[i]
        ang = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]   # [n, head_dim/2]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        xf = x.float()
        even, odd = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
        return out.flatten(-2).to(x.dtype)

    @torch.inference_mode()
    def forward(self, tokens, positions=None, cache: ReferenceCache | None = None) -> torch.Tensor:
        """Append ``tokens`` to ``cache`` (a fresh one if None); return [n, vocab]
        float32 logits for every token."""
        c, w = self.config, self.w
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        n = tokens.shape[0]
        if cache is None:
            cache = self.new_cache(n)
        start = cache.length
        if positions is None:
            positions = torch.arange(start, start + n, device=self.device)
        positions = torch.as_tensor(positions, dtype=torch.long, device=self.device)
        total = start + n
        rep = c.n_heads // c.n_kv_heads
        # query i sits at slot start+i and sees slots 0..start+i
        mask = torch.ones(n, total, dtype=torch.bool, device=self.device).tril(diagonal=start)
        x = w.embed[tokens].to(self.residual_dtype)
        for i, lw in enumerate(w.layers):
            h = F.rms_norm(x, (c.hidden_size,), lw.attn_norm.to(x.dtype), c.rms_eps).to(self.dtype)
            qkv = h @ lw.wqkv.t()
            if lw.bqkv is not None:
                qkv = qkv + lw.bqkv.to(qkv.dtype)
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = self._rope(q.view(n, c.n_heads, c.head_dim), positions)
            k = self._rope(k.view(n, c.n_kv_heads, c.head_dim), positions)
            cache.k[i, start:total] = k
            cache.v[i, start:total] = v.view(n, c.n_kv_heads, c.head_dim)
            kk = cache.k[i, :total].to(self.dtype).repeat_interleave(rep, dim=1).transpose(0, 1)  # [heads, total, d]
            vv = cache.v[i, :total].to(self.dtype).repeat_interleave(rep, dim=1).transpose(0, 1)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask)  # [heads, n, d]
            x = x + o.transpose(0, 1).reshape(n, c.q_size) @ lw.wo.t()
            h = F.rms_norm(x, (c.hidden_size,), lw.mlp_norm.to(x.dtype), c.rms_eps).to(self.dtype)
            gate, up = (h @ lw.w_gate_up.t()).split(c.intermediate_size, dim=-1)
            x = x + (F.silu(gate) * up) @ lw.w_down.t()
        cache.length = total
        x = F.rms_norm(x.float(), (c.hidden_size,), w.norm, c.rms_eps)
        return x @ self.lm_head.t()
