"""paged_attention_bf16 (CPU): bfloat16 products on the AMX tiles for sequences of 32 or more
query rows, paged_attention's float32 kernels for the rest, against the float64 reference.

The tolerance is bfloat16's: q, K, V and the softmax weights are rounded to 8 significant bits
(a relative error of 2^-9 each), the sums are float32. On a CPU without AMX-BF16 the op is
paged_attention exactly, and these tests check that."""
from __future__ import annotations

import math

import pytest
import torch

from symphony.engine import ops

from .test_ops import MIXED, make_batch, single_threaded


@pytest.fixture(scope="module", autouse=True)
def _built():
    ops.load()


def amx() -> bool:
    """Whether this process may use the AMX tiles, and so takes the tiled path."""
    return ops.qcpu_features()["amx_tiles"]


def reference(q, kc, vc, pt, cu, kvl, scale):
    return ops.paged_attention_reference(q.double(), kc.double(), vc.double(), pt, cu, kvl, scale).float()


# bfloat16 inputs: a score moves by ~|q| |k| 2^-8, an output by ~2^-8 of the values it averages
ATOL, RTOL = 3e-2, 2e-2


@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim", [(9, 3, 64), (4, 4, 64), (8, 2, 128), (6, 2, 32),
                                                           (12, 3, 96)])
def test_matches_the_reference_within_bfloat16(n_heads, n_kv_heads, head_dim):
    for seed, page_size in ((0, 16), (1, 5)):
        q, kc, vc, pt, cu, kvl = make_batch(**MIXED, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                            head_dim=head_dim, page_size=page_size, seed=seed)
        scale = 1.0 / math.sqrt(head_dim)
        out = ops.paged_attention_bf16(q, kc, vc, pt, cu, kvl, scale)
        assert out.shape == q.shape and out.dtype == q.dtype
        torch.testing.assert_close(out, reference(q, kc, vc, pt, cu, kvl, scale), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("q_len,kv_len", [(11, 11), (100, 2900), (300, 300), (64, 1000), (17, 4500)])
def test_long_prompts_and_chunks_deep_in_a_context(q_len, kv_len):
    """Key blocks of 64 cut by the causal mask at every offset, rows not a multiple of 16 (GQA 3)."""
    q, kc, vc, pt, cu, kvl = make_batch([q_len, 1], [kv_len, 700], n_heads=9, n_kv_heads=3, head_dim=64,
                                        seed=q_len)
    out = ops.paged_attention_bf16(q, kc, vc, pt, cu, kvl, 0.125)
    ref = reference(q, kc, vc, pt, cu, kvl, 0.125)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    err = (out - ref).abs().mean().item()
    assert err < 4e-3, err                              # on average ~2^-9 of |out| ~ 0.5


def test_few_rows_are_the_float32_kernels_exactly():
    """Decodes and short chunks (fewer than 32 rows), and a short prompt alone (48 rows x 16
    keys), run paged_attention's kernels: the same bits."""
    q, kc, vc, pt, cu, kvl = make_batch([1, 1, 3, 10, 1, 16], [500, 17, 40, 200, 3000, 16], n_heads=9, n_kv_heads=3,
                                        head_dim=64, seed=3)
    assert torch.equal(ops.paged_attention_bf16(q, kc, vc, pt, cu, kvl, 0.1),
                       ops.paged_attention(q, kc, vc, pt, cu, kvl, 0.1))


def test_prompt_rows_take_the_tiles_where_the_cpu_has_them():
    q, kc, vc, pt, cu, kvl = make_batch([1, 40], [300, 340], n_heads=9, n_kv_heads=3, head_dim=64, seed=4)
    got = ops.paged_attention_bf16(q, kc, vc, pt, cu, kvl, 0.125)
    exact = ops.paged_attention(q, kc, vc, pt, cu, kvl, 0.125)
    assert torch.equal(got[:1], exact[:1])                      # the decode: float32 kernels
    assert torch.equal(got[1:], exact[1:]) == (not amx())       # the prompt: rounded where AMX runs it
    torch.testing.assert_close(got, exact, atol=ATOL, rtol=RTOL)


def test_sixteen_bit_caches_and_odd_head_dims_are_paged_attention():
    for dtype, head_dim in ((torch.bfloat16, 64), (torch.float16, 64), (torch.float32, 40)):
        q, kc, vc, pt, cu, kvl = make_batch([50, 1], [80, 9], n_heads=4, n_kv_heads=2, head_dim=head_dim,
                                            seed=5, dtype=dtype)
        assert torch.equal(ops.paged_attention_bf16(q, kc, vc, pt, cu, kvl, 0.2),
                           ops.paged_attention(q, kc, vc, pt, cu, kvl, 0.2))


def test_strided_q_threads_and_repeats_give_the_same_bits():
    """q sliced out of a fused projection; one thread or the team, first call or tenth: each item
    reads all its keys itself, so the result does not depend on how the work is split."""
    q, kc, vc, pt, cu, kvl = make_batch(**MIXED, n_heads=9, n_kv_heads=3, head_dim=64, seed=6)
    fused = torch.randn(q.shape[0], 15, 64)
    fused[:, 2:11] = q
    qs = fused[:, 2:11]
    assert not qs.is_contiguous()
    want = ops.paged_attention_bf16(q, kc, vc, pt, cu, kvl, 0.1)
    assert torch.equal(ops.paged_attention_bf16(qs, kc, vc, pt, cu, kvl, 0.1), want)
    assert torch.equal(single_threaded(ops.paged_attention_bf16, q, kc, vc, pt, cu, kvl, 0.1), want)
    for _ in range(10):
        assert torch.equal(ops.paged_attention_bf16(q, kc, vc, pt, cu, kvl, 0.1), want)


def test_bad_input_is_refused_as_paged_attention_refuses_it():
    q, kc, vc, pt, cu, kvl = make_batch([40, 1], [45, 20], n_heads=4, n_kv_heads=2, head_dim=32, page_size=4,
                                        seed=14, spare_pages=1, extra_cols=0)
    ops.paged_attention_bf16(q, kc, vc, pt, cu, kvl, 0.2)
    bad = pt.clone()
    bad[1, 4] = 1000
    with pytest.raises(RuntimeError, match=r"page_table\[1, 4\] = 1000 is out of range"):
        ops.paged_attention_bf16(q, kc, vc, bad, cu, kvl, 0.2)
    with pytest.raises(RuntimeError, match="kv_len 1 < q_len 40"):
        ops.paged_attention_bf16(q, kc, vc, pt, cu, torch.tensor([1, 20], dtype=torch.int32), 0.2)
    with pytest.raises(RuntimeError, match="must be float32, float16 or bfloat16|dtype"):
        ops.paged_attention_bf16(q.double(), kc, vc, pt, cu, kvl, 0.2)


def test_opcheck():
    q, kc, vc, pt, cu, kvl = make_batch([1, 40, 0, 3], [9, 300, 4, 40], n_heads=4, n_kv_heads=2,
                                        head_dim=32, page_size=8, seed=12)
    torch.library.opcheck(torch.ops.symphony.paged_attention_bf16.default, (q, kc, vc, pt, cu, kvl, 0.25))
