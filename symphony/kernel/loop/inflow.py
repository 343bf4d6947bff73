"""Input on its way to a LIP, with back-pressure: the mirror of output.py.

The event loop owns this count: bytes a client sent to a LIP (queued or
running) that the LIP's recv() has not taken yet.  The syscall thread, which
owns the LIP's inbox, says when recv() takes a message (`taken`, through the
event loop's queue).  A client whose LIP holds ``limit`` unread bytes waits
before its next input is accepted (`wait_room`): its connection is not read
meanwhile, so its own sends block, as a LIP's send() waits for a client that
does not read.  Nothing is dropped; a LIP that never reads stops only its
own client.
"""
from __future__ import annotations

import asyncio
from typing import Callable, Optional


def input_bytes(data: Optional[str]) -> int:
    """What one input message counts: its UTF-8 bytes (end of input: 0)."""
    return 0 if data is None else len(data.encode("utf-8", "surrogatepass"))


class InputFlow:
    """Unread input per LIP and the clients waiting to send more (event loop)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.owed: dict[int, int] = {}              # lip -> bytes sent, not yet taken by recv()
        self._room: dict[int, asyncio.Event] = {}   # lip -> set when it takes some

    def total(self) -> int:
        return sum(self.owed.values())

    async def wait_room(self, lip: int, n: int, alive: Callable[[], bool]) -> bool:
        """Wait until ``lip`` has room for ``n`` more bytes (a LIP holding no
        unread input always has room for one message); False if it ended first."""
        while self.owed.get(lip, 0) and self.owed[lip] + n > self.limit:
            if not alive():
                return False
            ev = self._room.setdefault(lip, asyncio.Event())
            ev.clear()
            await ev.wait()
        return alive()

    def sent(self, lip: int, n: int) -> None:
        if n:
            self.owed[lip] = self.owed.get(lip, 0) + n

    def taken(self, lip: int, n: int) -> None:
        """The LIP's recv() took ``n`` bytes (from the syscall thread, via the loop)."""
        if lip in self.owed:
            self.owed[lip] = max(0, self.owed[lip] - n)
        self._wake(lip)

    def forget(self, lip: int) -> None:
        """The LIP ended: its unread input is gone; waiting senders give up."""
        self.owed.pop(lip, None)
        self._wake(lip)

    def _wake(self, lip: int) -> None:
        ev = self._room.pop(lip, None)
        if ev is not None:
            ev.set()
