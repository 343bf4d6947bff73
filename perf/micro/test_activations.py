"""Activation quantization: x ``[M, 2048]`` rounded per block of 16 values to int8 (the
int8-activation paths) and to 15 bits (the 15-bit paths), at 1, 32 and 512 rows.

The C++ kernels quantize x inside ``qlinear`` (csrc/cpu/qlinear*.cpp); no op exposes that step
alone, so what is timed here is ``ops.quantize_act_reference``, the PyTorch reference the tests
hold the kernels to. The kernels' own cost shows in test_qlinear.py: an int8 or 15-bit path
against the float path at the same rows."""
from __future__ import annotations

import pytest
import torch

from symphony.engine import ops


@pytest.mark.benchmark(group="activation_quantization_reference", min_rounds=3, max_time=0.25)
@pytest.mark.parametrize("qmax", (127, 16383), ids=("int8", "15bit"))
@pytest.mark.parametrize("rows", (1, 32, 512), ids=lambda r: f"{r}rows")
def test_quantize_act_reference(benchmark, rows, qmax):
    x = torch.randn(rows, 2048, generator=torch.Generator().manual_seed(0))
    q, d = benchmark(ops.quantize_act_reference, x, qmax)
    assert q.shape == x.shape and d.shape == (rows, 2048 // 16)
