"""The new CUDA kernels' arithmetic, emulated on the CPU (cuda_emulation.py) against plain
references: the query-tiled prefill and the split decode of paged_attention_tiled (tiles, causal
masks, GQA rows, the online softmax and its merges, split partials, which kernel writes which
token), and dense_gemv_tc's k-order and split-K. These run everywhere; the kernels themselves
run on a GPU only (test_cuda_kernels.py)."""
import numpy as np
import pytest
import torch

from . import cuda_emulation as emu
from symphony.engine import ops


def make(q_lens, kv_lens, n_heads, n_kv, head_dim, page_size=16, dtype=torch.bfloat16, seed=0,
         bad_page=None):
    """Random paged attention inputs (pages shuffled) as float32 arrays of dtype's values."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-kv // page_size) for kv in kv_lens]
    num_pages = sum(need) + 3
    perm = torch.randperm(num_pages, generator=g)
    pt = np.zeros((len(q_lens), max(need + [1])), np.int32)
    pos = 0
    for b, n in enumerate(need):
        pt[b, :n] = perm[pos:pos + n].numpy()
        pos += n
    if bad_page is not None:
        pt[bad_page] = num_pages + 5                  # out of range: an empty key, never read
    r = lambda *s: torch.randn(*s, generator=g).to(dtype).float().numpy()   # noqa: E731
    kc, vc = r(num_pages, page_size, n_kv, head_dim), r(num_pages, page_size, n_kv, head_dim)
    q = r(sum(q_lens), n_heads, head_dim)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return q, kc, vc, pt, cu, np.array(kv_lens, np.int32)


def reference(q, kc, vc, pt, cu, kvl, scale):
    """symphony's own reference attention, in float64 on the same values."""
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))   # noqa: E731
    return ops.paged_attention_reference(t(q).double(), t(kc).double(), t(vc).double(), t(pt), t(cu),
                                         t(kvl), scale).float().numpy()


CASES = {
    # name: (q_lens, kv_lens, n_heads, n_kv, head_dim)
    "prompt into a non-empty file, G=3 (SmolLM2), D=64": ([70], [150], 9, 3, 64),
    "prompt into an empty file, G=4, D=64": ([40], [40], 8, 2, 64),
    "two prompts and decodes mixed, G=4": ([1, 45, 1, 33], [9, 100, 300, 33], 8, 2, 64),
    "head_dim 128, G=2, prompt and decode": ([36, 1], [90, 200], 4, 2, 128),
    "G=8 (decode's larger instance), D=64": ([34, 1, 1], [34, 17, 140], 16, 2, 64),
    "G=1, D=128": ([33, 2], [70, 5], 2, 2, 128),
}


@pytest.mark.parametrize("name", list(CASES))
def test_tiled_attention_emulation_matches_the_reference(name):
    q_lens, kv_lens, H, KV, D = CASES[name]
    q, kc, vc, pt, cu, kvl = make(q_lens, kv_lens, H, KV, D, seed=len(name))
    scale = D ** -0.5
    out = emu.attention_tiled(q, kc, vc, pt, cu, kvl, scale, emu.rounder(torch.bfloat16), sms=4)
    assert not np.isnan(out).any(), "a query row no kernel wrote"
    ref = reference(q, kc, vc, pt, cu, kvl, scale)
    # bfloat16 P and output: within a few bfloat16 ulps of the values' size
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2)


def test_the_prefill_kernel_takes_long_prompts_and_the_decode_kernel_the_rest():
    q_lens, kv_lens = [1, 45, 31, 32], [9, 100, 40, 32]
    q, kc, vc, pt, cu, kvl = make(q_lens, kv_lens, 8, 2, 64)
    rnd = emu.rounder(torch.bfloat16)
    pre = emu.attention_tiled(q, kc, vc, pt, cu, kvl, 0.125, rnd, decode=False, sms=4)
    dec = emu.attention_tiled(q, kc, vc, pt, cu, kvl, 0.125, rnd, prefill=False, sms=4)
    long_rows = np.zeros(sum(q_lens), bool)
    for b, n in enumerate(q_lens):
        long_rows[cu[b]:cu[b + 1]] = n >= emu.K_MIN_Q            # 45 and 32 tokens: tiled
    assert (~np.isnan(pre[long_rows])).all() and np.isnan(pre[~long_rows]).all()
    assert (~np.isnan(dec)).all()                                   # alone it takes every token
    both = emu.attention_tiled(q, kc, vc, pt, cu, kvl, 0.125, rnd, decode=True, sms=4)
    assert np.array_equal(both[long_rows], pre[long_rows]) and np.array_equal(both[~long_rows], dec[~long_rows])
    short = emu.attention_tiled(q[:31], kc, vc, pt[:1], cu[:2] * 0 + [0, 31], kvl[:1] * 0 + 40, 0.125, rnd, sms=4)
    assert not np.isnan(short).any()                               # T < 32: no prefill kernel at all


