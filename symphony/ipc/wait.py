"""Waiting on the ring: doorbells (eventfds), the kernel's WaitSet, and the adaptive spin.

Both sides wait the same way: first spin, polling a cheap check (the kernel:
``ready()`` = "some LIP slot is in REQUEST"; the LIP: "my slot is in
RESPONSE") for up to ``spin_us`` microseconds; if that fails, block on the
semaphore / epoll.  The poster *always* posts (the LIP always rings its doorbell, the
kernel always posts the slot semaphore): a conditional "post only if the
waiter sleeps" protocol would need a store-load fence that Python cannot
issue, and would lose wakeups.  The price is stale posts when the spin wins:

* the kernel's ``WaitSet.wait`` returns on any bell's edge (the epoll is
  edge-triggered: every write to an eventfd is one wake-up, nothing is read or
  drained), and the caller polls *after* that, so the request stored before
  the ring is seen by that poll; a stale ring costs one spurious poll;
* the LIP, after a winning spin, takes at most one pending post off its slot
  semaphore; one that arrives later stays, and is harmless because after *every*
  wakeup the waiter re-checks the state word and goes back to sleep unless it
  reads RESPONSE.  A stale post never passes for a response.

Each spin iteration calls ``sched_yield()``: on a 2-core box shared with other
work, a spinner that does not yield sits on the very core its peer needs (a
measured 75-125 us round trip instead of ~20), and the yield also drops the
GIL for the spinner's sibling threads.

The spin budget adapts (``_Spin``): a spin that wins, or a block woken within
the maximum budget (a longer spin would have won), grows it (x2 + 1 us); two
failed spins in a row (the block then waited longer, or timed out) halve it,
to 0 below 1 us; at 0, every 8th wait probes with a full-budget spin so the
budget can recover after a burst of load.  A LIP thread spins only while it is
the sole call in flight in its process (a spinning thread holds the GIL its
sibling threads need).  An idle kernel is blocked in ``epoll_wait``: it
burns no CPU.
"""
from __future__ import annotations

import os
import select
import threading
import time
from typing import Callable

__all__ = ["Spin", "WaitSet", "new_bell", "ring_bell"]


_sched_yield = getattr(os, "sched_yield", lambda: None)   # releases the GIL, too


def _noop() -> None:
    pass


class Spin:
    """An adaptive spin budget in nanoseconds, in [0, max_ns].

    ``budget()`` is what the next wait spins for; the wait then reports ``won(used)``
    (the condition came true while spinning) or ``blocked(used, waited_ns, woken)``.

    * a win grows the budget (x2 + 1 us, up to max);
    * a block woken within max_ns of the start of the wait grows it too (a longer
      spin would have won);
    * otherwise the spin failed: two failures in a row halve it, to 0 below 1 us;
    * at 0, every ``PROBE_EVERY``-th wait spins the full max_ns as a probe, so a
      budget that collapsed under a burst of load can come back.
    """

    PROBE_EVERY = 8
    __slots__ = ("max_ns", "cur_ns", "adaptive", "yield_cpu", "_fails", "_skipped")

    def __init__(self, spin_us: float, adaptive: bool = True, yield_cpu: bool = True):
        if spin_us < 0:
            raise ValueError("spin_us must be >= 0")
        self.max_ns = int(spin_us * 1000)
        self.cur_ns = self.max_ns
        self.adaptive = adaptive
        self.yield_cpu = yield_cpu
        self._fails = 0
        self._skipped = 0

    def budget(self) -> int:
        """Nanoseconds the next wait may spin (0: block at once)."""
        if self.cur_ns or not self.adaptive or not self.max_ns:
            return self.cur_ns
        self._skipped += 1
        if self._skipped >= self.PROBE_EVERY:
            self._skipped = 0
            return self.max_ns
        return 0

    def yielder(self):
        """What a spin iteration calls: sched_yield (drops the GIL too), or nothing."""
        return _sched_yield if self.yield_cpu else _noop

    def _grow(self, used: int) -> None:
        self._fails = 0
        self.cur_ns = min(self.max_ns, 2 * max(self.cur_ns, used) + 1000)

    def won(self, used: int) -> None:
        """The condition came true while spinning a budget of ``used`` ns."""
        if self.adaptive:
            self._grow(used)

    def blocked(self, used: int, waited_ns: int, woken: bool) -> None:
        """The spin of ``used`` ns failed; the wait then took ``waited_ns`` in all (``woken``: not a timeout)."""
        if not self.adaptive or not self.max_ns:
            return
        if woken and waited_ns <= self.max_ns:
            self._grow(used)
        elif used:
            self._fails += 1
            if self._fails >= 2:
                c = self.cur_ns // 2
                self.cur_ns = c if c >= 1000 else 0


