"""Device KV memory on the syscall thread: before each step, whose calls may
run, who is suspended and who resumes (the policy: sched/memory.py).

`Residency` is a part of `SyscallServer`: it owns its planner, its page
counts, its stall clock and the overload counters, and is given KVFS, the
served LIPs, the scheduler and the answers in its constructor (the syscall
thread owns everything it touches).  Each step, `plan(chunks)` is given each
LIP's next chunks (`BatchScheduler.next_chunks`) and answers which LIPs wait:

  1. KVFS says how many device pages each chunk needs (`KVFS.device_need`);
  2. if they all fit in the free pages and nobody is suspended, nothing else
     happens (the common case costs one pass over the queued calls);
  3. otherwise `MemoryPlanner.plan` visits the LIPs most important first and
     yields its moves, which `_make` makes through KVFS: reclaim pages no
     running LIP holds (`KVFS.reclaim`: cache files, idle files, blocked
     LIPs' files), suspend less important LIPs whole (`KVFS.suspend`), resume
     suspended ones (`KVFS.swap_in_pid`);
  4. the LIPs that must wait, and the suspended ones, are returned; the step
     holds them in the scheduler (`BatchScheduler.hold`): their calls stay
     queued, not failed.

A waiting call fails with NoSpace in one case only: no page can move (the
device is full, and so are the host and disk tiers that would take a
suspended LIP's pages) and nothing else will free any -- see `stalled`.
"""
from __future__ import annotations

import logging
import time
from collections import Counter

from symphony.kvfs import KVFS, KVFSError, NoSpace
from symphony.sched import BatchScheduler
from symphony.sched.memory import LipMem, MemoryPlanner, Move, Plan, Planning, Reclaim, Suspend

from symphony.kernel.syscall.answers import Answers
from symphony.kernel.syscall.proc import ServedLips, Serving

log = logging.getLogger("symphony.syscalls")

KV_WAIT_S = 30.0
STUCK_GRACE_S = 1.0


