"""Quantized weights, op level: GGUF repacking against the ``gguf`` package's own dequantizer,
qlinear / qdequant against the plain PyTorch reference on every path this CPU runs, opcheck,
argument errors, the load-time quantizers.

Tolerance of qlinear, float paths (0-3): they compute the float32 product with the dequantized
weight (no activation quantization), so they differ from the float64 reference only by float32
rounding of the sum: |y - ref| <= 1e-5 * (|x| @ |W|^T) + 1e-6 (K <= 1024 terms of ulp 6e-8 each).

int8-activation paths (4-8, 10): x is rounded to int8 per block of 16 (d = max|x_block| / 127) and
the kernels multiply W by that rounded x (integer dot products scaled per block). Against
``qlinear_reference`` on the same path (the same rounding simulated in PyTorch, float64 after it)
they differ only by float32 rounding of the sums: |y - ref| <= 1e-5 * (|x^| @ |W|^T) + 1e-6.
Against the float product they differ by the rounding of x, at most half a step a value:
|y - x @ W^T| <= (d/2 @ |W|^T) (1 + 1e-5) + 1e-5 * (|x| @ |W|^T) + 1e-6.

The 15-bit paths (9 and 11, the automatic float choice below 64 rows on AVX-512 VNNI CPUs and
below 32 on AVX2 ones without AVX-512): the same,
with d = max|x_block| / 16383: half a step is 1/32766 of the block's largest value, so it is
within 3.1e-5 * (|x| @ |W|^T) of the float product (measured: 1.6e-5).
"""
import re

import gguf
import numpy as np
import pytest
import torch

from modelfiles import random_gguf_blocks
from symphony.engine import ops
from symphony.engine.ops import calibrate
from symphony.engine import quant
from symphony.engine.quant import I8, U4, QuantError, QWeight

TYPES = quant.GGUF_QUANT_TYPES


@pytest.fixture(autouse=True, scope="module")
def _ops_loaded():
    """Some tests call torch.ops.symphony.* directly, which exists only once the library is
    loaded: load it first, so that any test here also runs alone (pytest FILE::TEST). No
    measured choices installed (ops/calibrate.py): the automatic choices follow the rule tested
    here."""
    ops.load()
    calibrate.clear()


def _cpuinfo(field: str) -> str:
    """The first CPU's ``field`` in /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


FLAGS = set(_cpuinfo("flags").split())
IS_AMD = _cpuinfo("vendor_id") == "AuthenticAMD"
HAS_AVX2 = {"avx2", "fma"} <= FLAGS
HAS_AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= FLAGS and HAS_AVX2
HAS_AVX_VNNI = "avx_vnni" in FLAGS and HAS_AVX2
HAS_AVX512_VNNI = "avx512_vnni" in FLAGS and HAS_AVX512
HAS_AMX_BF16 = {"amx_bf16", "amx_tile"} <= FLAGS
# qlinear's automatic float-accurate choice (-1) rounds x to 15 bits below some rows: on AVX-512
# VNNI (path 9), and on AVX2 without AVX-512 (path 11)
AUTO_15BIT = HAS_AVX512_VNNI or (HAS_AVX2 and not HAS_AVX512)
PATHS = [
    pytest.param(0, id="scalar"),
    pytest.param(1, id="avx2", marks=pytest.mark.skipif(not HAS_AVX2, reason="this CPU has no AVX2+FMA: the AVX2 path cannot run here")),
    pytest.param(2, id="avx512", marks=pytest.mark.skipif(not HAS_AVX512, reason="this CPU has no AVX-512 (f/bw/vl/dq): the AVX-512 path cannot run here")),
    pytest.param(3, id="dense"),
]
Q8_PATHS = [
    pytest.param(4, id="int8-scalar"),
    pytest.param(5, id="int8-avx2", marks=pytest.mark.skipif(not HAS_AVX2, reason="this CPU has no AVX2+FMA: the int8 AVX2 path cannot run here")),
    pytest.param(6, id="int8-avxvnni", marks=pytest.mark.skipif(not HAS_AVX_VNNI, reason="this CPU has no AVX-VNNI: the int8 AVX-VNNI path cannot run here")),
    pytest.param(7, id="int8-avx512vnni", marks=pytest.mark.skipif(not HAS_AVX512_VNNI, reason="this CPU has no AVX-512 VNNI: the int8 AVX-512 VNNI path cannot run here")),
    pytest.param(8, id="int8-avx512vnni-t16", marks=pytest.mark.skipif(not HAS_AVX512_VNNI, reason="this CPU has no AVX-512 VNNI: the int8 AVX-512 VNNI 16-row-tile path cannot run here")),
    pytest.param(9, id="15bit-avx512vnni", marks=pytest.mark.skipif(not HAS_AVX512_VNNI, reason="this CPU has no AVX-512 VNNI: the 15-bit path cannot run here")),
    pytest.param(10, id="int8-avx2-t8", marks=pytest.mark.skipif(not HAS_AVX2, reason="this CPU has no AVX2+FMA: the int8 AVX2 8-row-tile path cannot run here")),
    pytest.param(11, id="15bit-avx2-t8", marks=pytest.mark.skipif(not HAS_AVX2, reason="this CPU has no AVX2+FMA: the 15-bit AVX2 8-row-tile path cannot run here")),
    pytest.param(12, id="15bit-avx2-rows", marks=pytest.mark.skipif(not HAS_AVX2, reason="this CPU has no AVX2+FMA: the 15-bit AVX2 row-kernel path cannot run here")),
]
# the best int8-activation path this CPU runs at one row (the one the automatic choice takes)
Q8_BEST = 7 if HAS_AVX512_VNNI else 6 if HAS_AVX_VNNI else 5 if HAS_AVX2 else 4


def qmax_of(path: int) -> int:
    """The largest |qx| of an integer-activation path's rounding of x: 16383 for the 15-bit paths."""
    return 16383 if path in ops.FIFTEEN_BIT_PATHS else 127


