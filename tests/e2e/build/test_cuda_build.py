"""The CUDA sources compile with nvcc for sm_90 (no GPU needed; skipped where nvcc is absent).

Slow (a minute or more of nvcc per source on a small CPU), so they sit outside the unit tier,
and the sources compile side by side."""
from __future__ import annotations

import concurrent.futures as cf
import shutil
import time

import pytest

from symphony.engine import ops
from symphony.engine.ops.build import _CUDA_SOURCES


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_every_cuda_source_compiles_with_nvcc(tmp_path):
    t0 = time.perf_counter()
    names = [s.split("/", 1)[1] for s in _CUDA_SOURCES]
    with cf.ThreadPoolExecutor(len(names)) as ex:
        objs = list(ex.map(lambda n: ops.compile_cuda_object(tmp_path / n, arch="sm_90", source=n), names))
    assert all(o.exists() and o.stat().st_size > 0 for o in objs)
    print(f"nvcc compiled {', '.join(names)} in {time.perf_counter() - t0:.1f} s")
