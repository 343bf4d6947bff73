"""Which part of the model each tensor-parallel rank holds.

Megatron's split, as vLLM does it:

  * q, k and v (fused ``wqkv``) and gate/up (fused ``w_gate_up``) are split by
    output rows (column-parallel): rank r holds query heads
    ``[r * H/N, (r+1) * H/N)``, the KV heads those query heads read, and an
    ``I/N`` slice of the intermediate dimension; no communication;
  * o and down are split by input columns (row-parallel): each rank's partial
    product is summed over the ranks, one all-reduce after each;
  * the embedding, the norms and the LM head are replicated: every rank embeds
    its input itself, and only rank 0 computes logits (on the CPU a vocabulary
    split would add a gather per step to save a 28 MiB read on rank 0 only).

Grouped-query attention: with N dividing the KV heads each rank holds
``KV/N`` of them; with KV dividing N (more ranks than KV heads) each rank
holds the one KV head its query heads read, replicated across ``N/KV`` ranks.
A size that splits neither way, or that cuts a quantized group, is refused
with the sizes that would work.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ConfigError, ModelConfig
from ..quant import QWeight, Weight
from ..weights import LayerWeights, ModelWeights


class TPConfigError(ConfigError):
    """This model cannot be split into that many ranks."""


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size`` tensor-parallel ranks."""

    rank: int
    size: int

    def heads(self, c: ModelConfig) -> tuple[int, int]:
        """The query heads this rank holds, [start, stop)."""
        n = c.n_heads // self.size
        return self.rank * n, (self.rank + 1) * n

    def kv_heads(self, c: ModelConfig) -> tuple[int, int]:
        """The KV heads this rank holds, [start, stop)."""
        if c.n_kv_heads % self.size == 0:
            n = c.n_kv_heads // self.size
            return self.rank * n, (self.rank + 1) * n
        h0 = self.heads(c)[0] // (c.n_heads // c.n_kv_heads)     # the one its query heads read
        return h0, h0 + 1

    def intermediate(self, c: ModelConfig) -> tuple[int, int]:
        n = c.intermediate_size // self.size
        return self.rank * n, (self.rank + 1) * n


def _problem(c: ModelConfig, n: int, quantized: bool) -> str:
    """Why ``n`` ranks cannot split ``c`` ('' if they can)."""
    if n < 1:
        return "the size must be at least 1"
    if c.n_heads % n:
        return f"{c.n_heads} query heads do not split into {n}"
    if c.n_kv_heads % n and n % c.n_kv_heads:
        return f"{c.n_kv_heads} KV heads neither split into {n} nor divide it"
    if c.intermediate_size % n:
        return f"the intermediate size {c.intermediate_size} does not split into {n}"
    if quantized:
        for what, k in (("the attention output's", c.q_size // n), ("the MLP's", c.intermediate_size // n)):
            if k % 32:
                return f"{what} input columns per rank ({k}) are not a multiple of 32 (a quantized group)"
    return ""


def valid_sizes(c: ModelConfig, quantized: bool = True, upto: int = 16) -> list[int]:
    """The tensor-parallel sizes up to ``upto`` that split ``c``."""
    return [n for n in range(1, upto + 1) if not _problem(c, n, quantized)]


def check_tp(c: ModelConfig, n: int, quantized: bool = True) -> None:
    """TPConfigError naming the sizes that work, unless ``n`` ranks split ``c``."""
    why = _problem(c, n, quantized)
    if why:
        raise TPConfigError(f"--tp {n} cannot split {c.name or c.arch}: {why}; sizes that work: "
                            f"{', '.join(map(str, valid_sizes(c, quantized)))}")


def local_config(c: ModelConfig, shard: Shard) -> ModelConfig:
    """The shape one rank computes: its heads, its KV heads, its intermediate slice."""
    h0, h1 = shard.heads(c)
    k0, k1 = shard.kv_heads(c)
    i0, i1 = shard.intermediate(c)
    return c.replace(n_heads=h1 - h0, n_kv_heads=k1 - k0, intermediate_size=i1 - i0)


def rows(w: Weight, spans: list[tuple[int, int]]) -> Weight:
    """The rows in ``spans`` ([start, stop) pairs), in order."""
    idx = torch.cat([torch.arange(a, b) for a, b in spans])
    if isinstance(w, QWeight):
        if len(spans) == 1:
            a, b = spans[0]
            mins = w.mins[a:b].contiguous() if w.mins.numel() else w.mins
            return QWeight(w.qs[a:b].contiguous(), w.scales[a:b].contiguous(), mins, w.kind, w.group, w.source)
        return w.select_rows(idx)
    return w.index_select(0, idx.to(w.device)).contiguous()


def cols(w: Weight, start: int, stop: int) -> Weight:
    """Columns [start, stop)."""
    if isinstance(w, QWeight):
        return w.select_cols(start, stop)
    return w[:, start:stop].contiguous()


def qkv_spans(c: ModelConfig, shard: Shard) -> list[tuple[int, int]]:
    """This rank's rows of the fused q/k/v projection (and its bias)."""
    d = c.head_dim
    h0, h1 = shard.heads(c)
    k0, k1 = shard.kv_heads(c)
    q, kv = c.q_size, c.kv_size
    return [(h0 * d, h1 * d), (q + k0 * d, q + k1 * d), (q + kv + k0 * d, q + kv + k1 * d)]


def shard_layer(lw: LayerWeights, c: ModelConfig, shard: Shard) -> LayerWeights:
    """One layer's part for ``shard`` (``c``: the whole model's config)."""
    d = c.head_dim
    h0, h1 = shard.heads(c)
    i0, i1 = shard.intermediate(c)
    I = c.intermediate_size
    spans = qkv_spans(c, shard)
    bqkv = None if lw.bqkv is None else torch.cat([lw.bqkv[a:b] for a, b in spans])
    return LayerWeights(attn_norm=lw.attn_norm, wqkv=rows(lw.wqkv, spans), bqkv=bqkv,
                        wo=cols(lw.wo, h0 * d, h1 * d), mlp_norm=lw.mlp_norm,
                        w_gate_up=rows(lw.w_gate_up, [(i0, i1), (I + i0, I + i1)]),
                        w_down=cols(lw.w_down, i0, i1))


def shard_weights(w: ModelWeights, shard: Shard) -> ModelWeights:
    """The part of whole-model weights ``w`` that ``shard`` holds (the loader
    cuts a GGUF file's tensors the same way as it reads them: loader.py)."""
    c = w.config
    check_tp(c, shard.size, w.is_quantized())
    if shard.size == 1:
        return w
    layers = [shard_layer(lw, c, shard) for lw in w.layers]
    return ModelWeights(local_config(c, shard), w.embed, w.norm, w.lm_head, layers, w.rope_freq_factors)