def gguf_weight(qtype: str, n: int, k: int, seed: int = 0) -> tuple[QWeight, np.ndarray]:
    """A QWeight from random GGUF blocks, and the gguf package's dequantization of them."""
    raw = random_gguf_blocks(qtype, n, k, seed=seed)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(n, k)
    return quant.from_gguf(raw, qtype, n, k), want


def assert_linear_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y vs x @ w^T within float32 summation error (module docstring)."""
    ref = x.double() @ w.double().t()
    bound = 1e-5 * (x.double().abs() @ w.double().abs().t()) + 1e-6
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"max err {err.max():.3g}, bound there {bound.flatten()[err.argmax()]:.3g}"


def assert_q8_close(y: torch.Tensor, x: torch.Tensor, qw: QWeight, w: torch.Tensor, path: int) -> None:
    """An int8-activation path's y vs the simulated reference and vs x @ w^T (module docstring)."""
    ref = ops.qlinear_reference(x, qw.qs, qw.scales, qw.mins, qw.kind, qw.group, path).double()
    qx, d = ops.quantize_act_reference(x, qmax_of(path))
    xr = qx.double() * d.double().repeat_interleave(16, dim=1)                # x as rounded
    terms = xr.abs() @ w.double().abs().t() + x.double().abs() @ w.double().abs().t()
    err = (y.double() - ref).abs()
    bound = 1e-5 * terms + 1e-6
    assert bool((err <= bound).all()), f"vs reference: max err {err.max():.3g}"
    half = d.double().repeat_interleave(16, dim=1) / 2                         # [M, K]
    err = (y.double() - x.double() @ w.double().t()).abs()
    bound = (half @ w.double().abs().t()) * (1 + 1e-5) + 1e-5 * terms + 1e-6
    assert bool((err <= bound).all()), f"vs float product: max err {err.max():.3g}"


