"""The process table: every LIP's lifecycle, owned by the event loop.

Who owns it, and why the event loop.  Every event that moves a LIP through
its life arrives on the event loop: a client's spawn and kill, the zygote's
"spawned" (pid) and "exited" reports, a client disconnecting, the wall-clock
timer.  And `ps`, `kill` and admission must keep answering while the syscall
thread is busy in a long forward pass or stalled (tests/e2e/kernel/test_faults.py holds
it for 40 s while LIPs spawn, exit and are killed).  A table owned by the
syscall thread would go stale exactly then.  So the table lives on the event
loop, and is the only writer of a LIP's lifecycle state; the syscall thread
never reads it: it serves its own record of each LIP (`proc.LipProc`: the
ring, inbox, counters), handed to it once at spawn, and asks for a kill by
message (the kill callable the Kernel gives it, daemon.py).  What each thread shows of its state to
the other is an immutable snapshot (snapshot.py).

State machine (one LIP; its states are `states.LipState`, the moves it may
make are `TRANSITIONS`; every transition is a method below, run on the event
loop, and republishes `snapshot`)::

                queue()             kill(why) / its timeout / its client left:
      (none) ---------> queued ---------------------------------------------+
        |                  |      drop(why): exited at once, never spawned  |
        |                  | admit(ring): a slot and its KV are free        |
        |   add()          v                                                |
        +-----------> starting --------------> running                      |
                           |    started(pid)        |                       |
                           | kill(why): the reason  | kill(why): SIGKILL now|
                           | is kept; SIGKILL once  |                       |
                           | the pid is known       v                       |
                           +-----------------> killing                      |
                           |                        |                       |
                           |  exit_reported(): the zygote reaped the worker;|
                           |  its ring, files and pages are reclaimed on the|
                           |  syscall thread                |               |
                           +-----------> exiting <----------+               |
                                            |                               |
                                            | reclaimed(status, signal, counters)
                                            v                               |
                                         exited: out of the table, into  <--+
                                         `finished` (the last 100), exit event sent

A queued LIP has no ring, uid or worker yet: those are made at admission (the
admission queue, sched/admission.py, says when), so dropping it undoes nothing.
`count_for` counts only admitted LIPs (starting to exiting): the per-user limit
is what a queued LIP waits for, so counting the waiting ones would make a user
wait for their own queue; the queue bounds those (--max-queued-per-user).
A LIP's first kill reason wins; `exited`'s reason is that, or what its exit
status / signal says.  `abandon()` ends an `exiting` LIP whose reclaim never
came back (shutdown with a hung syscall thread).
"""
from __future__ import annotations

import signal
from collections import deque
from dataclasses import dataclass, replace
from typing import Iterator, NamedTuple, Optional

from symphony.kernel.snapshot import LipCounters, ProcRow
from symphony.kernel.states import LipState

FINISHED_KEPT = 100

QUEUED, STARTING, RUNNING = LipState.QUEUED, LipState.STARTING, LipState.RUNNING
KILLING, EXITING, EXITED = LipState.KILLING, LipState.EXITING, LipState.EXITED

LIVE = (QUEUED, STARTING, RUNNING, KILLING, EXITING)

# state -> the states a LIP in it may move to (None: not in the table yet)
TRANSITIONS: dict[Optional[LipState], frozenset] = {
    None: frozenset({QUEUED, STARTING}),                # queue() / add()
    QUEUED: frozenset({STARTING, EXITED}),              # admit() / drop()
    STARTING: frozenset({RUNNING, KILLING, EXITING}),   # started() / kill() / exit_reported()
    RUNNING: frozenset({KILLING, EXITING}),             # kill() / exit_reported()
    KILLING: frozenset({KILLING, EXITING}),             # started(): its pid known / exit_reported()
    EXITING: frozenset({EXITED}),                       # reclaimed() / abandon()
    EXITED: frozenset(),
}

_SIGNAL_REASONS = {signal.SIGXCPU: "killed: CPU time limit exceeded", signal.SIGKILL: "killed",
                   signal.SIGSEGV: "crashed (segmentation fault)",
                   signal.SIGSYS: "killed by the sandbox (forbidden system call)"}


