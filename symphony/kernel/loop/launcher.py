"""Starting LIP workers: the zygote, its channel, and an admitted LIP's start.

`Launcher` is a part of `daemon.Kernel` on the event loop.  It owns the
zygote process and the SEQPACKET channel to it (commands and their fds out,
reports in), the tokenizer file the zygote loads, and the forks in flight:

    open()          start the zygote, wait for its "ready"
    start()         an admitted LIP: its uid and ring, a `LipProc` handed to
                    the syscall thread, the table's queued -> starting, and
                    the zygote asked to fork (a task: its arena is pinned first)
    read_reports()  a supervised task: the zygote's reports ("spawned",
                    "exited"), in order, into ``reports`` (lifecycle.py applies them)
    close()         tell the zygote to exit; close the channel
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import tempfile
from pathlib import Path

import orjson

from symphony.ipc.kernel_side import KernelSide

from symphony.kernel.loop.admission import PendingStart
from symphony.kernel.identity import UidPool
from symphony.kernel.syscall.proc import LipProc
from symphony.kernel.loop.proctable import ProcessTable
from symphony.kernel.loop.supervisor import Supervision

log = logging.getLogger("symphony.kernel")

READY_WAIT_S = 60           # how long the zygote may take to say it is ready


class Launcher:
    """The zygote's channel and the start of admitted LIPs (event loop)."""

    def __init__(self, procs: ProcessTable, sys_server, uids: UidPool, supervision: Supervision, *,
                 prefix: str, n_slots: int, arena_bytes: int, waitset, lip_nice: int):
        """``sys_server``: the syscall thread's server (a started LIP is handed to
        it); ``prefix``: this kernel instance's shared-memory name prefix;
        ``n_slots``, ``arena_bytes``: each LIP ring's size; ``lip_nice``: the
        nice value workers start with."""
        self.procs, self.sys, self.uids, self.supervision = procs, sys_server, uids, supervision
        self.prefix, self.n_slots, self.arena_bytes = prefix, n_slots, arena_bytes
        self.waitset, self.lip_nice = waitset, lip_nice
        self.reports: asyncio.Queue = asyncio.Queue()      # zygote reports, in order
        self.zygote = None                                 # the zygote's asyncio subprocess, once open
        self._chan = None
        self._tokfile = None
        self._forks: set = set()
        self._fork_lock = asyncio.Lock()

    async def open(self, tokenizer_json: str) -> None:
        """Start the zygote (never with the kernel's own environment) and wait
        until it is ready.  RuntimeError if it does not start."""
        loop = asyncio.get_running_loop()
        self._tokfile = tempfile.NamedTemporaryFile("w", suffix=".json", prefix="symphony-tok-", delete=False)
        self._tokfile.write(tokenizer_json)
        self._tokfile.close()
        from symphony.kernel.workers.zygote import BASE_ENV
        env = dict(BASE_ENV)
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2])] +
                                            ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
        self._chan, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._chan.setblocking(False)
        self.zygote = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "symphony.kernel.workers.zygote", self._tokfile.name, str(child.fileno()),
            str(os.getpid()), str(self.lip_nice), stdin=asyncio.subprocess.DEVNULL, pass_fds=(child.fileno(),),
            env=env)
        child.close()
        first = await asyncio.wait_for(loop.sock_recv(self._chan, 1 << 16), READY_WAIT_S)
        if b"ready" not in first:
            raise RuntimeError(f"the zygote did not start: {first!r}")

    def start(self, lip_id: int, p: PendingStart) -> None:
        """Admission: the LIP's uid and ring, a `LipProc` handed to the syscall
        thread with the input it was sent while it waited, the table's
        queued -> starting, and the zygote asked to fork (a task).  NoFreeUid
        when every LIP uid is taken."""
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
        srv = self.sys
        srv.submit(lambda: srv.add(lip), anytime=True)               # handed over (not touched here again); queued
                                                       # before the zygote forks (FIFO)
        for data in p.inputs:                          # what it was sent while it waited, in order
            srv.submit(lambda d=data: srv.give_input(lip_id, d), anytime=True)
        source, args, p.source, p.args, p.inputs = p.source, p.args, None, None, []   # the worker's alone now
        task = asyncio.get_running_loop().create_task(self._fork(lip_id, source, args, p, ring, uid, pinned))
        self._forks.add(task)
        task.add_done_callback(self._forked)
        log.info("LIP %d spawned: %s %s (user %s)", lip_id, p.filename, " ".join(row.args)[:80], row.user)

    async def read_reports(self) -> None:
        """Read the zygote's reports one at a time and queue each on
        ``reports``; never waits on anything else."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                line = await loop.sock_recv(self._chan, 1 << 16)
            except OSError:
                line = b""
            if not line:
                if not self.supervision.stopping.is_set():
                    self.supervision.fail_loudly("the zygote exited unexpectedly; no LIP can start or be reaped")
                return
            try:
                msg = orjson.loads(line)
                if not isinstance(msg, dict):
                    raise ValueError("not an object")
            except ValueError as e:
                log.error("unreadable zygote report %r: %s", line[:200], e)
                continue
            self.reports.put_nowait(msg)

    async def close(self) -> None:
        """Ask the zygote to exit (kill it if it does not), close the channel and
        remove the tokenizer file."""
        try:
            await self._send(b'{"cmd": "exit"}', [])
            await asyncio.wait_for(self.zygote.wait(), 3)
        except Exception:
            if self.zygote.returncode is None:          # dead already (e.g. it crashed): nothing to kill
                self.zygote.kill()
        self._chan.close()
        try:
            os.unlink(self._tokfile.name)
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------------ helpers
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
                await self._send(orjson.dumps(cmd), [prog, ring.bell_fd])
        finally:
            os.close(prog)

    def _forked(self, task: asyncio.Task) -> None:
        self._forks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("asking the zygote to fork failed: %r", task.exception())

    async def _send(self, data: bytes, fds: list) -> None:
        """One command (and its fds, SCM_RIGHTS) to the zygote; waits while its queue is full."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                socket.send_fds(self._chan, [data], fds)
                return
            except BlockingIOError:
                fut = loop.create_future()
                loop.add_writer(self._chan, lambda: fut.done() or fut.set_result(None))
                try:
                    await fut
                finally:
                    loop.remove_writer(self._chan)
