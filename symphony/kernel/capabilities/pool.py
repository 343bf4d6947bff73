"""The capability pool: worker threads shared fairly between LIPs, calls with deadlines.

    submit(owner, fn, done, timeout, user=...)
        -> queued on the owner's (a LIP's) FIFO; users with queued work take
           turns, and within a user its LIPs; a worker takes the next call of
           a user below the user's share (``per_user`` calls of one user's
           LIPs at once) and of a LIP below its share (``per_lip``); more are
           queued, never refused.  A user with no call running whose call
           finds every worker busy gets a thread of its own for it (up to
           ``max_threads`` in all): one user's slow calls never hold another
           user's first call
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

from symphony.kernel.capabilities.policy import CapError

log = logging.getLogger("symphony.capabilities")


@dataclass(eq=False)
class Job:
    """One call.  ``deadline`` (time.monotonic) is set when it starts to run."""
    owner: int
    user: object
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
                 max_threads: Optional[int] = None, name: str = "symphony-cap", per_user: Optional[int] = None):
        self.workers, self.per_lip, self.grace_s = workers, per_lip, grace_s
        self.per_user = per_user or workers
        self.max_threads = max_threads or 4 * workers
        self.name = name
        self._cv = threading.Condition()
        self._queues: dict[int, deque] = {}
        self._users: dict = {}                # user -> deque of its owners with queued calls, round-robin
        self._ring: deque = deque()           # users with queued calls, round-robin
        self._busy: dict[int, int] = {}       # owner -> calls running (stuck ones included)
        self._busy_user: dict = {}            # user -> calls running
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
               timeout: float, alive: Callable[[], bool] = lambda: True, user=None) -> Job:
        """Queue ``fn`` for ``owner`` (a LIP) of ``user``; ``done`` is called exactly
        once (unless the owner is gone by the time the call is reached: then it is
        dropped)."""
        job = Job(owner, user, fn, done, float(timeout), alive)
        with self._cv:
            if self._closed:
                raise RuntimeError("capability pool is closed")
            q = self._queues.get(owner)
            if q is None:
                q = self._queues[owner] = deque()
                owners = self._users.get(user)
                if owners is None:
                    owners = self._users[user] = deque()
                    self._ring.append(user)
                owners.append(owner)
            q.append(job)
            if (user is not None and not self._busy_user.get(user) and len(self._running) >= self._threads
                    and self._threads < self.max_threads):
                self._spawn()                  # every worker is busy with others' calls
            self._cv.notify_all()
        return job

    def drop(self, owner: int) -> int:
        """Forget the queued (not yet running) calls of ``owner``; returns how many."""
        with self._cv:
            q = self._queues.pop(owner, None)
            if q is not None:
                self._unqueue(q[0].user, owner)
            return len(q or ())

    def _unqueue(self, user, owner: int) -> None:
        owners = self._users[user]
        owners.remove(owner)
        if not owners:
            del self._users[user]
            self._ring.remove(user)

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
        """The next runnable call, round-robin over users below their share, then
        over their owners below theirs (lock held)."""
        for _ in range(len(self._ring)):
            user = self._ring[0]
            self._ring.rotate(-1)
            if user is not None and self._busy_user.get(user, 0) >= self.per_user:
                continue
            owners = self._users[user]
            for _ in range(len(owners)):
                owner = owners[0]
                owners.rotate(-1)
                if self._busy.get(owner, 0) >= self.per_lip:
                    continue
                q = self._queues[owner]
                job = q.popleft()
                if not q:
                    del self._queues[owner]
                    self._unqueue(user, owner)
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
                self._busy_user[job.user] = self._busy_user.get(job.user, 0) + 1
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
                self._busy_user[job.user] -= 1
                if not self._busy_user[job.user]:
                    del self._busy_user[job.user]
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
