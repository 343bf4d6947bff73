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
    with pytest.raises(ValueError, match="SYMPHONY_CUDA_KERNELS must be one of auto, off, on"):
        cuda_kernels.mode_from_env()


def test_cpu_engine_uses_none_of_them():
    eng = Engine(random_weights(tiny_config()), None, EngineConfig(num_pages=16))
    k = eng.model.kernels
    assert k.mode == "off" and not k.elementwise and not k.gemv


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


def test_gemv_choice_covers_each_shape_and_row_count_once():
    k = CudaKernels(mode="on")
    ws = _weights()
    head = torch.randn(100, 64).to(torch.bfloat16)
    k._choose_gemv(torch.device("cpu"), torch.bfloat16, ws, head,
                   lambda x, w: x.float() @ w.float().t(), reps=3)
    keys = {(t.n, t.k, t.rows, t.float_out) for t in k.choices}
    assert len(keys) == len(k.choices) == 3 * 3                          # 2 shapes + the head, 3 row counts
    assert all(t.use and t.why == "SYMPHONY_CUDA_KERNELS=on" for t in k.choices)
    assert (100, 64, 4, True) in k.gemv and (48, 64, 2, False) in k.gemv


def test_gemv_choice_rejects_a_wrong_kernel(monkeypatch, caplog):
    monkeypatch.setattr(ops, "dense_gemv", lambda x, w, f: torch.zeros(x.shape[0], w.shape[0],
                                                                        dtype=torch.float32 if f else x.dtype))
    k = CudaKernels(mode="on")
    with caplog.at_level(logging.WARNING, logger="symphony.engine"):
        k._choose_gemv(torch.device("cpu"), torch.bfloat16, _weights(), None, None, reps=3)
    assert k.choices and not any(k.gemv.values())
    assert "NOT used: differs from the float32 product" in caplog.text


def test_linear_dispatch_takes_the_gemv_only_where_chosen(monkeypatch):
    calls = []
    real = ops.dense_gemv
    monkeypatch.setattr(ops, "dense_gemv", lambda x, w, f: calls.append(x.shape[0]) or real(x, w, f))
    w = _weights()[0]                                                    # [48, 64]
    k = CudaKernels(mode="on", gemv={(48, 64, 1, False): True, (48, 64, 4, False): True,
                                     (48, 64, 2, False): False})
    x = torch.randn(8, 64).to(torch.bfloat16)
    for rows in (1, 2, 3, 4, 5):
        y = k.linear(x[:rows].contiguous(), w)
        torch.testing.assert_close(y.float(), (x[:rows].float() @ w.float().t()), rtol=2e-2, atol=2e-2)
    assert calls == [1, 3, 4]                     # 2 chose cuBLAS, 3 takes 4's choice, 5 is too many
    k.linear(x[:, ::2].contiguous()[:1], _weights()[1].t().contiguous()[:48, :32])   # no choice: torch
    k.linear(x.t().contiguous().t()[:1], w)                                          # not contiguous
    assert calls == [1, 3, 4]


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
def test_cuda_dense_gemv_rejects_bad_input():
    _need_cuda_ops()
    w = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="1 to 4 rows, got 5"):
        ops.dense_gemv(x[:5], w, False)
    with pytest.raises(RuntimeError, match="multiple of 8, got 60"):
        ops.dense_gemv(x[:1, :60].contiguous(), w[:, :60].contiguous(), False)
    with pytest.raises(RuntimeError, match="16-byte boundary"):
        ops.dense_gemv(x.view(-1)[1:65].view(1, 64), w, False)
    with pytest.raises(RuntimeError, match="must both be float16 or both bfloat16"):
        ops.dense_gemv(x[:1].float(), w.float(), False)
    with pytest.raises(RuntimeError, match="one device"):
        ops.dense_gemv(x[:1].cpu(), w, False)
    with pytest.raises(RuntimeError, match="w must be contiguous"):
        ops.dense_gemv(x[:1, :16].contiguous(), w.t(), False)


@cuda
def test_cuda_timing_chooses_per_shape():
    _need_cuda_ops()
    w = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16) * 0.02
    k = CudaKernels(mode="auto")
    k._choose_gemv(torch.device("cuda"), torch.bfloat16, [w], None, None, reps=5)
    assert len(k.choices) == 3
    for t in k.choices:
        assert t.ours_us > 0 and t.torch_us > 0 and t.use == (t.ours_us <= 0.97 * t.torch_us)


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
            engines[mode, graphs] = Engine(w, None, EngineConfig(page_size=4, num_pages=256, device="cuda",
                                                                 dtype=dtype, cuda_graphs=graphs))
    on = engines["on", True].model.kernels
    assert on.elementwise and any(on.gemv.values())
    assert not engines["off", True].model.kernels.elementwise
    for batch in (1, 3, 9):
        outs = {}
        for key, eng in engines.items():
            seqs = [eng.new_sequence() for _ in range(batch)]
            eng.pred_batch([PredRequest(s, [5 + i, 7, 11 + i]) for i, s in enumerate(seqs)])
            steps = []
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
