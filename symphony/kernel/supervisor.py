"""The kernel's supervision: long-lived tasks restarted on failure, watchdogs, loud failure.

A mixin of `daemon.Kernel` (event loop).  Nothing here owns LIP state: a
failing piece of the kernel either restarts (its state lives on the Kernel)
or shuts the kernel down through `_fail_loudly`, which every thread may ask
for (`_fail_threadsafe`).
"""
from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import deque

from .escape import printable

log = logging.getLogger("symphony.kernel")


class Supervision:
    """Supervised tasks and watchdogs of `daemon.Kernel`."""

    def _supervise(self, name: str, factory, restarts: int = 5) -> asyncio.Task:
        """Run ``factory()`` as a long-lived task.  An unexpected exception is
        logged with its traceback and the task restarted (its state lives on
        the Kernel, so it is intact); more than ``restarts`` failures within a
        minute, or an unexpected return, shut the kernel down loudly."""
        async def run():
            fails: deque = deque(maxlen=restarts + 1)
            while True:
                try:
                    await factory()
                    if not self.stopping.is_set():
                        self._fail_loudly(f"the kernel's {name} stopped")
                    return
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("the kernel's %s failed", name)
                    fails.append(time.monotonic())
                    if self.stopping.is_set():
                        return
                    if len(fails) > restarts and fails[-1] - fails[0] < 60:
                        self._fail_loudly(f"the kernel's {name} failed {len(fails)} times in a minute")
                        return
                    log.error("restarting the kernel's %s", name)
        task = asyncio.create_task(run(), name=name)
        self.tasks.append(task)
        return task

    def _fail_loudly(self, why: str) -> None:
        """A piece of the kernel cannot go on: shut everything down cleanly and
        loudly (LIPs killed with this reason, clients told, shm unlinked,
        durable files synced if the syscall thread still answers)."""
        if self.fatal is None:
            self.fatal = why
            log.critical("FATAL: %s; shutting the kernel down", why)
            print(f"symphony-kernel: FATAL: {printable(why)}; shutting down", file=sys.stderr, flush=True)
        self.stopping.set()

    def _fail_threadsafe(self, why: str) -> None:
        self.loop.call_soon_threadsafe(self._fail_loudly, why)

    def _loop_exception(self, loop, context: dict) -> None:
        exc = context.get("exception")
        if isinstance(exc, asyncio.CancelledError):     # a client's handler cancelled at shutdown
            return
        log.error("event loop: %s", context.get("message", "unhandled exception"),
                  exc_info=(type(exc), exc, exc.__traceback__) if exc is not None else None)

    async def _watch_syscall_thread(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            if self.stopping.is_set():
                return
            if not self.sys.thread.is_alive():
                self._fail_loudly("the syscall thread died")
                return

    async def _watch_server(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            if self.stopping.is_set():
                return
            if not self.server.is_serving():
                self._fail_loudly("the socket server stopped serving")
                return

    def sys_call(self, fn) -> "asyncio.Future":
        """Run ``fn`` on the syscall thread; an awaitable of its result that
        never blocks the event loop (await it with a timeout if you must)."""
        return asyncio.wrap_future(self.sys.call_future(fn))

