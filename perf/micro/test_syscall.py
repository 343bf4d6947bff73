"""The null system call: a LIP's ``call(op=0)`` round trip over the shared-memory ring to a
kernel loop in a forked process (perf/bench_syscall.py's two sides, reused), with the spin
before blocking (50 us, the default) and without (every wait blocks). The LIP side runs in
this process; a real kernel is a process of its own too, so the fork is part of what is
timed, not a stand-in."""
from __future__ import annotations

import pytest

import bench_syscall


@pytest.fixture(scope="module", params=[50.0, 0.0], ids=["spin50us", "blocking"])
def ring(request):
    c = bench_syscall.Config(f"spin {request.param:g} us", request.param)
    try:
        c.run(500, record=False)                                      # warm-up
        yield c
    finally:
        c.stop()


@pytest.mark.benchmark(group="null_syscall", min_rounds=200, max_time=0.25)
def test_null_syscall(benchmark, ring):
    call = ring.lip.call
    r = benchmark(call, bench_syscall.OP_NULL, b"", None)
    assert r.status == 0
