"""Quantized matrix times activations (``ops.qlinear``), every path this CPU runs, at 1, 8, 32
and 512 rows of x, on a SmolLM2-135M matrix (w_gate_up, 3072 x 576) and a Llama-1B one (wo,
2048 x 2048), with 4-bit (u4, groups of 32 with mins: Q4_0 / Q4_1 / Q4_K) and 8-bit (i8,
groups of 32: Q8_0) weights.

Paths (``quant.PATH_NAMES``): -1 / -2 the automatic float-accurate / int8-activation choices,
0 / 4 scalar, 1 / 5 AVX2, 2 AVX-512, 3 dense GEMM on the dequantized weight, 6 AVX-VNNI,
7 / 8 / 9 AVX-512 VNNI, 10 / 11 AVX2 8-row tiles, 12 the 15-bit AVX2 row kernel; the ones this CPU lacks are skipped, and the
scalar ones (0, 4) at 512 rows too (seconds a call). Each call reads the next of enough copies
of the weight to overflow the last-level cache twice, so that decode-sized calls read DRAM as a
model's decode step does, not a cache-hot matrix.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from symphony.engine import ops, quant

MATRICES = {"smollm2_gate_up": (3072, 576), "1b_wo": (2048, 2048)}
ROWS = (1, 8, 32, 512)
KINDS = {"u4": "int4", "i8": "int8"}
# as tests/unit/engine/test_quant.py names them
PATH_IDS = {-1: "auto", -2: "auto-int8", 0: "scalar", 1: "avx2", 2: "avx512", 3: "dense",
            4: "int8-scalar", 5: "int8-avx2", 6: "int8-avxvnni", 7: "int8-avx512vnni",
            8: "int8-avx512vnni-t16", 9: "15bit-avx512vnni", 10: "int8-avx2-t8", 11: "15bit-avx2-t8",
            12: "15bit-avx2-rows"}


def _cpu_paths() -> list[int]:
    f = ops.qcpu_features()
    paths = [-1, -2, 0, 3, 4]
    if f["avx2"]:
        paths += [1, 5, 10, 11, 12]
    if f["avx512"]:
        paths.append(2)
    if f["avx_vnni"]:
        paths.append(6)
    if f["avx512_vnni"]:
        paths += [7, 8, 9]
    return sorted(paths)


def llc_bytes() -> int:
    """The last-level cache's size (32 MiB when sysfs does not say)."""
    try:
        s = open("/sys/devices/system/cpu/cpu0/cache/index3/size").read().strip()
        return int(s[:-1]) * {"K": 1 << 10, "M": 1 << 20}[s[-1]]
    except (OSError, ValueError, KeyError):
        return 32 << 20


_weights: dict = {}


def weight_copies(name: str, kind: str) -> list[quant.QWeight]:
    """Copies of one random quantized matrix, together twice the last-level cache."""
    key = (name, kind)
    if key not in _weights:
        n, k = MATRICES[name]
        w = quant.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02,
                           KINDS[kind])
        copies = max(2, -(-2 * llc_bytes() // w.nbytes()))
        _weights.clear()                                  # one matrix's copies alive at a time
        _weights[key] = [w] + [quant.QWeight(w.qs.clone(), w.scales.clone(), w.mins.clone(), w.kind,
                                             w.group, w.source) for _ in range(copies - 1)]
    return _weights[key]


@pytest.mark.benchmark(group="qlinear", min_rounds=3, max_time=0.25)
@pytest.mark.parametrize("rows", ROWS, ids=lambda r: f"{r}rows")
@pytest.mark.parametrize("path", _cpu_paths(), ids=PATH_IDS.get)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("matrix", list(MATRICES))
def test_qlinear(benchmark, matrix, kind, path, rows):
    if path in (0, 4) and rows == 512:
        pytest.skip("the scalar kernels take seconds a call at 512 rows")
    ws = weight_copies(matrix, kind)
    x = torch.randn(rows, MATRICES[matrix][1])
    nxt = itertools.cycle(ws).__next__
    benchmark.extra_info.update(resolved_path=ops.qlinear_path_for(path, rows, *ws[0].shape, ws[0].kind),
                                weight_bytes=ws[0].nbytes(), copies=len(ws))

    def run():
        w = nxt()
        return ops.qlinear(x, w.qs, w.scales, w.mins, w.kind, w.group, path)
    y = benchmark(run)
    assert y.shape == (rows, MATRICES[matrix][0])
