"""Our decode kernels for a GPU (csrc/cuda/dense.cu) and the engine's choice of them
(symphony/engine/cuda_kernels.py).

On the CPU: the choosing logic with the ops' CPU implementations (the same checks the GPU runs,
a kernel that disagrees with torch's is not used, the mode switch), and dense_gemv's CPU
reference. On CUDA (skipped without a GPU): every kernel against torch in float32, float16 and
bfloat16 with awkward shapes, its argument checks, the timing, and the model with our kernels
against the model without them, eager and graphed."""
import logging

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_config
from symphony.engine import cuda_kernels, ops
from symphony.engine.config import EngineConfig
from symphony.engine.cuda_kernels import CudaKernels
from symphony.engine.engine import Engine, PredRequest
from symphony.engine.runner import Want
from symphony.engine.weights import random_weights

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True, scope="module")
def _ops_loaded():
    ops.load()


# ------------------------------------------------------------------ the choice, on the CPU
def test_mode_from_env(monkeypatch):
    monkeypatch.delenv("SYMPHONY_CUDA_KERNELS", raising=False)
    assert cuda_kernels.mode_from_env() == "auto"
    monkeypatch.setenv("SYMPHONY_CUDA_KERNELS", " Off ")
    assert cuda_kernels.mode_from_env() == "off"
    monkeypatch.setenv("SYMPHONY_CUDA_KERNELS", "fast")
    with pytest.raises(ValueError, match="SYMPHONY_CUDA_KERNELS must be one of auto, off, on, got 'fast'"):
        cuda_kernels.mode_from_env()
    monkeypatch.setenv("SYMPHONY_CUDA_KERNELS", "auto,-attention")
    assert cuda_kernels.mode_from_env() == "auto"


def test_parts_can_be_left_out():
    assert cuda_kernels.parse_mode("on, -gemv_tc,-attention") == ("on", frozenset({"gemv_tc", "attention"}))
    assert cuda_kernels.parse_mode("") == ("auto", frozenset())
    for bad in ("auto,attention", "auto,-flash", "auto,-"):
        with pytest.raises(ValueError, match="is not a part to leave out"):
            cuda_kernels.parse_mode(bad)
    k = CudaKernels(mode="on", excluded=frozenset({"gemv"}))
    assert k._candidates(torch.device("cpu"), 1) == []                 # no tensor cores on a CPU
    k.tensor_cores = lambda device: True
    assert k._candidates(torch.device("cpu"), 2) == ["tc0"]


def test_cpu_engine_uses_none_of_them():
    eng = Engine(random_weights(tiny_config()), None, EngineConfig(num_pages=16))
    k = eng.model.kernels
    assert k.mode == "off" and not k.elementwise and not k.gemv and k.attention == 0


def test_elementwise_check_passes_on_agreeing_kernels():
    """The check the GPU runs, here on the CPU kernels (float32): they agree, so they are used."""
    k = CudaKernels(mode="on")
    assert k._check_elementwise(torch.device("cpu"), torch.float32, tiny_config())
    assert "agree with torch's: used" in k.notes[-1]


def test_elementwise_check_rejects_a_kernel_that_disagrees(monkeypatch, caplog):
    real = ops.silu_mul
    monkeypatch.setattr(ops, "silu_mul", lambda gu: real(gu) * 1.5)     # a wrong kernel
    k = CudaKernels(mode="on")
    with caplog.at_level(logging.WARNING, logger="symphony.engine"):
        assert not k._check_elementwise(torch.device("cpu"), torch.float32, tiny_config())
    assert "element-wise kernels NOT used: silu_mul differs" in caplog.text


def test_elementwise_check_rejects_a_kernel_that_raises(monkeypatch, caplog):
    def broken(x, w, eps):
        raise RuntimeError("no kernel image is available for execution on the device")
    monkeypatch.setattr(ops, "rms_norm", broken)
    k = CudaKernels(mode="on")
    with caplog.at_level(logging.WARNING, logger="symphony.engine"):
        assert not k._check_elementwise(torch.device("cpu"), torch.float32, tiny_config())
    assert "no kernel image" in caplog.text


