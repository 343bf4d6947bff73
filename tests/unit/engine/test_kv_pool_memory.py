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


def test_the_pool_is_zero_lazily_committed_and_not_advised_as_huge_pages():
    before = rss_kib()
    pool = zeros_lazy((2, 64, 1024, 256), torch.float32, torch.device("cpu"))     # 128 MiB
    assert pool.shape == (2, 64, 1024, 256) and pool.dtype == torch.float32
    assert rss_kib() - before < 32 * 1024                      # not written at allocation
    assert "hg" not in vma_flags(pool.data_ptr() + pool.nbytes // 2)   # no MADV_HUGEPAGE on it
    pool[1, 3].fill_(2.0)                                      # a page written: committed then
    assert float(pool[1, 3].sum()) == 2.0 * 1024 * 256
    assert float(pool[0].abs().sum()) == 0.0 and float(pool[1, :3].abs().sum()) == 0.0


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
