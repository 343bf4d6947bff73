"""Micro-benchmarks (pytest-benchmark): ``pytest perf/micro --benchmark-only``.

They are not tests: pytest.ini's ``testpaths = tests`` keeps them out of a plain ``pytest``,
and a run that did not name perf/micro (``pytest .``, ``pytest perf``) skips them unless it
passes ``--benchmark-only``. docs/guide/benchmarks.md says how to save runs and compare commits.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (REPO, REPO / "perf"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def _named(config) -> bool:
    """Whether the command line named perf/micro, or a path inside it."""
    for a in config.args:
        p = Path(a.split("::")[0]).resolve()
        if p == HERE or HERE in p.parents:
            return True
    return False


def pytest_collection_modifyitems(config, items):
    if _named(config) or config.getoption("benchmark_only", False):
        return
    skip = pytest.mark.skip(reason="a micro-benchmark: pytest perf/micro --benchmark-only")
    for item in items:
        if HERE in Path(item.fspath).resolve().parents:
            item.add_marker(skip)


def pytest_benchmark_update_machine_info(config, machine_info):
    """What a saved run should say about the machine besides pytest-benchmark's CPU entry:
    torch and its threads (OMP_NUM_THREADS), the qlinear SIMD paths, the load average."""
    import torch
    from symphony.engine import ops, quant
    machine_info["torch"] = torch.__version__
    machine_info["torch_threads"] = torch.get_num_threads()
    machine_info["qcpu_features"] = ops.qcpu_features()
    machine_info["qlinear_auto"] = quant.describe_cpu_kernels()
    machine_info["loadavg_at_start"] = list(os.getloadavg())


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """perf/make_gguf.py's tiny random Llama in each of its types: {type: path}."""
    import make_gguf
    d = tmp_path_factory.mktemp("micro-gguf")
    return {t: make_gguf.write_gguf(d / f"tiny-{t}.gguf", "tiny", t, progress=False)
            for t in make_gguf.TYPES}