def _weights(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, k, generator=g).to(dtype) * 0.05 for n, k in ((48, 64), (64, 48), (48, 64))]


def test_gemv_choice_covers_each_shape_and_row_count_once(monkeypatch):
    monkeypatch.setattr(CudaKernels, "tensor_cores", staticmethod(lambda device: True))  # the CPU references
    k = CudaKernels(mode="on")
    ws = _weights()
    head = torch.randn(100, 64).to(torch.bfloat16)
    k._choose_gemv(torch.device("cpu"), torch.bfloat16, ws, head,
                   lambda x, w: x.float() @ w.float().t(), reps=3)
    keys = {(t.n, t.k, t.rows, t.float_out) for t in k.choices}
    assert len(keys) == len(k.choices) == 3 * 4                          # 2 shapes + the head, 4 row counts
    assert all(t.use == "tc0" and t.why == "SYMPHONY_CUDA_KERNELS=on" for t in k.choices)
    assert (100, 64, 8, True) in k.gemv and k.gemv[(48, 64, 2, False)] == "tc0"
    assert "48x64 rows=2: tc0 (SYMPHONY_CUDA_KERNELS=on)" in k.summary()


def test_gemv_choice_without_tensor_cores_keeps_cublas_for_8_rows():
    k = CudaKernels(mode="on")
    k._choose_gemv(torch.device("cpu"), torch.bfloat16, _weights()[:1], None, None, reps=3)
    assert {t.rows: t.use for t in k.choices} == {1: "gemv", 2: "gemv", 4: "gemv", 8: "cublas"}


def test_gemv_choice_rejects_a_wrong_kernel(monkeypatch, caplog):
    monkeypatch.setattr(ops, "dense_gemv", lambda x, w, f: torch.zeros(x.shape[0], w.shape[0],
                                                                        dtype=torch.float32 if f else x.dtype))
    k = CudaKernels(mode="on")
    with caplog.at_level(logging.WARNING, logger="symphony.engine"):
        k._choose_gemv(torch.device("cpu"), torch.bfloat16, _weights(), None, None, reps=3)
    assert k.choices and set(k.gemv.values()) == {"cublas"}
    assert "gemv gemv 48x64 rows=1 NOT used: differs from the float32 product" in caplog.text


def test_linear_dispatch_takes_the_gemv_only_where_chosen(monkeypatch):
    calls = []
    real, real_tc = ops.dense_gemv, ops.dense_gemv_tc
    monkeypatch.setattr(ops, "dense_gemv", lambda x, w, f: calls.append(x.shape[0]) or real(x, w, f))
    monkeypatch.setattr(ops, "dense_gemv_tc", lambda x, w, f, s: calls.append((x.shape[0], s)) or real_tc(x, w, f, s))
    w = _weights()[0]                                                    # [48, 64]
    k = CudaKernels(mode="on", gemv={(48, 64, 1, False): "gemv", (48, 64, 4, False): "gemv",
                                     (48, 64, 2, False): "cublas", (48, 64, 8, False): "tc4"})
    x = torch.randn(9, 64).to(torch.bfloat16)
    for rows in (1, 2, 3, 4, 5, 8, 9):
        y = k.linear(x[:rows].contiguous(), w)
        torch.testing.assert_close(y.float(), (x[:rows].float() @ w.float().t()), rtol=2e-2, atol=2e-2)
    # 2 chose cuBLAS, 3 takes 4's choice, 5 and 8 take 8's, 9 is too many
    assert calls == [1, 3, 4, (5, 4), (8, 4)]
    k.linear(x[:, ::2].contiguous()[:1], _weights()[1].t().contiguous()[:48, :32])   # no choice: torch
    k.linear(x.t().contiguous().t()[:1], w)                                          # not contiguous
    assert calls == [1, 3, 4, (5, 4), (8, 4)]


