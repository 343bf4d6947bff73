"""What the syscall thread shows of its state: the `ServingSnapshot` it publishes (snapshot.py).

`Publisher` is a part of `SyscallServer`, given what it reads in its constructor (the engine's
counters, KVFS, the served LIPs, the stepper, residency, the slow lane and the host times); it
builds a new snapshot on each `snapshot()` call, on the syscall thread, which owns all of it.
"""
from __future__ import annotations

import time
from types import MappingProxyType

from symphony.kernel.snapshot import HostTimes, ServingSnapshot

RECLAIMABLE_EVERY_S = 0.25  # kv_reclaimable at most this old (it walks the running LIPs' pages)


class Publisher:
    """Builds the syscall thread's `ServingSnapshot`s."""

    def __init__(self, engine, fs, lips, stepper, residency, slow, host: HostTimes):
        self.engine, self.fs, self.lips, self.stepper = engine, fs, lips, stepper
        self.residency, self.slow, self.host = residency, slow, host
        self.at = float("-inf")
        self.stale = False                 # the last snapshot used an older reclaimable count
        self._reclaimable_n, self._reclaimable_at = 0, float("-inf")
        self._cache_by_user = MappingProxyType({})     # user -> pages only unopened cache files hold

    def snapshot(self) -> ServingSnapshot:
        """What the thread serves now (O(LIPs))."""
        e, alloc, fs = self.engine.stats, self.engine.kv.allocator, self.fs
        self.at = time.monotonic()
        return ServingSnapshot(
            at=self.at, lips=MappingProxyType({i: (l.calls, l.preds, l.tokens, l.replies.total)
                                               for i, l in self.lips.items()}),
            batches=self.stepper.batches, batch_calls=self.stepper.batch_calls, max_batch=self.stepper.max_batch,
            forward_passes=e.forward_passes, pred_calls=e.pred_calls, engine_max_batch=e.max_batch_calls,
            tokens_computed=e.tokens,
            kv_pages_used=alloc.num_used, kv_pages_total=alloc.capacity,
            kv_pages_free=alloc.num_free + fs.pager.free_slots(), kv_device_free=alloc.num_free,
            kv_reclaimable=self._reclaimable(),
            lip_pages=MappingProxyType({i: fs.quotas.by_pid.get(i, 0) for i in self.lips}),
            user_pages=MappingProxyType({u: n for u, n in fs.quotas.by_user.items() if n}),
            user_cache_pages=self._cache_by_user,
            suspended=MappingProxyType({i: self.residency.pages_of(l)[1] for i, l in self.lips.items()
                                        if l.suspended}),
            overload=MappingProxyType({**fs.stats(), **self.residency.overload, "slow_calls": len(self.slow),
                                       "slow_slices": self.slow.slices}),
            host=MappingProxyType({**self.host.snapshot(), "device_s": e.forward_seconds}))

    def due(self, every_s: float) -> float:
        """When the next snapshot is due (time.monotonic()): ``every_s`` after the last, or once
        the reclaimable count may be taken anew when the last used an older one."""
        return self._reclaimable_at + RECLAIMABLE_EVERY_S if self.stale else self.at + every_s

    def _reclaimable(self) -> int:
        """`KVFS.reclaimable`, computed at most every RECLAIMABLE_EVERY_S: it walks
        the pages of the running LIPs' files, too much for every publish.  A
        publish that used an older count leaves the snapshot to publish again
        once it may be counted anew (`due`), so an idle kernel's is exact."""
        now = time.monotonic()
        self.stale = now - self._reclaimable_at < RECLAIMABLE_EVERY_S
        if not self.stale:
            self._reclaimable_n, self._reclaimable_at = self.fs.reclaimable(), now
            self._cache_by_user = MappingProxyType(self.fs.cache_pages_by_user())
        return self._reclaimable_n
