"""Paged attention decode (``ops.paged_attention``): one query token per sequence over a
context of 128, 1024 and 4096 tokens, batches of 1 and 8, in the head shapes of SmolLM2-135M
(9 query / 3 KV heads of 64) and Llama-1B (32 / 8 of 64), float32, pages of 16 in shuffled
order (as the page allocator leaves them after churn)."""
from __future__ import annotations

import pytest
import torch

from symphony.engine import ops

SHAPES = {"smollm2": (9, 3, 64), "1b": (32, 8, 64)}
PAGE = 16


def decode_batch(heads: tuple, batch: int, context: int, seed: int = 0) -> dict:
    """The arguments of one decode step of ``batch`` sequences with ``context`` cached tokens
    each (the new token's included)."""
    n_heads, n_kv, head_dim = heads
    g = torch.Generator().manual_seed(seed)
    per = -(-context // PAGE)
    num_pages = batch * per + 1
    perm = torch.randperm(num_pages, generator=g)[: batch * per].int()
    return dict(
        q=torch.randn(batch, n_heads, head_dim, generator=g),                 # [B, heads, d]
        k_cache=torch.randn(num_pages, PAGE, n_kv, head_dim, generator=g),    # [pages, page, kv, d]
        v_cache=torch.randn(num_pages, PAGE, n_kv, head_dim, generator=g),
        page_table=perm.view(batch, per),                                     # [B, pages per seq]
        cu_q_lens=torch.arange(batch + 1, dtype=torch.int32),
        kv_lens=torch.full((batch,), context, dtype=torch.int32),
        scale=head_dim ** -0.5)


@pytest.mark.benchmark(group="paged_attention_decode", min_rounds=3, max_time=0.25)
@pytest.mark.parametrize("context", (128, 1024, 4096), ids=lambda c: f"ctx{c}")
@pytest.mark.parametrize("batch", (1, 8), ids=lambda b: f"batch{b}")
@pytest.mark.parametrize("shape", list(SHAPES))
def test_paged_attention_decode(benchmark, shape, batch, context):
    a = decode_batch(SHAPES[shape], batch, context)
    benchmark.extra_info["kv_bytes"] = 2 * batch * context * SHAPES[shape][1] * SHAPES[shape][2] * 4
    out = benchmark(ops.paged_attention, **a)
    assert out.shape == a["q"].shape