def test_dense_gemv_tc_cpu_reference_and_checks():
    x, w = torch.randn(8, 16, dtype=torch.bfloat16), torch.randn(5, 16, dtype=torch.bfloat16)
    torch.testing.assert_close(ops.dense_gemv_tc(x, w, True, 2), x.float() @ w.float().t())
    with pytest.raises(RuntimeError, match="1 to 8 rows, got 9"):
        ops.dense_gemv_tc(torch.randn(9, 16, dtype=torch.bfloat16), w)
    with pytest.raises(RuntimeError, match="splits must be 0 .chosen from the shape., 1, 2, 4 or 8, got 3"):
        ops.dense_gemv_tc(x, w, False, 3)


ATTN_CFG = dict(hidden_size=256, intermediate_size=512, n_heads=4, n_kv_heads=2, head_dim=64)


def test_attention_choice_on_the_cpu_references(monkeypatch, caplog):
    """The check the GPU runs, on the CPU (where paged_attention_tiled is paged_attention): both
    parts agree and are used; a part that disagrees is left out with a warning; a head shape
    the tiled kernels do not take keeps paged_attention."""
    k = CudaKernels(mode="on")
    k._choose_attention(torch.device("cpu"), torch.float32, tiny_config(**ATTN_CFG), reps=3)
    assert k.attention == 3 and k.notes[-1] == "attention: paged_attention_tiled with kernels=3"
    real = ops.paged_attention_tiled
    monkeypatch.setattr(ops, "paged_attention_tiled",
                        lambda *a: real(*a) * (1.5 if a[-1] == 2 else 1.0))          # a broken decode part
    k = CudaKernels(mode="on")
    with caplog.at_level(logging.WARNING, logger="symphony.engine"):
        k._choose_attention(torch.device("cpu"), torch.float32, tiny_config(**ATTN_CFG), reps=3)
    assert k.attention == 1 and "the tiled decode kernel NOT used: it differs" in caplog.text
    k = CudaKernels(mode="on")
    k._choose_attention(torch.device("cpu"), torch.float32, tiny_config(), reps=3)   # head_dim 16
    assert k.attention == 0 and "head_dim 64 or 128" in k.notes[-1]


def test_attention_dispatch(monkeypatch):
    seen = []
    monkeypatch.setattr(ops, "paged_attention_tiled", lambda *a: seen.append(("tiled", a[-1])))
    monkeypatch.setattr(ops, "paged_attention", lambda *a: seen.append(("paged", len(a))))
    CudaKernels(attention=2).paged_attention(*range(7))
    CudaKernels().paged_attention(*range(7))
    assert seen == [("tiled", 2), ("paged", 7)]


def test_paged_attention_tiled_cpu_is_paged_attention():
    cfg = tiny_config(**ATTN_CFG)
    args = cuda_kernels.attention_case(cfg, torch.device("cpu"), torch.float32, torch.Generator().manual_seed(0),
                                       [1, 40, 1], [5, 90, 300])
    want = ops.paged_attention(*args)
    for kernels in (0, 1, 2, 3):
        assert torch.equal(ops.paged_attention_tiled(*args, kernels), want)
    with pytest.raises(RuntimeError, match="kernels must be 0 to 3"):
        ops.paged_attention_tiled(*args, 4)


def test_dense_gemv_cpu_reference_and_checks():
    x, w = torch.randn(3, 16, dtype=torch.bfloat16), torch.randn(5, 16, dtype=torch.bfloat16)
    y = ops.dense_gemv(x, w, True)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x.float() @ w.float().t())
    assert ops.dense_gemv(x, w, False).dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="x has 16 columns but w has 8"):
        ops.dense_gemv(x, w[:, :8], False)
    with pytest.raises(RuntimeError, match="must share a floating-point dtype"):
        ops.dense_gemv(x, w.float(), False)


