"""The fused element-wise ops of the decode step (csrc/cpu/fused.cpp): silu_mul and rope_ against
their torch references, their argument checks, and the model using them on the float32 CPU path."""
import math

import pytest
import torch

from conftest import tiny_config
from symphony.engine import ops
from symphony.engine.config import EngineConfig
from symphony.engine.engine import Engine
from symphony.engine.model import rope_inv_freq
from symphony.engine.quant import force_qlinear_path
from symphony.engine.weights import random_weights

ULP = 2.0 ** -23          # float32 relative spacing at 1


@pytest.fixture(autouse=True, scope="module")
def _ops_loaded():
    """Some tests call torch.ops.symphony.* directly, which exists only once the library is
    loaded: load it first, so that any test here also runs alone (pytest FILE::TEST)."""
    ops.load()


def rope_table(positions: int, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """float32 [positions, head_dim/2, 2] (cos, sin) table, as PagedLlama builds it."""
    cfg = tiny_config(head_dim=head_dim, rope_theta=theta)
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), rope_inv_freq(cfg))
    return torch.view_as_real(torch.polar(torch.ones_like(angles), angles))


# ------------------------------------------------------------------ silu_mul
@pytest.mark.parametrize("T, I", [(1, 1536), (37, 1536), (1, 7), (5, 64), (3, 1)])
def test_silu_mul_matches_torch(T, I):
    """The model's expression, row-strided gu (a slice of a wider buffer), the vector loop's tail
    (odd I): within a few float32 ulp (the op's exp is a polynomial, not libm's)."""
    torch.manual_seed(T * 1000 + I)
    big = torch.randn(T, 2 * I + 5) * 8
    gu = big[:, 3:3 + 2 * I]                                         # rows of stride 2I + 5
    got = ops.silu_mul(gu)
    assert got.shape == (T, I) and got.is_contiguous()
    torch.testing.assert_close(got, ops.silu_mul_reference(gu), rtol=8 * ULP, atol=1e-30)


def test_silu_mul_error_bound_against_float64():
    """Every gate value from -100 to 100 (step 1/64), up = 1 and up = -3.5: relative error at
    most 4 ulp against silu in float64 for gates from -87 up; within 2e-36 |up| under -87
    (exp's argument is clamped there, silu is 0 under -88); finite everywhere; huge gates and NaN."""
    g = torch.arange(-6400, 6401, dtype=torch.float32) / 64
    for u in (1.0, -3.5):
        gu = torch.cat([g, torch.full_like(g, u)]).unsqueeze(0)          # [1, 2N]: gate | up
        got = ops.silu_mul(gu)[0].double()
        want = g.double() * torch.sigmoid(g.double()) * u
        assert torch.isfinite(got).all()
        ok = g >= -87
        rel = ((got - want).abs() / want.abs().clamp_min(1e-300))[ok]
        assert rel.max().item() <= 4 * ULP, rel.max().item()
        assert ((got - want)[~ok].abs() < 2e-36 * abs(u)).all()
    assert ops.silu_mul(torch.zeros(1, 8)).eq(0).all()
    big = ops.silu_mul(torch.tensor([[1e30, -1e30, float("nan"), 2.0, 2.0, 2.0]]))
    assert big[0, 0].item() == pytest.approx(2e30) and big[0, 1].item() == 0.0
    assert math.isnan(big[0, 2].item())


def test_silu_mul_opcheck_and_bad_args():
    torch.library.opcheck(torch.ops.symphony.silu_mul.default, (torch.randn(3, 64),))
    bad = [
        (torch.randn(64), "2-D"),
        (torch.randn(2, 64, dtype=torch.float64), "must be float32"),
        (torch.randn(2, 64, dtype=torch.bfloat16), "must be float32"),
        (torch.randn(2, 7), "must be even"),
        (torch.randn(64, 2).t(), "must be contiguous"),
    ]
    for gu, match in bad:
        with pytest.raises(RuntimeError, match=match):
            ops.silu_mul(gu)


