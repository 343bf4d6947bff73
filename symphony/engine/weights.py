"""Model weights in the engine's layout, independent of the file they came from.

The projections are stored fused (``wqkv``: q, k and v stacked; ``w_gate_up``:
gate and up stacked) so that a layer is four matmuls.  Within each head, Q and
K rows are in the *interleaved* RoPE layout (dimensions 2i and 2i+1 rotate
together), as GGUF llama files store them; the loader permutes Hugging Face
"rotate-half" weights into it.  Permuting Q and K rows alike leaves every
attention score unchanged, so this is a storage choice, not a model change.

Each matrix (the projections, the embedding and lm_head) is either a dense tensor or a
`QWeight` kept quantized in memory (symphony/engine/quant.py); norms and biases are dense.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .config import ModelConfig
from .quant import QWeight, Weight


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor            # [hidden]
    wqkv: Weight                       # [q_size + 2*kv_size, hidden]
    bqkv: Optional[torch.Tensor]       # [q_size + 2*kv_size] (Qwen2) or None
    wo: Weight                         # [hidden, q_size]
    mlp_norm: torch.Tensor             # [hidden]
    w_gate_up: Weight                  # [2*intermediate, hidden]
    w_down: Weight                     # [hidden, intermediate]


@dataclass
class ModelWeights:
    config: ModelConfig
    embed: Weight                      # [vocab, hidden]
    norm: torch.Tensor                 # [hidden]
    lm_head: Weight                    # [vocab, hidden] (the embedding when tied)
    layers: list[LayerWeights]
    rope_freq_factors: Optional[torch.Tensor] = None  # [head_dim/2] (GGUF llama3)

    def to(self, device: torch.device, dtype: torch.dtype) -> "ModelWeights":
        """Move every tensor; norms and RoPE factors stay float32."""
        def mv(t, keep_fp32=False):
            if t is None:
                return None
            if isinstance(t, QWeight):          # quantized weights keep their bits
                return t.to(device)
            return t.to(device=device, dtype=torch.float32 if keep_fp32 else dtype).contiguous()
        embed = mv(self.embed)
        lm_head = embed if self.config.tie_embeddings else mv(self.lm_head)
        layers = [LayerWeights(mv(l.attn_norm, True), mv(l.wqkv), mv(l.bqkv, True), mv(l.wo),
                               mv(l.mlp_norm, True), mv(l.w_gate_up), mv(l.w_down))
                  for l in self.layers]
        return ModelWeights(self.config, embed, mv(self.norm, True), lm_head, layers,
                            mv(self.rope_freq_factors, True))

    def map_matrices(self, fn: Callable[[Weight], Weight]) -> "ModelWeights":
        """A copy with ``fn`` applied to every matrix (projections, embedding, lm_head); a tied
        lm_head stays the embedding."""
        embed = fn(self.embed)
        lm_head = embed if self.config.tie_embeddings else fn(self.lm_head)
        layers = [LayerWeights(l.attn_norm, fn(l.wqkv), l.bqkv, fn(l.wo), l.mlp_norm,
                               fn(l.w_gate_up), fn(l.w_down)) for l in self.layers]
        return ModelWeights(self.config, embed, self.norm, lm_head, layers, self.rope_freq_factors)

    def is_quantized(self) -> bool:
        """Whether any matrix is a QWeight."""
        found = []
        self.map_matrices(lambda t: found.append(isinstance(t, QWeight)) or t)
        return any(found)

    def dequantized(self) -> "ModelWeights":
        """Every QWeight as a float32 tensor (the same values the kernels compute with)."""
        return self.map_matrices(lambda t: t.dequantize() if isinstance(t, QWeight) else t)

    def nbytes(self) -> int:
        """Bytes held by the weights (quantized ones at their in-memory size)."""
        seen, total = set(), 0

        def add(t):
            nonlocal total
            if t is None or id(t) in seen:
                return
            seen.add(id(t))
            total += t.nbytes() if isinstance(t, QWeight) else t.numel() * t.element_size()
        for t in (self.embed, self.norm, self.lm_head, self.rope_freq_factors):
            add(t)
        for l in self.layers:
            for t in (l.attn_norm, l.wqkv, l.bqkv, l.wo, l.mlp_norm, l.w_gate_up, l.w_down):
                add(t)
        return total

    def num_parameters(self) -> int:
        n = self.embed.numel() + self.norm.numel()
        if not self.config.tie_embeddings:
            n += self.lm_head.numel()
        for l in self.layers:
            n += sum(t.numel() for t in (l.attn_norm, l.wqkv, l.wo, l.mlp_norm, l.w_gate_up, l.w_down))
            n += 0 if l.bqkv is None else l.bqkv.numel()
        return n


def random_weights(config: ModelConfig, seed: int = 0, scale: float = 0.05) -> ModelWeights:
    """Random float32 weights of the given shape (tests, GPU benchmarks)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, s=scale):
        return torch.randn(*shape, generator=g) * s

    c = config
    layers = []
    for _ in range(c.n_layers):
        layers.append(LayerWeights(
            attn_norm=1.0 + rnd(c.hidden_size, s=0.1),
            wqkv=rnd(c.q_size + 2 * c.kv_size, c.hidden_size),
            bqkv=rnd(c.q_size + 2 * c.kv_size) if c.attn_bias else None,
            wo=rnd(c.hidden_size, c.q_size),
            mlp_norm=1.0 + rnd(c.hidden_size, s=0.1),
            w_gate_up=rnd(2 * c.intermediate_size, c.hidden_size),
            w_down=rnd(c.hidden_size, c.intermediate_size),
        ))
    embed = rnd(c.vocab_size, c.hidden_size, s=1.0)
    lm_head = embed if c.tie_embeddings else rnd(c.vocab_size, c.hidden_size)
    return ModelWeights(c, embed, 1.0 + rnd(c.hidden_size, s=0.1), lm_head, layers)