@dataclass
class ProcEntry:
    """The event loop's record of one live LIP (its mutable side; only the
    table changes it)."""

    row: ProcRow
    ring: object                        # the LIP's KernelSide: only for its names, and unlink at a hung
                                        # shutdown (None while queued)
    reason: Optional[str] = None        # the first kill reason

    @property
    def id(self) -> int:
        return self.row.lip

    @property
    def state(self) -> LipState:
        return self.row.state

    @property
    def pid(self) -> int:
        return self.row.pid


class TableSnapshot(NamedTuple):
    """The table as published after one transition: never changed, replaced whole."""

    rows: tuple                 # ProcRow of every live LIP, by id order of spawn
    finished: tuple             # (ProcRow, exit event) of the last FINISHED_KEPT exited, oldest first
    version: int                # transitions so far


class TransitionError(RuntimeError):
    """A transition the state machine does not allow (a kernel bug)."""


class ProcessTable:
    """Every live LIP by id, and the last `FINISHED_KEPT` that exited.

    Readers (any thread) take `snapshot` once (a `TableSnapshot`, replaced
    whole on every transition) and read only that.  Only the owner thread
    calls the transition methods."""

    def __init__(self) -> None:
        self._live: dict[int, ProcEntry] = {}
        self._finished: deque = deque(maxlen=FINISHED_KEPT)
        self._by_user: dict[str, int] = {}
        self._queued = 0
        self.snapshot = TableSnapshot((), (), 0)

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, lip_id) -> bool:
        return lip_id in self._live

    def __iter__(self) -> Iterator[ProcEntry]:
        return iter(list(self._live.values()))

    def get(self, lip_id) -> Optional[ProcEntry]:
        return self._live.get(lip_id) if isinstance(lip_id, int) else None

    def count_for(self, user: str) -> int:
        """Admitted live LIPs of ``user`` (for the per-user limit; not the queued)."""
        return self._by_user.get(user, 0)

    def admitted_by_user(self) -> dict:
        """{user: admitted live LIPs} (a copy)."""
        return dict(self._by_user)

    @property
    def admitted(self) -> int:
        """Live LIPs that are not queued (each holds a LIP slot)."""
        return len(self._live) - self._queued

    @property
    def queued(self) -> int:
        """LIPs waiting in the admission queue."""
        return self._queued

    # ------------------------------------------------------------------ transitions
    def add(self, row: ProcRow, ring) -> ProcEntry:
        """(none) -> starting: the LIP is admitted and its worker asked for."""
        if row.lip in self._live:
            raise TransitionError(f"LIP {row.lip} is already in the table")
        _check(row.lip, None, STARTING)
        e = ProcEntry(replace(row, state=STARTING, pid=0), ring)
        self._live[row.lip] = e
        self._by_user[row.user] = self._by_user.get(row.user, 0) + 1
        self._publish()
        return e

    def queue(self, row: ProcRow) -> ProcEntry:
        """(none) -> queued: the LIP waits in the admission queue."""
        if row.lip in self._live:
            raise TransitionError(f"LIP {row.lip} is already in the table")
        _check(row.lip, None, QUEUED)
        e = ProcEntry(replace(row, state=QUEUED, pid=0), None)
        self._live[row.lip] = e
        self._queued += 1
        self._publish()
        return e

    def admit(self, lip_id: int, ring) -> ProcEntry:
        """queued -> starting: the LIP is admitted, its ring made, its worker asked for."""
        e = self._live.get(lip_id)
        if e is None or e.state != QUEUED:
            raise TransitionError(f"LIP {lip_id} is not queued")
        self._queued -= 1
        self._by_user[e.row.user] = self._by_user.get(e.row.user, 0) + 1
        e.ring = ring
        self._set(e, state=STARTING)
        return e

    def drop(self, lip_id: int, reason: str) -> Optional[tuple[ProcEntry, dict]]:
        """queued -> exited at once (killed, timed out or its client left while
        waiting; never spawned).  Returns (entry, its exit event), None if it
        is not queued."""
        e = self._live.get(lip_id)
        if e is None or e.state != QUEUED:
            return None
        self._queued -= 1
        e.reason = reason
        event = {"event": "exit", "lip": lip_id, "status": 128 + signal.SIGKILL, "reason": reason}
        self._retire(e, event, e.row.final, counted=False)
        return e, event

    def started(self, lip_id: int, pid: int) -> Optional[str]:
        """starting -> running (or killing stays killing) once the zygote says
        the worker's pid.  Returns the kill reason if it was killed meanwhile:
        the caller signals the pid now."""
        e = self._live.get(lip_id)
        if e is None or e.state not in (STARTING, KILLING) or e.pid:
            return None
        self._set(e, state=RUNNING if e.reason is None else KILLING, pid=pid)
        return e.reason

    def kill(self, lip_id: int, reason: str) -> Optional[ProcEntry]:
        """starting|running -> killing, keeping the first reason.  Returns the
        entry if it is live (its pid, 0 while starting, is the one to signal),
        None if there is no such LIP.  An exiting LIP keeps its state: it is
        dead already and its pid may be reused, so the caller sends nothing.
        A queued LIP is left as it is: the caller `drop`s it."""
        e = self._live.get(lip_id)
        if e is None or e.state == QUEUED:
            return e
        if e.reason is None and e.state != EXITING:
            e.reason = reason
        if e.state in (STARTING, RUNNING):
            self._set(e, state=KILLING)
        return e

    def exit_reported(self, lip_id: int) -> Optional[ProcEntry]:
        """starting|running|killing -> exiting: the worker was reaped.  Returns
        the entry if its reclaim is to start now, None if there is no such LIP
        or its reclaim is already under way (or it is queued: no worker yet)."""
        e = self._live.get(lip_id)
        if e is None or e.state in (EXITING, QUEUED):
            return None
        self._set(e, state=EXITING)
        return e

    def reclaimed(self, lip_id: int, status: int, sig: int,
                  counters: LipCounters) -> Optional[tuple[ProcEntry, dict]]:
        """exiting -> exited: the syscall thread reclaimed it.  Moves it to
        `finished` and returns (entry, its exit event); None if it already left
        (`abandon`)."""
        e = self._live.get(lip_id)
        if e is None or e.state != EXITING:
            return None
        reason = e.reason or exit_reason(status, sig)
        event = {"event": "exit", "lip": lip_id, "status": status if sig == 0 else 128 + sig, "reason": reason}
        self._retire(e, event, counters)
        return e, event

    def abandon(self, lip_id: int, why: str) -> Optional[tuple[ProcEntry, dict]]:
        """exiting -> exited without a reclaim (the syscall thread does not
        answer): the exit event says so."""
        e = self._live.get(lip_id)
        if e is None or e.state != EXITING:
            return None
        event = {"event": "exit", "lip": lip_id, "status": 128 + 9, "reason": (e.reason or "killed") + why}
        self._retire(e, event, e.row.final)
        return e, event

    # ------------------------------------------------------------------ helpers
    def _set(self, e: ProcEntry, state: LipState, **change) -> None:
        _check(e.id, e.state, state)
        e.row = replace(e.row, state=state, **change)
        self._publish()

    def _retire(self, e: ProcEntry, event: dict, counters: LipCounters, counted: bool = True) -> None:
        del self._live[e.id]
        n = self._by_user[e.row.user] - 1 if counted else -1
        if n > 0:
            self._by_user[e.row.user] = n
        elif n == 0:
            del self._by_user[e.row.user]
        _check(e.id, e.state, EXITED)
        e.row = replace(e.row, state=EXITED, final=counters)
        self._finished.append((e.row, event))
        self._publish()

    def _publish(self) -> None:
        old = self.snapshot
        finished = old.finished if not self._finished or (old.finished and old.finished[-1] is
                                                          self._finished[-1]) else tuple(self._finished)
        self.snapshot = TableSnapshot(tuple(e.row for e in self._live.values()), finished, old.version + 1)


def _check(lip_id: int, old: Optional[LipState], new: LipState) -> None:
    """TransitionError unless `TRANSITIONS` lets a LIP move from ``old`` to ``new``."""
    if new not in TRANSITIONS[old]:
        raise TransitionError(f"LIP {lip_id}: {old or '(none)'} -> {new} is not a transition")


def exit_reason(status: int, sig: int) -> str:
    """Why a LIP that nobody killed ended, from its exit status or signal."""
    if sig == 0:
        return {0: "finished", 1: "error"}.get(status, f"exit status {status}")
    return _SIGNAL_REASONS.get(sig, f"killed by signal {sig}")
