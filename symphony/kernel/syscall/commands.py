"""Commands: work other threads hand the syscall thread (it owns KVFS and the LIPs' records).

    commands.submit(fn)                  run fn between steps (it may touch KV pages)
    commands.submit(fn, anytime=True)    run fn also while a step is on the device (it touches no
                                         KV page: input for a LIP, output credit, a reply, ps)
    fut = commands.call_future(fn)       the same, a Future of fn's result (or its error)

The syscall thread runs them (`run`) at the top of every pass of its loop, in the order they
came: while a step is in flight it stops at the first that is not anytime (so that a LIP's
removal never runs before its hand-over, say), between steps it runs them all (server.py).
Each submit rings the thread's doorbell; nothing here blocks.
"""
from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future
from typing import Callable

log = logging.getLogger("symphony.syscalls")


class Commands:
    """The command queue; ``ring()`` wakes the syscall thread, ``after()`` runs after each
    `call_future` command (the server publishes its snapshot, so the caller's next ps/stats sees
    what the command did); ``fatal`` is the exception type that must escape (a test hook)."""

    def __init__(self, ring: Callable[[], None], after: Callable[[], None], fatal: type = ()):
        self.ring, self.after, self.fatal = ring, after, fatal
        self._q: deque = deque()          # (fn, anytime); append and popleft are atomic

    def submit(self, fn: Callable[[], None], anytime: bool = False) -> None:
        self._q.append((fn, anytime))
        self.ring()

    def call_future(self, fn: Callable[[], object], anytime: bool = False) -> Future:
        fut: Future = Future()

        def run():
            if not fut.set_running_or_notify_cancel():
                return
            try:
                result, error = fn(), None
            except BaseException as e:       # handed back to the caller
                result, error = None, e
            try:
                self.after()
            except Exception:                # never at the cost of the caller's answer
                log.exception("syscall thread: the snapshot could not be published")
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)
        self.submit(run, anytime)
        return fut

    def pending(self, in_flight: bool) -> bool:
        """Whether a command could run now."""
        q = self._q
        return bool(q) and (not in_flight or q[0][1])

    def run(self, between: bool) -> bool:
        """Run the queued commands in order (``between`` steps: all; else up to the first that is
        not anytime); whether any ran.  A command that raises is logged; the others run."""
        ran, q = False, self._q
        while q:
            fn, anytime = q[0]
            if not (between or anytime):
                break
            q.popleft()
            ran = True
            try:
                fn()
            except self.fatal:
                raise
            except Exception:
                log.exception("kernel command failed")
        return ran


__all__ = ["Commands"]