# ------------------------------------------------------------------ rope_
@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("n_heads, n_kv_heads, head_dim", [(9, 3, 64), (4, 4, 128), (6, 2, 8)])
def test_rope_matches_complex_multiply(T, n_heads, n_kv_heads, head_dim):
    """In place on a packed qkv [T, q + 2 kv] whose rows are strided (a slice of a wider buffer):
    q and k rotated as the complex multiply does (within rounding), v and the padding untouched."""
    torch.manual_seed(T + head_dim)
    q_size, kv_size = n_heads * head_dim, n_kv_heads * head_dim
    width = q_size + 2 * kv_size
    table = rope_table(4096, head_dim)
    positions = torch.randint(0, 4096, (T,))
    big = torch.randn(T, width + 6)
    qkv = big[:, 2:2 + width]
    want = ops.rope_reference(qkv, positions, table, n_heads + n_kv_heads)
    before = big.clone()
    ops.rope_(qkv, positions, table, n_heads + n_kv_heads)
    torch.testing.assert_close(qkv, want, rtol=4 * ULP, atol=1e-6)
    assert torch.equal(qkv[:, q_size + kv_size:], before[:, 2 + q_size + kv_size:2 + width])   # v
    assert torch.equal(big[:, :2], before[:, :2]) and torch.equal(big[:, 2 + width:], before[:, 2 + width:])
    if T == 37:                                            # and rotations really happened
        assert not torch.allclose(qkv[:, :q_size], before[:, 2:2 + q_size])


def test_rope_angles_are_pos_times_inv_freq():
    """One head, one position: pair i is turned by pos * inv_freq[i] (float64 check)."""
    head_dim, pos = 64, 1000
    table = rope_table(2048, head_dim)
    inv = rope_inv_freq(tiny_config(head_dim=head_dim, rope_theta=10000.0)).double()
    x = torch.zeros(1, head_dim)
    x[0, 0::2] = 1.0                                               # 1 + 0i in every pair
    ops.rope_(x, torch.tensor([pos]), table, 1)
    ang = torch.tensor([float(pos)], dtype=torch.float64) * inv
    # float32 angles as the table holds them: pos * inv_freq rounded, then cos/sin
    want_c = torch.cos((pos * inv.float()).double())
    assert torch.allclose(x[0, 0::2].double(), want_c, atol=1e-6)
    assert torch.allclose(x[0, 1::2].double(), torch.sin((pos * inv.float()).double()), atol=1e-6)
    assert torch.allclose(x[0, 0::2].double(), torch.cos(ang), atol=1e-3)    # sanity: the angle


def test_rope_opcheck_and_bad_args():
    table = rope_table(16, 8)
    torch.library.opcheck(torch.ops.symphony.rope_.default,
                          (torch.randn(3, 40), torch.tensor([0, 5, 15]), table, 4))
    good = dict(x=torch.randn(2, 40), positions=torch.tensor([1, 2]), table=table, heads=4)
    bad = [
        (dict(x=torch.randn(40)), "x must be 2-D"),
        (dict(x=torch.randn(2, 40, dtype=torch.float64)), "must be float32"),
        (dict(x=torch.randn(2, 40, dtype=torch.bfloat16)), "must be float32"),
        (dict(x=torch.randn(40, 2).t()), "must be contiguous"),
        (dict(heads=6), "do not fit"),
        (dict(heads=-1), "do not fit"),
        (dict(positions=torch.tensor([1, 2], dtype=torch.int32)), "int64"),
        (dict(positions=torch.tensor([1])), r"positions must be 1-D \[T\]"),
        (dict(positions=torch.tensor([1, 16])), r"positions\[1\] = 16 is outside"),
        (dict(positions=torch.tensor([-1, 2])), r"positions\[0\] = -1 is outside"),
        (dict(table=table.reshape(16, 8)), "table must be"),
        (dict(table=table.transpose(0, 1)), "table must be"),
        (dict(table=table.double()), "must be float32"),
    ]
    for change, match in bad:
        a = {**good, **change}
        with pytest.raises(RuntimeError, match=match):
            ops.rope_(a["x"], a["positions"], a["table"], a["heads"])


