"""The kernel's record of one LIP (`LipProc`)."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from symphony.ipc.kernel_side import KernelSide
from symphony.kvfs import Principal

from .replies import ReplyStore


@dataclass
class LipProc:
    """The kernel's record of one LIP."""

    id: int
    user: str
    filename: str
    args: list
    ring: KernelSide
    grants: dict
    limits: dict
    pid: int = 0
    priority: int = 0
    owner_uid: int = -1         # the submitting user's Unix identity, for file capabilities
    owner_gid: int = -1         # (-1: unknown -> they read as nobody)
    owner_groups: tuple = ()
    caps_in_flight: int = 0
    last_active: float = field(default_factory=time.monotonic)
    blocked_since: float = 0.0
    state: str = "starting"
    started: float = field(default_factory=time.time)
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

    @property
    def principal(self) -> Principal:
        return Principal(self.user, self.id)