class Residency:
    """Suspension and resumption of whole LIPs by device memory."""

    def __init__(self, fs: KVFS, lips: ServedLips, sched: BatchScheduler, answers: Answers,
                 kv_wait_s: float = KV_WAIT_S):
        self.fs, self.lips, self.sched, self.answers = fs, lips, sched, answers
        self.alloc = fs.engine.kv.allocator
        self.kv_wait_s = kv_wait_s
        self.planner = MemoryPlanner()
        self.overload: Counter = Counter()      # suspensions, resumes, memory_waits, kv_wait_failures
        self._page_counts: dict = {}            # lip -> (when, device pages, resume need, holds any): pages_of
        self._stalled_since = None

    # ------------------------------------------------------------------ the plan
    def schedule(self, now: float):
        """The scheduler's next step (`BatchScheduler.schedule`), the LIPs that must wait for
        device pages held out of it (`plan`); None if no call could be scheduled (the stall
        clock runs: `stalled`)."""
        self.sched.hold(self.plan(self.sched.next_chunks()))
        batch = self.sched.schedule(now)
        if batch is None:
            self.stalled()
        else:
            self.moved()
        return batch

    def plan(self, chunks: dict) -> set[int]:
        """The LIPs whose calls must wait this step (held in the scheduler),
        given each LIP's next chunks (``{lip: [(call, tokens)]}``,
        `BatchScheduler.next_chunks`); suspends and resumes LIPs on the way."""
        any_suspended = any(l.suspended for l in self.lips.values() if l.state == Serving.RUNNING)
        if not any_suspended and self.fs.pager.all_resident():
            # nothing to swap in: a bound will do (a chunk of n tokens takes at most n // S + 2 pages)
            S = self.fs.page_size
            if sum(n // S + 2 for cs in chunks.values() for _, n in cs) <= self.alloc.num_free:
                return set()                               # all fit: the common case
        needs = {}
        for lip in self.lips.values():
            if lip.state == Serving.RUNNING and lip.id in chunks:
                needs[lip.id] = sum(self._need(c, n, lip.suspended) for c, n in chunks[lip.id])
        if not any_suspended and sum(needs.values()) <= self.alloc.num_free:
            return set()                                   # all fit
        mem = []
        for lip in self.lips.values():
            if lip.state != Serving.RUNNING:
                continue
            queued = lip.id in chunks
            device, resume, holds = self.pages_of(lip)
            mem.append(LipMem(lip.id, lip.priority, lip.admitted, device, needs.get(lip.id, 0),
                              lip.suspended, resume, blocked=lip.blocked and not queued, fresh=not holds))
        headroom = sum(1 for m in mem if not m.suspended and not m.blocked)
        plan = self._apply(self.planner.plan(mem, self.alloc.num_free, headroom, self.alloc.capacity))
        if plan.wait:
            self.overload["memory_waits"] += len(plan.wait)
        return {l.id for l in self.lips.values() if l.suspended} | set(plan.wait)

    def forget(self, lip_id: int) -> None:
        """The LIP is gone: drop its page counts."""
        self._page_counts.pop(lip_id, None)

    def pages_of(self, lip) -> tuple[int, int, bool]:
        """(device pages of its files, or 0 if suspended; device pages it needs back
        to resume, or 0; whether its files hold any page).  Counting walks its
        files' page tables (a LIP with thousands of forks has millions of
        entries), so the counts are kept until the LIP makes a call or pages
        move between tiers: a blocked or suspended LIP is counted once, not at
        every step."""
        st = self.fs.pager.stats
        key = (lip.calls, lip.suspended, st.swap_outs, st.swap_ins, st.cache_drops)
        seen = self._page_counts.get(lip.id)
        if seen is None or seen[0] != key:
            device = 0 if lip.suspended else self.fs.pid_device_pages(lip.id)
            resume = self.fs.resume_need(lip.id) if lip.suspended else 0
            seen = self._page_counts[lip.id] = (key, device, resume, bool(device or resume)
                                                or self.fs.pid_pages(lip.id) > 0)
        return seen[1:]

    def _need(self, call, n: int, suspended: bool = False) -> int:
        """Device pages a call's next ``n`` tokens need; for a suspended LIP,
        only the new pages (its files count in `KVFS.resume_need`)."""
        if suspended:
            return -(-n // self.fs.page_size) + 1
        try:
            return self.fs.device_need(call.proc.principal, call.kv, n)
        except KVFSError:
            return 0                                       # the step answers it with its error

    # ------------------------------------------------------------------ the planner's moves
    def _apply(self, planning: Planning) -> Plan:
        """Make each move the planner yields (`_make`), tell it the pages free
        afterwards, and return its `Plan`."""
        try:
            move = next(planning)
            while True:
                move = planning.send(self._make(move))
        except StopIteration as done:
            return done.value

    def _make(self, move: Move):
        """Make one of the planner's moves through KVFS; the device pages free
        afterwards, or None for a suspension the host and disk cannot take."""
        if isinstance(move, Reclaim):
            self.fs.reclaim(move.pages, set())
        elif isinstance(move, Suspend):
            if self._suspend_lip(move.lip) is None:
                return None
        else:
            self._resume_lip(move.lip)
        return self.alloc.num_free

    def _suspend_lip(self, lip_id: int):
        """Swap LIP ``lip_id`` out whole; the device pages freed, None if the
        host and disk tiers cannot take them."""
        lip = self.lips[lip_id]
        keep = self.fs.pid_blocks(self.lips.running_ids() - {lip_id})   # pages shared with running LIPs stay
        try:
            freed = self.fs.suspend(lip_id, keep, partial=True)   # as much as the host and disk take
        except NoSpace as e:
            log.debug("LIP %d cannot be suspended: %s", lip_id, e)
            return None
        if not freed:
            return None
        lip.suspended = True
        lip.suspensions += 1
        self.overload["suspensions"] += 1
        log.info("LIP %d suspended: %d device KV pages swapped out for a more important LIP", lip_id, freed)
        return freed

    def _resume_lip(self, lip_id: int) -> None:
        lip = self.lips[lip_id]
        self.fs.swap_in_pid(lip_id)
        lip.suspended = False
        self.overload["resumes"] += 1
        log.info("LIP %d resumed after %d suspension(s)", lip_id, lip.suspensions)

    # ------------------------------------------------------------------ stalls
    def stalled(self) -> None:
        """No call could be scheduled: everything queued waits for pages.

        When every LIP that is not suspended is itself waiting for pages, no
        page can ever move again (the host and disk tiers are full): after a
        second's grace, the least important waiting LIP holding KV pages gets
        NoSpace for its calls, as an out-of-memory killer picks its victim, so
        that the others go on.  Otherwise (some LIP is computing, or blocked
        holding pages) the same happens only after ``kv_wait_s``."""
        now = time.monotonic()
        if self._stalled_since is None:
            self._stalled_since = now
            return
        queued = self.sched.queued_lips()
        live = [l for l in self.lips.values() if l.state == Serving.RUNNING]
        stuck = all(l.suspended or l.id in self.sched.held for l in live)
        if now - self._stalled_since < (STUCK_GRACE_S if stuck else self.kv_wait_s):
            return
        self._stalled_since = None
        waiting = [l for l in live if l.id in self.sched.held and l.id in queued]
        if not waiting:
            return
        pages = {l.id: self.fs.pid_pages(l.id) for l in waiting}
        lip = max(waiting, key=lambda l: (pages[l.id] > 0, -l.priority, l.admitted, l.id))
        alloc = self.alloc
        err = NoSpace(f"KV memory is full: {alloc.capacity - alloc.num_free} of {alloc.capacity} device pages "
                      f"in use and {self.fs.pager.free_slots()} host/disk slots free, and no page can move "
                      f"(every LIP waits for pages{'' if stuck else f' or holds them, for {self.kv_wait_s:.0f} s'})"
                      f"; this LIP is the least important one waiting and holds {pages[lip.id]} pages "
                      f"(a larger --host-pages or a --swap-dir gives the kernel room to suspend LIPs)")
        for c in self.sched.fail_lip(lip.id):
            c.fail(self.answers, err)
        self.overload["kv_wait_failures"] += 1
        log.warning("LIP %d: its pred calls failed: %s", lip.id, err)

    def moved(self) -> None:
        """A step was scheduled: pages are moving, the stall clock stops."""
        self._stalled_since = None
