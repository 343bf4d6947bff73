"""Slow work on the syscall thread, in slices and fairly across users.

Most system calls take microseconds; a few take time in proportion to what
their caller made: a durable sync copies every page of its file, a listing
builds an entry for every file of its directory.  Run whole, one of them holds
the syscall thread (and every other user's next pred) for as long as its
caller likes.  So they run here instead:

    lane.submit(user, job, done)    job: a generator; each step does a bounded
                                    slice of work and yields; its return value
                                    (or exception) goes to done(result, error)
    lane.run()                      one round: one slice of the first job of
                                    each user with work, round-robin, within
                                    ROUND_BUDGET_S; the syscall loop calls it
                                    once per pass, between LIP calls and steps

A user's jobs run one after another (FIFO); users take turns, so a user with
a hundred queued syncs delays another user's listing by one slice, never by
their hundred.  A job may yield `WAIT` while it waits for something outside
the thread (the durable writer): it keeps its place without taking a slice.

`Writer` is the one thread that writes and fsyncs durable files, so that no
disk write ever runs on the syscall thread; it takes one file at a time, and
its completion comes back through the syscall thread's command queue.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable, Generator, Optional

log = logging.getLogger("symphony.syscalls")

ROUND_BUDGET_S = 0.002      # one round of slices stops starting new ones after this long
WAIT = object()             # yielded by a job that waits for something off the thread


class SlowLane:
    """Generator jobs by user, one slice per user per round (the syscall thread's)."""

    def __init__(self):
        self._jobs: dict[str, deque] = {}
        self._ring: deque = deque()          # users with jobs, in turn order
        self.slices = 0

    def __len__(self) -> int:
        return sum(len(q) for q in self._jobs.values())

    def busy(self) -> bool:
        """Whether some job could run a slice now (not all of them waiting)."""
        return any(q and q[0][2] is not WAIT for q in self._jobs.values())

    def submit(self, user: str, job: Generator, done: Callable[[object, Optional[BaseException]], None]) -> None:
        q = self._jobs.get(user)
        if q is None:
            q = self._jobs[user] = deque()
            self._ring.append(user)
        q.append([job, done, None])

    def run(self, budget_s: float = ROUND_BUDGET_S) -> bool:
        """One round; whether any slice ran."""
        ran, t0 = False, time.perf_counter()
        for _ in range(len(self._ring)):
            if ran and time.perf_counter() - t0 > budget_s:
                break
            user = self._ring[0]
            self._ring.rotate(-1)
            entry = self._jobs[user][0]
            job, done, _ = entry
            try:
                entry[2] = next(job)
                if entry[2] is not WAIT:
                    ran = True
                    self.slices += 1
                continue
            except StopIteration as stop:
                result, error = stop.value, None
            except Exception as e:                      # the job's own error, for its caller
                result, error = None, e
            ran = True
            self._finish(user)
            try:
                done(result, error)
            except Exception:
                log.exception("slow call: its completion failed")
        return ran

    def _finish(self, user: str) -> None:
        q = self._jobs[user]
        q.popleft()
        if not q:
            del self._jobs[user]
            self._ring.remove(user)


class Writer:
    """One thread that runs file writes (``fn()``) one at a time; each result goes
    back through ``deliver(callback)`` (the syscall thread's command queue).

    A job claims a place (`claim`, at most ``places`` at once) before it copies
    the data it will write and gives it back when its write is done, so that
    the kernel holds at most ``places`` files' copies whatever the number of
    syncs asked for."""

    def __init__(self, deliver: Callable[[Callable[[], None]], None], places: int = 2,
                 name: str = "symphony-durable"):
        self.deliver, self.places = deliver, places
        self._claimed = 0                    # the syscall thread's count
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def claim(self) -> bool:
        """Take a place if one is free (syscall thread)."""
        if self._claimed >= self.places:
            return False
        self._claimed += 1
        return True

    def release(self) -> None:
        self._claimed -= 1

    def submit(self, fn: Callable[[], object], done: Callable[[object, Optional[BaseException]], None]) -> None:
        """Run ``fn`` on the writer thread; ``done(result, error)`` then runs on the
        syscall thread."""
        self._q.put((fn, done))

    def _work(self) -> None:
        while True:
            fn, finish = self._q.get()
            try:
                result, error = fn(), None
            except BaseException as e:              # handed to the syscall thread
                result, error = None, e
            self.deliver(lambda: finish(result, error))


class RingThread:
    """One thread for the slow ends of LIP rings, kept off the syscall thread: registering a
    new LIP's arena as pinned memory (CUDA, some milliseconds) before its worker is forked,
    and unregistering and unmapping an exited LIP's ring (unmapping a segment a LIP touched
    costs about a millisecond). Jobs run one at a time in the order given, so a ring's
    registration always ends before its release starts."""

    def __init__(self, name: str = "symphony-rings"):
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()                 # at once: the kernel's threads are all there from its start

    def submit(self, fn: Callable[[], None]) -> Future:
        """Run ``fn`` there; its Future (an error is logged, never raised)."""
        fut: Future = Future()
        self._q.put((fn, fut))
        return fut

    def _work(self) -> None:
        while True:
            fn, fut = self._q.get()
            if fn is None:
                fut.set_result(None)
                return
            try:
                fn()
            except Exception:
                log.exception("ring thread: a job failed")
            fut.set_result(None)

    def shutdown(self) -> None:
        """Finish the queued jobs, then end the thread."""
        done: Future = Future()
        self._q.put((None, done))
        done.result()
