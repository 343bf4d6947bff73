"""Level 1: the admission queue.  A LIP that cannot start now waits here
instead of being refused; pure policy (no threads, no torch), owned by the
kernel's event loop (kernel/loop/lifecycle.py drives it).

    AdmissionQueue.push(w)          a spawn that is to wait (QueueFull beyond the bounds)
    AdmissionQueue.next_ready(m)    the one LIP that may start now, given `Machine` m
    AdmissionQueue.remove(lip)      it started, was killed, timed out or its client left
    PeakTable.expected_pages(...)   the KV pages a new LIP is expected to need

Order (`AdmissionQueue.order`): priority class first (higher first); within a
class, fair across users: the user with the fewest LIPs admitted (starting or
running) first, then the user admitted least recently (fewest of the last
`RECENT_KEPT` admissions), then arrival.  Head of line: only the first LIP in
that order may start, so a big LIP is never starved by small ones slipping
past it; a higher-priority LIP is always ahead of a lower one, so it is never
stuck behind it.  A LIP is not eligible, and waits for its own user's LIPs
without blocking another user's, while its user already runs ``max_per_user``
LIPs, has started ``spawns_per_s`` LIPs within the last second, or while its
user's KV quota has no room for it (`Machine.user_room`):

    room(u) = quota(u) - pages charged to u (but those only u's unopened cache
              files hold: they are deleted first) - sum over u's admitted
              LIPs of the pages each is expected to need and does not hold yet

(a user with no LIP admitted is always eligible: nothing of theirs would free
pages, and a LIP bigger than the quota gets to run and fails honestly).

When the head may start (`Machine`): a LIP slot is free, and the device has
room for the KV it is expected to need (``reclaimable`` counts every page
only unopened cache files hold: cached prefixes are free memory)::

    free = device_free + reclaimable - suspended - reserved(p) + lower(p)

``reserved(p)``: for each admitted LIP of priority >= p, the pages it is
expected to need and does not hold yet, counted for each user only up to the
user's share of the device (``capacity`` / the users with LIPs admitted or
asking, less what the user holds); ``lower(p)``: the pages held by
admitted LIPs of priority < p (the level-2 memory manager suspends those when
a higher-priority LIP needs pages; their reservations do not count either),
and, for a user within its share, what other users of class p hold beyond
theirs (the memory manager suspends those for it too).
When no LIP is admitted at all, the head always starts: a LIP bigger than the
machine gets to run, and fails honestly.
"""
from __future__ import annotations

import hashlib
import math
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Mapping, Optional

from .lips import admit

RECENT_KEPT = 64            # admissions remembered for fairness
WAITS_KEPT = 256            # admission waits kept for the p50/max in stats
PEAKS_KEPT = 4              # peaks remembered per program
PROGRAMS_KEPT = 1024        # programs remembered (least recently used forgotten)


class QueueFull(ValueError):
    """The admission queue is at one of its bounds: the spawn is refused."""


