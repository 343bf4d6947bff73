"""``symphony-kernel --http HOST:PORT``: the HTTP gateway as the kernel's child.

The gateway is a process of its own (symphony/gateway/); this starts it once
the kernel is ready, forwards its log lines to the kernel's stderr, restarts
it if it dies (after 1 s, doubling with each failure in a row up to 60 s; a
run of 5 minutes or more resets the delay; at most 5 starts a minute and 10
failures in a row, then the kernel keeps serving its socket and logs that the
gateway is down), and stops it with the kernel.  It
also dies with the kernel on its own (PR_SET_PDEATHSIG).

Privilege: a root kernel starts the gateway as root only so that it can read
the key and TLS files and bind its port; the gateway then drops to the uid
the kernel trusts to act for the keys' users (``--gateway-uid``, by default a
free uid of the LIP range, never a real account's) before serving anything.
That uid may name any user but root in its requests; it cannot shut the
kernel down, and the kernel still applies its own limits and policy.
"""
from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Optional

log = logging.getLogger("symphony.kernel")

MAX_RESTARTS_PER_MIN = 5
MAX_FAILURES_IN_A_ROW = 10
HEALTHY_RUN_S = 300          # a run this long resets the restart delay
MAX_DELAY_S = 60.0


def restart_delay(failures_in_a_row: int) -> float:
    """Seconds before the next start after that many failures in a row (1, 2, 4, ... 60)."""
    return min(MAX_DELAY_S, 2.0 ** max(0, failures_in_a_row - 1))


class GatewayProcess:
    def __init__(self, http: str, socket_path: str, run_as: Optional[int], extra_argv: list[str]):
        self.argv = [sys.executable, "-m", "symphony.gateway", "--http", http, "--socket", socket_path,
                     "--parent-death", *extra_argv]
        if run_as is not None:
            self.argv += ["--run-as", str(run_as)]
        self.proc: Optional[asyncio.subprocess.Process] = None
        self._stopping = False
        self._starts: list[float] = []
        self.failures = 0                    # in a row
        self.task: Optional[asyncio.Task] = None

    def start(self, env: dict) -> None:
        self.env = env
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while not self._stopping:
            now = time.monotonic()
            self._starts = [t for t in self._starts if now - t < 60] + [now]
            if len(self._starts) > MAX_RESTARTS_PER_MIN:
                log.error("the HTTP gateway died %d times in a minute: not restarting it (the kernel's socket "
                          "still serves)", MAX_RESTARTS_PER_MIN)
                return
            self.proc = await asyncio.create_subprocess_exec(*self.argv, stdin=asyncio.subprocess.DEVNULL,
                                                             stderr=asyncio.subprocess.PIPE, env=self.env)
            log.info("HTTP gateway started (pid %d)", self.proc.pid)
            started = time.monotonic()
            async for line in self.proc.stderr:
                sys.stderr.write(line.decode("utf-8", "replace"))
                sys.stderr.flush()
            code = await self.proc.wait()
            if self._stopping:
                return
            if code == 2:
                log.error("the HTTP gateway refused its configuration (status 2): not restarting it")
                return
            self.failures = 1 if time.monotonic() - started >= HEALTHY_RUN_S else self.failures + 1
            if self.failures > MAX_FAILURES_IN_A_ROW:
                log.error("the HTTP gateway failed %d times in a row: not restarting it (the kernel's socket "
                          "still serves)", MAX_FAILURES_IN_A_ROW)
                return
            delay = restart_delay(self.failures)
            log.error("the HTTP gateway exited with status %s; restarting it in %.0f s", code, delay)
            await asyncio.sleep(delay)

    async def stop(self) -> None:
        self._stopping = True
        p = self.proc
        if p is not None and p.returncode is None:
            p.terminate()
            try:
                await asyncio.wait_for(p.wait(), 5)
            except asyncio.TimeoutError:
                p.kill()
                await p.wait()
        if self.task is not None:
            try:
                await asyncio.wait_for(self.task, 2)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self.task.cancel()
