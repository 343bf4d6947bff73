"""LIP lifecycles: spawn and admission, the zygote's channel, kill, exit and reclaim.

A mixin of `daemon.Kernel`; runs on the event loop, the owner of the process
table (`self.procs`, proctable.py), whose state machine this drives:

    spawn()             checks, then the admission queue (admission.py)  -> queued
    _start()            admitted: the LIP's uid and ring, a `LipProc` handed
                        to the syscall thread, the zygote asked to fork  -> starting
    _process_reports()  the zygote's reports, in order: "spawned" (pid)
                        -> running; "exited" -> exiting, reclaim requested
    _kill()             -> killing, SIGKILL to the pid (once it is known);
                        a queued LIP -> exited at once
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
from symphony.sched.admission import Waiting, check_kv_tokens, program_key

from .admission import PendingStart
from .capabilities import Identity
from .escape import printable
from .identity import check_caller
from .proc import LipProc
from .snapshot import LipCounters, ProcRow, shown_args

log = logging.getLogger("symphony.kernel")

MAX_SOURCE = 4 << 20


class LipLifecycle:
    """Spawn, kill and reclaim of `daemon.Kernel`."""

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
        device = self.engine.kv.allocator.capacity
        kv_tokens = check_kv_tokens(msg.get("kv_tokens"), device * self.engine.page_size)
        key = program_key(user, source)
        quota = self.fs.quotas.limit_for(user)             # fixed when KVFS was made
        pages = self.peaks.expected_pages(key, kv_tokens, self.engine.page_size,
                                          self.admission.limits.default_kv_tokens,
                                          most=device if quota is None else min(device, quota))
        lip_id = self.next_id
        self.admission.push(Waiting(lip_id, user, priority, pages, time.monotonic(), size + args_bytes))  # QueueFull
        self.next_id += 1
        filename = printable(str(filename)[:200])
        self.pending[lip_id] = PendingStart(source, filename, args, grants, limits, owner, key, pages,
                                            time.monotonic())
        self.procs.queue(ProcRow(lip_id, user, filename, "queued", priority, 0, time.time(), shown_args(args),
                                 limits))
        if watcher is not None:                        # before the fork: no early output is lost
            self.watchers.setdefault(lip_id, set()).add(watcher)
        if limits.get("timeout"):                      # the wait in the queue counts
            self.loop.call_later(limits["timeout"], self._timed_out, lip_id, limits["timeout"])
        self._admission_wake.set()
        self._spawning[lip_id] = None
        try:
            self._pump_admission()
            failed = self._spawning[lip_id]
        finally:
            del self._spawning[lip_id]
        if failed is not None:
            raise failed
        if lip_id in self.admission:
            position = self.admission.position(lip_id, self.procs.admitted_by_user())
            why = self.admission.why_waiting(lip_id, self._machine()) or self._waiting_for
            log.info("LIP %d queued at position %d (%s): %s (user %s)", lip_id, position, why, filename, user)
            return {"event": "queued", "lip": lip_id, "position": position, "waiting_for": why}
        return {"event": "started", "lip": lip_id}

    def _start(self, lip_id: int, p: PendingStart) -> None:
        """Admission: the LIP's uid and ring, a `LipProc` handed to the syscall
        thread with the input it was sent while it waited, the table's
        queued -> starting, and the zygote asked to fork (a task)."""
        row = self.procs.get(lip_id).row
        uid = self.uids.allocate(lip_id)               # IdentityError when the range is full
        try:
            ring = KernelSide.create(f"{self.prefix}_{lip_id}", n_slots=self.n_slots,
                                     arena_bytes=self.arena_bytes, waitset=self.waitset)
        except BaseException:
            self.uids.release(lip_id)
            raise
        pinned = self.sys.pin_ring(ring)               # CUDA: its arena pinned, on the ring thread
        lip = LipProc(lip_id, row.user, p.filename, row.args, ring, p.grants, p.limits)
        lip.priority = row.priority
        lip.owner_uid, lip.owner_gid, lip.owner_groups = p.owner or (-1, -1, ())   # file capabilities' identity
        self.procs.admit(lip_id, ring)
        self.sys.submit(lambda: self.sys.add(lip))     # handed over (not touched here again); queued
                                                       # before the zygote forks (FIFO)
        for data in p.inputs:                          # what it was sent while it waited, in order
            self.sys.submit(lambda d=data: self.sys.give_input(lip_id, d))
        source, args, p.source, p.args, p.inputs = p.source, p.args, None, None, []   # the worker's alone now
        task = self.loop.create_task(self._fork(lip_id, source, args, p, ring, uid, pinned))
        self._forks.add(task)
        task.add_done_callback(self._forked)
        log.info("LIP %d spawned: %s %s (user %s)", lip_id, p.filename, " ".join(row.args)[:80], row.user)

    async def _fork(self, lip_id: int, source: str, args: list, p: PendingStart, ring, uid, pinned) -> None:
        """Ask the zygote to fork LIP ``lip_id``'s worker once its arena is pinned
        (``pinned``, a Future); the program travels in a memfd only the worker
        reads, the zygote sees ids and fds."""
        await asyncio.wrap_future(pinned)              # never raises (pinning is an optimisation)
        prog = os.memfd_create(f"lip{lip_id}", os.MFD_CLOEXEC)
        try:
            data = orjson.dumps({"source": source, "filename": p.filename, "args": args})
            view = memoryview(data)
            while view:
                view = view[os.write(prog, view):]
            cmd = {"cmd": "spawn", "lip": lip_id, "names": ring.names, "uid": uid, "gid": uid,
                   "limits": p.limits, "threads": p.limits.get("threads") if uid is not None else None}
            async with self._fork_lock:                # one sender at a time on the channel
                await self._zy_send(orjson.dumps(cmd), [prog, ring.bell_fd])
        finally:
            os.close(prog)

    def _forked(self, task: asyncio.Task) -> None:
        self._forks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("asking the zygote to fork failed: %r", task.exception())

    def _kill(self, lip_id: int, reason: str) -> bool:
        """Kill a live LIP (the first reason is the one its exit event gives;
        a queued one leaves the queue at once); False if there is no such LIP."""
        if lip_id in self.admission:
            self._end_queued(lip_id, reason)
            return True
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
        self._deliver(lip_id, event)
        self._forget_output(lip_id)
        self._exited(lip_id, peak)                     # its slot and KV are free: admit the next

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
