"""The kernel's supervision: long-lived tasks restarted on failure, watchdogs, loud failure.

`Supervision` is a part of `daemon.Kernel` on the event loop.  It owns the
kernel's long-lived tasks, the ``stopping`` event every part waits on or
checks, and ``fatal``, why the kernel is going down after a failure.  It owns
no LIP state: a failing task either restarts (its state lives in the part that
runs it) or shuts the kernel down through `fail_loudly`, which any thread may
ask for (the Kernel hands the syscall thread a thread-safe wrapper of it).
"""
from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import deque
from typing import Callable, Optional

from symphony.kernel.escape import printable

log = logging.getLogger("symphony.kernel")

WATCHDOG_S = 0.5            # how often a watchdog looks


class Supervision:
    """Supervised tasks, watchdogs and the kernel's stop (event loop)."""

    def __init__(self) -> None:
        self.stopping = asyncio.Event()          # set: the kernel is going down
        self.fatal: Optional[str] = None         # why, after a failure
        self.tasks: list[asyncio.Task] = []

    def supervise(self, name: str, factory, restarts: int = 5) -> asyncio.Task:
        """Run ``factory()`` as a long-lived task.  An unexpected exception is
        logged with its traceback and the task restarted (its state lives in
        the part that runs it, so it is intact); more than ``restarts`` failures
        within a minute, or an unexpected return, shut the kernel down loudly."""
        async def run():
            fails: deque = deque(maxlen=restarts + 1)
            while True:
                try:
                    await factory()
                    if not self.stopping.is_set():
                        self.fail_loudly(f"the kernel's {name} stopped")
                    return
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("the kernel's %s failed", name)
                    fails.append(time.monotonic())
                    if self.stopping.is_set():
                        return
                    if len(fails) > restarts and fails[-1] - fails[0] < 60:
                        self.fail_loudly(f"the kernel's {name} failed {len(fails)} times in a minute")
                        return
                    log.error("restarting the kernel's %s", name)
        task = asyncio.create_task(run(), name=name)
        self.tasks.append(task)
        return task

    def watchdog(self, name: str, alive: Callable[[], bool], why: str) -> asyncio.Task:
        """A supervised task that fails the kernel loudly with ``why`` once
        ``alive()`` is false (checked every `WATCHDOG_S` until the kernel stops)."""
        async def watch():
            while True:
                await asyncio.sleep(WATCHDOG_S)
                if self.stopping.is_set():
                    return
                if not alive():
                    self.fail_loudly(why)
                    return
        return self.supervise(name, watch)

    def fail_loudly(self, why: str) -> None:
        """A piece of the kernel cannot go on: shut everything down cleanly and
        loudly (LIPs killed with this reason, clients told, shm unlinked,
        durable files synced if the syscall thread still answers)."""
        if self.fatal is None:
            self.fatal = why
            log.critical("FATAL: %s; shutting the kernel down", why)
            print(f"symphony-kernel: FATAL: {printable(why)}; shutting down", file=sys.stderr, flush=True)
        self.stopping.set()

    def cancel_all(self) -> None:
        """Cancel every supervised task (the kernel has stopped)."""
        for t in self.tasks:
            t.cancel()

    @staticmethod
    def loop_exception(loop, context: dict) -> None:
        """The event loop's exception handler: log what no task caught."""
        exc = context.get("exception")
        if isinstance(exc, asyncio.CancelledError):     # a client's handler cancelled at shutdown
            return
        log.error("event loop: %s", context.get("message", "unhandled exception"),
                  exc_info=(type(exc), exc, exc.__traceback__) if exc is not None else None)
