"""The capability pool: worker threads shared fairly between LIPs, calls with deadlines.

    submit(owner, fn, done, timeout)
        -> queued on the owner's FIFO; owners with queued work wait in a
           round-robin ring; a worker takes the next owner below its share
           (at most ``per_lip`` calls of one owner run at once); more are
           queued, never refused
    a worker runs fn(ctx); done(result, None) or done(None, exc) exactly once
    the watchdog answers a call past its deadline with TimedOut, runs its
        cancel hooks (an http socket is shut down) and, while the stuck thread
        has not come back, starts a replacement so that the pool keeps its
        ``workers`` live threads (at most ``max_threads`` in all)
    a call whose owner is gone (``alive()`` false) is dropped when reached

The owner's share stays taken until its thread really returns: a LIP whose
calls hang only delays itself.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from .policy import CapError

log = logging.getLogger("symphony.capabilities")


@dataclass(eq=False)
class Job:
    """One call.  ``deadline`` (time.monotonic) is set when it starts to run."""
    owner: int
    fn: Callable[["Job"], dict]
    done: Callable[[Optional[dict], Optional[BaseException]], None]
    timeout: float
    alive: Callable[[], bool] = lambda: True
    deadline: float = 0.0
    answered: bool = False
    hooks: list = field(default_factory=list)

    def on_cancel(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` if this call overruns its deadline (e.g. shut a socket)."""
        self.hooks.append(hook)


class CapPool:
    def __init__(self, workers: int = 4, per_lip: int = 2, grace_s: float = 0.5,
                 max_threads: Optional[int] = None, name: str = "symphony-cap"):
        self.workers, self.per_lip, self.grace_s = workers, per_lip, grace_s
        self.max_threads = max_threads or 4 * workers
        self.name = name
        self._cv = threading.Condition()
        self._queues: dict[int, deque] = {}
        self._ring: deque = deque()           # owners with queued calls, round-robin
        self._busy: dict[int, int] = {}       # owner -> calls running (stuck ones included)
        self._running: set = set()
        self._threads = 0
        self._stuck = 0
        self._closed = False
        self.timeouts = 0
        self.served = 0
        for _ in range(workers):
            self._spawn()
        threading.Thread(target=self._watchdog, name=f"{name}-watchdog", daemon=True).start()

    # ------------------------------------------------------------------ public
    def submit(self, owner: int, fn: Callable[[Job], dict],
               done: Callable[[Optional[dict], Optional[BaseException]], None],
               timeout: float, alive: Callable[[], bool] = lambda: True) -> Job:
        """Queue ``fn`` for ``owner``; ``done`` is called exactly once (unless the
        owner is gone by the time the call is reached: then it is dropped)."""
        job = Job(owner, fn, done, float(timeout), alive)
        with self._cv:
            if self._closed:
                raise RuntimeError("capability pool is closed")
            q = self._queues.get(owner)
            if q is None:
                q = self._queues[owner] = deque()
                self._ring.append(owner)
            q.append(job)
            self._cv.notify_all()
        return job

    def drop(self, owner: int) -> int:
        """Forget the queued (not yet running) calls of ``owner``; returns how many."""
        with self._cv:
            q = self._queues.pop(owner, None)
            if q is not None:
                self._ring.remove(owner)
            return len(q or ())

    def stats(self) -> dict:
        with self._cv:
            return {"threads": self._threads, "stuck": self._stuck, "running": len(self._running),
                    "queued": sum(len(q) for q in self._queues.values()), "timeouts": self.timeouts,
                    "served": self.served}

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    # ------------------------------------------------------------------ workers
    def _spawn(self) -> None:
        self._threads += 1
        threading.Thread(target=self._work, name=f"{self.name}-{self._threads}", daemon=True).start()

    def _next(self) -> Optional[Job]:
        """The next runnable call, round-robin over owners below their share (lock held)."""
        for _ in range(len(self._ring)):
            owner = self._ring.popleft()
            q = self._queues[owner]
            if self._busy.get(owner, 0) >= self.per_lip:
                self._ring.append(owner)
                continue
            job = q.popleft()
            if q:
                self._ring.append(owner)
            else:
                del self._queues[owner]
            return job
        return None

    def _work(self) -> None:
        while True:
            with self._cv:
                job = None
                while not self._closed:
                    if self._threads - self._stuck > self.workers:
                        break                          # a stuck thread came back: one too many
                    job = self._next()
                    if job is not None:
                        break
                    self._cv.wait()
                if job is None:
                    self._threads -= 1
                    return
                if not job.alive():
                    continue                           # its LIP is gone: drop
                self._busy[job.owner] = self._busy.get(job.owner, 0) + 1
                job.deadline = time.monotonic() + job.timeout
                self._running.add(job)
                self._cv.notify_all()                  # the watchdog learns the new deadline
            res, err = None, None
            try:
                res = job.fn(job)
            except BaseException as e:                 # handed to done()
                err = e
            with self._cv:
                self._running.discard(job)
                self._busy[job.owner] -= 1
                if not self._busy[job.owner]:
                    del self._busy[job.owner]
                late = job.answered
                if late:
                    self._stuck -= 1
                job.answered = True
                self.served += 1
                self._cv.notify_all()
            if not late:
                _call(job.done, res, err)

    def _watchdog(self) -> None:
        while True:
            overdue = []
            with self._cv:
                if self._closed:
                    return
                now = time.monotonic()
                wake = None
                for j in self._running:
                    if j.answered:
                        continue
                    if now >= j.deadline + self.grace_s:
                        j.answered = True
                        self._stuck += 1
                        self.timeouts += 1
                        overdue.append(j)
                    else:
                        t = j.deadline + self.grace_s
                        wake = t if wake is None else min(wake, t)
                while overdue and self._threads - self._stuck < self.workers and self._threads < self.max_threads:
                    self._spawn()
                    if self._threads >= self.max_threads:
                        log.warning("capability pool: %d threads, %d stuck past their deadline",
                                    self._threads, self._stuck)
                        break
                if not overdue:
                    self._cv.wait(None if wake is None else max(0.001, wake - now))
            for j in overdue:
                for hook in j.hooks:
                    _call(hook)
                _call(j.done, None, CapError("TimedOut", "ETIMEDOUT",
                                             f"capability call took longer than its {j.timeout:g} s limit"))


def _call(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:
        log.exception("capability pool: a completion callback failed")
