"""symphony-kernel: the kernel daemon.

    main thread   asyncio (uvloop) event loop: the Unix-socket program RPC,
                  the zygote's pipe, LIP lifecycles, output streaming
    syscall thread `syscalls.SyscallServer`: owns the engine and KVFS, serves
                  every LIP's shared-memory ring, runs the forward passes
    zygote        `zygote.py`: forks one sandboxed worker per LIP

Client requests (framed JSON, see `protocol.py`), each answered on the same
connection:
    {"op": "spawn", "source", "filename", "args", "grants", "limits", "attach"}
        -> {"event": "started", "lip": id} then, if attached, the LIP's events:
           {"event": "out"|"stdout"|"stderr", "data"}, {"event": "exit", "status", "reason"}
    {"op": "input", "lip", "data"} / {"op": "input", "lip", "eof": true}
    {"op": "kill", "lip"}, {"op": "ps"}, {"op": "kv_ls", "path"}, {"op": "kv_rm", "path"},
    {"op": "kv_stat", "path"}, {"op": "stats"}, {"op": "shutdown"} (root only)
The caller's user is the peer's Unix user (SO_PEERCRED); root may act as any
user by naming it in the request.
"""
from __future__ import annotations

import asyncio
import logging
import os
import pwd
import re
import secrets
import signal
import socket
import struct
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Optional

import orjson

from symphony.sched import admit
from .capabilities import Capabilities, CapPolicy, Identity, identity_for
from symphony.kvfs import KVFS, KVFSError, Principal
from .limits import LimitPolicy
from symphony.ipc.protocol import ProtocolError, default_socket_path, encode_frame, read_frame  # noqa: F401
from .identity import UidPool, check_caller
from symphony.ipc.kernel_side import KernelSide
from symphony.ipc.wait import WaitSet
from .io_calls import MAX_MESSAGE_BYTES, MAX_QUEUED_OUTPUT
from .proc import LipProc
from .syscalls import SyscallServer

log = logging.getLogger("symphony.kernel")

MAX_SOURCE = 4 << 20
_USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,31}")


