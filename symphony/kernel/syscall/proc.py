"""The syscall thread's record of one LIP (`LipProc`) and of all of them (`ServedLips`).

These are the syscall thread's own: built on the event loop at spawn and
handed over once (`SyscallServer.add`, through its command queue); from then
on only the syscall thread reads or writes them.  The LIP's lifecycle as
`ps` shows it is another record, the event loop's (proctable.py).

`LipProc.state` is the serving state (`Serving`), written only on the syscall thread::

    starting --add()--> running --condemn (kill asked of the event loop)--> killing
        running|killing --remove() (the worker is gone: reclaim)--> exited

running: its ring is polled; killing: no new call is read, calls in flight
may still be answered; exited: nothing is written to its ring again.
"""
from __future__ import annotations

import enum
import functools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from symphony.ipc.kernel_side import KernelSide
from symphony.kvfs import Principal
from symphony.sched import LipView, swap_out_order

from symphony.kernel.syscall.replies import ReplyStore
from symphony.kernel.snapshot import LipCounters


class Serving(str, enum.Enum):
    """A served LIP's state (a str, so that it compares equal to its name)."""

    STARTING = "starting"
    RUNNING = "running"         # its ring is polled
    KILLING = "killing"         # no new call is read; calls in flight may still be answered
    EXITED = "exited"           # nothing is written to its ring again

    def __str__(self) -> str:
        return self.value


@dataclass
class LipProc:
    """The syscall thread's record of one LIP."""

    id: int
    user: str
    filename: str
    args: list
    ring: KernelSide
    grants: dict
    limits: dict
    priority: int = 0
    owner_uid: int = -1         # the submitting user's Unix identity, for file capabilities
    owner_gid: int = -1         # (-1: unknown -> they read as nobody)
    owner_groups: tuple = ()
    caps_in_flight: int = 0
    last_active: float = field(default_factory=time.monotonic)
    blocked_since: float = 0.0
    state: Serving = Serving.STARTING
    inbox: deque = field(default_factory=deque)
    eof: bool = False
    parked_recv: Optional[tuple] = None
    strikes: int = 0
    calls: int = 0
    preds: int = 0
    tokens: int = 0
    replies: ReplyStore = field(default_factory=ReplyStore)   # chunked replies awaiting FETCH
    out_bytes: int = 0              # output emitted to the client, not yet taken (back-pressure)
    parked_out: deque = field(default_factory=deque)          # (slot, call_id) of sends waiting for room
    admitted: int = 0               # order in which the syscall thread took it over (memory importance)
    suspended: bool = False         # swapped out whole for a more important LIP; its calls are held
    suspensions: int = 0

    @property
    def blocked(self) -> bool:
        """Waiting in recv() or on a capability call: its pages may be swapped out page by page."""
        return self.parked_recv is not None or self.caps_in_flight > 0

    @functools.cached_property
    def principal(self) -> Principal:
        return Principal(self.user, self.id)          # (user and id never change)

    @property
    def counters(self) -> LipCounters:
        return LipCounters(self.calls, self.preds, self.tokens, self.replies.total)


class ServedLips(dict):
    """The LIPs the syscall thread serves, by id (a dict of `LipProc`).

    Made before KVFS and the syscall server, so that KVFS gets its
    `swap_out_first` in its constructor (``KVFS(..., evict_first=...)``);
    called only on the syscall thread, like everything KVFS does."""

    def swap_out_first(self) -> list[int]:
        """Ids of the blocked LIPs (waiting in recv or on a capability call),
        whose KV pages to move off the device first, in `swap_out_order`."""
        views = [LipView(l.id, l.priority, l.blocked, l.blocked_since, l.last_active, 1) for l in self.values()]
        blocked = {v.id for v in views if v.blocked}
        return [i for i in swap_out_order(views) if i in blocked]

    def running_ids(self) -> set[int]:
        """Ids of the LIPs whose KV files KVFS must never evict page by page
        (``KVFS(..., pinned=...)``): served, neither blocked nor suspended.
        Their pages leave the device only with the whole LIP (kernel/syscall/residency.py)."""
        return {l.id for l in self.values() if l.state in (Serving.RUNNING, Serving.KILLING) and not l.suspended
                and not l.blocked}
