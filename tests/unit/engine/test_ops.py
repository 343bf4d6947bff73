"""Tests of the symphony C++/CUDA ops against their pure-PyTorch references."""
from __future__ import annotations

import math

import pytest
import torch

from symphony.engine import ops

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no CUDA device"))]


def single_threaded(fn, *args):
    """fn(*args) with torch on one thread (the kernels split work differently)."""
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        return fn(*args)
    finally:
        torch.set_num_threads(n)


@pytest.fixture(scope="module", autouse=True)
def _built():
    ops.load()


def _device_ok(device: str) -> None:
    if device == "cuda" and not ops.cuda_available():
        pytest.skip("CUDA kernels were not built")


def make_batch(q_lens, kv_lens, *, n_heads, n_kv_heads, head_dim, page_size=16, dtype=torch.float32,
               device="cpu", seed=0, spare_pages=7, extra_cols=3):
    """A random paged batch: caches filled with noise, each sequence's pages shuffled."""
    g = torch.Generator().manual_seed(seed)
    B = len(q_lens)
    need = [-(-kv // page_size) for kv in kv_lens]
    num_pages = sum(need) + spare_pages
    perm = torch.randperm(num_pages, generator=g).tolist()
    max_pages = max(need + [0]) + extra_cols
    # Unused entries hold garbage (here: huge / negative ids): the op must not read them.
    page_table = torch.randint(-5, 10**6, (B, max_pages), generator=g, dtype=torch.int32)
    pos = 0
    for b, n in enumerate(need):
        page_table[b, :n] = torch.tensor(perm[pos:pos + n], dtype=torch.int32)
        pos += n
    T = sum(q_lens)
    shape = (num_pages, page_size, n_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(T, n_heads, head_dim, generator=g).to(dtype)
    cu = torch.zeros(B + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int32), 0)
    kvl = torch.tensor(kv_lens, dtype=torch.int32)
    t = [x.to(device) for x in (q, k_cache, v_cache, page_table, cu, kvl)]
    return t


MIXED = dict(  # decodes, prefill chunks, an empty sequence, kv_len not a multiple of page_size
    q_lens=[1, 37, 0, 1, 5, 130, 1, 2, 16],
    kv_lens=[1, 37, 20, 300, 77, 181, 16, 33, 16 * 9 + 5],
)


def shaped_batch(case, device, dtype=torch.float32):
    """The batches of the shape tests. On CUDA, decode batches split each sequence's keys
    among blocks; "unaligned_cache" (head_dim 30, caches starting off a 16-byte boundary)
    takes the kernel's scalar-load path."""
    kw = dict(n_heads=9, n_kv_heads=3, head_dim=64, page_size=16, device=device, dtype=dtype)
    if case == "decode_batch":
        return make_batch([1] * 12, [1, 2, 15, 16, 17, 100, 255, 256, 257, 500, 31, 64], seed=2, **kw)
    if case == "single_prefill":
        return make_batch([300], [300], seed=3, **kw)
    if case == "long_decode":
        return make_batch([1, 3], [3000, 1500], seed=4, **kw)
    if case == "odd_dims":  # head_dim not a multiple of 16 bytes in float32, GQA group 10, page size 1
        kw.update(n_heads=20, n_kv_heads=2, head_dim=40, page_size=1)
        return make_batch([1, 9, 2], [10, 40, 2], seed=5, **kw)
    assert case == "unaligned_cache"
    kw.update(n_heads=6, n_kv_heads=2, head_dim=30, page_size=8)
    q, kc, vc, pt, cu, kvl = make_batch([1, 1, 4, 1], [700, 3, 90, 129], seed=8, **kw)

    def shifted(x):  # the same values, one element past the allocation's start
        buf = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
        buf[1:] = x.flatten()
        return buf[1:].view(x.shape)
    return q, shifted(kc), shifted(vc), pt, cu, kvl


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (9, 3)])
@pytest.mark.parametrize("head_dim", [64, 32])
def test_paged_attention_matches_reference(device, n_heads, n_kv_heads, head_dim):
    _device_ok(device)
    for seed, page_size in ((0, 16), (1, 5)):
        q, kc, vc, pt, cu, kvl = make_batch(**MIXED, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                            head_dim=head_dim, page_size=page_size, seed=seed,
                                            device=device)
        scale = 1.0 / math.sqrt(head_dim)
        out = ops.paged_attention(q, kc, vc, pt, cu, kvl, scale)
        ref = ops.paged_attention_reference(q, kc, vc, pt, cu, kvl, scale)
        assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["decode_batch", "single_prefill", "long_decode", "odd_dims",
                                  "unaligned_cache"])
