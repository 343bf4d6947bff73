"""perf/bench_kernel.py part 5, at a tiny size: the null-call probe LIP and the decoding LIPs
through the real kernel."""
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "perf"))

import bench_kernel as bench  # noqa: E402


def test_null_call_rounds_idle_then_busy(kernel):
    watch = bench.CpuWatch(kernel.proc.pid, *bench._children(kernel.proc.pid))
    res = list(bench.null_calls(kernel, 40, 1, 1, 120, watch))
    assert [r["busy"] for r in res] == [False, True]
    for r in res:
        assert len(r["ns"]) == 40 and all(x > 0 for x in r["ns"])
        assert 0 < r["span"] <= r["dt"]
    busy = res[1]
    # the model was decoding (the warm-up steps and on; the probe's own round may fit inside one
    # step, whose calls the kernel answers while the device runs it)
    assert busy["decoded"] > 0 and res[0]["decoded"] == 0
    assert kernel.client().stats()["lips"] == 0                              # probe and decoder gone