# ----------------------------------------------------------------- doorbells
_EV_IN = select.EPOLLIN | select.EPOLLET


def new_bell() -> int:
    """A fresh doorbell: a non-blocking, close-on-exec eventfd (counter 0)."""
    return os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)


def ring_bell(fd: int) -> None:
    """Add 1 to the eventfd ``fd``; a saturated counter (EAGAIN) is already rung."""
    try:
        os.eventfd_write(fd, 1)
    except (BlockingIOError, OSError):
        pass


class _Bell:
    __slots__ = ("fd", "taken", "pending", "seen", "strikes", "level")

    def __init__(self, fd: int, taken: Callable[[], int], pending: Callable[[], bool]):
        self.fd, self.taken, self.pending = fd, taken, pending
        self.seen = taken()         # requests taken when this bell was last checked
        self.strikes = 0            # consecutive rings that brought no request
        self.level = 0              # how many mutes in a row (each twice as long)


class WaitSet:
    """The kernel's wake-up channel: its own private eventfd (``ring()``, for its
    own commands) plus every LIP's *own* doorbell eventfd (``add``: the fd and two
    counters of its ring, see `KernelSide.create`), all watched by one
    edge-triggered epoll.

    ``wait(timeout, ready)`` spins on ``ready()`` and a non-blocking look at the
    epoll for up to the (adaptive) spin budget, then blocks in ``epoll_wait``; call
    ``ready`` / poll the rings *after* it returns.  The doorbells that rang (and were
    not muted) accumulate in a set that `take_rung` hands over, so the caller polls
    only those rings (and every ring now and then: a muted bell's calls are seen so).  The kernel never reads a LIP's eventfd (edge-triggered epoll
    reports every write without a read), so no value a LIP stores there, nor its
    reading it, nor making it blocking, can block or confuse the kernel: it only
    decides whether *that* LIP's bell wakes the kernel.  Each ring that finds no
    request in its ring and none taken since its last ring is a strike; each
    request taken pays off ``RINGS_PER_CALL`` strikes.  A bell with ``MUTE_AFTER``
    strikes (a LIP ringing far more often than it calls, whether or not it calls
    now and then) is muted (left out of the epoll set) for ``MUTE_S`` seconds,
    doubling per repeat up to ``MUTE_MAX_S`` until its strikes are paid off: that
    LIP's calls are then seen by the spin and the periodic poll only, which delays
    nobody else.
    """

    MUTE_AFTER = 32
    RINGS_PER_CALL = 2
    MUTE_S = 0.02
    MUTE_MAX_S = 0.5

    def __init__(self, spin_us: float = 50.0, adaptive: bool = True):
        self._ep = select.epoll()
        self._own = new_bell()
        self._ep.register(self._own, _EV_IN)
        self._lock = threading.Lock()
        self._bells: dict[int, _Bell] = {}
        self._muted: dict[int, float] = {}        # fd -> monotonic time to unmute
        self.mutes = 0                            # bells muted so far (statistics)
        self.spin = Spin(spin_us, adaptive)
        self._rung: set[int] = set()              # LIP doorbells that rang since `take_rung`

    @property
    def spin_us(self) -> float:
        """The current spin budget, in microseconds."""
        return self.spin.cur_ns / 1000.0

    def ring(self) -> None:
        """Wake the waiter (the kernel's own commands; any thread)."""
        ring_bell(self._own)

    def add(self, fd: int, taken: Callable[[], int], pending: Callable[[], bool]) -> None:
        """Watch the doorbell ``fd`` of a ring whose requests are counted by ``taken()`` (how many
        the kernel has taken so far) and ``pending()`` (whether one waits, not yet taken): a ring
        that brings neither is a strike.  `KernelSide.create` does this."""
        b = _Bell(fd, taken, pending)
        with self._lock:
            self._bells[fd] = b
            self._ep.register(fd, _EV_IN)

    def discard(self, fd: int) -> None:
        """Stop watching the doorbell ``fd`` (`KernelSide.close` does this, before closing it)."""
        with self._lock:
            b = self._bells.pop(fd, None)
            if b is None:
                return
            self._muted.pop(b.fd, None)
            try:
                self._ep.unregister(b.fd)
            except (OSError, ValueError):
                pass

    def take_rung(self) -> set[int]:
        """The LIP doorbells (fds) that rang since the last call; the set starts empty again."""
        rung, self._rung = self._rung, set()
        return rung

    def watching(self) -> int:
        """How many doorbells are watched (muted ones included)."""
        with self._lock:
            return len(self._bells)

    def _unmute(self, now: float) -> float | None:
        """Re-arm bells whose mute is over; the next unmute time, or None."""
        nxt = None
        for fd, until in list(self._muted.items()):
            if until <= now:
                del self._muted[fd]
                try:
                    self._ep.modify(fd, _EV_IN)     # fires at once if written meanwhile
                except (OSError, ValueError):
                    pass
            elif nxt is None or until < nxt:
                nxt = until
        return nxt

    def _check(self, b: _Bell, now: float) -> None:
        taken = b.taken()
        new, b.seen = taken - b.seen, taken
        if b.pending():
            return                                  # a request waits: the ring was due
        if new:                                     # requests came with the rings: each pays for
            b.strikes = max(0, b.strikes - self.RINGS_PER_CALL * new)   # a few rings
            if not b.strikes:
                b.level = 0
            return
        b.strikes += 1
        if b.strikes >= self.MUTE_AFTER:
            b.strikes = 0
            self._muted[b.fd] = now + min(self.MUTE_MAX_S, self.MUTE_S * (1 << min(b.level, 16)))
            b.level += 1
            self.mutes += 1
            try:
                self._ep.modify(b.fd, 0)
            except (OSError, ValueError):
                pass

    def wait(self, timeout: float | None = None, ready=None) -> bool:
        """Wait for work.  True if ``ready()`` turned true or a bell rang; False on timeout.

        ``timeout`` None blocks forever; ``ready`` None skips the spin phase.
        """
        spin = self.spin
        t0 = time.perf_counter_ns()
        budget = 0
        if ready is not None:
            if ready():
                return True
            if self._events(self._ep.poll(0)):    # rung already: as a block woken at once
                spin.blocked(0, time.perf_counter_ns() - t0, True)
                return True
            budget = spin.budget()
            if budget:
                end = t0 + budget
                pc = time.perf_counter_ns
                yld = spin.yielder()
                while True:                        # ready() at least once more, however late
                    if ready() or self._events(self._ep.poll(0)):   # this thread got here (a
                        spin.won(budget)           # preempted spin still sees what came meanwhile)
                        return True
                    if pc() >= end:
                        break
                    yld()
        now = time.monotonic()
        deadline = None if timeout is None else now + max(0.0, timeout)
        while True:                                # re-arm muted bells as their time comes
            with self._lock:
                nxt = self._unmute(now) if self._muted else None
            t = -1 if deadline is None else max(0.0, deadline - now)
            if nxt is not None:
                t = nxt - now if t < 0 else min(t, nxt - now)
            events = self._ep.poll(t)
            now = time.monotonic()
            if events or nxt is None or (deadline is not None and now >= deadline):
                break
        woken = self._events(events, now)
        if ready is not None:
            spin.blocked(budget, time.perf_counter_ns() - t0, woken)
        if woken:
            return True
        return bool(ready()) if ready is not None else False

    def _events(self, events, now: float | None = None) -> bool:
        """Note the bells of ``events`` (epoll's (fd, mask) pairs) as rung, and check each for
        strikes; whether there was any event."""
        if not events:
            return False
        now = time.monotonic() if now is None else now
        with self._lock:
            for fd, _ in events:
                b = self._bells.get(fd)
                if b is not None:
                    self._rung.add(fd)
                    self._check(b, now)
        return True

    def close(self) -> None:
        """Close the epoll and the private eventfd (the LIPs' bells belong to their rings)."""
        for fd in (self._ep, self._own):
            try:
                fd.close() if fd is self._ep else os.close(fd)
            except OSError:
                pass