class Kernel:
    def __init__(self, engine, fs: KVFS, socket_path: str, *, max_lips: int = 256,
                 n_slots: int = 8, arena_rows: int = 8, default_limits: Optional[dict] = None,
                 token_budget: Optional[int] = None, policy: Optional[LimitPolicy] = None,
                 max_queued_output: int = MAX_QUEUED_OUTPUT, cap_policy: Optional[CapPolicy] = None,
                 lip_uids: Optional[tuple[int, int]] = None, test_hooks: bool = False):
        """``policy``: the administrator's ceilings and defaults (limits.py; by
        default the stock ones, with ``default_limits`` as defaults).
        ``max_queued_output``: bytes of one LIP's output the kernel holds for
        its client (or keeps for a detached LIP) before its send() waits."""
        self.engine, self.fs, self.socket_path = engine, fs, socket_path
        self.max_lips, self.n_slots = max_lips, n_slots
        self.arena_bytes = arena_rows * engine.model_config.vocab_size * 4
        self.policy = policy or LimitPolicy(defaults=dict(default_limits or {}),
                                            max_lips_per_user=max(1, max_lips // 4))
        self.max_queued_output = max_queued_output
        self.instance = secrets.token_hex(4)
        self.prefix = f"sym{self.instance}"
        self.waitset = WaitSet()
        self.uids = UidPool(*lip_uids) if lip_uids else UidPool()
        self.caps = Capabilities(cap_policy, MAX_MESSAGE_BYTES)       # capabilities under the admin's policy
        self.sys = SyscallServer(engine, fs, self.waitset, self._emit_threadsafe, self._kill_threadsafe,
                                 max_batch_tokens=token_budget, caps=self.caps,
                                 max_queued_output=max_queued_output, on_fatal=self._fail_threadsafe)
        self.test_hooks = test_hooks          # --test-hooks: fault-injection ops for the fault tests
        self.fatal: Optional[str] = None      # why the kernel is going down after a failure
        self.reaping: set = set()             # exit reported, syscall thread still reclaiming
        self.lips: dict[int, LipProc] = {}
        self.finished: deque = deque(maxlen=100)
        self.by_pid: dict[int, LipProc] = {}
        self.watchers: dict[int, set] = {}
        self.kill_reason: dict[int, str] = {}
        self.history: dict[int, deque] = {}            # a detached LIP's output: (bytes, event), oldest dropped
        self.history_bytes: dict[int, int] = {}
        self.owed: dict[int, int] = {}                 # output bytes written to clients, not yet credited
        self._flushing: set[int] = set()
        self.next_id = 1
        self.zygote = None
        self.stopping: Optional[asyncio.Event] = None

    # ================================================================== lifecycle
    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.loop.set_exception_handler(self._loop_exception)
        self.stopping = asyncio.Event()
        self.reports: asyncio.Queue = asyncio.Queue()     # zygote reports, in order, for _process_reports
        self.tasks: list = []
        self._tokfile = tempfile.NamedTemporaryFile("w", suffix=".json", prefix="symphony-tok-", delete=False)
        self._tokfile.write(self.engine.tokenizer.to_json())
        self._tokfile.close()
        if not self.uids.can_switch:
            msg = (f"not running as root: cannot give LIPs identities of their own; every LIP runs as "
                   f"uid {self.uids.kernel_uid} and only uid {self.uids.kernel_uid} may start LIPs")
            log.warning(msg)
            print(f"symphony-kernel: {msg}", file=sys.stderr, flush=True)
        else:
            log.info("LIPs run as uids %d-%d", self.uids.first, self.uids.last)
        from .zygote import BASE_ENV
        env = dict(BASE_ENV)                           # never the kernel's own environment
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2])] +
                                            ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
        self._chan, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._chan.setblocking(False)
        self.zygote = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "symphony.kernel.zygote", self._tokfile.name, str(child.fileno()),
            str(os.getpid()), stdin=asyncio.subprocess.DEVNULL, pass_fds=(child.fileno(),), env=env)
        child.close()
        first = await asyncio.wait_for(self.loop.sock_recv(self._chan, 1 << 16), 60)
        if b"ready" not in first:
            raise RuntimeError(f"the zygote did not start: {first!r}")
        self._zy_task = self._supervise("zygote reader", self._read_zygote)
        self._supervise("process table", self._process_reports)
        self.sys.thread.start()
        self._supervise("syscall thread watchdog", self._watch_syscall_thread)
        if os.path.exists(self.socket_path):
            if _socket_alive(self.socket_path):
                raise RuntimeError(f"another kernel is serving {self.socket_path}")
            os.unlink(self.socket_path)
        self.server = await asyncio.start_unix_server(self._client, path=self.socket_path)
        os.chmod(self.socket_path, 0o666)       # any local user may connect; SO_PEERCRED says who
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.stopping.set)
        self._supervise("socket server", self._watch_server)
        log.info("kernel %s ready on %s (zygote pid %d)", self.instance, self.socket_path, self.zygote.pid)
        print(f"symphony-kernel: ready on {self.socket_path}", file=sys.stderr, flush=True)
        await self.stopping.wait()
        await self.shutdown()
        if self.fatal:
            raise RuntimeError(f"the kernel stopped after a failure: {self.fatal}")

    async def shutdown(self) -> None:
        """Stop cleanly: kill every LIP (each client gets its exit event with the
        reason), sync durable files, stop the syscall thread and the zygote,
        unlink every shared-memory name.  Also the path of `_fail_loudly`."""
        log.info("shutting down: stopping %d LIPs", len(self.lips))
        self.server.close()
        why = f"killed: the kernel failed ({self.fatal})" if self.fatal else "kernel shutting down"
        for lip in list(self.lips.values()):
            self._kill(lip.id, why)
        deadline = time.monotonic() + 3
        while self.lips and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for lip_id in list(self.lips):                     # never reported: reclaim anyway
            self._reclaim(lip_id, -9, 9)
        healthy = await self._drain_reaping(10)
        from symphony.kvfs.store import write_durable
        synced = None
        if healthy:
            try:
                synced = await asyncio.wait_for(self.sys_call(
                    lambda: [write_durable(self.fs, i) for i in list(self.fs.inodes.values())
                             if i.durable and i.linked]), 60)
            except Exception as e:                        # noqa: BLE001 - report, go on stopping
                log.error("durable KV files NOT synced at shutdown: %s: %s", type(e).__name__, e)
        else:
            log.error("durable KV files NOT synced at shutdown: the syscall thread does not answer")
        self.sys.stop.set()
        self.waitset.ring()
        self.sys.thread.join(5)
        if self.sys.thread.is_alive():                     # hung: only unlink names, touch nothing it owns
            log.error("the syscall thread did not stop; unlinking the LIPs' shared memory anyway")
            for lip in list(self.sys.lips.values()):
                lip.ring.unlink()
        else:
            for lip_id in list(self.sys.lips):             # reclaims that never ran
                self.sys.remove(lip_id)
            self.fs.close_all()
        for t in self.tasks:
            t.cancel()
        try:
            await self._zy_send(b'{"cmd": "exit"}', [])
            await asyncio.wait_for(self.zygote.wait(), 3)
        except Exception:
            if self.zygote.returncode is None:          # dead already (e.g. it crashed): nothing to kill
                self.zygote.kill()
        self._chan.close()
        self.waitset.close()
        for p in (self.socket_path, self._tokfile.name):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        log.info("kernel stopped (%d durable KV files synced)", len(synced or []))

    # ================================================================== LIPs
    async def spawn(self, user: str, msg: dict, watcher=None, owner: Optional[Identity] = None,
                    caller_uid: Optional[int] = None) -> LipProc:
        source, filename, args = msg.get("source"), msg.get("filename", "lip.py"), msg.get("args", [])
        if not isinstance(source, str) or len(source) > MAX_SOURCE:
            raise ValueError(f"source must be a string of at most {MAX_SOURCE} bytes")
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ValueError("args must be a list of strings")
        if caller_uid is not None:
            check_caller(self.uids.kernel_uid, caller_uid, self.uids.can_switch)
        free = self.engine.kv.allocator.num_free + self.fs.pager.free_slots()
        ok, why = admit(len(self.lips), self.max_lips, free, pages_reserve=1)
        if not ok:
            raise ValueError(f"LIP not admitted: {why}")
        priority = self.policy.priority_for(user, msg.get("priority", "normal"))
        grants = self.caps.policy.check_grants(msg.get("grants") or {}, owner)
        limits = self.policy.limits_for(msg.get("limits"))
        self.policy.check_count(user, sum(1 for l in self.lips.values() if l.user == user))
        lip_id = self.next_id
        uid = self.uids.allocate(lip_id)               # IdentityError when the range is full
        self.next_id += 1
        try:
            ring = KernelSide.create(f"{self.prefix}_{lip_id}", n_slots=self.n_slots,
                                     arena_bytes=self.arena_bytes, waitset=self.waitset)
        except BaseException:
            self.uids.release(lip_id)
            raise
        lip = LipProc(lip_id, user, str(filename)[:200], args, ring, grants, limits)
        lip.priority = priority
        lip.owner_uid, lip.owner_gid, lip.owner_groups = owner or (-1, -1, ())   # file capabilities' identity
        lip.state = "running"
        self.lips[lip_id] = lip
        self.sys.submit(lambda: self.sys.add(lip))     # queued before the zygote forks: FIFO, never blocks the loop
        if watcher is not None:                        # before the fork: no early output is lost
            self.watchers.setdefault(lip_id, set()).add(watcher)
        # the program travels in a memfd only the worker reads; the zygote sees ids and fds
        prog = os.memfd_create(f"lip{lip_id}", os.MFD_CLOEXEC)
        try:
            data = orjson.dumps({"source": source, "filename": lip.filename, "args": args})
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
        log.info("LIP %d spawned: %s %s (user %s)", lip_id, lip.filename, " ".join(args)[:80], user)
        return lip

    def _kill(self, lip_id: int, reason: str) -> bool:
        lip = self.lips.get(lip_id)
        if lip is None:
            return False
        if lip_id in self.reaping:                     # already dead; its pid may be reused
            return True
        self.kill_reason.setdefault(lip_id, reason)
        if lip.pid:
            try:
                os.kill(lip.pid, signal.SIGKILL)
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
        """The one owner of the process table's spawn/exit transitions: applies
        the zygote's reports in order.  Never blocks: an exit's reclaim runs on
        the syscall thread and the exit event goes out when it is done."""
        while True:
            msg = await self.reports.get()
            if "spawned" in msg:
                lip = self.lips.get(msg["spawned"])
                if lip is not None and isinstance(msg.get("pid"), int):
                    lip.pid = msg["pid"]
                    self.by_pid[lip.pid] = lip
                    if lip.id in self.kill_reason:
                        self._kill(lip.id, self.kill_reason[lip.id])
            elif "exited" in msg:
                self.uids.release(msg["exited"])           # the worker is reaped: its uid is free
                self._reclaim(msg["exited"], msg.get("status", -1), msg.get("signal", 0))
            else:
                log.error("unknown zygote report %r", msg)

    def _reclaim(self, lip_id: int, status: int, sig: int) -> None:
        """The LIP's process is gone: mark it, have the syscall thread reclaim
        its files and ring, then send the exit event (`_reclaimed`)."""
        lip = self.lips.get(lip_id)
        if lip is None or lip_id in self.reaping:
            return
        self.reaping.add(lip_id)
        lip.state = "exiting"
        self.by_pid.pop(lip.pid, None)
        fut = self.sys.call_future(lambda: self.sys.remove(lip_id))
        fut.add_done_callback(lambda f: self.loop.call_soon_threadsafe(self._reclaimed, lip, status, sig, f))

    def _reclaimed(self, lip: LipProc, status: int, sig: int, fut) -> None:
        lip_id = lip.id
        if lip_id not in self.reaping:                 # already told (shutdown gave up waiting)
            return
        self.reaping.discard(lip_id)
        self.lips.pop(lip_id, None)
        if not fut.cancelled() and fut.exception() is not None:
            log.error("LIP %d: reclaim failed: %r", lip_id, fut.exception())
        reason = self.kill_reason.pop(lip_id, None)
        if reason is None:
            reason = {0: "finished", 1: "error"}.get(status, f"exit status {status}") if sig == 0 else \
                {signal.SIGXCPU: "killed: CPU time limit exceeded", signal.SIGKILL: "killed",
                 signal.SIGSEGV: "crashed (segmentation fault)",
                 signal.SIGSYS: "killed by the sandbox (forbidden system call)"}.get(sig, f"killed by signal {sig}")
        lip.state = "exited"
        event = {"event": "exit", "lip": lip_id, "status": status if sig == 0 else 128 + sig, "reason": reason}
        log.info("LIP %d exited: %s (%s); %d calls, %d preds", lip_id, event["status"], reason, lip.calls, lip.preds)
        self._deliver(lip_id, event)
        self.finished.append((lip, event))
        self.watchers.pop(lip_id, None)
        self.history.pop(lip_id, None)                 # a detached LIP's unread output goes with it
        self.history_bytes.pop(lip_id, None)
        self.owed.pop(lip_id, None)

    # ================================================================== events
    # ================================================================== supervision
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
            print(f"symphony-kernel: FATAL: {why}; shutting down", file=sys.stderr, flush=True)
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

    async def _drain_reaping(self, timeout: float) -> bool:
        """Wait until every pending reclaim is done; False if the syscall
        thread did not get to them in ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self.reaping and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.reaping:
            for lip_id in list(self.reaping):            # tell their clients anyway
                lip = self.lips.pop(lip_id, None)
                self.reaping.discard(lip_id)
                if lip is not None:
                    self._deliver(lip_id, {"event": "exit", "lip": lip_id, "status": 128 + 9,
                                           "reason": self.kill_reason.pop(lip_id, "killed") +
                                           " (not reclaimed: the syscall thread did not answer)"})
            return False
        return True

    def _emit_threadsafe(self, lip_id: int, event: dict) -> None:
        self.loop.call_soon_threadsafe(self._deliver, lip_id, event)

    def _deliver(self, lip_id: int, event: dict) -> None:
        """Write a LIP's event to its clients.  Output events ("out", "stdout",
        "stderr") were counted by the syscall thread; their bytes are credited
        back once the clients' transports have taken them (`_flush`), so a
        client that does not read stops its LIP's send() instead of growing the
        kernel.  With no client, the event is kept in a history bounded by
        bytes (oldest dropped) and credited at once."""
        frame = encode_frame(event)
        counted = event.get("event") in ("out", "stdout", "stderr")
        ws = self.watchers.get(lip_id)
        if ws:
            for w in [w for w in ws if w.is_closing()]:
                ws.discard(w)
        if not ws:
            h = self.history.setdefault(lip_id, deque())
            h.append((len(frame), event))
            size = self.history_bytes.get(lip_id, 0) + len(frame)
            while size > self.max_queued_output and len(h) > 1:
                size -= h.popleft()[0]
            self.history_bytes[lip_id] = size
            if counted:
                self._credit(lip_id, len(frame))
            return
        for w in ws:
            w.write(frame)
        if counted:
            self.owed[lip_id] = self.owed.get(lip_id, 0) + len(frame)
            if lip_id not in self._flushing:
                self._flushing.add(lip_id)
                self.loop.create_task(self._flush(lip_id))

    async def _flush(self, lip_id: int) -> None:
        """Wait until the LIP's clients have taken what was written to them
        (their transports are below the high-water mark), then credit it."""
        try:
            while self.owed.get(lip_id):
                n = self.owed[lip_id]
                for w in list(self.watchers.get(lip_id, ())):
                    try:
                        await w.drain()
                    except Exception:                  # the client went away: nothing more to wait for
                        self.watchers.get(lip_id, set()).discard(w)
                if lip_id not in self.owed:
                    return                             # the LIP was reclaimed meanwhile
                self.owed[lip_id] -= n
                self._credit(lip_id, n)
        finally:
            self._flushing.discard(lip_id)

    def _credit(self, lip_id: int, n: int) -> None:
        self.sys.submit(lambda: self.sys.credit_output(lip_id, n))

    # ================================================================== clients
    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        uid = _peer_uid(writer)
        attached: set[int] = set()
        try:
            while True:
                try:
                    msg = await read_frame(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    break
                try:
                    reply = await self._request(uid, msg, writer, attached)
                except (ValueError, KVFSError, PermissionError, TimeoutError) as e:
                    reply = {"error": getattr(e, "code", "EINVAL"), "type": type(e).__name__, "message": str(e)}
                except Exception as e:                     # a kernel bug: fail this request only
                    log.exception("client request %r failed", msg.get("op") if isinstance(msg, dict) else None)
                    reply = {"error": "EIO", "type": "InternalError", "message": f"internal error: {e!r}"}
                if reply is not None:
                    writer.write(encode_frame(reply))
                    await writer.drain()
        except ProtocolError as e:
            log.warning("client protocol error: %s", e)
        finally:
            for lip_id in attached:                        # a session's LIPs end with it
                self._kill(lip_id, "killed: the client that ran it disconnected")
            writer.close()

    async def _request(self, uid: int, msg: dict, writer, attached: set) -> Optional[dict]:
        op = msg.get("op")
        user = _user_for(uid, msg.get("user"))
        if op == "spawn":
            attach = msg.get("attach", True)
            lip = await self.spawn(user, msg, watcher=writer if attach else None, caller_uid=uid,
                                   owner=identity_for(uid, user, acting=msg.get("user") is not None))
            if attach:
                attached.add(lip.id)
            return {"event": "started", "lip": lip.id}
        if op == "input":
            lip = self._own(uid, user, msg.get("lip"))
            data = None if msg.get("eof") else msg.get("data")
            if data is not None and not isinstance(data, str):
                raise ValueError("input data must be a string")
            self.sys.submit(lambda: self.sys.give_input(lip.id, data))
            return None
        if op == "kill":
            lip = self._own(uid, user, msg.get("lip"))
            self._kill(lip.id, f"killed by {user}")
            return {"ok": True, "lip": lip.id}
        if op == "ps":                                 # others' LIPs without their arguments
            admin = uid == 0 and msg.get("user") is None   # root acting as a user sees what that user sees
            full = lambda l: admin or l.user == user  # noqa: E731
            return {"lips": [self._ps(l, full(l)) for l in self.lips.values()],
                    "finished": [dict(self._ps(l, full(l)), **e) for l, e in list(self.finished)[-20:]]}
        if op == "stats":
            s = self.sys
            e = self.engine.stats
            return {"lips": len(self.lips), "batches": s.batches, "batch_calls": s.batch_calls,
                    "max_batch": s.max_batch, "forward_passes": e.forward_passes, "pred_calls": e.pred_calls,
                    "engine_max_batch": e.max_batch_calls, "kv_pages_used": self.engine.kv.allocator.num_used,
                    "kv_pages_total": self.engine.kv.allocator.capacity, "instance": self.instance,
                    "output_queued_bytes": sum(self.owed.values()) + sum(self.history_bytes.values()),
                    "pending_reply_bytes": sum(l.replies.total for l in list(self.lips.values()))}
        who = Principal(user, 0)
        if op == "kv_ls":
            return {"entries": await self.sys_call(lambda: self.fs.list(who, msg.get("path") or "/"))}
        if op == "kv_stat":
            return await self.sys_call(lambda: self.fs.stat(who, msg.get("path")))
        if op == "kv_rm":
            await self.sys_call(lambda: self.fs.remove(who, msg.get("path")))
            return {"ok": True}
        if op == "test_hook" and self.test_hooks:
            return self._test_hook(uid, msg)
        if op == "shutdown":
            if uid != 0:
                raise PermissionError("only root may shut the kernel down")
            self.stopping.set()
            return {"ok": True}
        raise ValueError(f"unknown op {op!r}")

    def _test_hook(self, uid: int, msg: dict) -> dict:
        """Fault injection, only with --test-hooks, root only:
        {"hook": "stall", "seconds": s}: hold the syscall thread s seconds;
        {"hook": "syscall_crash"}: an unexpected exception in its loop."""
        if uid != 0:
            raise PermissionError("test hooks are root only")
        hook = msg.get("hook")
        if hook == "stall":
            secs = msg.get("seconds")
            if not isinstance(secs, (int, float)) or isinstance(secs, bool) or not 0 <= secs <= 600:
                raise ValueError("seconds must be a number in [0, 600]")
            self.sys.submit(lambda: time.sleep(secs))
        elif hook == "syscall_crash":
            self.sys.inject_fault()
        else:
            raise ValueError(f"unknown test hook {hook!r}")
        return {"ok": True}

    def _own(self, uid: int, user: str, lip_id) -> LipProc:
        lip = self.lips.get(lip_id) if isinstance(lip_id, int) else None
        if lip is None:
            raise ValueError(f"no running LIP {lip_id!r}")
        if uid != 0 and lip.user != user:
            raise PermissionError(f"LIP {lip_id} belongs to {lip.user}")
        return lip

    @staticmethod
    def _ps(l: LipProc, full: bool = True) -> dict:
        """A LIP as `ps` shows it; ``full`` False (another user's LIP): without
        its arguments (prompts, paths) and limits; the program's file name stays,
        like a process's name in ps."""
        d = {"lip": l.id, "user": l.user, "file": l.filename, "state": l.state, "priority": l.priority,
             "pid": l.pid, "started": l.started, "calls": l.calls, "preds": l.preds, "tokens": l.tokens}
        if full:
            d["args"], d["limits"] = l.args, l.limits
        return d


# ---------------------------------------------------------------- helpers
def _peer_uid(writer) -> int:
    sock = writer.get_extra_info("socket")
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def _user_for(uid: int, asked) -> str:
    if asked is not None:
        if uid != 0:
            try:
                own = pwd.getpwuid(uid).pw_name
            except KeyError:
                own = f"uid{uid}"
            if asked != own:
                raise PermissionError("only root may act as another user")
        if not isinstance(asked, str) or not _USER_RE.fullmatch(asked):
            raise ValueError(f"bad user name {asked!r}")
        return asked
    try:
        name = pwd.getpwuid(uid).pw_name.lower()
    except KeyError:
        name = f"uid{uid}"
    return name if _USER_RE.fullmatch(name) else f"uid{uid}"




def _socket_alive(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()
