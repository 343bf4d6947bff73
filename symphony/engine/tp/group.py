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

Headers travel on a group of their own with no practical timeout (a worker
waits for the next step as long as the kernel is idle); every other collective
has ``timeout_s``.  A rank that dies or hangs makes the next collective on
rank 0 fail: that raises `TPFailure`, the group is broken from then on, and
the kernel shuts down (kernel/syscall/server.py).
"""
from __future__ import annotations

import datetime
import logging
from typing import Optional

import torch
import torch.distributed as dist

log = logging.getLogger("symphony.tp")

STEP, COPY_PAGE, COPY_SLOTS, GATHER, SCATTER, STOP = range(1, 7)
NAMES = {STEP: "step", COPY_PAGE: "copy_page", COPY_SLOTS: "copy_slots", GATHER: "gather",
         SCATTER: "scatter", STOP: "stop"}
HEADER = 8
IDLE_TIMEOUT = datetime.timedelta(days=365)


class TPFailure(RuntimeError):
    """A tensor-parallel rank died, hung past the timeout or failed: the model
    cannot run any more."""


class TPGroup:
    """This process's place in the group: ``rank`` of ``size``."""

    def __init__(self, rank: int, size: int, init_method: str, backend: str = "gloo",
                 timeout_s: float = 60.0, device: Optional[torch.device] = None):
        self.rank, self.size, self.backend = rank, size, backend
        self.timeout_s = timeout_s
        self.device = device or torch.device("cpu")
        self.broken: Optional[str] = None
        self.steps = 0
        self.bytes_reduced = 0
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        # the headers' own group: a worker waits on it for as long as the kernel is idle
        self.headers = dist.new_group(list(range(size)), timeout=IDLE_TIMEOUT, backend="gloo")

    # ------------------------------------------------------------------ collectives
    def _guard(self, what: str, fn):
        if self.broken:
            raise TPFailure(self.broken)
        try:
            return fn()
        except Exception as e:              # gloo/NCCL raise RuntimeError (and subclasses) on a lost rank
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
        self._guard(f"the {NAMES.get(op, op)} command", lambda: dist.broadcast(head, 0, group=self.headers))
        if payload is not None and payload.numel():
            p = payload.to(self._comm_device())
            self._guard(f"the {NAMES.get(op, op)} payload", lambda: dist.broadcast(p, 0))

    def receive(self) -> tuple[int, list[int], Optional[torch.Tensor]]:
        """Another rank: the next command (op, args, payload)."""
        head = torch.zeros(HEADER, dtype=torch.int64)
        self._guard("waiting for a command", lambda: dist.broadcast(head, 0, group=self.headers))
        op, n = int(head[0]), int(head[1])
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

    def _comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def close(self) -> None:
        try:
            dist.destroy_process_group()
        except Exception:                     # already gone with a failed rank
            pass