# ------------------------------------------------------------------ the model
def _logits(eng, toks=(5, 17, 3, 99, 42, 8, 1)):
    """Logits of a 5-token prompt and two decode steps on a new sequence, [7, vocab]."""
    kv = eng.new_sequence()
    out = [eng.pred(kv, list(toks[:5]), all_logits=True)] + [eng.pred(kv, [t]).unsqueeze(0) for t in toks[5:]]
    eng.release(kv)
    return torch.cat(out)


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
@pytest.mark.parametrize("cfg", [tiny_config(), tiny_config(n_heads=6, n_kv_heads=2, head_dim=32, hidden_size=64),
                                 tiny_config(arch="qwen2", attn_bias=True)], ids=["gqa2", "gqa3", "qwen2-bias"])
def test_model_fused_paths_give_torch_logits(cfg, quantize, monkeypatch):
    """float32 CPU, dense or quantized matrices: one llama_layers call a pass by default; with the
    layer stack off, the Python loop calls rope_ and silu_mul once a layer; with those off too,
    torch's code. The logits of a prompt and two decode steps agree within 1e-5 in all three
    (1e-4 with quantized matrices: see below)."""
    w = random_weights(cfg, seed=3)
    eng = Engine(w, None, EngineConfig(page_size=4, num_pages=64, quantize=quantize))
    calls = {"llama_layers": 0, "rope_": 0, "silu_mul": 0}
    for name in calls:
        def counted(*a, _real=getattr(ops, name), _name=name):
            calls[_name] += 1
            return _real(*a)
        monkeypatch.setattr(ops, name, counted)
    m, L = eng.model, cfg.n_layers
    assert m.fused_elementwise and m.layer_stack is not None
    stack = _logits(eng)
    assert calls == {"llama_layers": 3, "rope_": 0, "silu_mul": 0}
    m.layer_stack = None
    fused = _logits(eng)
    assert calls == {"llama_layers": 3, "rope_": 3 * L, "silu_mul": 3 * L}
    m.fused_elementwise = False
    plain = _logits(eng)
    assert calls == {"llama_layers": 3, "rope_": 3 * L, "silu_mul": 3 * L}   # torch's code only
    # quantized matrices on AVX-512 VNNI CPUs round x to 15 bits (the default kernels): where the
    # three paths' float32 values differ in the last bit a value can round to the next step
    # (measured 2.3e-5 on logits of ~1)
    atol = 1e-5 if quantize is None else 1e-4
    torch.testing.assert_close(stack, plain, atol=atol, rtol=0)
    torch.testing.assert_close(fused, plain, atol=atol, rtol=0)
    assert math.isfinite(plain.abs().max().item()) and plain.abs().max() > 0.1


def test_layer_stack_follows_the_qlinear_path():
    """llama_layers asks qlinear for the path QWeight.linear would (quant's current path): under
    force_qlinear_path(-2) (int8 activations) it gives the Python loop's logits on that path,
    which differ from the float32-activation ones."""
    eng = Engine(random_weights(tiny_config(), seed=5), None,
                 EngineConfig(page_size=4, num_pages=64, quantize="int8"))
    with force_qlinear_path(-2):
        stack_q8 = _logits(eng)
        saved, eng.model.layer_stack = eng.model.layer_stack, None
        loop_q8 = _logits(eng)
        eng.model.layer_stack = saved
    stack_f32 = _logits(eng)
    torch.testing.assert_close(stack_q8, loop_q8, atol=1e-5, rtol=0)
    assert (stack_q8 - stack_f32).abs().max() > 1e-4


