"""Immutable snapshots one kernel thread publishes for the other to read.

Each piece of kernel state has one owner thread (DESIGN: one owner per
state).  What the other thread needs to *see* of it travels as a frozen
snapshot, replaced whole by its owner (a single reference assignment, atomic
under the GIL), never as a shared mutable object:

    ProcRow          the process table's view of one LIP (state, pid, ...);
                     published by the event loop (`ProcessTable.rows`)
    ServingSnapshot  what the syscall thread serves: per-LIP call counters,
                     batch and engine counters, KV pages used/free;
                     published by the syscall thread (`SyscallServer.snapshot`)

A reader takes the reference once and reads only that object, so it never
sees half of an update.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, NamedTuple


class LipCounters(NamedTuple):
    """One LIP's work as the syscall thread counts it."""

    calls: int = 0              # system calls served
    preds: int = 0              # pred calls
    tokens: int = 0             # tokens fed to the model
    reply_bytes: int = 0        # chunked replies awaiting FETCH


NO_COUNTERS = LipCounters()

ARGS_SHOWN = 4096       # characters of a LIP's arguments `ps` shows (all the kernel keeps once it starts)

# counters `stats` always shows (0 until they move): the residency manager's
# (kernel/syscall/residency.py) and KVFS's own (`KVFS.stats`: drops, swap traffic)
OVERLOAD_COUNTERS = ("suspensions", "resumes", "memory_waits", "kv_wait_failures")


@dataclass(frozen=True)
class ProcRow:
    """One LIP as `ps` shows it; replaced (never changed) on every transition."""

    lip: int
    user: str
    file: str
    state: str                  # ProcessTable's states: queued starting running killing exiting exited
    priority: int
    pid: int
    started: float              # wall clock (time.time()) of the spawn request
    args: tuple                 # as `ps` shows them (`shown_args`)
    limits: Mapping
    final: LipCounters = NO_COUNTERS    # an exited LIP's last counters

    def ps(self, counters: LipCounters, full: bool) -> dict:
        """The `ps` entry; ``full`` False (another user's LIP): without its
        arguments (prompts, paths) and limits; the program's file name stays,
        like a process's name in ps."""
        d = {"lip": self.lip, "user": self.user, "file": self.file, "state": self.state,
             "priority": self.priority, "pid": self.pid, "started": self.started,
             "calls": counters.calls, "preds": counters.preds, "tokens": counters.tokens}
        if full:
            d["args"], d["limits"] = list(self.args), dict(self.limits)
        return d


def shown_args(args) -> tuple:
    """A LIP's arguments as `ps` shows them: at most `ARGS_SHOWN` characters in
    all, the one that crosses it cut with a marker, the rest counted."""
    out, room = [], ARGS_SHOWN
    for i, a in enumerate(args):
        if len(a) > room:
            out.append(f"{a[:room]}… [{len(a)} characters]")
            if i + 1 < len(args):
                out.append(f"[{len(args) - i - 1} more arguments]")
            break
        out.append(a)
        room -= len(a)
    return tuple(out)


@dataclass(frozen=True)
class ServingSnapshot:
    """What the syscall thread serves, as of ``at`` (time.monotonic())."""

    at: float = 0.0
    lips: Mapping[int, tuple] = field(default_factory=lambda: MappingProxyType({}))   # id -> LipCounters fields
    batches: int = 0            # forward passes the scheduler ran
    batch_calls: int = 0        # pred calls in them
    max_batch: int = 0          # most calls in one
    forward_passes: int = 0     # the engine's own counters
    pred_calls: int = 0
    tokens_computed: int = 0    # tokens fed to the model since start (prompts and generated)
    engine_max_batch: int = 0
    kv_pages_used: int = 0      # device KV pages
    kv_pages_total: int = 0
    kv_pages_free: int = 0      # device pages free + host/disk slots free
    kv_device_free: int = 0     # device KV pages free now
    kv_reclaimable: int = 0     # device pages freeable without suspending a running LIP
                                # (unopened cache/idle files, blocked LIPs' files)
    lip_pages: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}))   # id -> KV pages charged (all tiers)
    user_pages: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))  # user -> KV pages charged (all tiers)
    user_cache_pages: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))  # of which only unopened cache files hold
    suspended: Mapping[int, int] = field(default_factory=lambda: MappingProxyType({}))   # id -> pages it needs back to resume
    overload: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))    # preemptions, resumes, drops, swap bytes, ...
    host: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))      # the syscall thread's time (HostTimes)

    def counters(self, lip_id: int) -> LipCounters:
        c = self.lips.get(lip_id)
        return NO_COUNTERS if c is None else LipCounters(*c)

    @property
    def pending_reply_bytes(self) -> int:
        return sum(c[3] for c in self.lips.values())

    def as_stats(self) -> dict:
        """The `stats` fields this snapshot answers."""
        return {"batches": self.batches, "batch_calls": self.batch_calls, "max_batch": self.max_batch,
                "forward_passes": self.forward_passes, "pred_calls": self.pred_calls,
                "tokens_computed": self.tokens_computed,
                "engine_max_batch": self.engine_max_batch, "kv_pages_used": self.kv_pages_used,
                "kv_pages_total": self.kv_pages_total, "pending_reply_bytes": self.pending_reply_bytes,
                "kv_device_free": self.kv_device_free, "kv_reclaimable": self.kv_reclaimable,
                "suspended_lips": len(self.suspended), "suspended_pages": sum(self.suspended.values()),
                **{k: self.overload.get(k, 0) for k in OVERLOAD_COUNTERS}, **dict(self.overload),
                "host": dict(self.host)}


class HostTimes:
    """Where the syscall thread's time goes (its own; published as ``ServingSnapshot.host``):
    seconds and counts per part of its loop -- ``handle`` (calls read, checked, queued or
    answered), ``launch`` (a step scheduled and prepared), ``finish`` (a step committed and its
    calls answered) -- and counters (``deferred``: calls that waited for the step in flight).
    ``clock``: wall time (perf_counter); a benchmark may give the thread's CPU time instead."""

    PARTS = ("handle", "launch", "finish")

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.seconds = dict.fromkeys(self.PARTS, 0.0)
        self.counts = dict.fromkeys(self.PARTS + ("deferred",), 0)

    def add(self, part: str, seconds: float, n: int = 1) -> None:
        self.seconds[part] += seconds
        self.counts[part] += n

    def count(self, what: str) -> None:
        self.counts[what] += 1

    def snapshot(self) -> Mapping[str, float]:
        return MappingProxyType({**{f"{k}_s": v for k, v in self.seconds.items()}, **self.counts})