def test_paged_attention_shapes(device, case):
    """Decode batches, one long prefill, a lone long decode (split keys), unusual dims."""
    _device_ok(device)
    q, kc, vc, pt, cu, kvl = shaped_batch(case, device)
    scale = 0.125
    out = ops.paged_attention(q, kc, vc, pt, cu, kvl, scale)
    ref = ops.paged_attention_reference(q, kc, vc, pt, cu, kvl, scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_strided_q_and_threads(device):
    """q may be a token-strided slice of a fused projection; results do not depend on threads."""
    _device_ok(device)
    q, kc, vc, pt, cu, kvl = make_batch(**MIXED, n_heads=9, n_kv_heads=3, head_dim=64, seed=6,
                                        device=device)
    fused = torch.randn(q.shape[0], 15, 64, device=device)
    fused[:, 2:11] = q
    qs = fused[:, 2:11]
    assert not qs.is_contiguous()
    ref = ops.paged_attention_reference(q, kc, vc, pt, cu, kvl, 0.1)
    out = ops.paged_attention(qs, kc, vc, pt, cu, kvl, 0.1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    if device == "cpu":
        out1 = single_threaded(ops.paged_attention, q, kc, vc, pt, cu, kvl, 0.1)
        torch.testing.assert_close(out1, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no CUDA device"))])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["mixed", "decode_batch", "long_decode", "unaligned_cache"])
def test_paged_attention_half_cuda(device, dtype, case):
    _device_ok(device)
    if case == "mixed":
        q, kc, vc, pt, cu, kvl = make_batch(**MIXED, n_heads=9, n_kv_heads=3, head_dim=64, seed=7,
                                            device=device, dtype=dtype)
    else:
        q, kc, vc, pt, cu, kvl = shaped_batch(case, device, dtype)
    out = ops.paged_attention(q, kc, vc, pt, cu, kvl, 0.125)
    ref = ops.paged_attention_reference(q, kc, vc, pt, cu, kvl, 0.125)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


# --------------------------------------------------------------------------------------------
# float16 / bfloat16 on the CPU
# --------------------------------------------------------------------------------------------
# The CPU kernel widens q and the K/V it reads to float32 exactly (in place for decode-like
# sequences, through float32 scratch pages for prefill-like ones), computes in float32 and
# rounds the output once. So against the float32 reference on the same (already rounded) values
# it is off by at most half an ulp of the dtype, 2^-9 (bfloat16) / 2^-12 (float16) relative,
# plus float32 summation-order noise (1e-5 absolute; the float32 tests use the same). Stated
# tolerance: rtol 2^-8 / 2^-11 (one ulp), atol 1e-5. Against the reference run in the dtype
# itself (also float32 accumulation, rounded once) the two roundings may land one ulp apart.
HALF = [torch.bfloat16, torch.float16]
HALF_RTOL = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _check_half(out, q, kc, vc, pt, cu, kvl, scale):
    dtype = q.dtype
    assert out.dtype == dtype and out.shape == q.shape
    ref32 = ops.paged_attention_reference(q.float(), kc.float(), vc.float(), pt, cu, kvl, scale)
    torch.testing.assert_close(out.float(), ref32, rtol=HALF_RTOL[dtype], atol=1e-5)
    ref = ops.paged_attention_reference(q, kc, vc, pt, cu, kvl, scale)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 * HALF_RTOL[dtype], atol=1e-5)


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (9, 3)])
@pytest.mark.parametrize("head_dim", [64, 32])
def test_paged_attention_half_cpu_matches_reference(dtype, n_heads, n_kv_heads, head_dim):
    """Mixed prefill + decode batch (an empty sequence, ragged last pages), MHA and GQA."""
    for seed, page_size in ((0, 16), (1, 5)):
        q, kc, vc, pt, cu, kvl = make_batch(**MIXED, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                            head_dim=head_dim, page_size=page_size, seed=seed,
                                            dtype=dtype)
        out = ops.paged_attention(q, kc, vc, pt, cu, kvl, 1.0 / math.sqrt(head_dim))
        _check_half(out, q, kc, vc, pt, cu, kvl, 1.0 / math.sqrt(head_dim))


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", ["decode_batch", "long_decode", "odd_dims", "odd_page_bytes"])
def test_paged_attention_half_cpu_shapes(dtype, case):
    """Decode batches, a long decode (split keys), head_dim off the vector width, page size 1,
    pages whose element count is no multiple of the vector width (the scalar widening tail)."""
    kw = dict(n_heads=9, n_kv_heads=3, head_dim=64, page_size=16, dtype=dtype)
    if case == "decode_batch":
        batch = make_batch([1] * 12, [1, 2, 15, 16, 17, 100, 255, 256, 257, 500, 31, 64], seed=2, **kw)
    elif case == "long_decode":
        batch = make_batch([1, 3], [3000, 1500], seed=4, **kw)
    elif case == "odd_page_bytes":
        kw.update(n_heads=2, n_kv_heads=1, head_dim=20, page_size=3)   # 60 elements a page
        batch = make_batch([1, 7, 3], [11, 7, 30], seed=8, **kw)
    else:
        kw.update(n_heads=20, n_kv_heads=2, head_dim=40, page_size=1)
        batch = make_batch([1, 9, 2], [10, 40, 2], seed=5, **kw)
    out = ops.paged_attention(*batch, 0.125)
    _check_half(out, *batch, 0.125)


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_paged_attention_half_cpu_shared_pages(dtype):
    """Forked sequences share pages, read in place by decode-like sequences and widened once
    for the prefill-like one: every sequence must still see its own table; one sharer has no
    queries."""
    q_lens, kv_lens = [1, 4, 0, 1, 2], [40, 37, 48, 45, 33]
    q, kc, vc, pt, cu, kvl = make_batch(q_lens, kv_lens, n_heads=9, n_kv_heads=3, head_dim=64,
                                        page_size=8, seed=20, dtype=dtype)
    # sequences 1..4 fork sequence 0's first four pages (32 slots); 3 also repeats a page
    for b in range(1, 5):
        pt[b, :4] = pt[0, :4]
    pt[3, 5] = pt[0, 1]
    out = ops.paged_attention(q, kc, vc, pt, cu, kvl, 0.125)
    _check_half(out, q, kc, vc, pt, cu, kvl, 0.125)
    # and the same batch in float32 gives the same values, rounded once
    out32 = ops.paged_attention(q.float(), kc.float(), vc.float(), pt, cu, kvl, 0.125)
    torch.testing.assert_close(out.float(), out32, rtol=HALF_RTOL[dtype], atol=1e-6)


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_paged_attention_half_cpu_strided_q_and_threads(dtype):
    q, kc, vc, pt, cu, kvl = make_batch(**MIXED, n_heads=9, n_kv_heads=3, head_dim=64, seed=6,
                                        dtype=dtype)
    fused = torch.randn(q.shape[0], 15, 64).to(dtype)
    fused[:, 2:11] = q
    qs = fused[:, 2:11]
    assert not qs.is_contiguous()
    out = ops.paged_attention(qs, kc, vc, pt, cu, kvl, 0.1)
    _check_half(out, q, kc, vc, pt, cu, kvl, 0.1)
    out1 = single_threaded(ops.paged_attention, q, kc, vc, pt, cu, kvl, 0.1)
    _check_half(out1, q, kc, vc, pt, cu, kvl, 0.1)


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_write_kv_half_then_attention(dtype):
    """write_kv in a reduced dtype is a bit-exact row copy (token-strided k included); attention
    over what it wrote equals dense causal SDPA in float32 on the same values."""
    g = torch.Generator().manual_seed(21)
    n_heads, n_kv, d, ps = 9, 3, 64, 16
    pool = torch.randn(2, 2, 12, ps, n_kv, d, generator=g).to(dtype)
    before = pool.clone()
    kc, vc = pool[1, 0], pool[1, 1]
    L = 70
    pages = torch.tensor([7, 2, 9, 0, 5], dtype=torch.int32)
    fused = torch.randn(L, 2 * n_kv + 1, d, generator=g).to(dtype)
    k = fused[:, 1:1 + n_kv]
    v = torch.randn(L, n_kv, d, generator=g).to(dtype)
    q = torch.randn(L, n_heads, d, generator=g).to(dtype)
    slots = (pages.long()[torch.arange(L) // ps] * ps + torch.arange(L) % ps)
    slots[3] = -1                                       # skipped
    ops.write_kv(k, v, kc, vc, slots)
    expect = before.clone()
    ops.write_kv_reference(k, v, expect[1, 0], expect[1, 1], slots)
    assert torch.equal(pool.view(torch.int16), expect.view(torch.int16))   # bit-exact
    k_cache_page = kc[slots[5] // ps, slots[5] % ps]
    assert torch.equal(k_cache_page.view(torch.int16), k[5].view(torch.int16))
    # attention over the written pages (slot 3 keeps the noise that was there)
    keys = kc.reshape(-1, n_kv, d)[slots.clamp_min(0)].clone()
    vals = vc.reshape(-1, n_kv, d)[slots.clamp_min(0)].clone()
    keys[3] = before[1, 0].reshape(-1, n_kv, d)[pages[0] * ps + 3]
    vals[3] = before[1, 1].reshape(-1, n_kv, d)[pages[0] * ps + 3]
    out = ops.paged_attention(q, kc, vc, pages[None], torch.tensor([0, L], dtype=torch.int32),
                              torch.tensor([L], dtype=torch.int32), 1 / 8)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1), keys.float().transpose(0, 1).repeat_interleave(3, 0),
        vals.float().transpose(0, 1).repeat_interleave(3, 0), is_causal=True, scale=1 / 8).transpose(0, 1)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, rtol=HALF_RTOL[dtype], atol=1e-5)


