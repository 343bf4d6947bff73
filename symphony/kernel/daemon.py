"""symphony-kernel: the kernel daemon.

    main thread   asyncio (uvloop) event loop: the Unix-socket program RPC,
                  the zygote's pipe, LIP lifecycles, output streaming
    syscall thread `syscalls.SyscallServer`: owns the engine and KVFS, serves
                  every LIP's shared-memory ring, runs the forward passes
    zygote        `zygote.py`: forks one sandboxed worker per LIP

Client requests (framed JSON, see `protocol.py`), each answered on the same
connection, are declared once as types in ipc/rpc.py (spawn, input, kill, ps,
stats, kv_ls, kv_stat, kv_rm, kv_export, kv_import, kv_adopt, drain, shutdown;
the reference: docs/reference/client-rpc.md).  The caller's user is the peer's
Unix user (SO_PEERCRED); root may act as any user by naming it in the request;
over TCP (``--listen``, remote.py) an authenticated remote gateway acts for the
user it names.

The Kernel is a composition root: it builds these parts, each owning its
state and given its collaborators in its constructor, and wires them:
    supervisor.py  Supervision: supervised tasks, watchdogs, the stop, loud failure
    output.py      OutputStreams: LIP output to clients, with back-pressure
    launcher.py    Launcher: the zygote and its channel; an admitted LIP's start
    admission.py   AdmissionControl: the admission queue and what waits in it
                   (policy: sched/admission.py)
    lifecycle.py   LipLifecycle: spawn, input, kill, reclaim (drives the
                   process table, proctable.py)
    status.py      KernelStatus: `ps` and `stats`, from published snapshots
    sessions.py    ClientSessions: the client RPC server
beside the event loop's process table (proctable.py), connection table
(bounds.py: connections and partial frames per user), unread input per LIP
(inflow.py) and CPU governor (cpu.py).  Who is given whom:
    Supervision()
    OutputStreams(inflow, credit)             credit: a command to the syscall thread
    SyscallServer(..., deliver, kill, on_fatal, on_input_read)
                                              each run on the event loop
                                              (`call_soon_threadsafe`)
    Launcher(procs, sys, uids, supervision)
    AdmissionControl(procs, sys, output, stopping, start=Launcher.start)
    LipLifecycle(procs, admission, launcher, output, sys, uids, caps, policy)
    KernelStatus(procs, admission, sys, output, inflow, conns)
    ClientSessions(lifecycle, status, conns, inflow, sys, fs, stopping)
The process table's transitions are made by admission (queue, drop),
the launcher (admit) and the lifecycle (started, kill, exit, reclaim).
One owner per state: the event loop owns the process table and the clients'
streams; the syscall thread owns the engine, KVFS and what it serves of each
LIP (proc.py).  Each reads only the snapshots the other publishes
(snapshot.py) and asks the other for changes by message.
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
import sys
import time
from typing import Optional

from symphony.ipc.wait import WaitSet
from symphony.kvfs import KVFS
from symphony.sched.admission import AdmissionLimits

from symphony.kernel import heap
from symphony.kernel.loop.admission import AdmissionControl
from symphony.kernel.loop.bounds import FD_RESERVE, ClientBounds, Connections, open_file_limit
from symphony.kernel.capabilities import Capabilities, CapPolicy
from symphony.kernel.loop.cpu import CHECK_EVERY_S, CpuGovernor
from symphony.kernel.identity import UidPool
from symphony.kernel.loop.inflow import InputFlow
from symphony.kernel.syscall.calls.messages import MAX_MESSAGE_BYTES, MAX_QUEUED_OUTPUT
from symphony.kernel.loop.launcher import Launcher
from symphony.kernel.loop.lifecycle import LipLifecycle
from symphony.kernel.loop.limits import LimitPolicy
from symphony.kernel.loop.output import OutputStreams
from symphony.kernel.syscall.proc import ServedLips
from symphony.kernel.loop.proctable import ProcessTable
from symphony.kernel.syscall.residency import KV_WAIT_S
from symphony.kernel.loop.sessions import REMOTE_UID, ClientSessions
from symphony.kernel.loop.transfer import KvTransfers
from symphony.kernel.states import LipState
from symphony.kernel.loop.status import KernelStatus
from symphony.kernel.loop.supervisor import Supervision
from symphony.kernel.syscall.server import SyscallServer

log = logging.getLogger("symphony.kernel")

LISTEN_BACKLOG = 1024       # connections waiting for accept (a flood of them is refused after accept)
BUSY_CPU = 0.1              # a LIP computing more of a core than this is demoted (cpu.py)


class Kernel:
    """The kernel daemon (see the module docstring): builds its parts, serves, shuts down."""

    def __init__(self, engine, fs: KVFS, socket_path: str, *, served: ServedLips, max_lips: int = 256,
                 n_slots: int = 8, arena_rows: int = 8, default_limits: Optional[dict] = None,
                 token_budget: Optional[int] = None, policy: Optional[LimitPolicy] = None,
                 max_queued_output: int = MAX_QUEUED_OUTPUT, cap_policy: Optional[CapPolicy] = None,
                 lip_uids: Optional[tuple[int, int]] = None, test_hooks: bool = False,
                 admission: Optional[AdmissionLimits] = None, kv_wait_s: float = KV_WAIT_S,
                 compute_threads: Optional[int] = None, bounds: Optional[ClientBounds] = None,
                 lip_nice: int = 0, lip_busy_cpu: float = BUSY_CPU, gateway: Optional[dict] = None,
                 overlap: bool = True, listen=None, peer_durable_dirs: tuple = ()):
        """``served``: the syscall thread's LIP set, the one ``fs`` was built
        with (``KVFS(..., evict_first=served.swap_out_first, pinned=served.running_ids)``).
        ``policy``: the administrator's ceilings and defaults (limits.py; by
        default the stock ones, with ``default_limits`` as defaults).
        ``max_queued_output``: bytes of one LIP's output the kernel holds for
        its client (or keeps for a detached LIP) before its send() waits.
        ``admission``: the admission queue's bounds and default KV estimate.
        ``kv_wait_s``: how long calls may all wait for device pages that
        cannot move before one LIP gets NoSpace (kernel/syscall/residency.py).
        ``compute_threads``: torch's CPU threads for the thread that runs the model
        (None: leave torch's setting as it is).  ``overlap``: that thread is a device
        thread of its own, while the syscall thread serves on (False: the syscall thread).
        ``bounds``: what one client or user may make the kernel hold (bounds.py).
        ``lip_nice``: the nice value LIP workers start with (0..19); ``lip_busy_cpu``:
        the share of a core above which one is demoted (cpu.py; 0: never).
        ``gateway``: {"http": "HOST:PORT", "uid": UID or None, "argv": [...]}
        to start the HTTP gateway once ready (gateway_proc.py); ``uid``: the
        uid it serves as, trusted to act for any user but root (None: a free
        uid of the LIP range on a root kernel, the kernel's own otherwise).
        ``listen``: a `remote.ListenConfig` to serve remote gateways over TCP too;
        ``peer_durable_dirs``: other kernels' durable directories whose files
        this one may adopt (transfer.py)."""
        if fs.evict_first != served.swap_out_first or fs.pinned != served.running_ids:
            raise ValueError("fs must be built with evict_first=served.swap_out_first and "
                             "pinned=served.running_ids (a running LIP loses pages only whole)")
        if not isinstance(lip_nice, int) or not 0 <= lip_nice <= 19:
            raise ValueError(f"lip_nice must be an int in [0, 19], got {lip_nice!r}")
        self.engine, self.fs, self.socket_path = engine, fs, socket_path
        self.max_lips = max_lips
        policy = policy or LimitPolicy(defaults=dict(default_limits or {}), max_lips_per_user=max(1, max_lips // 4))
        self.instance = secrets.token_hex(4)
        self.waitset = WaitSet()
        self.uids = UidPool(*lip_uids) if lip_uids else UidPool()
        caps = Capabilities(cap_policy, MAX_MESSAGE_BYTES)         # capabilities under the admin's policy
        self.bounds = bounds = bounds or ClientBounds()
        self.cpu = CpuGovernor(lip_busy_cpu, lip_nice, can_restore=os.geteuid() == 0)
        self.inflow = InputFlow(bounds.max_input_bytes)            # unread input per LIP
        self.conns = Connections(bounds, 0)                        # connections (total set in serve)
        self.loop: Optional[asyncio.AbstractEventLoop] = None      # set by serve
        self.supervision = Supervision()
        self.procs = ProcessTable()
        self.output = OutputStreams(self.inflow, max_queued_output, self._credit_output)
        self.sys = SyscallServer(engine, fs, self.waitset, self._threadsafe(self.output.deliver),
                                 self._threadsafe(self._kill),
                                 max_batch_tokens=token_budget, caps=caps,
                                 max_queued_output=max_queued_output,
                                 on_fatal=self._threadsafe(self.supervision.fail_loudly),
                                 lips=served, kv_wait_s=kv_wait_s, compute_threads=compute_threads,
                                 on_input_read=self._threadsafe(self.inflow.taken), overlap=overlap)
        self.launcher = Launcher(self.procs, self.sys, self.uids, self.supervision, prefix=f"sym{self.instance}",
                                 n_slots=n_slots, arena_bytes=arena_rows * engine.model_config.vocab_size * 4,
                                 waitset=self.waitset, lip_nice=lip_nice)
        self.admission = AdmissionControl(admission or AdmissionLimits(), self.procs, self.sys, policy, self.output,
                                          self.supervision.stopping, self.launcher.start, max_lips=max_lips,
                                          quotas=fs.quotas, device_pages=engine.kv.allocator.capacity,
                                          page_size=engine.page_size)
        self.lifecycle = LipLifecycle(self.procs, self.admission, self.launcher, self.output, self.sys, self.uids,
                                      caps, policy, bounds)
        self.status = KernelStatus(self.procs, self.admission, self.sys, self.output, self.inflow, self.conns,
                                   engine, self.instance)
        self.gateway_spec = gateway
        self.gateway_uid: Optional[int] = None
        self.gateway = None                   # gateway_proc.GatewayProcess, once started
        if gateway is not None:
            uid = gateway.get("uid")
            if uid is None:
                uid = self.uids.allocate(-1) if self.uids.can_switch else self.uids.kernel_uid
            self.gateway_uid = uid
            self.conns.exempt = frozenset({uid})      # one connection per LIP, for many users
        self.listen = listen
        if listen is not None:                        # remote gateways: one connection per LIP, many users
            self.conns.exempt = self.conns.exempt | {REMOTE_UID}
        self.sessions = ClientSessions(self.lifecycle, self.status, self.conns, self.inflow, self.sys, fs,
                                       self.supervision.stopping, bounds=bounds, kernel_uid=self.uids.kernel_uid,
                                       gateway_uid=self.gateway_uid, test_hooks=test_hooks,
                                       transfers=KvTransfers(self.sys, fs, self.conns, peer_durable_dirs))
        self.server = None                    # the Unix-socket server, once serving
        self.remote = None                    # remote.RemoteListener, once serving (with listen)

    @property
    def stopping(self) -> asyncio.Event:
        """Set when the kernel is going down (supervisor.py)."""
        return self.supervision.stopping

    @property
    def fatal(self) -> Optional[str]:
        """Why the kernel is going down after a failure (None: it is not, or cleanly)."""
        return self.supervision.fatal

    async def serve(self) -> None:
        """Start the zygote, the syscall thread and the socket server; serve
        until SIGTERM/SIGINT, a root `shutdown` request or a fatal failure;
        then `shutdown`.  RuntimeError if it stopped after a failure."""
        self.loop = loop = asyncio.get_running_loop()
        loop.set_exception_handler(Supervision.loop_exception)
        sup = self.supervision
        if not self.uids.can_switch:
            msg = (f"not running as root: cannot give LIPs identities of their own; every LIP runs as "
                   f"uid {self.uids.kernel_uid} and only uid {self.uids.kernel_uid} may start LIPs")
            log.warning(msg)
            print(f"symphony-kernel: {msg}", file=sys.stderr, flush=True)
        else:
            log.info("LIPs run as uids %d-%d", self.uids.first, self.uids.last)
        await self.launcher.open(self.engine.tokenizer.to_json())
        sup.supervise("zygote reader", self.launcher.read_reports)
        sup.supervise("process table", self.lifecycle.process_reports)
        sup.supervise("admission queue", self.admission.watch)
        if self.cpu.busy:
            sup.supervise("LIP CPU governor", self._watch_cpu)
        heap.settle("kernel", heap.KERNEL_YOUNG)        # start-up is over: no full collection walks it again
        self.sys.thread.start()
        sup.watchdog("syscall thread watchdog", self.sys.thread.is_alive, "the syscall thread died")
        if getattr(self.engine, "tp", None) is not None:
            sup.supervise("tensor-parallel ranks", self._watch_ranks)
        nofile = open_file_limit()                     # the soft limit raised to the hard one
        total = self.bounds.max_connections or max(2 * self.bounds.root_connections,
                                                   nofile - FD_RESERVE - 2 * self.max_lips)
        self.conns.total = total
        log.info("client connections: at most %d (%d per user, the last %d root's; open-file limit %d)",
                 total, self.bounds.max_connections_per_user, self.bounds.root_connections, nofile)
        if os.path.exists(self.socket_path):
            if _socket_alive(self.socket_path):
                raise RuntimeError(f"another kernel is serving {self.socket_path}")
            os.unlink(self.socket_path)
        self.server = await asyncio.start_unix_server(self.sessions.serve_client, path=self.socket_path,
                                                      backlog=LISTEN_BACKLOG)
        os.chmod(self.socket_path, 0o666)       # any local user may connect; SO_PEERCRED says who
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, sup.stopping.set)
        sup.watchdog("socket server", self.server.is_serving, "the socket server stopped serving")
        if self.listen is not None:
            from symphony.kernel.loop.remote import RemoteListener
            self.remote = RemoteListener(self.listen, self.sessions.serve_client)
            addr = await self.remote.start()
            sup.watchdog("TCP listener", self.remote.is_serving, "the TCP listener stopped serving")
            log.info("listening for remote gateways on %s", addr)
            print(f"symphony-kernel: listening on {addr}", file=sys.stderr, flush=True)
        log.info("kernel %s ready on %s (zygote pid %d)", self.instance, self.socket_path, self.launcher.zygote.pid)
        print(f"symphony-kernel: ready on {self.socket_path}", file=sys.stderr, flush=True)
        if self.gateway_spec is not None and self.gateway_spec.get("http"):
            from symphony.kernel.loop.gateway_proc import GatewayProcess
            g = self.gateway_spec
            self.gateway = GatewayProcess(g["http"], self.socket_path,
                                          self.gateway_uid if os.geteuid() == 0 else None, g.get("argv", []))
            log.info("starting the HTTP gateway on %s (serving as uid %d)", g["http"], self.gateway_uid)
            self.gateway.start(dict(os.environ))
        await sup.stopping.wait()
        await self.shutdown()
        if self.fatal:
            raise RuntimeError(f"the kernel stopped after a failure: {self.fatal}")

    async def shutdown(self) -> None:
        """Stop cleanly: kill every LIP (each client gets its exit event with the
        reason), sync durable files, stop the syscall thread and the zygote,
        unlink every shared-memory name.  Also the path of a loud failure."""
        log.info("shutting down: stopping %d LIPs", len(self.procs))
        if self.gateway is not None:
            await self.gateway.stop()
        self.server.close()
        if self.remote is not None:
            self.remote.close()
        why = f"killed: the kernel failed ({self.fatal})" if self.fatal else "kernel shutting down"
        for e in self.procs:
            self._kill(e.id, why)
        deadline = time.monotonic() + 3
        while len(self.procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        rings = [e.ring for e in self.procs]               # to unlink if the syscall thread hangs
        for e in self.procs:                               # never reported: reclaim anyway
            self.lifecycle.reclaim(e.id, -9, 9)
        healthy = await self.lifecycle.drain_reaping(10)
        from symphony.kvfs.store import write_durable
        synced = None
        if healthy:
            try:
                synced = await asyncio.wait_for(asyncio.wrap_future(self.sys.call_future(
                    lambda: [write_durable(self.fs, i) for i in list(self.fs.inodes.values())
                             if i.durable and i.linked])), 60)
            except Exception as e:                        # noqa: BLE001 - report, go on stopping
                log.error("durable KV files NOT synced at shutdown: %s: %s", type(e).__name__, e)
        else:
            log.error("durable KV files NOT synced at shutdown: the syscall thread does not answer")
        self.sys.stop.set()
        self.waitset.ring()
        self.sys.thread.join(5)
        if self.sys.thread.is_alive():                     # hung: only unlink names, touch nothing it owns
            log.error("the syscall thread did not stop; unlinking the LIPs' shared memory anyway")
            for ring in rings:
                ring.unlink()
        else:
            for lip_id in list(self.sys.lips):             # reclaims that never ran (the thread has
                self.sys.remove(lip_id)                    # stopped: what it owned is ours now)
            self.fs.close_all()
        self.supervision.cancel_all()
        await self.launcher.close()
        self.waitset.close()
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        log.info("kernel stopped (%d durable KV files synced)", len(synced or []))

    async def _watch_ranks(self) -> None:
        """Fail the kernel loudly once a tensor-parallel rank has exited (a
        hung one is found by the next step's collective timing out)."""
        while not self.supervision.stopping.is_set():
            await asyncio.sleep(0.5)
            why = self.engine.tp.dead()
            if why:
                self.supervision.fail_loudly(why)
                return

    # ------------------------------------------------------------------ wiring
    def _threadsafe(self, fn):
        """``fn`` made callable from any thread: it runs on the event loop."""
        return lambda *a: self.loop.call_soon_threadsafe(fn, *a)

    def _kill(self, lip_id: int, reason: str) -> bool:
        return self.lifecycle.kill(lip_id, reason)

    def _credit_output(self, lip_id: int, n: int) -> None:
        """``n`` bytes of LIP ``lip_id``'s output were taken: its send() may go on (syscall thread)."""
        srv = self.sys
        srv.submit(lambda: srv.credit_output(lip_id, n), anytime=True)

    async def _watch_cpu(self) -> None:
        """Every CHECK_EVERY_S: demote the LIPs that keep a core busy (cpu.py)."""
        while True:
            await asyncio.sleep(CHECK_EVERY_S)
            me, served = os.geteuid(), self.sys.snapshot
            self.cpu.check((e.id, e.pid, self.uids.held.get(e.id, me), served.counters(e.id).calls)
                           for e in self.procs if e.state == LipState.RUNNING and e.pid)


def _socket_alive(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()
