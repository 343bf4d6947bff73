"""Host memory on machines where a page's first write is expensive.

On a virtual machine, a page the guest has not used before - or has freed, when the
hypervisor takes freed pages back (free page reporting) - is backed by the host on its
first write: 20-40 us a 4 KiB page against ~1.4 us for one in use (an Intel Xeon VM, 2
vCPUs; `perf/bench_kv_commit.py`). Two things keep that cost out of the forward pass:

* `Committer` / `commit_memory`: commit a large buffer (the KV pool) ahead, in the
  background, without changing a byte;
* `retain_freed_memory`: glibc's allocator keeps what a step frees for the next step
  instead of handing it back to the system (which would make the next step fault it in
  again).
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform
import sys
import threading
import time
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

log = logging.getLogger("symphony.engine")

_MADV_POPULATE_WRITE = 23          # Linux 5.14+: fault pages in writable, contents unchanged
# what the log says when a commit ended, either way (a kernel's start-up is over for those who wait)
COMMIT_ENDED = (" committed in ", ": not committed ahead")


def commit_ended(log_text: str) -> bool:
    """Whether ``log_text`` (a kernel's log) says its pool's commit ended, done or refused."""
    return any(m in log_text for m in COMMIT_ENDED)


class Committer(threading.Thread):
    """Commits a host tensor's memory in the background: every page of it faulted in as if
    written, without changing a byte (madvise MADV_POPULATE_WRITE, 64 MiB a call, the GIL
    released), while the tensor is in use.

    Why: a lazily committed KV pool makes the step that first writes a page pay for it, and
    on a virtual machine a page the guest has not used before is backed by the host on that
    first write (see above), so a kernel whose pool was fresh memory ran 16 clients' distinct
    prompts at 44 tok/s, and 58 with its pool committed ahead (perf/bench_kv_commit.py).
    Servers that reserve their KV memory at start pay this once there."""

    CHUNK = 64 << 20

    def __init__(self, t: torch.Tensor, what: str):
        super().__init__(name="kv-commit", daemon=True)
        self.t, self.what = t, what
        self.committed = 0                      # bytes
        self.error: Optional[str] = None
        self._stop_asked = threading.Event()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop after the call in progress (at most one chunk) and wait for that."""
        self._stop_asked.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout)

    def run(self) -> None:
        t0 = time.perf_counter()
        log.info("%s: committing its memory in the background", self.what)
        try:
            self.committed, self.error = commit_memory(self.t, self.CHUNK, self._stop_asked)
        finally:
            self.t = None                       # the pool is the engine's to free
        took = time.perf_counter() - t0
        if self.error is not None:
            log.warning("%s: not committed ahead (%s): steps commit its pages as they first write them",
                        self.what, self.error)
        elif self._stop_asked.is_set():
            log.info("%s: committing stopped after %.0f MiB", self.what, self.committed / 2**20)
        else:
            log.info("%s committed in %.1f s", self.what, took)


def commit_memory(t: torch.Tensor, chunk: int, stop: Optional[threading.Event] = None) -> tuple[int, Optional[str]]:
    """Fault in every page of host tensor ``t``'s memory as if written, contents unchanged:
    (bytes committed, None) or (bytes so far, why it cannot: another OS, an older Linux).
    ``stop``: checked between chunks of ``chunk`` bytes."""
    if not sys.platform.startswith("linux"):
        return 0, f"{sys.platform} has no MADV_POPULATE_WRITE"
    page = mmap.PAGESIZE
    lo = t.data_ptr() // page * page                      # the pages holding the tensor: its mapping's
    hi = -(-(t.data_ptr() + t.numel() * t.element_size()) // page) * page
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes, madvise.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    done = 0
    for a in range(lo, hi, chunk):
        if stop is not None and stop.is_set():
            break
        n = min(chunk, hi - a)
        if madvise(a, n, _MADV_POPULATE_WRITE) != 0:
            why = f"madvise(MADV_POPULATE_WRITE): {os.strerror(ctypes.get_errno())}"
            return done, why + (f" (it needs Linux 5.14; this is {os.uname().release})" if _linux() < (5, 14) else "")
        done += n
    return done, None


def _linux() -> tuple[int, int]:
    """This Linux kernel's (major, minor) release."""
    try:
        major, minor = os.uname().release.split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except ValueError:
        return (0, 0)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20          # glibc's largest: blocks below it come from the heap, reused
TRIM_THRESHOLD = 2**31 - 1        # the most mallopt takes: a heap's free top is kept up to 2 GiB


def retain_freed_memory() -> Optional[str]:
    """Make glibc's malloc keep freed memory for reuse: blocks up to 32 MiB from its heaps
    (not a mapping of their own, unmapped when freed) and a heap's free top kept (up to 2 GiB).
    A forward pass frees and allocates the same activations every step; handed back, each
    step faulted them in again (~118,000 page faults a 10-s round of 16 clients on the VM
    above, 39,000 after). The process's memory is then its peak, not its current, use.
    Returns what was set (for the log), or None where the C library is not glibc."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = (mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1) and ok
    return ("malloc keeps freed memory for reuse (blocks up to 32 MiB from its heaps, free tops up to 2 GiB kept)"
            if ok else None)