def test_model_keeps_torch_code_for_bfloat16():
    eng = Engine(random_weights(tiny_config(), seed=1), None,
                 EngineConfig(page_size=4, num_pages=64, dtype=torch.bfloat16))
    assert not eng.model.fused_elementwise and eng.model.layer_stack is None


# ------------------------------------------------------------------ llama_layers arguments
def _stack_args(T=3, bias=False):
    """A one-layer stack (hidden 64, 2 heads and 1 kv head of 32, intermediate 96; dense
    matrices) over a 4-page pool, T new tokens of one sequence at positions 0 .. T-1."""
    g = torch.Generator().manual_seed(0)
    H, nh, nkv, d, inter = 64, 2, 1, 32, 96
    mats = []
    for n, k in ((nh * d + 2 * nkv * d, H), (H, nh * d), (2 * inter, H), (H, inter)):
        w = torch.randn(n, k, generator=g) / math.sqrt(k)
        mats += [w, w, w]
    return dict(x=torch.randn(T, H, generator=g), positions=torch.arange(T), rope_table=rope_table(16, d),
                kv_pool=torch.zeros(1, 2, 4, 4, nkv, d), slots=torch.arange(T),
                page_table=torch.arange(4, dtype=torch.int32).view(1, 4),
                cu_q_lens=torch.tensor([0, T], dtype=torch.int32), kv_lens=torch.tensor([T], dtype=torch.int32),
                norms=[torch.rand(H, generator=g) + 0.5 for _ in range(2)], mats=mats, kinds=[-1] * 4,
                groups=[0] * 4, biases=[torch.randn(nh * d + 2 * nkv * d, generator=g) if bias else None],
                n_heads=nh, n_kv_heads=nkv, scale=d ** -0.5, eps=1e-5, qpath=-1)


def test_llama_layers_opcheck_and_kv_written():
    a = _stack_args(bias=True)
    out = ops.llama_layers(**a)
    assert out.shape == a["x"].shape and torch.isfinite(out).all()
    assert a["kv_pool"][0, :, 0, :3].abs().sum(-1).gt(0).all()      # K and V of the 3 tokens
    assert a["kv_pool"][0, :, 0, 3:].eq(0).all() and a["kv_pool"][0, :, 1:].eq(0).all()
    torch.library.opcheck(torch.ops.symphony.llama_layers.default, tuple(_stack_args().values()))


@pytest.mark.parametrize("change, match", [
    (dict(kv_pool=torch.zeros(2, 4, 4, 1, 32)), "kv_pool must be"),
    (dict(kv_pool=torch.zeros(1, 2, 4, 4, 1, 32, dtype=torch.float64)), "kv_pool must be float32, bfloat16 or float16"),
    (dict(x=torch.randn(3, 64, dtype=torch.float64)), "x must be a float32"),
    (dict(norms=[torch.rand(64)]), "expected 2L norms"),
    (dict(kinds=[-1] * 3), "expected 2L norms"),
    (dict(biases=[None, None]), "expected 2L norms"),
    (dict(n_kv_heads=2), "kv heads"),
    (dict(n_heads=3), "wqkv gives"),
    (dict(biases=[torch.randn(7)]), "bias of matrix 0"),
])
def test_llama_layers_bad_args_raise(change, match):
    a = {**_stack_args(), **change}
    if "biases" in change and len(change["biases"]) == 1:          # a quantized wqkv takes the bias path
        q = torch.ones(128, 64, dtype=torch.int8)                   # i8, groups of 32, no mins
        a["mats"] = [q, torch.ones(128, 2), torch.empty(0)] + a["mats"][3:]
        a["kinds"], a["groups"] = [1, -1, -1, -1], [32, 0, 0, 0]
    with pytest.raises(RuntimeError, match=match):
        ops.llama_layers(**a)