def test_half_dtypes_must_match():
    q, kc, vc, pt, cu, kvl = make_batch([2, 1], [5, 20], n_heads=4, n_kv_heads=2, head_dim=32,
                                        page_size=4, seed=22, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="q dtype Half must equal the cache dtype BFloat16"):
        ops.paged_attention(q.half(), kc, vc, pt, cu, kvl, 0.2)
    with pytest.raises(RuntimeError, match="v_cache dtype"):
        ops.paged_attention(q, kc, vc.float(), pt, cu, kvl, 0.2)
    with pytest.raises(RuntimeError, match="must equal the cache dtype"):   # float32 into 16 bits is
        ops.write_kv(torch.zeros(1, 2, 32).half(), torch.zeros(1, 2, 32).half(), kc, vc,  # rounded;
                     torch.tensor([0]))                                   # float16 into bfloat16 not
    with pytest.raises(RuntimeError, match="must equal the cache dtype"):
        ops.write_kv(kc[:1, :1, :, :].reshape(1, 2, 32), kc[:1, :1].reshape(1, 2, 32),
                     kc.float(), vc.float(), torch.tensor([0]))           # nor 16 bits into float32


# --------------------------------------------------------------------------------------------
# write_kv
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_write_kv(device):
    _device_ok(device)
    g = torch.Generator().manual_seed(10)
    num_pages, page_size, n_kv, d = 6, 4, 3, 32
    pool = torch.randn(2, 2, num_pages, page_size, n_kv, d, generator=g).to(device)
    k_cache, v_cache = pool[1, 0], pool[1, 1]
    before = pool.clone()
    T = 9
    slots = torch.tensor([5, -1, 0, 23, 7, -3, 12, 13, 1], dtype=torch.int64)
    fused = torch.randn(T, 2 * n_kv + 4, d, generator=g).to(device)
    k = fused[:, 1:1 + n_kv]  # token-strided slice
    v = torch.randn(T, n_kv, d, generator=g).to(device)
    ops.write_kv(k, v, k_cache, v_cache, slots.to(device))

    expect = before.clone()
    ops.write_kv_reference(k, v, expect[1, 0], expect[1, 1], slots.to(device))
    torch.testing.assert_close(pool, expect, atol=0, rtol=0)
    # Explicitly: written rows landed at page s // page_size, offset s % page_size ...
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(k_cache[s // page_size, s % page_size], k[t])
            assert torch.equal(v_cache[s // page_size, s % page_size], v[t])
    # ... and nothing else changed (layer 0 untouched, unwritten slots untouched).
    written = torch.zeros(num_pages * page_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    flat_now = pool[1].reshape(2, -1, n_kv, d)
    flat_before = before[1].reshape(2, -1, n_kv, d)
    assert torch.equal(flat_now[:, ~written.to(device)], flat_before[:, ~written.to(device)])
    assert torch.equal(pool[0], before[0])


def test_write_kv_then_attention_roundtrip():
    """Engine-style use: write the new tokens' K/V, then attend; equals dense causal SDPA."""
    torch.manual_seed(11)
    n_heads, n_kv, d, ps = 9, 3, 64, 16
    pool = torch.zeros(1, 2, 12, ps, n_kv, d)
    kc, vc = pool[0, 0], pool[0, 1]
    L = 70
    pages = torch.tensor([7, 2, 9, 0, 5], dtype=torch.int32)
    k = torch.randn(L, n_kv, d)
    v = torch.randn(L, n_kv, d)
    q = torch.randn(L, n_heads, d)
    slots = (pages.long()[torch.arange(L) // ps] * ps + torch.arange(L) % ps)
    ops.write_kv(k, v, kc, vc, slots)
    out = ops.paged_attention(q, kc, vc, pages[None], torch.tensor([0, L], dtype=torch.int32),
                              torch.tensor([L], dtype=torch.int32), 1 / 8)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(3, 0),
        v.transpose(0, 1).repeat_interleave(3, 0), is_causal=True, scale=1 / 8).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------------------------
# opcheck
# --------------------------------------------------------------------------------------------
def test_opcheck_paged_attention():
    q, kc, vc, pt, cu, kvl = make_batch([1, 6, 0, 3], [9, 6, 4, 40], n_heads=4, n_kv_heads=2,
                                        head_dim=32, page_size=8, seed=12)
    torch.library.opcheck(torch.ops.symphony.paged_attention.default,
                          (q, kc, vc, pt, cu, kvl, 0.25))


@pytest.mark.parametrize("dtype", HALF, ids=["bf16", "fp16"])
def test_opcheck_half(dtype):
    q, kc, vc, pt, cu, kvl = make_batch([1, 6, 0, 3], [9, 6, 4, 40], n_heads=4, n_kv_heads=2,
                                        head_dim=32, page_size=8, seed=12, dtype=dtype)
    torch.library.opcheck(torch.ops.symphony.paged_attention.default, (q, kc, vc, pt, cu, kvl, 0.25))
    k = torch.randn(3, 2, 32).to(dtype)
    torch.library.opcheck(torch.ops.symphony.write_kv.default,
                          (k, k + 1, kc, vc, torch.tensor([0, -1, 9], dtype=torch.int64)))


def test_opcheck_write_kv():
    g = torch.Generator().manual_seed(13)
    kc = torch.randn(5, 4, 2, 16, generator=g)
    vc = torch.randn(5, 4, 2, 16, generator=g)
    k = torch.randn(6, 2, 16, generator=g)
    v = torch.randn(6, 2, 16, generator=g)
    slots = torch.tensor([0, 3, -1, 19, 8, 4], dtype=torch.int64)
    torch.library.opcheck(torch.ops.symphony.write_kv.default, (k, v, kc, vc, slots))


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------
def _good_args():
    q, kc, vc, pt, cu, kvl = make_batch([2, 1], [5, 20], n_heads=4, n_kv_heads=2, head_dim=32,
                                        page_size=4, seed=14, spare_pages=1, extra_cols=0)
    return dict(q=q, k_cache=kc, v_cache=vc, page_table=pt, cu_q_lens=cu, kv_lens=kvl, scale=0.2)


def _attn(a):
    return ops.paged_attention(a["q"], a["k_cache"], a["v_cache"], a["page_table"],
                               a["cu_q_lens"], a["kv_lens"], a["scale"])


@pytest.mark.parametrize("mutate,match", [
    (lambda a: a.update(page_table=a["page_table"].long()), "page_table must be int32"),
    (lambda a: a.update(cu_q_lens=a["cu_q_lens"].long()), "cu_q_lens must be int32"),
    (lambda a: a.update(kv_lens=a["kv_lens"].float()), "kv_lens must be int32"),
    (lambda a: a.update(q=a["q"][:, :3]), "must be a positive multiple of n_kv_heads"),
    (lambda a: a["page_table"].__setitem__((1, 4), 1000), r"page_table\[1, 4\] = 1000 is out of range"),
    (lambda a: a["page_table"].__setitem__((0, 0), -1), r"page_table\[0, 0\] = -1 is out of range"),
    (lambda a: a.update(q=a["q"][:2]), r"cu_q_lens\[B\] = 3 must equal .* T = q.size\(0\) = 2"),
    (lambda a: a["cu_q_lens"].__setitem__(1, 4), "cu_q_lens must be non-decreasing"),
    (lambda a: a["kv_lens"].__setitem__(0, 1), "kv_len 1 < q_len 2"),
    (lambda a: a["kv_lens"].__setitem__(1, 21), "only 5 columns"),
    (lambda a: a.update(q=a["q"].double()), "must be float32, float16 or bfloat16|dtype"),
    (lambda a: a.update(q=a["q"][..., :16]), "head_dim"),
    (lambda a: a.update(k_cache=a["k_cache"].transpose(1, 2).contiguous().transpose(1, 2)), "contiguous"),
    (lambda a: a.update(v_cache=a["v_cache"][:-1]), "v_cache shape"),
    (lambda a: a.update(q=a["q"].transpose(0, 1).contiguous().transpose(0, 1)), "contiguous"),
    (lambda a: a.update(kv_lens=a["kv_lens"][:1]), "kv_lens must be 1-D"),
    (lambda a: a.update(page_table=a["page_table"][0]), "page_table must be 2-D"),
])
def test_bad_attention_input_raises(mutate, match):
    a = _good_args()
    _attn(a)  # the unmodified arguments are fine
    mutate(a)
    with pytest.raises(RuntimeError, match=match):
        _attn(a)


def test_bad_write_kv_input_raises():
    kc = torch.zeros(3, 4, 2, 8)
    vc = torch.zeros(3, 4, 2, 8)
    k = torch.randn(2, 2, 8)
    v = torch.randn(2, 2, 8)
    with pytest.raises(RuntimeError, match="slots must be int64"):
        ops.write_kv(k, v, kc, vc, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"slots\[1\] = 12 is out of range"):
        ops.write_kv(k, v, kc, vc, torch.tensor([0, 12]))
    with pytest.raises(RuntimeError, match="n_kv_heads, head_dim"):
        ops.write_kv(torch.randn(2, 1, 8), torch.randn(2, 1, 8), kc, vc, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="slots must be 1-D"):
        ops.write_kv(k, v, kc, vc, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="dtype"):
        ops.write_kv(k.double(), v.double(), kc, vc, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.write_kv(k.transpose(1, 2).contiguous().transpose(1, 2), v, kc, vc, torch.tensor([0, 1]))
    assert kc.abs().sum() == 0 and vc.abs().sum() == 0  # nothing written on failure


def test_error_messages_spell_numbers_and_shapes():
    """The checks build their messages without iostreams (csrc/check.h): numbers, shapes, dtypes
    and devices still read as TORCH_CHECK would have written them."""
    with pytest.raises(RuntimeError) as e:
        ops.rms_norm(torch.randn(64), torch.rand(64), 1e-6)
    assert "symphony::rms_norm: x must be 2-D [T, H], got shape [64]" in str(e.value)
    with pytest.raises(RuntimeError) as e:
        ops.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.rand(8), 1e-6)
    assert "x and r shapes differ: [2, 8] vs [3, 8]" in str(e.value)
    a = _good_args()
    a["q"] = a["q"].double()
    with pytest.raises(RuntimeError, match=r"q must be float32, float16 or bfloat16, got Double|"
                                           r"q dtype Double must equal the cache dtype Float"):
        _attn(a)
    a = _good_args()
    a["page_table"][1, 4] = -7
    with pytest.raises(RuntimeError, match=r"page_table\[1, 4\] = -7 is out of range \[0, \d+\)"):
        _attn(a)


def test_every_check_goes_through_sym_check():
    """No TORCH_CHECK outside csrc/check.h: a stray one would format its numbers through an
    ostringstream again (see check.h for the machine where that crashed)."""
    root = ops.csrc_dir()
    stray = [f"{p.relative_to(root)}:{i + 1}" for p in sorted(root.rglob("*"))
             if p.suffix in (".h", ".cpp", ".cu", ".inc") and p.name != "check.h"
             for i, line in enumerate(p.read_text().splitlines()) if "TORCH_CHECK(" in line]
    assert not stray, f"use SYM_CHECK (csrc/check.h) instead of TORCH_CHECK at {stray}"


# ------------------------------------------------------------------ RMSNorm (CPU, float32)
def test_rms_norm_ops_match_torch():
    """symphony::rms_norm / add_rms_norm vs F.rms_norm: float32 sums in another order only
    (rtol 1e-6 of the row scale); odd H (the 16-wide loop's tail), row-strided x, several rows."""
    torch.manual_seed(0)
    for T, H in ((1, 576), (7, 100), (33, 16), (2, 5)):
        big = torch.randn(T, H + 3) * 4
        x = big[:, 2:2 + H]                                         # rows of stride H + 3
        r = torch.randn(T, H)
        w = torch.rand(H) + 0.5
        want = torch.nn.functional.rms_norm(x, (H,), w, 1e-5)
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), want, rtol=1e-6, atol=1e-6)
        s, n = ops.add_rms_norm(x, r, w, 1e-5)
        assert torch.equal(s, x + r)
        torch.testing.assert_close(n, torch.nn.functional.rms_norm(x + r, (H,), w, 1e-5),
                                   rtol=1e-6, atol=1e-6)
    torch.library.opcheck(torch.ops.symphony.rms_norm.default, (torch.randn(3, 64), torch.rand(64), 1e-6))
    torch.library.opcheck(torch.ops.symphony.add_rms_norm.default,
                          (torch.randn(3, 64), torch.randn(3, 64), torch.rand(64), 1e-6))


@pytest.mark.parametrize("args, match", [
    ((torch.randn(64), torch.rand(64)), "x must be 2-D"),
    ((torch.randn(2, 64, dtype=torch.float64), torch.rand(64)), "must be float32"),
    ((torch.randn(2, 64), torch.rand(63)), r"w must be \[H\]"),
    ((torch.randn(64, 2).t(), torch.rand(64)), "must be contiguous"),
])
def test_rms_norm_bad_args_raise(args, match):
    with pytest.raises(RuntimeError, match=match):
        ops.rms_norm(*args, 1e-6)
    with pytest.raises(RuntimeError, match="shapes differ"):
        ops.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.rand(8), 1e-6)
