"""A LIP's states: one name for each, shared by both threads' state machines.

Two records of a LIP each follow a state machine, and both spell their states
with `LipState`:

    the process table (event loop, proctable.py)   queued starting running
                                                    killing exiting exited
    the served LIP (syscall thread, proc.py)        starting running killing exited

`ps` also shows ``suspended``: a running LIP whose pages the memory manager
swapped out for a more important one (a view, not a state either machine
moves through).  The members are strings (``LipState.RUNNING == "running"``,
and they hash, print and serialise as those strings), so the wire protocol
and `ps` output are the same words.
"""
from __future__ import annotations

from enum import Enum


class LipState(str, Enum):
    """One state of a LIP (see the module docstring)."""

    QUEUED = "queued"           # waits in the admission queue: no ring, uid or worker yet
    STARTING = "starting"       # admitted: its ring made, its worker asked for
    RUNNING = "running"         # its worker runs
    SUSPENDED = "suspended"     # `ps` only: running, its pages swapped out
    KILLING = "killing"         # killed: SIGKILL sent (or to send once its pid is known)
    EXITING = "exiting"         # its worker is gone: its ring, files and pages being reclaimed
    EXITED = "exited"           # reclaimed: out of the table, exit event sent

    __str__ = str.__str__
    __format__ = str.__format__
    __hash__ = str.__hash__
