"""Level 1, device memory: which LIPs may hold device KV pages this step.

The batch scheduler (level 2, batch.py) forms a step out of token budgets;
this module decides, before each step, whose calls may run given the device
pages, and whom to suspend when there are not enough.  Pure Python: the
kernel hands it `LipMem` views and the free page count, and the planner
answers with moves (`Reclaim`, `Suspend`, `Resume`) and, at the end, a `Plan`
(who runs, who waits).  It calls nothing: the kernel's step applies each
move (kernel/syscall/residency.py) and tells the planner the pages free afterwards.

The order of importance is total and stable: higher priority class first,
then the LIPs of users within their share of the device before those of
users beyond it, then the LIP admitted first (`rank`).  A user's share is the
device pool / the users with LIPs here; what a user holds is its LIPs' device
pages and the pages its suspended LIPs need back.  So within a class one
user's many LIPs, however early they came, never keep another user's LIP
that is within its share from its pages: his LIP may suspend hers, hers not
his.  Every decision follows the order:

  * Each step, LIPs with queued calls are visited most important first; each
    is promised the device pages its next chunk needs (its file swapped back
    in, new pages, a copy-on-write copy).  When the free pages run short the
    kernel first reclaims pages that belong to no running LIP (cache files,
    idle files, blocked LIPs' files), then suspends running LIPs *less
    important* than the one asking, least important first: a suspended LIP's
    pages go to host memory or disk whole, and its calls are held.
  * A call that cannot get its pages even so waits (it is not failed); the
    LIPs after it in the order may still run with what is left.  Since a LIP
    only ever suspends less important ones, there is no cycle: the most
    important LIP with work always runs, so some LIP always progresses.
  * While a suspended LIP waits to come back, a LIP that holds no KV yet
    (``fresh``) does not start: the pages freed go to those already under
    way, as vLLM serves its preempted requests before new ones.  Otherwise
    every suspension would make room for more new work, and the KV of the
    work under way could outgrow the device and host tiers together.
  * A suspended LIP resumes, in the same order, when its pages fit in what is
    free with `headroom` to spare (one page per running LIP, so that their
    next decode steps do not push it straight back out).  Only a strictly
    higher priority class may suspend running LIPs to resume; within a class
    it waits for free pages, as a waiting request does in vLLM.

That is the no-thrash rule: pages leave the device a whole LIP at a time, and
a LIP goes out only for a more important one, never page by page on every
step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generator, Optional, Union


@dataclass
class LipMem:
    """One LIP as the memory planner sees it."""

    id: int
    priority: int               # higher runs first
    admitted: int               # admission order (lower = earlier)
    device_pages: int = 0       # device pages its open files hold now
    need: int = 0               # device pages its queued calls' next chunks need (0: nothing queued);
                                # for a suspended LIP: the new pages only (its files count in resume_need)
    suspended: bool = False
    resume_need: int = 0        # device pages to bring its files back (suspended LIPs)
    blocked: bool = False       # waiting for input or a capability: reclaimed, not suspended
    fresh: bool = False         # holds no KV page in any tier yet (its first pred would start it)
    user: str = ""              # its user (the share of the device is per user)


def rank(l: LipMem, over: frozenset = frozenset()) -> tuple:
    """Sort key, most important first; ``over``: the users beyond their share."""
    return (-l.priority, l.user in over, l.admitted, l.id)


def over_share(lips: list[LipMem], capacity: int) -> frozenset:
    """The users holding more than the device pool / the users with LIPs
    (device pages, and pages their suspended LIPs need back)."""
    held: dict[str, int] = {}
    for l in lips:
        held[l.user] = held.get(l.user, 0) + l.device_pages + l.resume_need
    if len(held) < 2:
        return frozenset()
    share = capacity // len(held)
    return frozenset(u for u, n in held.items() if n > share)


@dataclass
class Plan:
    """What the kernel does before a step."""

    run: list[int] = field(default_factory=list)       # LIPs whose calls may be scheduled
    wait: list[int] = field(default_factory=list)      # LIPs with calls that must wait for pages
    suspend: list[int] = field(default_factory=list)   # LIPs to swap out whole, in this order
    resume: list[int] = field(default_factory=list)    # suspended LIPs to bring back


@dataclass(frozen=True)
class Reclaim:
    """Make ``pages`` device pages free without touching a running LIP (cache
    files, idle files, blocked LIPs' files).  Answer: the pages free afterwards."""

    pages: int


@dataclass(frozen=True)
class Suspend:
    """Swap LIP ``lip`` out whole.  Answer: the pages free afterwards, or None
    when the host and disk tiers cannot take its pages (it stays)."""

    lip: int


@dataclass(frozen=True)
class Resume:
    """Bring suspended LIP ``lip``'s files back to the device.  Answer: the pages
    free afterwards."""

    lip: int


Move = Union[Reclaim, Suspend, Resume]
Planning = Generator[Move, Optional[int], Plan]


class MemoryPlanner:
    """Plans one step's device pages.  `plan` is a generator: it yields one
    move at a time and is sent back the free device pages after the move was
    made (None: a suspension the host and disk could not take), and returns the
    `Plan`.  A plan is made move by move because each decision depends on what
    the one before achieved: a suspension frees fewer pages than the LIP holds
    when some are shared with running LIPs, or none when the slower tiers are
    full.  The kernel's residency (kernel/syscall/residency.py) makes the moves."""

    def plan(self, lips: list[LipMem], free: int, headroom: int = 0, capacity: int = 1 << 62) -> Planning:
        """Visit LIPs most important first; see the module docstring.  ``free``:
        device pages free now.  ``capacity``: the device pool's pages (the
        headroom a resuming LIP asks for never makes it larger than the pool)."""
        over = over_share(lips, capacity)
        key = lambda l: rank(l, over)                   # noqa: E731
        order = sorted(lips, key=key)
        out = Plan()
        pool = _Pool(free)
        promised = 0
        gone: set[int] = set()                          # suspended during this plan
        running = [l for l in order if not l.suspended and not l.blocked]
        backlog = False                                 # a suspended LIP waits to come back
        for l in order:
            if l.id in gone:
                continue
            if l.suspended:
                base = l.resume_need + l.need
                want = base + min(headroom, max(0, capacity - base))
                # only a higher class may push running LIPs out to come back
                lower = [v for v in running[::-1] if v.id not in gone and v.priority < l.priority
                         and key(v) > key(l)]
                if (yield from self._room(pool, promised, want, lower, gone, out)):
                    pool.free = yield Resume(l.id)
                    out.resume.append(l.id)
                    promised += l.need                  # the free count already has the pages it brought back
                    if l.need:
                        out.run.append(l.id)
                else:
                    backlog = True
                    if l.need:
                        out.wait.append(l.id)
                continue
            if not l.need:
                continue
            if backlog and l.fresh:                     # suspended LIPs come back before new KV starts
                out.wait.append(l.id)
                continue
            # everything less important and running may be pushed out for it
            lower = [v for v in running[::-1] if v.id not in gone and key(v) > key(l)]
            if (yield from self._room(pool, promised, l.need, lower, gone, out)):
                promised += l.need
                out.run.append(l.id)
            else:
                out.wait.append(l.id)
        return out

    def _room(self, pool: "_Pool", promised: int, need: int, victims: list[LipMem], gone: set, out: Plan):
        """Make ``need`` pages free beyond ``promised``: reclaim, then suspend
        ``victims`` in order (least important first) while it helps.  Suspends
        nobody unless that is enough."""
        if pool.free - promised >= need:
            return True
        pool.free = yield Reclaim(promised + need)
        if pool.free - promised >= need:
            return True
        if pool.free - promised + sum(v.device_pages for v in victims) < need:
            return False                                # even all of them would not do
        for v in victims:
            if v.device_pages <= 0:
                continue
            after = yield Suspend(v.id)
            if after is None:                           # host and disk are full for it
                continue
            pool.free = after
            gone.add(v.id)
            out.suspend.append(v.id)
            if pool.free - promised >= need:
                return True
        return pool.free - promised >= need


@dataclass
class _Pool:
    free: int           # device pages free, as the last answer said
