"""The tensor-parallel process group and what rank 0 tells the other ranks.

torch.distributed does the work: gloo on CPUs (so that CI runs the same code),
NCCL on GPUs.  Rank 0 (the kernel) sends every operation as a command, a
fixed header of int64 broadcast to the ranks, then its payload; every rank
does the operation on its shard:

    STEP        a forward pass: the packed `BatchMeta`; two all-reduces a layer
    COPY_PAGE   copy-on-write of a page's first n slots
    COPY_SLOTS  slots between pages (extract, merge)
    GATHER      pages to rank 0, every rank its heads (swap out, durable sync)
    SCATTER     pages from rank 0 (swap in, durable restore)
    STOP        the kernel stops: leave the group and exit

Three process groups: the main one (NCCL or gloo) carries payloads and
collectives, with ``timeout_s`` plus a margin; the headers' (gloo) has no
practical timeout, since a worker waits for the next step as long as the
kernel is idle; the heartbeat's (gloo) carries one tiny all-reduce a second
from a thread of every rank, with ``timeout_s``.

Failure (docs/design/tensor-parallel.md, Failure), each ending in `broken`
(a sentence), after which every call raises `TPFailure`:

    a collective raises            a rank died (gloo sees its socket close) or
                                   the backend's own timeout passed
    a collective outlasts          `CollectiveWatch`: the call has run past
      timeout_s                    ``timeout_s`` (a hung rank; a GPU stream that
                                   never finishes); found by a thread, so it
                                   does not matter whether the backend raises
    the heartbeat fails            a rank died or froze while the kernel is idle

Rank 0's kernel polls `TensorParallel.dead` and shuts down loudly; a worker
exits (`on_broken`).  On GPUs, before the group starts, each process binds its
device (``torch.cuda.set_device``, and ``device_id`` for NCCL's eager init),
and NCCL's own watchdog is told to abort the communicator on an error or a
timeout rather than end the process (TORCH_NCCL_ASYNC_ERROR_HANDLING=2), so
that the kernel's shutdown, not a crash, is what follows.
"""
from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from contextlib import contextmanager
from typing import Callable, Optional

import torch
import torch.distributed as dist

log = logging.getLogger("symphony.tp")

STEP, COPY_PAGE, COPY_SLOTS, GATHER, SCATTER, STOP = range(1, 7)
NAMES = {STEP: "step", COPY_PAGE: "copy_page", COPY_SLOTS: "copy_slots", GATHER: "gather",
         SCATTER: "scatter", STOP: "stop"}
HEADER = 8
IDLE_TIMEOUT = datetime.timedelta(days=365)
BACKEND_MARGIN_S = 2.0          # the backend's own timeout: ours plus this (ours fires first)
HEARTBEAT_S = 1.0               # between two heartbeats
CLOSE_WAIT_S = 5.0              # for the other ranks to join the heartbeat's last round
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}    # abort the communicator, keep the process


class TPFailure(RuntimeError):
    """A tensor-parallel rank died, hung past the timeout or failed: the model
    cannot run any more."""


class CollectiveWatch:
    """Notices a collective that has run longer than ``timeout_s``.

        watch = CollectiveWatch(timeout_s, on_hang)
        with watch.busy("an all-reduce"):       # any blocking call
            ...

    A daemon thread looks every ``tick_s``; once a call has been busy longer
    than ``timeout_s`` it calls ``on_hang(what, seconds)`` once, from that
    thread, while the call is still blocked (the caller's thread is not
    interrupted: the backend's own timeout or an abort frees it, or the
    process ends)."""

    def __init__(self, timeout_s: float, on_hang: Callable[[str, float], None], tick_s: float = 0.25):
        self.timeout_s, self.on_hang, self.tick_s = timeout_s, on_hang, tick_s
        self._busy: Optional[tuple[str, float]] = None
        self._fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="symphony-tp-watch", daemon=True)
        self._thread.start()

    @contextmanager
    def busy(self, what: str):
        self._busy = (what, time.monotonic())
        try:
            yield
        finally:
            self._busy = None

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            b = self._busy
            if b is not None and not self._fired and time.monotonic() - b[1] > self.timeout_s:
                self._fired = True
                self.on_hang(b[0], time.monotonic() - b[1])


