"""LIP lifecycles: admission and spawn, the zygote's channel, kill, exit and reclaim.

A mixin of `daemon.Kernel`; runs on the event loop, the owner of the process
table (`self.procs`, proctable.py), whose state machine this drives:

    spawn()             admission, the LIP's ring, a `LipProc` handed to the
                        syscall thread, the zygote asked to fork  -> starting
    _process_reports()  the zygote's reports, in order: "spawned" (pid)
                        -> running; "exited" -> exiting, reclaim requested
    _kill()             -> killing, SIGKILL to the pid (once it is known)
    _reclaimed()        the syscall thread reclaimed it -> exited, the exit
                        event goes out
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from typing import Optional

import orjson

from symphony.ipc.kernel_side import KernelSide
from symphony.sched import admit

from .capabilities import Identity
from .identity import check_caller
from .proc import LipProc
from .snapshot import LipCounters, ProcRow

log = logging.getLogger("symphony.kernel")

MAX_SOURCE = 4 << 20


class LipLifecycle:
    """Spawn, kill and reclaim of `daemon.Kernel`."""

    async def spawn(self, user: str, msg: dict, watcher=None, owner: Optional[Identity] = None,
                    caller_uid: Optional[int] = None) -> ProcRow:
        """Admit and start a LIP for ``user`` from a client's spawn request;
        its row as the table has it (state "starting").  ValueError /
        PermissionError / LimitExceeded when it may not start."""
        source, filename, args = msg.get("source"), msg.get("filename", "lip.py"), msg.get("args", [])
        if not isinstance(source, str) or len(source) > MAX_SOURCE:
            raise ValueError(f"source must be a string of at most {MAX_SOURCE} bytes")
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ValueError("args must be a list of strings")
        if caller_uid is not None:
            check_caller(self.uids.kernel_uid, caller_uid, self.uids.can_switch)
        ok, why = admit(len(self.procs), self.max_lips, self.sys.snapshot.kv_pages_free, pages_reserve=1)
        if not ok:
            raise ValueError(f"LIP not admitted: {why}")
        priority = self.policy.priority_for(user, msg.get("priority", "normal"))
        grants = self.caps.policy.check_grants(msg.get("grants") or {}, owner)
        limits = self.policy.limits_for(msg.get("limits"))
        self.policy.check_count(user, self.procs.count_for(user))
        lip_id = self.next_id
        uid = self.uids.allocate(lip_id)               # IdentityError when the range is full
        self.next_id += 1
        try:
            ring = KernelSide.create(f"{self.prefix}_{lip_id}", n_slots=self.n_slots,
                                     arena_bytes=self.arena_bytes, waitset=self.waitset)
        except BaseException:
            self.uids.release(lip_id)
            raise
        filename = str(filename)[:200]
        lip = LipProc(lip_id, user, filename, args, ring, grants, limits)
        lip.priority = priority
        lip.owner_uid, lip.owner_gid, lip.owner_groups = owner or (-1, -1, ())   # file capabilities' identity
        entry = self.procs.add(ProcRow(lip_id, user, filename, "starting", priority, 0, time.time(),
                                       tuple(args), limits), ring)
        self.sys.submit(lambda: self.sys.add(lip))     # handed over (not touched here again); queued
                                                       # before the zygote forks (FIFO)
        if watcher is not None:                        # before the fork: no early output is lost
            self.watchers.setdefault(lip_id, set()).add(watcher)
        # the program travels in a memfd only the worker reads; the zygote sees ids and fds
        prog = os.memfd_create(f"lip{lip_id}", os.MFD_CLOEXEC)
        try:
            data = orjson.dumps({"source": source, "filename": filename, "args": args})
            view = memoryview(data)
            while view:
                view = view[os.write(prog, view):]
            cmd = {"cmd": "spawn", "lip": lip_id, "names": ring.names, "uid": uid, "gid": uid,
                   "limits": limits, "threads": limits.get("threads") if uid is not None else None}
            await self._zy_send(orjson.dumps(cmd), [prog, ring.bell_fd])
        finally:
            os.close(prog)
        if limits.get("timeout"):
            self.loop.call_later(limits["timeout"], self._kill, lip_id,
                                 f"killed: wall-clock limit of {limits['timeout']} s")
        log.info("LIP %d spawned: %s %s (user %s)", lip_id, filename, " ".join(args)[:80], user)
        return entry.row

    def _kill(self, lip_id: int, reason: str) -> bool:
        """Kill a live LIP (the first reason is the one its exit event gives);
        False if there is no such LIP."""
        entry = self.procs.kill(lip_id, reason)
        if entry is None:
            return False
        if entry.state == "killing" and entry.pid:     # not once it is exiting: its pid may be reused
            try:
                os.kill(entry.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return True

    def _kill_threadsafe(self, lip_id: int, reason: str) -> None:
        self.loop.call_soon_threadsafe(self._kill, lip_id, reason)

    async def _zy_send(self, data: bytes, fds: list) -> None:
        """One command (and its fds, SCM_RIGHTS) to the zygote; waits while its queue is full."""
        while True:
            try:
                socket.send_fds(self._chan, [data], fds)
                return
            except BlockingIOError:
                fut = self.loop.create_future()
                self.loop.add_writer(self._chan, lambda: fut.done() or fut.set_result(None))
                try:
                    await fut
                finally:
                    self.loop.remove_writer(self._chan)

    async def _read_zygote(self) -> None:
        """Read the zygote's reports one at a time and queue each for
        `_process_reports`; never waits on anything else."""
        while True:
            try:
                line = await self.loop.sock_recv(self._chan, 1 << 16)
            except OSError:
                line = b""
            if not line:
                if not self.stopping.is_set():
                    self._fail_loudly("the zygote exited unexpectedly; no LIP can start or be reaped")
                return
            try:
                msg = orjson.loads(line)
                if not isinstance(msg, dict):
                    raise ValueError("not an object")
            except ValueError as e:
                log.error("unreadable zygote report %r: %s", line[:200], e)
                continue
            self.reports.put_nowait(msg)

    async def _process_reports(self) -> None:
        """Apply the zygote's reports to the process table, in order.  Never
        blocks: an exit's reclaim runs on the syscall thread and the exit
        event goes out when it is done."""
        while True:
            msg = await self.reports.get()
            if "spawned" in msg:
                if isinstance(msg.get("spawned"), int) and isinstance(msg.get("pid"), int):
                    reason = self.procs.started(msg["spawned"], msg["pid"])
                    if reason is not None:                 # killed while it was starting
                        self._kill(msg["spawned"], reason)
            elif "exited" in msg:
                self.uids.release(msg["exited"])           # the worker is reaped: its uid is free
                self._reclaim(msg["exited"], msg.get("status", -1), msg.get("signal", 0))
            else:
                log.error("unknown zygote report %r", msg)

    def _reclaim(self, lip_id: int, status: int, sig: int) -> None:
        """The LIP's process is gone: mark it exiting, have the syscall thread
        reclaim its files and ring, then send the exit event (`_reclaimed`)."""
        if self.procs.exit_reported(lip_id) is None:
            return
        fut = self.sys.call_future(lambda: self.sys.remove(lip_id))
        fut.add_done_callback(lambda f: self.loop.call_soon_threadsafe(self._reclaimed, lip_id, status, sig, f))

    def _reclaimed(self, lip_id: int, status: int, sig: int, fut) -> None:
        counters = LipCounters()
        if fut.cancelled() or fut.exception() is not None:
            log.error("LIP %d: reclaim failed: %r", lip_id, None if fut.cancelled() else fut.exception())
        else:
            counters = fut.result()
        done = self.procs.reclaimed(lip_id, status, sig, counters)
        if done is None:                               # already told (shutdown gave up waiting)
            return
        event = done[1]
        log.info("LIP %d exited: %s (%s); %d calls, %d preds", lip_id, event["status"], event["reason"],
                 counters.calls, counters.preds)
        self._deliver(lip_id, event)
        self._forget_output(lip_id)

    async def _drain_reaping(self, timeout: float) -> bool:
        """Wait until every pending reclaim is done; False if the syscall
        thread did not get to them in ``timeout`` seconds (their clients get
        their exit events anyway)."""
        deadline = time.monotonic() + timeout
        while any(e.state == "exiting" for e in self.procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        late = [e.id for e in self.procs if e.state == "exiting"]
        for lip_id in late:
            done = self.procs.abandon(lip_id, " (not reclaimed: the syscall thread did not answer)")
            if done is not None:
                self._deliver(lip_id, done[1])
        return not late