@dataclass(frozen=True)
class AdmissionLimits:
    """The queue's bounds and the default KV estimate (symphony-kernel flags)."""

    max_queued: int = 1024              # LIPs waiting, all users (--max-queued)
    max_queued_per_user: int = 256      # LIPs waiting, one user (--max-queued-per-user)
    max_queued_bytes: int = 256 << 20   # source + arguments of the waiting LIPs, all users (--max-queued-mb)
    default_kv_tokens: int = 512        # expected KV of a LIP with no hint and no history (--lip-kv-tokens)
    max_queued_bytes_per_user: int = 64 << 20   # the same, one user (--max-queued-mb-per-user)
    spawns_per_s: int = 20              # LIPs one user may start a second (--spawn-rate); more wait

    def __post_init__(self):
        for name in ("max_queued", "max_queued_per_user", "max_queued_bytes", "default_kv_tokens",
                     "max_queued_bytes_per_user", "spawns_per_s"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")


@dataclass
class Waiting:
    """One queued LIP, as the policy sees it."""

    lip: int
    user: str
    priority: int
    pages: int                  # KV pages it is expected to need
    arrived: float              # time.monotonic() when it was queued
    source_bytes: int = 0


@dataclass(frozen=True)
class Machine:
    """What admission needs to know of the machine now."""

    admitted: int                               # LIPs starting or running (a slot each)
    max_lips: int
    per_user: Mapping[str, int]                 # admitted LIPs by user
    max_per_user: Optional[int]
    device_free: int = 0                        # device KV pages free
    reclaimable: int = 0                        # freeable without suspending a running LIP
    suspended: int = 0                          # pages suspended LIPs need back to resume
    holding: tuple = ()                         # (priority, pages held, pages expected, user) per admitted LIP
    user_room: Mapping[str, int] = field(default_factory=dict)   # pages left in a waiting user's KV quota
                                                                 # (absent: no quota, root included)
    capacity: int = 0                           # device KV pages in all (0: reservations are not shared out)
    now: float = 0.0                            # time.monotonic(), for the per-user start rate

    def free_for(self, priority: int, user: Optional[str] = None) -> int:
        """Device pages a new LIP of ``priority`` (of ``user``) may count on.  What
        one user's admitted LIPs reserve (expected, not yet held) counts only up to
        that user's share of the device, ``capacity`` / the users with LIPs admitted
        or asking: one user's big expectations never reserve the device for all.
        For a user within its share, what another user of the same class holds
        beyond its own share counts as free: the memory manager suspends those
        LIPs for it (sched/memory.py), as it does lower classes'."""
        free = self.device_free + self.reclaimable - self.suspended
        reserved, held_by, same = Counter(), Counter(), Counter()
        for p, held, expected, *who in self.holding:
            u = who[0] if who else None
            if p < priority:
                free += held
            else:
                reserved[u] += max(0, expected - held)
                held_by[u] += held
                if p == priority:
                    same[u] += held
        users = {who[0] if who else None for _, _, _, *who in self.holding} | {user}
        share = self.capacity // len(users) if self.capacity else None
        for u, r in reserved.items():
            free -= r if share is None or u is None else min(r, max(0, share - held_by[u]))
        if share is not None and user is not None and held_by[user] < share:
            free += sum(h - share for u, h in same.items() if u not in (user, None) and h > share)
        return free


@dataclass
class AdmissionQueue:
    """The LIPs waiting to start, and the counters `stats` shows."""

    limits: AdmissionLimits = field(default_factory=AdmissionLimits)

    def __post_init__(self):
        self._waiting: dict[int, Waiting] = {}
        self._by_user: Counter = Counter()
        self._bytes = 0
        self._bytes_by_user: Counter = Counter()
        self._starts: dict[str, deque] = {}                 # user -> time.monotonic() of its last starts
        self._recent: deque = deque(maxlen=RECENT_KEPT)     # users of the last admissions
        self._waits: deque = deque(maxlen=WAITS_KEPT)       # seconds waited by the last admitted after waiting
        self.waits = 0                  # LIPs admitted after waiting
        self.timeouts = 0               # LIPs whose timeout passed while queued

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, lip) -> bool:
        return lip in self._waiting

    def order(self, per_user: Mapping[str, int] = {}) -> list[Waiting]:
        """The waiting LIPs, the next to start first."""
        recent = Counter(self._recent)
        return sorted(self._waiting.values(),
                      key=lambda w: (-w.priority, per_user.get(w.user, 0), recent[w.user], w.arrived, w.lip))

    def position(self, lip: int, per_user: Mapping[str, int] = {}) -> int:
        """1-based place of ``lip`` in `order` (0 if it is not waiting)."""
        for i, w in enumerate(self.order(per_user), 1):
            if w.lip == lip:
                return i
        return 0

    def users(self) -> set:
        """The users with LIPs waiting."""
        return set(self._by_user)

    def held_back(self, w: Waiting, m: Machine) -> str:
        """Why ``w``'s own user keeps it from starting ("" when nothing does)."""
        mine = m.per_user.get(w.user, 0)
        if m.max_per_user is not None and mine >= m.max_per_user:
            return (f"user {w.user} runs {mine} LIPs, the most one user may (symphony-kernel "
                    f"--max-lips-per-user {m.max_per_user})")
        starts, rate = self._starts.get(w.user), self.limits.spawns_per_s
        if starts and len(starts) >= rate and m.now - starts[0] < 1.0:
            return (f"user {w.user} started {len(starts)} LIPs within the last second, the most one user "
                    f"may (symphony-kernel --spawn-rate {rate})")
        room = m.user_room.get(w.user)
        if room is not None and mine and w.pages > room:
            return (f"user {w.user}'s KV quota: the user's files and {mine} running LIPs leave room for "
                    f"{max(room, 0)} more pages, this LIP is expected to need {w.pages} (symphony-kernel "
                    f"--user-quota)")
        return ""

    def next_ready(self, m: Machine) -> tuple[Optional[Waiting], str]:
        """(the LIP that may start now, "") or (None, why the head waits; when
        no LIP is eligible, why the first one is held back).  It stays queued
        until `remove`d."""
        first_why, head = "", None
        for w in self.order(m.per_user):
            why = self.held_back(w, m)
            if not why:
                head = w
                break
            first_why = first_why or why
        if head is None:
            return None, first_why
        if m.admitted == 0:
            return head, ""
        ok, why = admit(m.admitted, m.max_lips, m.free_for(head.priority, head.user), head.pages)
        return (head, "") if ok else (None, why)

    def why_waiting(self, lip: int, m: Machine) -> str:
        """Why queued ``lip`` has not started: its user's limits, else what the head waits for."""
        w = self._waiting.get(lip)
        if w is None:
            return ""
        return self.held_back(w, m) or self.next_ready(m)[1]

    def stats(self) -> dict:
        """The `stats` fields of the queue."""
        waits = sorted(self._waits)
        return {"admission_queue": len(self._waiting), "admission_waits": self.waits,
                "admission_wait_s_max": round(waits[-1], 3) if waits else 0.0,
                "admission_wait_s_p50": round(waits[(len(waits) - 1) // 2], 3) if waits else 0.0,
                "queue_timeouts": self.timeouts}

    # ------------------------------------------------------------------ changes
    def push(self, w: Waiting) -> None:
        """Queue ``w``; QueueFull if a bound would be passed."""
        lim = self.limits
        if len(self._waiting) >= lim.max_queued:
            raise QueueFull(f"admission queue full: {len(self._waiting)} LIPs are waiting, the most the "
                            f"kernel queues (symphony-kernel --max-queued {lim.max_queued})")
        if self._by_user[w.user] >= lim.max_queued_per_user:
            raise QueueFull(f"admission queue full: user {w.user} has {self._by_user[w.user]} LIPs waiting, "
                            f"the most one user may (symphony-kernel --max-queued-per-user "
                            f"{lim.max_queued_per_user})")
        mine = self._bytes_by_user[w.user]
        if mine + w.source_bytes > lim.max_queued_bytes_per_user:
            raise QueueFull(f"admission queue full: user {w.user}'s waiting LIPs' programs and arguments take "
                            f"{mine} bytes and this one {w.source_bytes}, beyond the {lim.max_queued_bytes_per_user}"
                            f" bytes one user may (symphony-kernel --max-queued-mb-per-user "
                            f"{lim.max_queued_bytes_per_user >> 20})")
        if self._bytes + w.source_bytes > lim.max_queued_bytes:
            raise QueueFull(f"admission queue full: the waiting LIPs' programs and arguments take {self._bytes} "
                            f"bytes and this one {w.source_bytes}, beyond {lim.max_queued_bytes} bytes "
                            f"(symphony-kernel --max-queued-mb {lim.max_queued_bytes >> 20})")
        if w.lip in self._waiting:
            raise ValueError(f"LIP {w.lip} is already queued")
        self._waiting[w.lip] = w
        self._by_user[w.user] += 1
        self._bytes += w.source_bytes
        self._bytes_by_user[w.user] += w.source_bytes

    def remove(self, lip: int) -> Optional[Waiting]:
        """Take ``lip`` out of the queue (None if it is not there)."""
        w = self._waiting.pop(lip, None)
        if w is not None:
            self._by_user[w.user] -= 1
            if not self._by_user[w.user]:
                del self._by_user[w.user]
            self._bytes -= w.source_bytes
            self._bytes_by_user[w.user] -= w.source_bytes
            if self._bytes_by_user[w.user] <= 0:
                del self._bytes_by_user[w.user]
        return w

    def admitted(self, user: str, waited_s: Optional[float] = None, now: float = 0.0) -> None:
        """A LIP of ``user`` starts (after waiting ``waited_s`` seconds, or at once: None)
        at ``now`` (time.monotonic(): counted for its user's start rate)."""
        self._recent.append(user)
        starts = self._starts.get(user)
        if starts is None or starts.maxlen != self.limits.spawns_per_s:
            starts = self._starts[user] = deque(starts or (), maxlen=self.limits.spawns_per_s)
        starts.append(now)
        for u in [u for u, d in self._starts.items() if now - d[-1] >= 1.0]:   # forget users idle for a second
            del self._starts[u]
        if waited_s is not None:
            self.waits += 1
            self._waits.append(waited_s)


class PeakTable:
    """The most KV pages LIPs of one program held, for the programs that ran
    lately: what a new LIP of the same program is expected to need.

    A program is its user and the hash of its source text (`program_key`):
    the user is part of it so that one user's runs never make another user's
    LIPs of the same program look big (and wait longer)."""

    def __init__(self, kept: int = PROGRAMS_KEPT, peaks: int = PEAKS_KEPT):
        self._kept, self._peaks = kept, peaks
        self._table: OrderedDict[str, deque] = OrderedDict()

    def record(self, key: str, peak_pages: int) -> None:
        """A LIP of program ``key`` exited having held at most ``peak_pages``."""
        if peak_pages <= 0:
            return
        d = self._table.pop(key, None) or deque(maxlen=self._peaks)
        d.append(peak_pages)
        self._table[key] = d
        while len(self._table) > self._kept:
            self._table.popitem(last=False)

    def expected_pages(self, key: str, kv_tokens: Optional[int], page_size: int, default_tokens: int,
                       most: Optional[int] = None) -> int:
        """Pages a new LIP is expected to need: the client's hint (``kv_tokens``),
        else the largest of the program's last peaks, else ``default_tokens``;
        never more than ``most`` (what it could ever hold: the device, its user's quota)."""
        if kv_tokens is not None:
            pages = math.ceil(kv_tokens / page_size)
        elif self._table.get(key):
            self._table.move_to_end(key)
            pages = max(self._table[key])
        else:
            pages = math.ceil(default_tokens / page_size)
        return pages if most is None else max(1, min(pages, most))


def program_key(user: str, source: str) -> str:
    """The `PeakTable` key of ``user``'s program ``source``."""
    return f"{user}:{hashlib.sha256(source.encode('utf-8', 'surrogatepass')).hexdigest()[:32]}"


def check_kv_tokens(v, device_tokens: Optional[int] = None) -> Optional[int]:
    """A spawn's ``kv_tokens`` hint: None or an int > 0, at most ``device_tokens``
    (what the device KV pool can ever hold; ValueError otherwise)."""
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not 0 < v <= 1 << 30:
        raise ValueError(f"kv_tokens must be an int in [1, {1 << 30}], got {v!r}")
    if device_tokens is not None and v > device_tokens:
        raise ValueError(f"kv_tokens {v} is more than the device KV pool can ever hold ({device_tokens} tokens); "
                         f"a LIP that needs that much cannot run on this kernel (symphony-kernel --kv-memory-mb)")
    return v