# ------------------------------------------------------------------ the kernels, on CUDA
def _need_cuda_ops():
    if not ops.cuda_available():
        pytest.skip("the CUDA ops did not build")


DTYPES = [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)]


@cuda
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("T,H,strided", [(1, 2048, False), (7, 576, False), (2, 8192, False),
                                         (2, 8200, False), (1, 2048, True), (7, 576, True),
                                         (3, 33, False), (2, 1, True)])
def test_cuda_rms_norms_match_torch(dtype, tol, T, H, strided):
    """16-byte vectors (16-bit contiguous rows of up to 8,192 values) and the scalar kernel
    (float32, misaligned or strided rows, odd or larger H)."""
    _need_cuda_ops()
    torch.manual_seed(T + H)
    wide = torch.randn(T, H + 3, device="cuda", dtype=dtype)
    x = wide[:, 1:H + 1] if strided else torch.randn(T, H, device="cuda", dtype=dtype)
    r, w = torch.randn(T, H, device="cuda", dtype=dtype), torch.randn(H, device="cuda")
    got = ops.rms_norm(x, w, 1e-5)
    want = F.rms_norm(x.float(), (H,), w, 1e-5)
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    s, n = ops.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(s, x + r)                                    # rounded as torch rounds
    torch.testing.assert_close(n.float(), F.rms_norm((x + r).float(), (H,), w, 1e-5), rtol=tol, atol=tol)
    if dtype != torch.float32:          # a float32 residual stream plus a 16-bit layer output
        xf = x.float() * 3
        s, n = ops.add_rms_norm(xf, r, w, 1e-5)
        assert s.dtype == torch.float32 and n.dtype == dtype
        assert torch.equal(s, xf + r.float())                        # not rounded
        torch.testing.assert_close(n.float(), F.rms_norm(xf + r.float(), (H,), w, 1e-5), rtol=tol, atol=tol)
    with pytest.raises(RuntimeError, match="r must have x's dtype, or x be float32 and r 16-bit"):
        ops.add_rms_norm(x.half(), r.float(), w, 1e-5)                 # 16-bit x, float32 r


@cuda
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("T,I", [(1, 8192), (5, 1536), (3, 7)])
def test_cuda_silu_mul_matches_torch(dtype, tol, T, I):
    _need_cuda_ops()
    wide = torch.randn(T, 2 * I + 2, device="cuda", dtype=dtype) * 4
    gu = wide[:, 2:]
    want = F.silu(gu[:, :I].float()) * gu[:, I:].float()
    torch.testing.assert_close(ops.silu_mul(gu).float(), want, rtol=tol, atol=tol)
    big = torch.tensor([[-1e4, 1e4, 2.0, 3.0]], device="cuda", dtype=dtype)
    assert ops.silu_mul(big).float().tolist() == [[0.0, pytest.approx(3e4, rel=tol)]]


