"""A LIP's output on its way to its clients, with back-pressure.

`OutputStreams` is a part of `daemon.Kernel`; all of it runs on the event
loop, which owns this state (the syscall thread reaches `deliver` only through
the loop's queue, and is credited back through ``credit``, a callable that
queues a command for it):

    watchers        lip -> the client streams attached to it
    history         a detached LIP's output: (frame bytes, event), oldest dropped
    history_bytes   lip -> bytes in its history
    owed            lip -> output bytes written to clients, not yet credited

When a LIP ends, `forget` drops all of it, and the LIP's unread input
(inflow.py, the mirror of this file) with it.
"""
from __future__ import annotations

import asyncio
from collections import deque
from typing import Callable

from symphony.ipc.protocol import encode_frame

from symphony.kernel.loop.inflow import InputFlow


class OutputStreams:
    """Event delivery to a LIP's clients (event loop)."""

    def __init__(self, inflow: InputFlow, max_queued_output: int, credit: Callable[[int, int], None]):
        """``max_queued_output``: bytes of a detached LIP's output kept for a
        client that may attach; ``credit(lip, n)``: tell the syscall thread
        that ``n`` bytes of the LIP's output were taken (its send() may go on)."""
        self.inflow = inflow
        self.max_queued_output = max_queued_output
        self.credit = credit
        self.watchers: dict[int, set] = {}
        self.history: dict[int, deque] = {}
        self.history_bytes: dict[int, int] = {}
        self.owed: dict[int, int] = {}
        self._flushing: set[int] = set()

    def queued_bytes(self) -> int:
        """Output held for clients: written and not yet taken, or kept for detached LIPs."""
        return sum(self.owed.values()) + sum(self.history_bytes.values())

    def watch(self, lip_id: int, writer) -> None:
        """Send LIP ``lip_id``'s events to the client stream ``writer`` too."""
        self.watchers.setdefault(lip_id, set()).add(writer)

    def forget(self, lip_id: int) -> None:
        """The LIP's exit event went out: drop its clients and unread output."""
        self.watchers.pop(lip_id, None)
        self.history.pop(lip_id, None)                 # a detached LIP's unread output goes with it
        self.history_bytes.pop(lip_id, None)
        self.owed.pop(lip_id, None)
        self.inflow.forget(lip_id)                     # and its unread input; waiting senders give up

    def deliver(self, lip_id: int, event: dict) -> None:
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
                self.credit(lip_id, len(frame))
            return
        for w in ws:
            w.write(frame)
        if counted:
            self.owed[lip_id] = self.owed.get(lip_id, 0) + len(frame)
            if lip_id not in self._flushing:
                self._flushing.add(lip_id)
                asyncio.get_running_loop().create_task(self._flush(lip_id))

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
                self.credit(lip_id, n)
        finally:
            self._flushing.discard(lip_id)
