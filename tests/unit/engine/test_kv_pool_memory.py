"""The CPU KV pool's memory (engine/kv_cache.py `zeros_lazy`): zero, committed only as it is
first written, and in the system's default pages - not advised as transparent huge pages, whose
first write (a fresh KV page in a step) zeroes 2 MiB at a time and, on a virtual machine, took
~25x as long as in 4 KiB pages."""
from __future__ import annotations

import sys

import pytest
import torch

from symphony.engine.kv_cache import zeros_lazy

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")

MIB = 1 << 20


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def vma_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping holding ``addr`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and all(c in "0123456789abcdef-" for c in head[0]):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return head[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
from test_kv_pool_memory import rss_kib, vma_flags
from symphony.engine.kv_cache import zeros_lazy
before = rss_kib()
pool = zeros_lazy((2, 64, 1024, 256), torch.float32, torch.device("cpu"))     # 128 MiB
assert pool.shape == (2, 64, 1024, 256) and pool.dtype == torch.float32
grew = rss_kib() - before
assert grew < 32 * 1024, f"RSS grew {grew} KiB at allocation"      # not written at allocation
flags = vma_flags(pool.data_ptr() + pool.nbytes // 2)
assert "hg" not in flags, flags                                        # no MADV_HUGEPAGE on it
pool[1, 3].fill_(2.0)                                                  # a page written: committed then
assert float(pool[1, 3].sum()) == 2.0 * 1024 * 256
assert float(pool[0].abs().sum()) == 0.0 and float(pool[1, :3].abs().sum()) == 0.0
print("ok")
"""


def test_the_pool_is_zero_lazily_committed_and_not_advised_as_huge_pages():
    """In a fresh interpreter, as in a kernel starting: a long-lived process may hand the
    allocation memory it had already written (then calloc writes the zeros)."""
    import os
    import subprocess
    from pathlib import Path
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parents[2]), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", CHECK, str(here)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_numpy_keeps_its_own_huge_page_setting():
    """The switch is turned off for the pool's allocation only: whatever numpy did before for
    large arrays, it does after."""
    from symphony.engine.kv_cache import _numpy_hugepage
    switch = _numpy_hugepage()
    if switch is None:
        pytest.skip("this numpy has no huge page switch")
    old = switch(True)
    try:
        zeros_lazy((4 * MIB,), torch.uint8, torch.device("cpu"))
        assert switch(True) is True
    finally:
        switch(old)
