"""A KV pool narrower than the activations (CPU): float32 k, v and q beside bfloat16 / float16
caches (``EngineConfig.kv_dtype``, ``--kv-dtype``).

write_kv rounds each float32 row to the cache's dtype exactly as torch's ``.to()`` does (round
to nearest even; infinities and NaN kept), so the checks are bit-exact. paged_attention and
paged_attention_bf16 with a float32 q read the 16-bit caches as they are: every widening to
float32 is exact, so their result is the same kernels' on float32 copies of the caches' values
up to float32 rounding (the kernels' instances for each element type may fuse multiply-adds
differently: measured <= 2.4e-7), and the float32 output is not rounded (the reference: float64
on the same values)."""
from __future__ import annotations

import pytest
import torch

from symphony.engine import ops

from .test_ops import MIXED, make_batch

HALF = [torch.bfloat16, torch.float16]
IDS = ["bf16", "fp16"]


@pytest.fixture(scope="module", autouse=True)
def _built():
    ops.load()


def cast(kc, vc, dtype):
    return kc.to(dtype), vc.to(dtype)


@pytest.mark.parametrize("dtype", HALF, ids=IDS)
@pytest.mark.parametrize("n_kv,d", [(3, 64), (2, 40), (1, 8), (5, 24)])
def test_write_kv_rounds_as_torch_rounds(dtype, n_kv, d):
    """Row lengths that are and are not a multiple of the vector width; values at the rounding
    ties, beyond the 16-bit range, infinities and NaN."""
    g = torch.Generator().manual_seed(n_kv * d)
    T, pages, ps = 23, 9, 4
    k = torch.randn(T, n_kv, d, generator=g) * 3
    v = torch.randn(T, n_kv, d, generator=g) * 1e-3
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x477FF000, 0x7F7FFFFF], dtype=torch.int32)
    k.view(-1)[: bits.numel()] = bits.view(torch.float32)                  # ties, near-overflow
    k.view(-1)[10:13] = torch.tensor([float("inf"), -float("inf"), float("nan")])
    v.view(-1)[5] = 1e-30                                                   # below float16's range
    kc = torch.full((pages, ps, n_kv, d), 7.0).to(dtype)
    vc = kc.clone()
    slots = torch.randperm(pages * ps, generator=g)[:T]
    slots[4] = -1                                                           # skipped
    want_k, want_v = kc.clone(), vc.clone()
    ops.write_kv_reference(k, v, want_k, want_v, slots)
    ops.write_kv(k, v, kc, vc, slots)
    assert torch.equal(kc.isnan(), want_k.isnan())
    keep = ~want_k.isnan()
    assert torch.equal(kc[keep].view(torch.int16), want_k[keep].view(torch.int16))
    assert torch.equal(vc.view(torch.int16), want_v.view(torch.int16))
    # strided rows (k, v sliced out of a fused projection) round the same
    fused = torch.randn(T, 3 * n_kv, d, generator=g)
    kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
    ops.write_kv(fused[:, :n_kv], fused[:, n_kv: 2 * n_kv], kc2, vc2, slots)
    want_k2, want_v2 = torch.zeros_like(kc), torch.zeros_like(vc)
    ops.write_kv_reference(fused[:, :n_kv], fused[:, n_kv: 2 * n_kv], want_k2, want_v2, slots)
    assert torch.equal(kc2.view(torch.int16), want_k2.view(torch.int16))
    assert torch.equal(vc2.view(torch.int16), want_v2.view(torch.int16))


@pytest.mark.parametrize("dtype", HALF, ids=IDS)
@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128), (6, 2, 40)])
def test_paged_attention_float32_q_over_16_bit_caches(dtype, n_heads, n_kv_heads, head_dim):
    """Decodes (the lanes kernel reads the 16-bit pages), prompt chunks (pages widened first), an
    empty sequence: float32 out, equal to the float32 kernels on the caches' values widened."""
    q, kc, vc, pt, cu, kvl = make_batch(**MIXED, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                        head_dim=head_dim, seed=head_dim)
    kh, vh = cast(kc, vc, dtype)
    out = ops.paged_attention(q, kh, vh, pt, cu, kvl, 0.1)
    assert out.dtype == torch.float32 and out.shape == q.shape
    wide = ops.paged_attention(q, kh.float(), vh.float(), pt, cu, kvl, 0.1)
    torch.testing.assert_close(out, wide, atol=2e-6, rtol=1e-5)
    ref = ops.paged_attention_reference(q.double(), kh.double(), vh.double(), pt, cu, kvl, 0.1).float()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", HALF, ids=IDS)
def test_paged_attention_bf16_over_16_bit_caches(dtype):
    """The AMX tiles (where this CPU has them) pack 16-bit pages as they pack float32 ones: on
    caches holding the same values, the same bits; the rest of the batch as paged_attention."""
    q, kc, vc, pt, cu, kvl = make_batch(**MIXED, n_heads=9, n_kv_heads=3, head_dim=64, seed=31)
    kh, vh = cast(kc, vc, dtype)
    got = ops.paged_attention_bf16(q, kh, vh, pt, cu, kvl, 0.125)
    assert got.dtype == torch.float32
    if dtype == torch.bfloat16:          # float32 caches of bfloat16 values: rounding them is exact
        same = ops.paged_attention_bf16(q, kh.float(), vh.float(), pt, cu, kvl, 0.125)
        torch.testing.assert_close(got, same, atol=1e-6, rtol=1e-6)
    ref = ops.paged_attention_reference(q.double(), kh.double(), vh.double(), pt, cu, kvl, 0.125).float()
    torch.testing.assert_close(got, ref, atol=3e-2, rtol=2e-2)       # bfloat16 products (test_ops_bf16)
    few = [i for i, n in enumerate(MIXED["q_lens"]) if n * 3 < 32]    # sequences below the tiles' rows
    exact = ops.paged_attention(q, kh, vh, pt, cu, kvl, 0.125)
    for b in few:
        rows = slice(int(cu[b]), int(cu[b + 1]))
        assert torch.equal(got[rows], exact[rows]), b


def test_what_stays_refused():
    """Only a float32 q / k / v beside a 16-bit cache: not a 16-bit q beside another 16-bit cache,
    nor a wider cache than the activations."""
    q, kc, vc, pt, cu, kvl = make_batch([3, 1], [9, 20], n_heads=4, n_kv_heads=2, head_dim=32,
                                        page_size=4, seed=2)
    kb, vb = cast(kc, vc, torch.bfloat16)
    with pytest.raises(RuntimeError, match="q dtype Half must equal the cache dtype BFloat16"):
        ops.paged_attention(q.half(), kb, vb, pt, cu, kvl, 0.2)
    with pytest.raises(RuntimeError, match="q dtype BFloat16 must equal the cache dtype Float"):
        ops.paged_attention_bf16(q.bfloat16(), kc, vc, pt, cu, kvl, 0.2)
    with pytest.raises(RuntimeError, match="k/v dtypes"):
        ops.write_kv(torch.zeros(1, 2, 32).double(), torch.zeros(1, 2, 32).double(), kb, vb, torch.tensor([0]))
