"""The admission queue, driven on the event loop.

`AdmissionControl` is a part of `daemon.Kernel`.  It owns the queue
(``queue``, policy: sched/admission.py), what each spawn waits with
(``pending``, a `PendingStart`, kept until the LIP exits), the programs' peaks
(``peaks``), why the head waits and when to look for a free LIP uid again.
Every spawn enters the queue (the process table's state "queued": no ring,
uid or worker yet); `pump` starts the LIPs the policy says may start, head of
line first, through ``start`` (launcher.py), and runs when a LIP is queued,
when one is reclaimed or leaves the queue, and every `ADMISSION_TICK_S` while
the queue is not empty (the serving snapshot, whose free pages it reads,
changes meanwhile).  It never blocks: a start is the ring and the table's
transition, and the zygote's fork in a task.

While a LIP waits, its client may send it input (kept, up to the input
bound of inflow.py, and handed over in order once it starts),
kill it, or go away (it is dropped: exit event, nothing to undo); its
``timeout`` limit counts the wait.  What a LIP of each program held at its
peak is remembered (`PeakTable`) as the next one's expected KV.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from symphony.sched.admission import (AdmissionLimits, AdmissionQueue, Machine, PeakTable, Waiting,
                                      check_kv_tokens, program_key)

from symphony.kernel.identity import NoFreeUid
from symphony.kernel.states import LipState

log = logging.getLogger("symphony.kernel")

ADMISSION_TICK_S = 0.02     # re-check period while LIPs wait
UID_RETRY_S = 1.0           # every LIP uid taken: look again after a LIP exits, or this long


@dataclass
class PendingStart:
    """What the event loop keeps of a spawn from its request to its exit."""

    source: Optional[str]       # the program text; None once handed to the zygote
    filename: str
    args: Optional[list]        # its arguments; None once handed to the zygote
    grants: dict
    limits: dict
    owner: Optional[tuple]
    key: str                    # its program (PeakTable key)
    pages: int                  # KV pages it is expected to need
    queued_at: float            # time.monotonic() of the request
    inputs: list = field(default_factory=list)      # input sent while it waited, in order


class AdmissionControl:
    """The admission queue and what waits in it (event loop)."""

    def __init__(self, limits: AdmissionLimits, procs, sys_server, policy, output, stopping: asyncio.Event,
                 start: Callable[[int, PendingStart], None], *, max_lips: int, quotas, device_pages: int,
                 page_size: int):
        """``procs``: the process table (the queued LIPs are its rows too);
        ``sys_server``: the syscall thread's server, for its published snapshot
        only; ``policy``: the limit policy (per-user LIP count); ``output``: the
        LIPs' output streams ("started" and exit events); ``stopping``: set when
        the kernel is going down (nothing starts then); ``start(lip, pending)``: start an admitted LIP
        (`launcher.Launcher.start`); ``quotas``: KVFS's per-user page quotas
        (fixed when KVFS is made); ``device_pages``, ``page_size``: the device
        KV pool."""
        self.queue = AdmissionQueue(limits)
        self.peaks = PeakTable()
        self.pending: dict[int, PendingStart] = {}     # lip -> its request, until it exits
        self.procs, self.sys, self.policy, self.output = procs, sys_server, policy, output
        self.stopping, self.start = stopping, start
        self.max_lips, self.quotas = max_lips, quotas
        self.device_pages, self.page_size = device_pages, page_size
        self._spawning: dict = {}                      # lip -> its start's error, while its spawn pumps
        self._waiting_for = ""                         # why the queue's head waits
        self._uid_retry_at = 0.0                       # no LIP uid was free: try again after this
        self._wake = asyncio.Event()

    def __contains__(self, lip_id) -> bool:
        """Whether LIP ``lip_id`` waits in the queue."""
        return lip_id in self.queue

    def estimate(self, user: str, source: str, kv_tokens) -> tuple[str, int]:
        """(program key, KV pages expected) of a spawn of ``source`` by ``user``
        with the ``kv_tokens`` hint (ValueError if the hint is bad)."""
        kv_tokens = check_kv_tokens(kv_tokens, self.device_pages * self.page_size)
        key = program_key(user, source)
        quota = self.quotas.limit_for(user)
        pages = self.peaks.expected_pages(key, kv_tokens, self.page_size, self.queue.limits.default_kv_tokens,
                                          most=self.device_pages if quota is None else
                                          min(self.device_pages, quota))
        return key, pages

    def enqueue(self, w: Waiting, p: PendingStart, row) -> None:
        """Queue a spawn: ``w`` in the queue (QueueFull when it may not even
        wait), ``p`` kept, ``row`` in the process table as queued."""
        self.queue.push(w)                             # QueueFull
        self.pending[w.lip] = p
        self.procs.queue(row)
        self._wake.set()

    def start_now(self, lip_id: int) -> dict:
        """The reply to LIP ``lip_id``'s own spawn request, once the queue has
        moved: {"event": "started", "lip"} or {"event": "queued", "lip",
        "position", "waiting_for"}; raises what its start raised."""
        self._spawning[lip_id] = None
        try:
            self.pump()
            failed = self._spawning[lip_id]
        finally:
            del self._spawning[lip_id]
        if failed is not None:
            raise failed
        if lip_id in self.queue:
            position = self.queue.position(lip_id, self.procs.admitted_by_user())
            why = self.queue.why_waiting(lip_id, self._machine()) or self._waiting_for
            log.info("LIP %d queued at position %d (%s): %s (user %s)", lip_id, position, why,
                     self.pending[lip_id].filename, self.procs.get(lip_id).row.user)
            return {"event": "queued", "lip": lip_id, "position": position, "waiting_for": why}
        return {"event": "started", "lip": lip_id}

    def pump(self) -> None:
        """Start every queued LIP that may start now, in the queue's order
        (none once the kernel is stopping)."""
        while len(self.queue) and not self.stopping.is_set():
            w, why = self.queue.next_ready(self._machine())
            if w is not None:
                if time.monotonic() < self._uid_retry_at:   # no uid was free: a scan of the
                    return                                  # whole range waits for an exit
                why = self._admit(w)
                if not why:
                    continue
            if why and why != self._waiting_for:
                log.debug("admission: %d LIPs wait: %s", len(self.queue), why)
            self._waiting_for = why
            return

    def keep_input(self, lip_id: int, data: Optional[str]) -> None:
        """Keep input for a queued LIP (bounded by the sender's back-pressure, inflow.py)."""
        self.pending[lip_id].inputs.append(data)

    def time_out(self, lip_id: int, secs: float) -> None:
        """A queued LIP's wall-clock limit passed while it waited."""
        self.queue.timeouts += 1
        self.leave(lip_id, f"timed out waiting for admission ({secs:g} s)")

    def leave(self, lip_id: int, reason: str, tell: bool = True, pump: bool = True) -> None:
        """A queued LIP leaves without starting: exit event to its clients at
        once (``tell``), then the queue moves on (``pump``)."""
        self.queue.remove(lip_id)
        self.pending.pop(lip_id, None)
        done = self.procs.drop(lip_id, reason)
        if done is not None:
            log.info("LIP %d left the admission queue: %s", lip_id, reason)
            if tell:
                self.output.deliver(lip_id, done[1])
            self.output.forget(lip_id)
        if pump:
            self.pump()

    def exited(self, lip_id: int, peak: int = 0) -> None:
        """A started LIP is gone: remember the most KV pages it held at once (``peak``, counted
        by the syscall thread at every charge) as its program's next estimate, free its
        reservation, admit the next."""
        p = self.pending.pop(lip_id, None)
        if p is not None:
            self.peaks.record(p.key, peak)
        self._uid_retry_at = 0.0                        # its uid is free again
        self.pump()

    async def watch(self) -> None:
        """Re-check the queue while it is not empty (the serving snapshot, whose free pages it
        reads, changes meanwhile); sleep while it is empty (an idle kernel does nothing)."""
        while True:
            if not len(self.queue):
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(ADMISSION_TICK_S)
            self.pump()

    def stats(self) -> dict:
        """The queue's `stats` fields."""
        return self.queue.stats()

    def queued_views(self) -> dict:
        """{lip: its `ps` fields} of the queued LIPs: place in the queue, how
        long it has waited, the KV pages it is expected to need."""
        now = time.monotonic()
        m = self._machine()
        order = self.queue.order(m.per_user)
        head_why = (self.queue.next_ready(m)[1] or self._waiting_for) if order else ""
        return {w.lip: {"position": i, "waited_s": round(now - w.arrived, 3), "kv_pages_expected": w.pages,
                        "waiting_for": self.queue.held_back(w, m) or head_why}
                for i, w in enumerate(order, 1)}

    # ------------------------------------------------------------------ helpers
    def _machine(self) -> Machine:
        """The machine as admission sees it: the process table and the last
        serving snapshot."""
        snap = self.sys.snapshot
        admitted = [e for e in self.procs if e.state != LipState.QUEUED and e.id in self.pending]
        holding = tuple((e.row.priority, snap.lip_pages.get(e.id, 0), self.pending[e.id].pages, e.row.user)
                        for e in admitted)
        return Machine(self.procs.admitted, self.max_lips, self.procs.admitted_by_user(),
                       self.policy.max_lips_per_user, snap.kv_device_free, snap.kv_reclaimable,
                       sum(snap.suspended.values()), holding, self._user_room(snap, admitted),
                       snap.kv_pages_total, time.monotonic())

    def _user_room(self, snap, admitted) -> dict:
        """{waiting user: KV pages their quota has left for one more LIP}: the quota, less the
        pages charged to the user (the snapshot's) but those only their unopened cache files
        hold (deleted first when the quota is short), and what each of the user's admitted LIPs
        is expected to need and does not hold yet.  Users without a quota (root) are absent.
        The quota limits are fixed when KVFS is made, so reading them here is safe; the
        charges, which the syscall thread owns, come from its snapshot."""
        users = self.queue.users()
        if not users:
            return {}
        to_come: dict[str, int] = {}
        for e in admitted:
            if e.row.user in users:
                n = max(0, self.pending[e.id].pages - snap.lip_pages.get(e.id, 0))
                to_come[e.row.user] = to_come.get(e.row.user, 0) + n
        room = {}
        for user in users:
            limit = self.quotas.limit_for(user)
            if limit is not None:
                held = snap.user_pages.get(user, 0) - snap.user_cache_pages.get(user, 0)   # cache: room
                room[user] = limit - held - to_come.get(user, 0)
        return room

    def _admit(self, w: Waiting) -> str:
        """Take ``w`` out of the queue and start it (its own spawn request, if
        still waiting on it, replies "started"; else its clients get a
        "started" event with how long it waited).  "" when it started or
        ended; why it is back in the queue when every LIP uid is taken (it
        waits for one, as for a LIP slot)."""
        self.queue.remove(w.lip)
        p = self.pending[w.lip]
        waited = time.monotonic() - p.queued_at
        try:
            self.start(w.lip, p)
        except NoFreeUid as e:
            self.queue.push(w)                          # same place: its arrival time is kept
            self._uid_retry_at = time.monotonic() + UID_RETRY_S
            if str(e) != self._waiting_for:
                log.warning("admission waits for a LIP uid: %s", e)
            return str(e)
        except Exception as e:                          # noqa: BLE001 - told to its client, never lost
            log.warning("LIP %d could not start: %s: %s", w.lip, type(e).__name__, e)
            immediate = w.lip in self._spawning          # its own spawn request raises it
            if immediate:
                self._spawning[w.lip] = e
            self.leave(w.lip, f"could not start: {e}", tell=not immediate, pump=False)
            return ""
        immediate = w.lip in self._spawning
        self.queue.admitted(w.user, None if immediate else waited, time.monotonic())
        if not immediate:
            log.info("LIP %d admitted after waiting %.2f s", w.lip, waited)
            self.output.deliver(w.lip, {"event": "started", "lip": w.lip, "waited_s": round(waited, 3)})
        return ""
