"""The CPU KV pool's memory (engine/kv_cache.py): `zeros_lazy` makes it zero, committed only as
it is first written, and in the system's default pages - not advised as transparent huge pages,
whose first write (a fresh KV page in a step) zeroes 2 MiB at a time and, on a virtual machine,
took ~25x as long as in 4 KiB pages; `hostmem.Committer` then commits all of it in the
background (the kernel's default), so that no step pays a page's first write; and
`hostmem.retain_freed_memory` keeps what a step frees for the next."""
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


COMMIT = """
import sys, threading, logging
sys.path.insert(0, sys.argv[1])
import torch
from test_kv_pool_memory import rss_kib
from symphony.engine.hostmem import commit_memory
from symphony.engine.kv_cache import zeros_lazy
pool = zeros_lazy((2, 64, 1024, 256), torch.float32, torch.device("cpu"))     # 128 MiB, lazy
pool[1, 3, 5].fill_(7.0)                                              # in use while it is committed
stopped = threading.Event()
stopped.set()
assert commit_memory(pool, 1 << 20, stopped) == (0, None)             # asked to stop: nothing done
before = rss_kib()
done, why = commit_memory(pool, 16 << 20)
assert why is None and done >= pool.nbytes, (done, why)
grew = rss_kib() - before
assert grew >= 120 * 1024, f"RSS grew only {grew} KiB"                # every page committed
assert float(pool[1, 3, 5].sum()) == 7.0 * 256                        # contents unchanged
assert float(pool.abs().sum()) == 7.0 * 256
print("ok")
"""


def _fresh(code: str) -> str:
    import os
    import subprocess
    from pathlib import Path
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parents[2]), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code, str(here)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_committing_faults_in_every_page_and_changes_no_byte():
    """In a fresh interpreter (RSS counts only what this allocation commits)."""
    assert _fresh(COMMIT).strip().endswith("ok")


def test_memory_that_cannot_be_committed_is_reported_not_raised(tmp_path):
    """A read-only mapping (madvise refuses it as an old Linux would): the reason comes back,
    and the committer logs it and leaves the pool to be committed lazily."""
    import logging
    import mmap
    import warnings

    import numpy as np

    from symphony.engine.hostmem import Committer, commit_memory
    f = tmp_path / "ro"
    f.write_bytes(bytes(1 << 20))
    with open(f, "rb") as fh:
        m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")              # torch warns of a non-writable buffer
        t = torch.from_numpy(np.frombuffer(m, dtype=np.uint8))
    done, why = commit_memory(t, 1 << 16)
    assert done == 0 and why.startswith("madvise(MADV_POPULATE_WRITE): ")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("symphony.engine").addHandler(handler)
    try:
        c = Committer(t, "a read-only buffer")
        c.start()
        c.join(10)
    finally:
        logging.getLogger("symphony.engine").removeHandler(handler)
    assert c.error == why and c.t is None
    assert any("a read-only buffer: not committed ahead" in r.getMessage() for r in records)


def test_the_pool_commits_in_the_background_only_when_asked():
    """EngineConfig(kv_commit=...): "lazy" (the library's default) never starts a committer;
    "background" commits the whole pool once `start_commit` is called, once; close() stops it."""
    from symphony.engine.config import ConfigError, EngineConfig
    from symphony.engine.kv_cache import KVPool
    from conftest import tiny_config
    model = tiny_config()
    lazy = KVPool(model, EngineConfig(kv_memory_bytes=8 * MIB))
    lazy.start_commit()
    assert lazy.committer is None
    pool = KVPool(model, EngineConfig(kv_memory_bytes=8 * MIB, kv_commit="background"))
    assert pool.committer is None                    # not before the engine is set up
    pool.start_commit()
    first = pool.committer
    pool.start_commit()
    assert pool.committer is first
    first.join(30)
    assert not first.is_alive() and first.error is None and first.committed >= pool.pool.nbytes
    pool.close()
    with pytest.raises(ConfigError, match="kv_commit must be one of lazy, background"):
        EngineConfig(kv_commit="eager")


RETAIN = """
import ctypes, sys
from symphony.engine.hostmem import retain_freed_memory
said = retain_freed_memory()
import platform
if platform.libc_ver()[0] != "glibc":
    assert said is None
    print("ok")
    raise SystemExit
assert said and "keeps freed memory" in said, said
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
def mapped(addr):
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return hi - lo
size = 16 << 20                      # above glibc's default mmap threshold (128 KiB)
p = libc.malloc(size)
libc.free(p)
q = libc.malloc(size)                # the same block again: from the heap, not a new mapping
assert q == p, (hex(p), hex(q))
libc.free(q)
print("ok")
"""


def test_freed_memory_is_kept_for_the_next_allocation():
    """A 16 MiB block freed and asked for again comes back from the heap (no new mapping,
    no page faulted in again); without the setting glibc maps and unmaps such a block."""
    assert _fresh(RETAIN).strip().endswith("ok")