def test_prefill_tiles_are_numbered_per_sequence_and_run_longest_first():
    cu = np.array([0, 1, 65, 65, 100, 132], np.int32)               # q_lens 1, 64, 0, 35, 32
    starts = emu.prefill_tiles(cu, 21)                              # G = 3: 21 tokens a tile
    assert starts.tolist() == [0, 0, 4, 4, 6, 8]
    assert [emu.find_last_le(starts, 5, t) for t in range(8)] == [1, 1, 1, 1, 3, 3, 4, 4]
    T = 132
    assert (T + 20) // 21 + T // emu.K_MIN_Q + 1 >= starts[-1]       # the grid covers every tile


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_splits_and_their_merge(dtype):
    """A decode batch small enough to split (sms=16: up to 32 splits), contexts from 1 key to
    several splits' worth, and one sequence whose page ids are out of range (no keys: zeros)."""
    kv = [1, 2, 63, 64, 65, 200, 700]
    q, kc, vc, pt, cu, kvl = make([1] * len(kv), kv, 8, 2, 64, dtype=dtype, seed=3)
    rnd = emu.rounder(dtype)
    splits = emu.decode_splits(len(kv), 2, pt.shape[1] * 16, 16, 64)
    assert splits > 1
    out = emu.attention_tiled(q, kc, vc, pt, cu, kvl, 0.125, rnd, prefill=False, sms=16)
    np.testing.assert_allclose(out, reference(q, kc, vc, pt, cu, kvl, 0.125), rtol=1e-2, atol=1e-2)
    one = emu.attention_tiled(q, kc, vc, pt, cu, kvl, 0.125, rnd, prefill=False, sms=1)   # no split
    np.testing.assert_allclose(out, one, rtol=1e-2, atol=1e-2)


def test_decode_rows_with_no_valid_key_are_zero_not_nan():
    q, kc, vc, pt, cu, kvl = make([1, 1], [40, 30], 8, 2, 64, bad_page=1)
    out = emu.attention_tiled(q, kc, vc, pt, cu, kvl, 0.125, emu.rounder(torch.bfloat16), sms=16)
    assert (out[1] == 0).all() and not np.isnan(out).any()


def test_mma_layout_round_trips():
    """The emulated mma against a plain product: A and B scattered into the lanes' fragments by
    the layout, multiplied, gathered back."""
    rng = np.random.default_rng(0)
    A, B, C = rng.standard_normal((16, 16), np.float32), rng.standard_normal((16, 8), np.float32), \
        rng.standard_normal((16, 8), np.float32)
    a, b = A[emu.MMA.A_ROW, emu.MMA.A_COL], B[emu.MMA.B_ROW, emu.MMA.B_COL]
    c = C[emu.MMA.C_ROW, emu.MMA.C_COL]
    d = emu.MMA.run(c, a, b)
    D = np.zeros((16, 8), np.float32)
    D[emu.MMA.C_ROW, emu.MMA.C_COL] = d
    np.testing.assert_allclose(D, A @ B + C, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("N,K", [(40, 136), (16, 64), (33, 8), (70, 520)])
@pytest.mark.parametrize("splits", [1, 2, 8])
def test_gemv_tc_emulation_is_the_product(M, N, K, splits):
    rng = np.random.default_rng(M * N + K)
    x = torch.from_numpy(rng.standard_normal((M, K), np.float32)).bfloat16().float().numpy()
    w = torch.from_numpy(rng.standard_normal((N, K), np.float32)).bfloat16().float().numpy()
    got = emu.gemv_tc(x, w, splits)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4)


def test_gemv_auto_splits_fill_the_device():
    assert emu.gemv_auto_splits(3072, 2048, 132) == 8             # Llama-3.2-1B q/k/v: 192 row groups
    assert emu.gemv_auto_splits(16384, 2048, 132) == 4            # gate/up: 1,024 groups
    assert emu.gemv_auto_splits(128256, 2048, 132) == 1           # the head
    assert emu.gemv_auto_splits(2048, 128, 132) == 1              # 2 k-blocks: no split
