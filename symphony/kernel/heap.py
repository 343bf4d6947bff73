"""Python's cyclic garbage collector kept off the serving path.

A kernel that has loaded a model (torch, the engine, KVFS, the gateway's libraries) holds some
hundreds of thousands of objects that live as long as it does, and a full collection walks all
of them: ~100 ms on a 2-core VM, a pause in the middle of some step.  The syscall path makes a
handful of short-lived objects per call (a call record, its chunk, its page table, its reply),
so at device speed the default thresholds (a young collection every 700 allocations) run
collections thousands of times a second, and every so often a full one.

`settle` is called once, when start-up is over (the kernel: before the syscall thread starts; the
zygote: before it forks its first LIP worker, which inherits the frozen heap):

* everything alive is collected once, then **frozen** (`gc.freeze`: moved to a permanent
  generation that no collection walks; a LIP worker forked from the zygote then also leaves the
  pages of those objects shared instead of writing collector bookkeeping into them);
* the young generation's threshold is raised to ``young`` allocations (the kernel: `KERNEL_YOUNG`;
  the zygote keeps Python's default for the LIPs, whose programs are theirs).

Reference counting still frees every object that is not in a cycle the moment it is dropped; a
cycle among frozen objects is never freed (start-up objects live for the whole process anyway).
"""
from __future__ import annotations

import gc
import logging
import time
from typing import Optional

log = logging.getLogger("symphony.kernel")

KERNEL_YOUNG = 20_000       # young-generation threshold of the kernel process (Python's default: 700)


def settle(who: str, young: Optional[int] = None) -> dict:
    """Collect once, freeze what is left, and (``young``) raise the young generation's threshold.
    Returns what it did (logged): frozen objects, seconds the collection took, the thresholds."""
    if young is not None and (not isinstance(young, int) or isinstance(young, bool) or young < 1):
        raise ValueError(f"young must be an int >= 1, got {young!r}")
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    if young is not None:
        _, mid, old = gc.get_threshold()
        gc.set_threshold(young, mid, old)
    out = {"frozen": gc.get_freeze_count(), "collect_s": time.perf_counter() - t0,
           "threshold": gc.get_threshold()}
    log.info("%s heap settled: %d objects frozen (a full collection took %.0f ms), collector thresholds %s",
             who, out["frozen"], 1e3 * out["collect_s"], out["threshold"])
    return out


__all__ = ["KERNEL_YOUNG", "settle"]