# ---------------------------------------------------------------------------------- repacking
@pytest.mark.parametrize("qtype", TYPES)
def test_repack_equals_gguf_dequantize(qtype):
    k = 512
    qw, want = gguf_weight(qtype, 7, k, seed=3)
    assert qw.shape == (7, k) and qw.source == qtype
    got = qw.dequantize().numpy()
    # the kernels use a fused multiply-add for scale * q + min: at most one float32 ulp apart
    np.testing.assert_allclose(got, want, rtol=2.5e-7, atol=1e-30)
    np.testing.assert_allclose(ops.qdequant_reference(qw.qs, qw.scales, qw.mins, qw.kind, qw.group).numpy(),
                               want, rtol=2.5e-7, atol=1e-30)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_repack_of_real_quantization(qtype):
    """The gguf package's own quantizer on smooth data (not random bits)."""
    w = np.random.default_rng(0).standard_normal((9, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    qw = quant.from_gguf(raw, qtype, 9, 96)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(9, 96)
    np.testing.assert_allclose(qw.dequantize().numpy(), want, rtol=2.5e-7, atol=1e-30)
    assert np.abs(want - w).max() < (0.02 if qtype == "Q8_0" else 0.3)


def test_repack_rejects_bad_sizes():
    raw = random_gguf_blocks("Q4_K", 2, 256)
    with pytest.raises(QuantError, match="not a multiple of 256"):
        quant.from_gguf(raw, "Q4_K", 2, 128)
    with pytest.raises(QuantError, match="bytes for a"):
        quant.from_gguf(raw[:, :-1], "Q4_K", 2, 256)
    with pytest.raises(QuantError, match="not kept quantized"):
        quant.from_gguf(raw, "Q2_K", 2, 256)


# ---------------------------------------------------------------------------------- qlinear
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("qtype", TYPES)
def test_qlinear_matches_dequantized_reference(qtype, path):
    k = 512 if qtype.endswith("_K") else 96
    for n in (1, 7, 37):                    # odd N: the 4-row blocks' remainders
        qw, want = gguf_weight(qtype, n, k, seed=n)
        w = torch.from_numpy(want)
        for m in (1, 2, 3, 5, 7, 8, 9, 33):  # the m-blocks' remainders, the tiles' direct and buffered
                                            # sides (7, 8 rows), and the dense-tile size
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            y = ops.qlinear(x, qw.qs, qw.scales, qw.mins, qw.kind, qw.group, path)
            assert y.shape == (m, n) and y.dtype == torch.float32
            assert_linear_close(y, x, w)


@pytest.mark.parametrize("path", Q8_PATHS)
@pytest.mark.parametrize("qtype", TYPES)
def test_qlinear_int8_activations(qtype, path):
    """Every int8 path vs the reference that rounds x the same way, and vs the float product;
    K = 96 and 160 end in half a 64-value step (the AVX-512 kernels' masked tail)."""
    ks = (256, 512) if qtype.endswith("_K") else (32, 96, 160)
    for k in ks:
        for n in (1, 7, 37):
            qw, want = gguf_weight(qtype, n, k, seed=n + k)
            w = torch.from_numpy(want)
            for m in (1, 2, 3, 4, 5, 7, 8, 9, 33):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
                x[0, :16] = 0                                # an all-zero block: d = 0
                y = ops.qlinear(x, qw.qs, qw.scales, qw.mins, qw.kind, qw.group, path)
                assert y.shape == (m, n) and y.dtype == torch.float32
                assert_q8_close(y, x, qw, w, path)


def test_int8_paths_agree_and_round_like_the_reference():
    """All int8 paths this CPU runs give the same rounding of x: each equals the scalar path to
    float32 summation error; and the rounding itself is what quantize_act_reference says (a
    weight that picks single columns reads back d * qx exactly)."""
    qw, want = gguf_weight("Q5_K", 11, 256, seed=4)
    x = torch.randn(6, 256) * torch.logspace(-3, 3, 256)     # blocks of very different scales
    runs = {4: True, 5: HAS_AVX2, 6: HAS_AVX_VNNI, 7: HAS_AVX512_VNNI, 8: HAS_AVX512_VNNI, 10: HAS_AVX2}
    ys = {p: ops.qlinear(x, qw.qs, qw.scales, qw.mins, qw.kind, qw.group, p) for p in runs if runs[p]}
    for p, y in ys.items():
        torch.testing.assert_close(y, ys[4], rtol=1e-5, atol=1e-5 * float(ys[4].abs().max()))
    # identity-like i8 weight: row n has q = 1 at column n, scale 1: y[m, n] = d * qx[m, n]
    k = 64
    qs = torch.zeros(k, k, dtype=torch.int8)
    qs[torch.arange(k), torch.arange(k)] = 1
    xs = torch.randn(3, k) * 5
    qx, d = ops.quantize_act_reference(xs)
    want_x = qx.float() * d.repeat_interleave(16, dim=1)
    for p in ys:
        y = ops.qlinear(xs, qs, torch.ones(k, 2), torch.empty(0), I8, 32, p)
        assert torch.equal(y, want_x), p


@pytest.mark.skipif(not HAS_AVX2, reason="this CPU has no AVX2+FMA: paths 5, 10, 11 and 12 cannot run here")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_avx2_kernels_extremes(qtype):
    """The AVX2 row kernels (5, 12) and 8-row tiles (10, 11) at the ends of the byte ranges: i8 weights of -128 and 127 (|w| = 128 goes
    to vpmaddubsw unsigned, x takes w's sign), x blocks whose largest value is negative (qx =
    -127, or -16383 whose qx >> 7 is -128: split as -127 and a negative low part), N = 8 + 1
    (a full tile and a one-row tail; the row kernels: two 4-row blocks and a tail), M = 1..6 (the
    tiles' 4-row blocks, the row kernels' pairs, and their remainders)."""
    k = 96
    qw, want = gguf_weight(qtype, 9, k, seed=8)
    if qtype == "Q8_0":                       # every byte either extreme, scale 1
        qs = torch.where(torch.arange(9 * k).reshape(9, k) % 3 == 0, 127, -128).to(torch.int8)
        qw = QWeight(qs, torch.ones(9, k // 32), torch.empty(0), I8, 32)
        want = ops.qdequant_reference(qw.qs, qw.scales, qw.mins, qw.kind, qw.group).numpy()
    g = torch.Generator().manual_seed(9)
    for m in range(1, 7):
        x = torch.rand(m, k, generator=g) * 2 - 1
        x[:, ::16] = -1.5                     # the largest |x| of every block, negative
        for path in (5, 10, 11, 12):
            y = ops.qlinear(x, qw.qs, qw.scales, qw.mins, qw.kind, qw.group, path)
            assert_q8_close(y, x, qw, torch.from_numpy(want), path)


@pytest.mark.parametrize("path", PATHS + Q8_PATHS)
def test_qlinear_strided_rows_and_threads(path):
    """x a row-strided view (a slice of a fused projection), several threads, a wide N."""
    qw, want = gguf_weight("Q4_1", 301, 128, seed=5)
    big = torch.randn(6, 200)
    x = big[:, 40:168]                      # rows of stride 200
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            y = ops.qlinear(x, qw.qs, qw.scales, qw.mins, qw.kind, qw.group, path)
            if path >= 4:
                assert_q8_close(y, x, qw, torch.from_numpy(want), path)
            else:
                assert_linear_close(y, x, torch.from_numpy(want))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("k", [96, 352])
@pytest.mark.parametrize("path", PATHS + Q8_PATHS)
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_float16_scales_equal_float32(qtype, path, k):
    """Q4_0 / Q4_1 / Q8_0 keep the file's float16 scales (and Q4_1's mins; Q4_0's, -8 d, are
    implied) in memory; the AVX2 row kernels (5, 12) read them as they are, every other path widens
    the scales exactly and writes implied mins out, a block of 64 rows at a time, so each result is
    bit for bit that of the same weight with float32 scales and stored mins: N = 150 (two blocks
    and a tail), K = 96 and 352 (3 and 11 groups: the row kernels take mins 8 groups at a time),
    M = 1, 3, 8, 33 and 70, one to three threads; qdequant and the embedding lookup too."""
    qw, want = gguf_weight(qtype, 150, k, seed=11)
    assert qw.scales.dtype == torch.float16
    assert (qw.mins.numel() == 0) == (qtype != "Q4_1") and (qw.mins.dtype == torch.float16 or not qw.mins.numel())
    q32 = qw.with_float32_scales()
    q32 = QWeight(q32.qs, q32.scales, q32.stored_mins(), q32.kind, q32.group)   # mins stored
    assert q32.scales.dtype == torch.float32 and torch.equal(q32.scales, qw.scales.float())
    assert qw.nbytes() < q32.nbytes()
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for m in (1, 3, 8, 33, 70):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                a = ops.qlinear(x, qw.qs, qw.scales, qw.mins, qw.kind, qw.group, path)
                b = ops.qlinear(x, q32.qs, q32.scales, q32.mins, q32.kind, q32.group, path)
                assert torch.equal(a, b), (threads, m)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(qw.dequantize(), q32.dequantize())
    np.testing.assert_allclose(qw.dequantize().numpy(), want, rtol=1e-6, atol=1e-6)
    idx = torch.tensor([[0, 149], [64, 3]])
    assert torch.equal(qw.rows(idx), q32.rows(idx))


def test_float16_scales_layout_rules():
    """Float16 scales: mins of another dtype, or scales of a third, are refused (QWeight and the
    op); moving off the CPU widens them (the CUDA kernels read float32), on it keeps them;
    stacking a float16-scale weight with a float32 one widens both, exactly."""
    qw, _ = gguf_weight("Q4_1", 6, 64, seed=2)
    with pytest.raises(QuantError, match="dtypes differ"):
        QWeight(qw.qs, qw.scales, qw.mins.float(), U4, 32)
    with pytest.raises(QuantError, match="float32 or float16"):
        QWeight(qw.qs, qw.scales.double(), qw.mins.double(), U4, 32)
    with pytest.raises(RuntimeError, match="mins must have the scales' dtype"):
        ops.qlinear(torch.randn(1, 64), qw.qs, qw.scales, qw.mins.float(), U4, 32, -1)
    assert qw.to("cpu") is qw
    moved = qw.to("meta")
    assert moved.scales.dtype == torch.float32 and moved.mins.dtype == torch.float32
    q0, want0 = gguf_weight("Q4_0", 4, 64, seed=5)             # implied mins: written out off the CPU
    assert q0.mins.numel() == 0 and q0.to("meta").mins.shape == q0.scales.shape
    assert torch.equal(q0.stored_mins(), q0.scales * -8)
    np.testing.assert_allclose(ops.qdequant_reference(q0.qs, q0.scales, q0.mins, U4, 32).numpy(), want0,
                               rtol=1e-6, atol=1e-6)
    q41, _ = gguf_weight("Q4_1", 3, 64, seed=6)                 # stacked with stored mins: written out
    mixed = QWeight.cat([q0, q41])
    assert mixed.mins.shape == mixed.scales.shape
    assert torch.equal(mixed.dequantize(), torch.cat([q0.dequantize(), q41.dequantize()]))
    assert torch.equal(q0.as_i8(16).dequantize(), q0.dequantize())
    k4, _ = gguf_weight("Q4_K", 3, 256, seed=3)                 # K-quants keep float32 scales
    assert k4.scales.dtype == torch.float32
    q4, _ = gguf_weight("Q4_0", 3, 256, seed=4)
    both = QWeight.cat([q4, k4])
    assert both.scales.dtype == torch.float32
    assert torch.equal(both.dequantize(), torch.cat([q4.dequantize(), k4.dequantize()]))


def test_force_qlinear_path_validates_and_restores():
    qw, _ = gguf_weight("Q4_1", 5, 64)
    x = torch.randn(1, 64)
    with quant.force_qlinear_path(4):
        assert torch.equal(qw.linear(x), ops.qlinear(x, qw.qs, qw.scales, qw.mins, U4, 32, 4))
    assert torch.equal(qw.linear(x), ops.qlinear(x, qw.qs, qw.scales, qw.mins, U4, 32, -1))
    for bad in (14, -3, "7", 1.0, True):
        with pytest.raises(ValueError, match="qlinear path"):
            quant.force_qlinear_path(bad)


def test_set_int8_activations():
    qw, _ = gguf_weight("Q4_1", 5, 64)
    x = torch.randn(3, 64)
    assert not quant.int8_activations()                     # the default: float32 activations
    try:
        quant.set_int8_activations(True)
        assert quant.int8_activations()
        assert torch.equal(qw.linear(x), ops.qlinear(x, qw.qs, qw.scales, qw.mins, U4, 32,
                                                     expected_auto(-2, 3, qw)))
        with quant.force_qlinear_path(0):
            assert torch.equal(qw.linear(x), ops.qlinear(x, qw.qs, qw.scales, qw.mins, U4, 32, 0))
        assert quant.int8_activations()
    finally:
        quant.set_int8_activations(False)
    assert torch.equal(qw.linear(x), ops.qlinear(x, qw.qs, qw.scales, qw.mins, U4, 32, -1))
    with pytest.raises(TypeError):
        quant.set_int8_activations(1)


def expected_auto(path: int, m: int, qw: QWeight) -> int:
    """The path qlinear's automatic choice (-1 or -2) takes for m rows (csrc/cpu/qlinear.cpp).
    The AVX2 8-row tiles (10, 11) are chosen only on CPUs without AVX-512 VNNI, which this
    test cannot see on one that has it: there the forced paths 10 / 11 are what is tested."""
    t8 = not HAS_AVX512_VNNI and HAS_AVX2
    if path == -2:
        if HAS_AMX_BF16 and m >= 64:
            return 13
        if HAS_AVX512_VNNI:
            return 7 if m < 2 else 8
        return ((10 if m >= 4 else 5) if t8 else Q8_BEST) if m < 32 or (m < 64 and qw.numel() >= 3 << 18) else 3
    if HAS_AVX512_VNNI:
        return 3 if m >= 64 else 12 if m == 1 and qw.kind == U4 and not IS_AMD else 9
    if m >= 32:
        return 3
    if t8 and not HAS_AVX512:
        return 12 if m < 4 else 11
    return 2 if HAS_AVX512 else 1 if HAS_AVX2 else 0


def test_qlinear_path_for_is_the_choice_qlinear_makes():
    """`ops.qlinear_path_for` (what the kernel's log line is made of) resolves -1 / -2 as the
    rule of `expected_auto` says qlinear does; forced paths come back as they are; bad
    arguments are refused; the log line names the dense GEMM's first row count."""
    for qtype in ("Q6_K", "Q4_1"):
        qw, _ = gguf_weight(qtype, 13, 256)
        n, k = qw.qs.shape[0], 256
        for m in (1, 2, 3, 4, 31, 32, 63, 64, 100, 255, 256):
            for path in (-1, -2):
                assert ops.qlinear_path_for(path, m, n, k, qw.kind) == expected_auto(path, m, qw), (qtype, m, path)
        assert ops.qlinear_path_for(3, 1, n, k, qw.kind) == 3
    for bad in ((14, 1, 8, 8, U4), (-3, 1, 8, 8, U4), (-1, 0, 8, 8, U4), (-1, 1, 0, 8, U4), (-1, 1, 8, 8, 2)):
        with pytest.raises(RuntimeError, match="qlinear_path_for"):
            ops.qlinear_path_for(*bad)
    dense_from = next(m for m in range(1, 257) if ops.qlinear_path_for(-1, m, 576, 576, U4) == 3)
    assert f"from {dense_from} rows: dense float32 GEMM" in quant.describe_cpu_kernels()


def test_qlinear_auto_path_and_empty_batch():
    """The automatic choice is one of the forced paths (bit for bit), by the rule of
    `expected_auto`, and -1 stays within the 15-bit bound of the float product whichever it is."""
    for qtype in ("Q6_K", "Q4_1"):
        qw, want = gguf_weight(qtype, 13, 256)
        for m in (1, 2, 3, 4, 31, 32, 63, 64, 100, 255, 256):
            x = torch.randn(m, 256)
            y = qw.linear(x)
            assert torch.equal(y, ops.qlinear(x, qw.qs, qw.scales, qw.mins, qw.kind, qw.group,
                                              expected_auto(-1, m, qw))), (qtype, m)
            w = torch.from_numpy(want).double()
            err = (y.double() - x.double() @ w.t()).abs()
            assert bool((err <= 3.1e-5 * (x.double().abs() @ w.abs().t()) + 1e-6).all()), (qtype, m)
            y8 = ops.qlinear(x, qw.qs, qw.scales, qw.mins, qw.kind, qw.group, -2)
            assert torch.equal(y8, ops.qlinear(x, qw.qs, qw.scales, qw.mins, qw.kind, qw.group,
                                               expected_auto(-2, m, qw))), (qtype, m)
    # without AVX-512 VNNI, from 32 to 63 rows, -2 keeps the int8 kernels for matrices of
    # 3 * 2^18 weights and more
    x = torch.randn(40, 512)
    for n in (1536, 1024):
        big, _ = gguf_weight("Q8_0", n, 512)
        y8 = ops.qlinear(x, big.qs, big.scales, big.mins, big.kind, big.group, -2)
        assert torch.equal(y8, ops.qlinear(x, big.qs, big.scales, big.mins, big.kind, big.group,
                                           expected_auto(-2, 40, big))), n
    assert qw.linear(torch.randn(0, 256)).shape == (0, 13)
    y = qw.linear(torch.randn(2, 3, 256, dtype=torch.bfloat16))       # any leading shape / dtype
    assert y.shape == (2, 3, 13) and y.dtype == torch.bfloat16


def test_cpu_features_match_cpuinfo():
    feats = ops.qcpu_features()
    tiles = feats.pop("amx_tiles")                  # the OS's grant as well: not in cpuinfo
    assert feats == {"avx2": HAS_AVX2, "avx512": HAS_AVX512, "avx_vnni": HAS_AVX_VNNI,
                     "avx512_vnni": HAS_AVX512_VNNI, "amx_bf16": HAS_AMX_BF16}
    assert not tiles or HAS_AMX_BF16


@pytest.mark.parametrize("qtype", TYPES)
def test_qdequant_and_rows(qtype):
    qw, want = gguf_weight(qtype, 11, 256)
    ref = ops.qdequant_reference(qw.qs, qw.scales, qw.mins, qw.kind, qw.group)
    torch.testing.assert_close(qw.dequantize(), ref, rtol=2.5e-7, atol=0)
    idx = torch.tensor([[3, 0], [10, 3]])
    torch.testing.assert_close(qw.rows(idx), ref[idx], rtol=2.5e-7, atol=0)
    torch.testing.assert_close(qw[2:5], ref[2:5], rtol=2.5e-7, atol=0)


def test_opcheck_qlinear_and_qdequant():
    for qtype in ("Q4_1", "Q6_K", "Q5_K"):
        qw, _ = gguf_weight(qtype, 5, 256)
        for m in (1, 3, 40):
            for path in (-1, -2, 4, Q8_BEST) + ((8, 9) if HAS_AVX512_VNNI else ()):
                torch.library.opcheck(torch.ops.symphony.qlinear.default,
                                      (torch.randn(m, 256), qw.qs, qw.scales, qw.mins, qw.kind, qw.group, path))
        torch.library.opcheck(torch.ops.symphony.qdequant.default,
                              (qw.qs, qw.scales, qw.mins, qw.kind, qw.group))


def _args(**over):
    qw, _ = gguf_weight("Q4_0", 4, 64)
    a = dict(x=torch.randn(2, 64), qs=qw.qs, scales=qw.scales, mins=qw.mins, kind=U4, group=32, path=-1)
    a.update(over)
    return a


@pytest.mark.parametrize("over, match", [
    (dict(kind=2), "kind must be 0"),
    (dict(group=16), "u4 weights have groups of 32"),
    (dict(x=torch.randn(2, 63)), "x has 63 columns"),
    (dict(x=torch.randn(2, 64, dtype=torch.float64)), "x must be float32"),
    (dict(x=torch.randn(64)), "x must be 2-D"),
    (dict(x=torch.randn(64, 2).t()), "x rows must be contiguous"),
    (dict(qs=torch.zeros(4, 32, dtype=torch.int8)), "u4 qs must be uint8"),
    (dict(scales=torch.ones(4, 3)), r"scales must be \[N, K/group\]"),
    (dict(mins=torch.ones(4, 3)), "mins shape"),
    (dict(scales=torch.ones(4, 2, dtype=torch.float64)), "scales must be float32"),
    (dict(path=14), "path must be"),
    (dict(path=-3), "path must be"),
    (dict(qs=torch.zeros(4, 15, dtype=torch.uint8), scales=torch.ones(4, 0), mins=torch.ones(4, 0)),
     "multiple of 32"),
])
def test_bad_qlinear_input_raises(over, match):
    a = _args(**over)
    with pytest.raises(RuntimeError, match=match):
        ops.qlinear(a["x"], a["qs"], a["scales"], a["mins"], a["kind"], a["group"], a["path"])


@pytest.mark.skipif(HAS_AVX512_VNNI and HAS_AVX_VNNI,
                    reason="this CPU has AVX-512 VNNI and AVX-VNNI: the unsupported-path error cannot show")
def test_unsupported_int8_path_raises():
    a = _args()
    p, what = (6, "path 6 (int8, AVX-VNNI) asked for") if not HAS_AVX_VNNI else \
        (7, "path 7 (int8, AVX-512 VNNI) asked for")
    with pytest.raises(RuntimeError, match=re.escape(what)):
        ops.qlinear(a["x"], a["qs"], a["scales"], a["mins"], 0, 32, p)


@pytest.mark.skipif(HAS_AVX512, reason="this CPU has AVX-512: the unsupported-path error cannot show")
def test_unsupported_path_raises():
    a = _args()
    with pytest.raises(RuntimeError, match=re.escape("path 2 (AVX-512) asked for")):
        ops.qlinear(a["x"], a["qs"], a["scales"], a["mins"], 0, 32, 2)


# ---------------------------------------------------------------------------------- QWeight
def test_cat_widens_mixed_layouts_exactly():
    """Q4_K_M fuses Q4_K q/k with a Q6_K v: stacked as i8 groups of 16, the same numbers."""
    a, wa = gguf_weight("Q4_K", 6, 256, seed=1)
    b, wb = gguf_weight("Q6_K", 3, 256, seed=2)
    c, wc = gguf_weight("Q8_0", 2, 256, seed=3)
    fused = QWeight.cat([a, b, c])
    assert (fused.kind, fused.group, fused.shape) == (I8, 16, (11, 256))
    np.testing.assert_allclose(fused.dequantize().numpy(), np.concatenate([wa, wb, wc]), rtol=2.5e-7, atol=1e-30)
    same = QWeight.cat([a, a])
    assert (same.kind, same.group) == (U4, 32)
    perm = torch.tensor([2, 0, 1, 5, 4, 3])
    torch.testing.assert_close(a.select_rows(perm).dequantize(), a.dequantize()[perm])
    with pytest.raises(QuantError, match="different K"):
        QWeight.cat([a, gguf_weight("Q8_0", 2, 64)[0]])


@pytest.mark.parametrize("scheme, step", [("int8", 1 / 127), ("int4", 1 / 15)])
def test_load_time_quantizers(scheme, step):
    w = torch.randn(10, 96)
    qw = quant.quantize(w, scheme)
    g = w.reshape(10, 3, 32)
    span = (g.abs().amax(2) if scheme == "int8" else g.amax(2) - g.amin(2)).repeat_interleave(32, 1)
    err = (qw.dequantize() - w).abs()
    assert bool((err <= 0.5 * step * span + 1e-6).all())     # half a quantization step
    x = torch.randn(3, 96)
    with quant.force_qlinear_path(2 if HAS_AVX512 else 1 if HAS_AVX2 else 0):
        assert_linear_close(qw.linear(x), x, qw.dequantize())
    if HAS_AVX512_VNNI:
        with quant.force_qlinear_path(9):
            assert_q8_close(qw.linear(x), x, qw, qw.dequantize(), 9)
    with quant.force_qlinear_path(Q8_BEST):
        assert_q8_close(qw.linear(x), x, qw, qw.dequantize(), Q8_BEST)
    with pytest.raises(QuantError, match="K % 32"):
        quant.quantize(torch.randn(4, 40), scheme)
    with pytest.raises(QuantError, match="unknown quantization"):
        quant.quantize(w, "int3")


# ---------------------------------------------------------------------------------- CUDA
def _cuda_ops() -> bool:
    return torch.cuda.is_available() and ops.cuda_available()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: the CUDA qlinear/qdequant kernels cannot run here")
@pytest.mark.parametrize("qtype", TYPES)
def test_cuda_qlinear_matches_dequantized_reference(qtype):
    if not _cuda_ops():
        pytest.skip("the CUDA ops were not built (no CUDA toolkit)")
    k = 512
    qw, want = gguf_weight(qtype, 37, k, seed=7)
    g = qw.to("cuda")
    torch.testing.assert_close(g.dequantize().cpu(), torch.from_numpy(want), rtol=2.5e-7, atol=0)
    for m in (1, 3, 8, 9, 40):               # GEMV kernel up to 8 rows, dequantize + GEMM above
        x = torch.randn(m, k)
        y = ops.qlinear(x.cuda(), g.qs, g.scales, g.mins, g.kind, g.group)
        ref = x.double() @ torch.from_numpy(want).double().t()
        # cuBLAS may use TF32 for float32 GEMMs where allowed: 1e-3 relative to |x| @ |W|^T
        bound = 1e-3 * (x.double().abs() @ torch.from_numpy(want).double().abs().t()) + 1e-5
        assert bool(((y.cpu().double() - ref).abs() <= bound).all())


@pytest.mark.parametrize("qtype", TYPES)
def test_bfloat16_dense_path(qtype):
    """Path 13 (the dense GEMM in bfloat16, the int8-activation choice for batches on AMX CPUs;
    it runs, slower, on any CPU): within 2 bfloat16 ulps (2^-7) of the row's scale of the
    reference that rounds x, W and the product to bfloat16, and within 1 % of that scale of
    the float product; in pieces over the 8 MiB scratch too."""
    k = 512 if qtype.endswith("_K") else 96
    for n in (7, 37):
        qw, want = gguf_weight(qtype, n, k, seed=n)
        w = torch.from_numpy(want).double()
        for m in (1, 33, 64):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            y = ops.qlinear(x, qw.qs, qw.scales, qw.mins, qw.kind, qw.group, 13)
            assert y.shape == (m, n) and y.dtype == torch.float32
            ref = ops.qlinear_reference(x, qw.qs, qw.scales, qw.mins, qw.kind, qw.group, 13).double()
            scale = x.double().abs() @ w.abs().t()
            assert bool(((y.double() - ref).abs() <= 2.0 ** -7 * scale + 1e-6).all())
            assert bool(((y.double() - x.double() @ w.t()).abs() <= 1e-2 * scale + 1e-6).all())
    n, k = (1 << 16) + 5, 32
    g = torch.Generator().manual_seed(0)
    qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales, mins = torch.rand(n, 1, generator=g), torch.randn(n, 1, generator=g)
    x = torch.randn(2, k, generator=g)
    y = ops.qlinear(x, qs, scales, mins, U4, 32, 13).double()
    w = ops.qdequant_reference(qs, scales, mins, U4, 32).double()
    assert bool(((y - x.double() @ w.t()).abs() <= 1e-2 * (x.double().abs() @ w.abs().t()) + 1e-6).all())


def test_bfloat16_copies_are_kept_within_the_budget_and_dropped_with_their_weight():
    """Path 13 keeps each weight's bfloat16 copy (made on its first product) while the weight
    lives and the budget allows: results are the same bit for bit with and without the copy; a
    weight freed gives its copy back, and another one at the same address is never mistaken for
    it; the budget bounds what is kept (0: nothing)."""
    import gc
    cache, set_budget = torch.ops.symphony.qlinear_bf16_cache, torch.ops.symphony.qlinear_set_bf16_cache
    budget = cache()[2]
    try:
        set_budget(0)
        assert list(cache())[:2] == [0, 0]
        qw, _ = gguf_weight("Q4_1", 64, 256, seed=1)
        x = torch.randn(70, 256)
        y0 = ops.qlinear(x, qw.qs, qw.scales, qw.mins, qw.kind, qw.group, 13)
        assert list(cache())[:2] == [0, 0]                     # over the budget: none kept
        set_budget(1 << 20)
        y1 = ops.qlinear(x, qw.qs, qw.scales, qw.mins, qw.kind, qw.group, 13)
        assert list(cache())[:2] == [64 * 256 * 2, 1]
        y2 = ops.qlinear(x, qw.qs, qw.scales, qw.mins, qw.kind, qw.group, 13)
        assert torch.equal(y0, y1) and torch.equal(y1, y2)
        assert list(cache())[:2] == [64 * 256 * 2, 1]          # the copy reused
        for seed in range(2, 6):                              # freed weights, new ones (same sizes,
            del qw                                            # often the same addresses): each
            gc.collect()                                      # result is its own weight's
            qw, want = gguf_weight("Q4_1", 64, 256, seed=seed)
            y = ops.qlinear(x, qw.qs, qw.scales, qw.mins, qw.kind, qw.group, 13)
            ref = ops.qlinear_reference(x, qw.qs, qw.scales, qw.mins, qw.kind, qw.group, 13)
            scale = x.abs() @ torch.from_numpy(want).abs().t()
            assert bool(((y - ref).abs() <= 2.0 ** -7 * scale + 1e-6).all()), seed
            assert cache()[1] == 1
        big, _ = gguf_weight("Q4_1", 4096, 256, seed=9)        # 2 MiB: over the 1 MiB budget
        ops.qlinear(x, big.qs, big.scales, big.mins, big.kind, big.group, 13)
        assert cache()[0] <= 1 << 20
        with pytest.raises(RuntimeError, match="budget must be >= 0"):
            set_budget(-1)
    finally:
        set_budget(budget)


def test_dense_path_in_pieces():
    """A matrix over the 8 MiB dequantization scratch (a large vocabulary's head) is multiplied
    in pieces of rows: N = 2^16 + 5 rows of K = 32 gives two pieces, the second of 5 rows."""
    n, k = (1 << 16) + 5, 32
    g = torch.Generator().manual_seed(0)
    qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales, mins = torch.rand(n, 1, generator=g), torch.randn(n, 1, generator=g)
    x = torch.randn(2, k, generator=g)
    y = ops.qlinear(x, qs, scales, mins, U4, 32, 3)
    assert_linear_close(y, x, ops.qdequant_reference(qs, scales, mins, U4, 32))
