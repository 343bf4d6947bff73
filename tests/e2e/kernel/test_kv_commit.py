"""The kernel's KV pool in host memory is committed in the background once it serves
(``--kv-commit background``, the default), so that no step pays a page's first write;
``--kv-commit lazy`` leaves each page to the step that first writes it."""
from __future__ import annotations

import time
from pathlib import Path

from conftest import start_kernels, stop_kernels
from symphony.engine.hostmem import commit_ended

REPO = Path(__file__).resolve().parents[3]
POOL_MB = 1024           # more than the rest of a kernel on the embedded model holds (~0.6 GiB)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_the_default_kernel_commits_its_pool_and_a_lazy_one_does_not(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ks = start_kernels({"default": ((tmp_path / "a", "--kv-memory-mb", str(POOL_MB)), {}),
                        "lazy": ((tmp_path / "b", "--kv-memory-mb", str(POOL_MB), "--kv-commit", "lazy"), {})})
    try:
        deadline = time.time() + 120
        while not commit_ended(ks["default"].read_log()) and time.time() < deadline:
            time.sleep(0.2)
        assert f"KV pool ({POOL_MB} MiB) committed in" in ks["default"].read_log()
        r = ks["default"].run(REPO / "userland/generate.py", "What is the capital of France?", "12")
        assert r.returncode == 0 and "Paris" in r.stdout, r.stderr
        assert rss_mib(ks["default"].proc.pid) >= POOL_MB
        assert rss_mib(ks["lazy"].proc.pid) < POOL_MB * 0.9
        assert "committed" not in ks["lazy"].read_log()
    finally:
        stop_kernels(ks)
