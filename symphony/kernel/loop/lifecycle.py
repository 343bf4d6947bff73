"""LIP lifecycles: spawn, input, kill, exit and reclaim.

`LipLifecycle` is a part of `daemon.Kernel` on the event loop, which owns the
process table (proctable.py) whose state machine this drives, with the
admission queue (admission.py) and the launcher (launcher.py, the zygote's
channel):

    spawn()             checks, then the admission queue         -> queued
    Launcher.start()    admitted: uid, ring, the syscall thread's
                        `LipProc`, the zygote asked to fork      -> starting
    process_reports()   the zygote's reports, in order: "spawned" (pid)
                        -> running; "exited" -> exiting, reclaim requested
    kill()              -> killing, SIGKILL to the pid (once it is known);
                        a queued LIP -> exited at once
    _reclaimed()        the syscall thread reclaimed it -> exited, the exit
                        event goes out, the queue moves on

It owns the next LIP id; the rest of a LIP's state lives in the parts above.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import Optional

from symphony.sched.admission import Waiting

from symphony.kernel.loop.admission import AdmissionControl, PendingStart
from symphony.kernel.loop.bounds import ClientBounds
from symphony.kernel.capabilities import Capabilities, Identity
from symphony.kernel.escape import printable
from symphony.kernel.identity import UidPool, check_caller
from symphony.kernel.loop.launcher import Launcher
from symphony.kernel.loop.limits import LimitPolicy
from symphony.kernel.loop.output import OutputStreams
from symphony.kernel.loop.proctable import ProcessTable
from symphony.kernel.snapshot import LipCounters, ProcRow, shown_args
from symphony.kernel.states import LipState

log = logging.getLogger("symphony.kernel")

MAX_SOURCE = 4 << 20


class LipLifecycle:
    """Spawn, input, kill and reclaim of LIPs (event loop)."""

    def __init__(self, procs: ProcessTable, admission: AdmissionControl, launcher: Launcher,
                 output: OutputStreams, sys_server, uids: UidPool, caps: Capabilities, policy: LimitPolicy,
                 bounds: ClientBounds):
        """``sys_server``: the syscall thread's server (input, reclaim); ``uids``:
        the LIP uid range; ``caps``: the capability policy grants are checked
        against; ``policy``: the administrator's limits and priorities;
        ``bounds``: what one client may make the kernel hold (arguments)."""
        self.procs, self.admission, self.launcher, self.output = procs, admission, launcher, output
        self.sys, self.uids, self.caps, self.policy, self.bounds = sys_server, uids, caps, policy, bounds
        self.next_id = 1

    async def spawn(self, user: str, msg: dict, watcher=None, owner: Optional[Identity] = None,
                    caller_uid: Optional[int] = None) -> dict:
        """Queue a LIP for ``user`` from a client's spawn request and start it
        if it may start now.  Returns the reply: {"event": "started", "lip"}
        or {"event": "queued", "lip", "position", "waiting_for"}.  ValueError /
        PermissionError / LimitExceeded / QueueFull when it may not even wait."""
        source, filename, args = msg.get("source"), msg.get("filename", "lip.py"), msg.get("args", [])
        if not isinstance(source, str) or len(source) > MAX_SOURCE:
            raise ValueError(f"source must be a string of at most {MAX_SOURCE} bytes")
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ValueError("args must be a list of strings")
        cap = self.bounds.max_args_bytes
        args_bytes = sum(len(a) + 1 for a in args)        # characters first: a huge one is refused uncopied
        if args_bytes <= cap:
            args_bytes = sum(len(a.encode("utf-8", "surrogatepass")) + 1 for a in args)
        if args_bytes > cap:
            raise ValueError(f"the LIP's {len(args)} arguments take {args_bytes} bytes or more, more than a LIP "
                             f"may be given ({cap} bytes: symphony-kernel --max-args-kb {cap >> 10})")
        size = len(source.encode("utf-8", "surrogatepass"))
        if caller_uid is not None:
            check_caller(self.uids.kernel_uid, caller_uid, self.uids.can_switch)
        priority = self.policy.priority_for(user, msg.get("priority", "normal"))
        grants = self.caps.policy.check_grants(msg.get("grants") or {}, owner)
        limits = self.policy.limits_for(msg.get("limits"))
        key, pages = self.admission.estimate(user, source, msg.get("kv_tokens"))
        filename = printable(str(filename)[:200])
        lip_id = self.next_id
        self.admission.enqueue(Waiting(lip_id, user, priority, pages, time.monotonic(), size + args_bytes),
                               PendingStart(source, filename, args, grants, limits, owner, key, pages,
                                            time.monotonic()),
                               ProcRow(lip_id, user, filename, LipState.QUEUED, priority, 0, time.time(),
                                       shown_args(args), limits))      # QueueFull
        self.next_id += 1
        if watcher is not None:                        # before the fork: no early output is lost
            self.output.watch(lip_id, watcher)
        if limits.get("timeout"):                      # the wait in the queue counts
            asyncio.get_running_loop().call_later(limits["timeout"], self._timed_out, lip_id, limits["timeout"])
        return self.admission.start_now(lip_id)

    def give_input(self, lip_id: int, data: Optional[str]) -> None:
        """Input for a live LIP (None: end of input): kept while it is queued,
        handed to the syscall thread once it runs."""
        if lip_id in self.admission:                   # kept until it starts
            self.admission.keep_input(lip_id, data)
            return
        srv = self.sys
        srv.submit(lambda: srv.give_input(lip_id, data), anytime=True)

    def kill(self, lip_id: int, reason: str) -> bool:
        """Kill a live LIP (the first reason is the one its exit event gives;
        a queued one leaves the queue at once); False if there is no such LIP."""
        if lip_id in self.admission:
            self.admission.leave(lip_id, reason)
            return True
        entry = self.procs.kill(lip_id, reason)
        if entry is None:
            return False
        if entry.state == LipState.KILLING and entry.pid:     # not once it is exiting: its pid may be reused
            try:
                os.kill(entry.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return True

    async def process_reports(self) -> None:
        """Apply the zygote's reports to the process table, in order.  Never
        blocks: an exit's reclaim runs on the syscall thread and the exit
        event goes out when it is done."""
        while True:
            msg = await self.launcher.reports.get()
            if "spawned" in msg:
                if isinstance(msg.get("spawned"), int) and isinstance(msg.get("pid"), int):
                    reason = self.procs.started(msg["spawned"], msg["pid"])
                    if reason is not None:                 # killed while it was starting
                        self.kill(msg["spawned"], reason)
            elif "exited" in msg:
                self.uids.release(msg["exited"])           # the worker is reaped: its uid is free
                self.reclaim(msg["exited"], msg.get("status", -1), msg.get("signal", 0))
            else:
                log.error("unknown zygote report %r", msg)

    def reclaim(self, lip_id: int, status: int, sig: int) -> None:
        """The LIP's process is gone: mark it exiting, have the syscall thread
        reclaim its files and ring, then send the exit event (`_reclaimed`)."""
        if self.procs.exit_reported(lip_id) is None:
            return
        loop, srv = asyncio.get_running_loop(), self.sys
        fut = srv.call_future(lambda: srv.remove(lip_id))
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(self._reclaimed, lip_id, status, sig, f))

    async def drain_reaping(self, timeout: float) -> bool:
        """Wait until every pending reclaim is done; False if the syscall
        thread did not get to them in ``timeout`` seconds (their clients get
        their exit events anyway)."""
        deadline = time.monotonic() + timeout
        while any(e.state == LipState.EXITING for e in self.procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        late = [e.id for e in self.procs if e.state == LipState.EXITING]
        for lip_id in late:
            done = self.procs.abandon(lip_id, " (not reclaimed: the syscall thread did not answer)")
            if done is not None:
                self.output.deliver(lip_id, done[1])
        return not late

    # ------------------------------------------------------------------ helpers
    def _timed_out(self, lip_id: int, secs: float) -> None:
        """A LIP's wall-clock limit passed: waiting counts."""
        if lip_id in self.admission:
            self.admission.time_out(lip_id, secs)
        else:
            self.kill(lip_id, f"killed: wall-clock limit of {secs} s")

    def _reclaimed(self, lip_id: int, status: int, sig: int, fut) -> None:
        counters, peak = LipCounters(), 0
        if fut.cancelled() or fut.exception() is not None:
            log.error("LIP %d: reclaim failed: %r", lip_id, None if fut.cancelled() else fut.exception())
        else:
            counters, peak = fut.result()
        done = self.procs.reclaimed(lip_id, status, sig, counters)
        if done is None:                               # already told (shutdown gave up waiting)
            return
        event = done[1]
        log.info("LIP %d exited: %s (%s); %d calls, %d preds", lip_id, event["status"], event["reason"],
                 counters.calls, counters.preds)
        self.output.deliver(lip_id, event)
        self.output.forget(lip_id)
        self.admission.exited(lip_id, peak)            # its slot and KV are free: admit the next