class TPGroup:
    """This process's place in the group: ``rank`` of ``size``.

    ``record``: this rank's settings (agree.py), checked against every other
    rank's once the group has met (`agree.TPMismatch` if they disagree);
    ``on_broken``: called once, from a watch thread, when the group breaks
    while no call of this process is failing on its own (a hang, a heartbeat)."""

    def __init__(self, rank: int, size: int, init_method: str, backend: str = "gloo",
                 timeout_s: float = 60.0, device: Optional[torch.device] = None, *,
                 record: Optional[dict] = None, on_broken: Optional[Callable[[str], None]] = None):
        self.rank, self.size, self.backend = rank, size, backend
        self.timeout_s = timeout_s
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.broken: Optional[str] = None
        self.stopping = False
        self.steps = 0
        self.bytes_reduced = 0
        self.last_sent = time.monotonic()
        self.on_broken = on_broken
        kw = bind_device(backend, self.device)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s + BACKEND_MARGIN_S), **kw)
        # the headers' own group: a worker waits on it for as long as the kernel is idle
        self.headers = dist.new_group(list(range(size)), timeout=IDLE_TIMEOUT, backend="gloo")
        self.beats = dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=timeout_s),
                                    backend="gloo")
        if record is not None:
            from .agree import check
            try:
                check(record, size, self.headers)
            except BaseException:           # every rank refuses: leave the group in order (a group
                try:                        # left for the interpreter's exit to tear down aborted
                    dist.destroy_process_group()       # the process now and then)
                except Exception:
                    pass
                raise
        self.watch = CollectiveWatch(timeout_s, self._hung)
        self._wake = threading.Event()          # close(): beat now, do not wait out the second
        self._heart = threading.Thread(target=self._heartbeat, name="symphony-tp-heartbeat", daemon=True)
        self._heart.start()

    # ------------------------------------------------------------------ collectives
    def _guard(self, what: str, fn):
        if self.broken:
            raise TPFailure(self.broken)
        try:
            with self.watch.busy(what):
                return fn()
        except Exception as e:              # gloo/NCCL raise RuntimeError (and subclasses) on a lost rank
            if not self.broken:
                self.broken = (f"tensor parallelism failed during {what} on rank {self.rank} of {self.size}: "
                               f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]} (a rank died, "
                               f"hung past {self.timeout_s:.0f} s, or failed)")
                log.error("%s", self.broken)
            raise TPFailure(self.broken) from None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns x."""
        self.bytes_reduced += x.numel() * x.element_size()
        self._guard("an all-reduce", lambda: dist.all_reduce(x))
        return x

    def send(self, op: int, args=(), payload: Optional[torch.Tensor] = None) -> None:
        """Rank 0: tell every rank to do ``op`` (ints ``args``, an int64 ``payload``)."""
        head = torch.zeros(HEADER, dtype=torch.int64)
        head[0], head[1] = op, 0 if payload is None else payload.numel()
        for i, a in enumerate(args):
            head[2 + i] = int(a)
        if op == STOP:
            self.stopping = True
        self.last_sent = time.monotonic()
        self._guard(f"the {NAMES.get(op, op)} command", lambda: dist.broadcast(head, 0, group=self.headers))
        if payload is not None and payload.numel():
            p = payload.to(self._comm_device())
            self._guard(f"the {NAMES.get(op, op)} payload", lambda: dist.broadcast(p, 0))

    def receive(self) -> tuple[int, list[int], Optional[torch.Tensor]]:
        """Another rank: the next command (op, args, payload)."""
        head = torch.zeros(HEADER, dtype=torch.int64)
        try:
            dist.broadcast(head, 0, group=self.headers)    # no watch: idle for as long as the kernel is
        except Exception as e:
            self._guard("waiting for a command", lambda: _raise(e))
        op, n = int(head[0]), int(head[1])
        if op == STOP:
            self.stopping = True
        payload = None
        if n:
            payload = torch.empty(n, dtype=torch.int64, device=self._comm_device())
            self._guard(f"the {NAMES.get(op, op)} payload", lambda: dist.broadcast(payload, 0))
        return op, [int(a) for a in head[2:]], payload

    def gather(self, x: torch.Tensor) -> Optional[list[torch.Tensor]]:
        """Every rank's ``x`` (same shape) at rank 0, in rank order; None elsewhere."""
        x = x.to(self._comm_device()).contiguous()
        out = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        self._guard("a gather of KV pages", lambda: dist.gather(x, out, dst=0))
        return out

    def scatter(self, parts: Optional[list[torch.Tensor]], like: torch.Tensor) -> torch.Tensor:
        """Rank 0 sends ``parts[r]`` to rank r; each rank gets its part (shaped like ``like``)."""
        out = torch.empty_like(like, device=self._comm_device())
        src = [p.to(self._comm_device()).contiguous() for p in parts] if self.rank == 0 else None
        self._guard("a scatter of KV pages", lambda: dist.scatter(out, src, src=0))
        return out

    def finish(self, x: torch.Tensor) -> None:
        """The end of this rank's part of a step: on a GPU, wait (watched) until its
        stream has run every kernel and collective queued so far, so that a rank whose
        NCCL call never completes is found here, once a step, not in a later copy.
        (NCCL calls return as soon as they are queued; on the CPU they have finished.)"""
        if x.is_cuda:
            self._guard("a step's kernels and collectives", lambda: torch.cuda.current_stream(x.device).synchronize())

    def _comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    # ------------------------------------------------------------------ failure
    def _break(self, why: str) -> None:
        if self.broken or self.stopping:
            return
        self.broken = why
        log.error("%s", why)
        if self.on_broken is not None:
            self.on_broken(why)

    def _hung(self, what: str, seconds: float) -> None:
        self._break(f"tensor parallelism failed: {what} on rank {self.rank} of {self.size} did not finish "
                    f"within {self.timeout_s:.0f} s (--tp-timeout; a rank hung or its device stalled)")

    def _heartbeat(self) -> None:
        """A tiny all-reduce a second on the heartbeat group: a rank that died or froze
        while the kernel is idle breaks the group within ``timeout_s``.

        Every round carries each rank's vote to leave (``stopping``: the STOP command
        sent or received, or `close`); the heartbeat ends on the round where any rank
        voted, on every rank at once.  (A rank that simply stopped beating
        would leave the others blocked in a round it never joins, and tearing the group
        down under a blocked collective aborts the process.)"""
        t = torch.zeros(1)
        while not self.broken:
            self._wake.wait(HEARTBEAT_S)
            if self.broken:
                return
            t.fill_(1.0 if self.stopping else 0.0)
            try:
                dist.all_reduce(t, group=self.beats)
            except Exception as e:
                if not self.stopping:
                    self._break(f"tensor parallelism failed: the heartbeat of rank {self.rank} of {self.size} "
                                f"failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]} "
                                f"(a rank died, or froze for {self.timeout_s:.0f} s)")
                return
            if t.item() > 0:
                return

    def close(self) -> None:
        """Leave the group: end the heartbeat on a round every rank takes part in, then
        tear the group down.  A broken group, or one whose heartbeat did not end, is left
        as it is: a thread of this process may still be blocked in one of its
        collectives, which tearing it down could hang or abort."""
        self.stopping = True
        self._wake.set()
        self.watch.stop()
        if self.broken:
            return
        self._heart.join(HEARTBEAT_S + CLOSE_WAIT_S)
        if self._heart.is_alive():
            log.warning("rank %d of %d: the heartbeat did not end within %.0f s; leaving the group as it is",
                        self.rank, self.size, HEARTBEAT_S + CLOSE_WAIT_S)
            return
        try:
            dist.destroy_process_group()
        except Exception:                     # already gone with a failed rank
            pass


# ---------------------------------------------------------------- helpers
def bind_device(backend: str, device: torch.device) -> dict:
    """Before a process group starts: on a GPU, make ``device`` this process's current
    device (NCCL picks its communicator's device from it) and NCCL's error handling
    the kind that aborts communicators instead of the process; the extra keyword
    arguments of ``init_process_group`` (``device_id``: NCCL's eager init on that device)."""
    if device.type != "cuda":
        return {}
    if device.index is None:
        raise ValueError(f"a tensor-parallel rank needs an indexed GPU (cuda:N), got {device}")
    torch.cuda.set_device(device)
    for k, v in NCCL_ENV.items():
        if os.environ.get(k, v) != v:
            log.warning("%s=%s in the environment: NCCL errors may end the process instead of shutting the "
                        "kernel down (Symphony sets %s)", k, os.environ[k], v)
        os.environ.setdefault(k, v)
    return {"device_id": device} if backend == "nccl" else {}


def _raise(e: BaseException):
    raise e