@cuda
@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_cuda_rope_matches_the_complex_multiply(dtype, tol):
    _need_cuda_ops()
    T, hd, qh, kvh, P = 6, 64, 9, 3, 100
    qkv = torch.randn(T, (qh + 2 * kvh) * hd, device="cuda", dtype=dtype)
    ang = torch.rand(P, hd // 2) * 6.28
    table = torch.stack([ang.cos(), ang.sin()], -1).cuda()
    pos = torch.tensor([0, 5, 99, 17, -1, 100], device="cuda")      # the last two: outside the table
    got = qkv.clone()
    ops.rope_(got, pos, table, qh + kvh)
    qk = torch.view_as_complex(qkv[:4, : (qh + kvh) * hd].float().reshape(4, qh + kvh, hd // 2, 2))
    rot = torch.view_as_complex(table[pos[:4]].unsqueeze(1).contiguous())
    want = torch.view_as_real(qk * rot).reshape(4, -1)
    torch.testing.assert_close(got[:4, : (qh + kvh) * hd].float(), want, rtol=tol, atol=tol)
    assert torch.equal(got[:, (qh + kvh) * hd:], qkv[:, (qh + kvh) * hd:])  # v untouched
    assert torch.equal(got[4:], qkv[4:])                               # unrotated, nothing read out of bounds


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 2, 3, 4])
@pytest.mark.parametrize("N,K", [(2048, 2048), (37, 8), (5, 8200), (1000, 264)])
def test_cuda_dense_gemv_matches_the_float32_product(dtype, M, N, K):
    _need_cuda_ops()
    torch.manual_seed(M * N + K)
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    w = torch.randn(N, K, device="cuda", dtype=dtype) * 0.05
    ref = x.float() @ w.float().t()
    got = ops.dense_gemv(x, w, True)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    low = ops.dense_gemv(x, w, False)
    assert low.dtype == dtype
    torch.testing.assert_close(low.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    xs = torch.randn(M, K + 8, device="cuda", dtype=dtype)[:, :K]   # rows 16-byte aligned, strided
    torch.testing.assert_close(ops.dense_gemv(xs, w, True), xs.float() @ w.float().t(),
                               rtol=1e-4, atol=1e-3)


@cuda
@pytest.mark.parametrize("name,max_rows", [("dense_gemv", 4), ("dense_gemv_tc", 8)])
def test_cuda_gemvs_reject_bad_input(name, max_rows):
    _need_cuda_ops()
    op = getattr(ops, name)
    w = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(9, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=f"1 to {max_rows} rows, got {max_rows + 1}"):
        op(x[:max_rows + 1], w, False)
    with pytest.raises(RuntimeError, match="multiple of 8, got 60"):
        op(x[:1, :60].contiguous(), w[:, :60].contiguous(), False)
    with pytest.raises(RuntimeError, match="16-byte boundary"):
        op(x.view(-1)[1:65].view(1, 64), w, False)
    with pytest.raises(RuntimeError, match="must both be float16 or both bfloat16"):
        op(x[:1].float(), w.float(), False)
    with pytest.raises(RuntimeError, match="one device"):
        op(x[:1].cpu(), w, False)
    with pytest.raises(RuntimeError, match="w must be contiguous"):
        op(x[:1, :16].contiguous(), w.t(), False)
    if name == "dense_gemv_tc":
        with pytest.raises(RuntimeError, match="splits must be 0"):
            op(x[:1], w, False, 16)


@cuda
def test_cuda_timing_chooses_per_shape():
    _need_cuda_ops()
    w = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16) * 0.02
    k = CudaKernels(mode="auto")
    k._choose_gemv(torch.device("cuda"), torch.bfloat16, [w], None, None, reps=5)
    assert [t.rows for t in k.choices] == [1, 2, 4, 8]
    for t in k.choices:
        assert t.times["cublas"] > 0 and len(t.times) >= 2 and all(us > 0 for us in t.times.values())
        ours = {c: us for c, us in t.times.items() if c != "cublas"}
        best = min(ours, key=ours.get)
        assert t.use == (best if ours[best] <= 0.97 * t.times["cublas"] else "cublas"), t.line()
        assert (t.rows <= 4) == ("gemv" in t.times)


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("N,K", [(3072, 2048), (37, 8), (16, 64), (1000, 264), (2048, 8192)])
def test_cuda_dense_gemv_tc_matches_the_float32_product(dtype, M, N, K):
    """Every split count, rows past N and k past the last 64-block masked, float32 and 16-bit out."""
    _need_cuda_ops()
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("tensor-core mma needs compute capability 8.0")
    torch.manual_seed(M * N + K)
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    w = torch.randn(N, K, device="cuda", dtype=dtype) * 0.05
    ref = x.float() @ w.float().t()
    for splits in (0, 1, 2, 4, 8):
        got = ops.dense_gemv_tc(x, w, True, splits)
        assert got.dtype == torch.float32 and got.shape == (M, N)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    low = ops.dense_gemv_tc(x, w, False)
    assert low.dtype == dtype
    torch.testing.assert_close(low.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    xs = torch.randn(M, K + 8, device="cuda", dtype=dtype)[:, :K]   # rows 16-byte aligned, strided
    torch.testing.assert_close(ops.dense_gemv_tc(xs, w, True, 2), xs.float() @ w.float().t(), rtol=1e-4, atol=1e-3)


def _attn_case(dtype, q_lens, kv_lens, n_heads, n_kv, head_dim, seed=0, strided=False):
    cfg = tiny_config(n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim)
    q, kc, vc, pt, cu, kvl, scale = cuda_kernels.attention_case(
        cfg, torch.device("cuda"), dtype, torch.Generator().manual_seed(seed), q_lens, kv_lens)
    if strided:                                         # q as a slice of a fused qkv projection
        wide = torch.randn(q.shape[0], n_heads + 2 * n_kv, head_dim, device="cuda", dtype=dtype)
        wide[:, :n_heads] = q
        q = wide[:, :n_heads]
    return q, kc, vc, pt, cu, kvl, scale


ATTN_CASES = [
    # (q_lens, kv_lens, n_heads, n_kv, head_dim)
    ([1500], [2000], 9, 3, 64),              # SmolLM2: a prompt into a non-empty file
    ([70], [150], 32, 8, 64),                # Llama-3.2-1B
    ([1, 45, 1, 33, 31, 32], [9, 100, 300, 33, 40, 32], 8, 2, 64),   # mixed; 31 and 32 at the boundary
    ([36, 1, 1], [90, 200, 5000], 4, 2, 128),
    ([34, 1, 1], [34, 17, 140], 16, 2, 64),  # a group of 8
    ([33, 2], [70, 5], 2, 2, 128),           # a group of 1
    ([1] * 7, [1, 2, 63, 64, 65, 200, 700], 8, 2, 64),   # decode splits
    ([1], [2000], 32, 8, 64),
]


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(ATTN_CASES)))
@pytest.mark.parametrize("kernels", [1, 2, 3])
def test_cuda_paged_attention_tiled_matches_paged_attention(dtype, case, kernels):
    _need_cuda_ops()
    q_lens, kv_lens, H, KV, D = ATTN_CASES[case]
    args = _attn_case(dtype, q_lens, kv_lens, H, KV, D, seed=case, strided=case % 2 == 1)
    want = ops.paged_attention(*args)
    got = ops.paged_attention_tiled(*args, kernels)
    ref = ops.paged_attention_reference(*(a.double() if a.is_floating_point() else a
                                          for a in (t.cpu() for t in args[:6])), args[6]).float()
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(got.float().cpu(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@cuda
def test_cuda_paged_attention_tiled_falls_back_on_other_shapes():
    """float32, head_dim 80, a group of 16: exactly paged_attention's result."""
    _need_cuda_ops()
    for dtype, H, KV, D in ((torch.float32, 8, 2, 64), (torch.bfloat16, 4, 2, 80), (torch.bfloat16, 16, 1, 64)):
        args = _attn_case(dtype, [40, 1], [60, 300], H, KV, D)
        assert torch.equal(ops.paged_attention_tiled(*args), ops.paged_attention(*args))


@cuda
def test_cuda_paged_attention_tiled_in_a_graph_any_lengths():
    """Captured once, replayed with other lengths and tables: the split count follows from the
    shapes alone."""
    _need_cuda_ops()
    q, kc, vc, pt, cu, kvl, scale = _attn_case(torch.bfloat16, [1, 1, 1], [700, 30, 1], 8, 2, 64)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    ops.paged_attention_tiled(q, kc, vc, pt, cu, kvl, scale)          # warm-up
    with torch.cuda.graph(g):
        out = ops.paged_attention_tiled(q, kc, vc, pt, cu, kvl, scale)
    for lens in ([5, 600, 64], [700, 1, 129]):
        kvl.copy_(torch.tensor(lens, dtype=torch.int32))
        g.replay()
        torch.testing.assert_close(out.float(), ops.paged_attention(q, kc, vc, pt, cu, kvl, scale).float(),
                                   rtol=2e-2, atol=2e-2)


@cuda
def test_cuda_graph_greedy_tokens_replayed_from_another_thread():
    """The decode graphs' in-graph argmax and token copy: the same tokens as the logits' argmax,
    when the graph is replayed from a thread that did not capture it (the kernel's device
    thread)."""
    import threading
    _need_cuda_ops()
    eng = Engine(random_weights(tiny_config(), seed=5), None,
                 EngineConfig(page_size=4, num_pages=128, device="cuda", dtype=torch.bfloat16, cuda_graphs=True))
    seqs = [eng.new_sequence() for _ in range(3)]
    eng.pred_batch([PredRequest(s, [3 + i, 9, 4]) for i, s in enumerate(seqs)])
    logits = torch.stack(eng.pred_batch([PredRequest(s, [7]) for s in seqs]))
    want = logits.float().argmax(-1).cpu()
    for s in seqs:                                                     # the same step again
        eng.truncate(s, 3)
    got = {}

    def device_thread():
        torch.cuda.set_device(0)
        got["ids"] = eng.pred_batch([PredRequest(s, [7], want=Want("argmax")) for s in seqs])
    t = threading.Thread(target=device_thread)
    t.start()
    t.join()
    assert [v.device.type for v in got["ids"]] == ["cpu"] * 3                 # landed by the graph
    assert torch.equal(torch.stack(got["ids"]).reshape(-1), want)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_model_with_our_kernels_matches_torch_kernels(dtype, monkeypatch):
    """The same weights with SYMPHONY_CUDA_KERNELS=on and =off, eager and graphed: close logits
    at batch 1 and 3 (the GEMV's row counts) and 9 (cuBLAS)."""
    _need_cuda_ops()
    cfg = tiny_config(hidden_size=256, intermediate_size=512, n_heads=4, n_kv_heads=2, head_dim=64)
    w = random_weights(cfg, seed=3)
    engines = {}
    for mode in ("on", "off"):
        monkeypatch.setenv("SYMPHONY_CUDA_KERNELS", mode)
        for graphs in (True, False):
            engines[mode, graphs] = Engine(w, None, EngineConfig(page_size=4, num_pages=512, device="cuda",
                                                                 dtype=dtype, cuda_graphs=graphs))
    on = engines["on", True].model.kernels
    assert on.elementwise and any(v != "cublas" for v in on.gemv.values()) and on.attention == 3
    assert not engines["off", True].model.kernels.elementwise
    for batch in (1, 3, 9):
        outs = {}
        for key, eng in engines.items():
            seqs = [eng.new_sequence() for _ in range(batch)]
            eng.pred_batch([PredRequest(s, [5 + i, 7, 11 + i]) for i, s in enumerate(seqs)])
            # a prompt of 40 into the non-empty file (the tiled prefill kernel), its last logits
            steps = [torch.stack(eng.pred_batch([PredRequest(s, [(13 * j + i) % 90 + 3 for j in range(40)])
                                                 for i, s in enumerate(seqs)])).float().cpu()]
            for t in range(3):
                o = eng.pred_batch([PredRequest(s, [20 + t + i]) for i, s in enumerate(seqs)])
                steps.append(torch.stack(o).float().cpu())
            outs[key] = torch.stack(steps)
            for s in seqs:
                eng.release(s)
        ref = outs["off", False]
        scale = ref.std().item()
        for key, got in outs.items():
            assert (got - ref).abs().max().item() <= 0.1 * scale, (key, batch)
