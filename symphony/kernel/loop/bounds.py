"""The bounds on what a client controls: one validated config, its flags, and the connection table.

Every byte a client sends is held by the kernel only up to a bound, counted
in the kernel's own accounting (never trusted from the client):

    what                                    bound (flag, default)
    one LIP's arguments                     --max-args-kb (1024)
    input sent to one LIP, not yet read     --max-input-kb (1024): the sender waits (back-pressure)
    request frames being received, one user --max-partial-mb-per-user (64): the user's further
                                            frames wait; one frame is at most protocol.MAX_FRAME
    connections, one user                   --max-connections-per-user (256)
    connections, all users                  --max-connections (from RLIMIT_NOFILE), of which the
                                            last --root-connections (16) are root's alone
    a connection with nothing to do         --client-idle-timeout (600 s): closed
    a reply                                 MAX_REPLY_BYTES (half the client's frame limit)

(The queue's bounds, per user and for all users, are `sched.admission.AdmissionLimits`.)
`Connections` is the event loop's table of open connections and of the
partial frames each user holds; `read_request` reads one request under it.
"""
from __future__ import annotations

import argparse
import asyncio
import resource
import struct
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import orjson

from symphony.ipc.protocol import MAX_FRAME, ProtocolError

MAX_REPLY_BYTES = MAX_FRAME // 2        # every reply fits the client's frame limit with room to spare
FD_RESERVE = 256                        # descriptors kept for the kernel itself, besides 2 per LIP


class ConnectionRefused(Exception):
    """A connection over a bound: closed at once with this message."""


@dataclass(frozen=True)
class ClientBounds:
    """What one client (and one user's clients together) may make the kernel hold."""

    max_args_bytes: int = 1 << 20               # --max-args-kb
    max_input_bytes: int = 1 << 20              # --max-input-kb
    max_partial_bytes_per_user: int = 64 << 20  # --max-partial-mb-per-user
    max_connections: Optional[int] = None       # --max-connections (None: from RLIMIT_NOFILE)
    max_connections_per_user: int = 256         # --max-connections-per-user
    root_connections: int = 16                  # --root-connections
    idle_timeout_s: float = 600.0               # --client-idle-timeout (0: never)

    def __post_init__(self):
        for name in ("max_args_bytes", "max_input_bytes", "max_connections_per_user"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.max_partial_bytes_per_user, int) or self.max_partial_bytes_per_user < MAX_FRAME:
            raise ValueError(f"max_partial_bytes_per_user must be at least one frame ({MAX_FRAME >> 20} MiB)")
        if self.max_connections is not None and (not isinstance(self.max_connections, int)
                                                 or self.max_connections <= self.root_connections):
            raise ValueError("max_connections must be an int above root_connections")
        if not isinstance(self.root_connections, int) or self.root_connections < 1:
            raise ValueError("root_connections must be an int >= 1")
        if not 0 <= self.idle_timeout_s <= 86400:
            raise ValueError("idle_timeout_s must be in [0, 86400]")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """The flags of `ClientBounds` (symphony-kernel)."""
    g = p.add_argument_group("client bounds (what one client or user may make the kernel hold)")
    g.add_argument("--max-args-kb", type=int, default=1024,
                   help="KiB of arguments one LIP may be given (default 1024)")
    g.add_argument("--max-input-kb", type=int, default=1024,
                   help="KiB of input sent to one LIP and not yet read by its recv(); the sender then "
                        "waits (default 1024)")
    g.add_argument("--max-partial-mb-per-user", type=int, default=64,
                   help="MiB of request frames one user's connections may have in flight at once; "
                        "further frames wait (default 64, at least 16)")
    g.add_argument("--max-connections", type=int, default=None,
                   help="client connections, all users (default: the open-file limit less what the "
                        "kernel and its LIPs need)")
    g.add_argument("--max-connections-per-user", type=int, default=256,
                   help="client connections one user may have open (default 256)")
    g.add_argument("--root-connections", type=int, default=16,
                   help="connections kept for root beyond --max-connections' share of the others (default 16)")
    g.add_argument("--client-idle-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="close a connection with no request, no frame in flight and no LIP attached after "
                        "this long (default 600; 0: never)")


def from_args(p: argparse.ArgumentParser, args) -> ClientBounds:
    """`ClientBounds` from the flags (argparse error if one is bad)."""
    try:
        return ClientBounds(args.max_args_kb << 10, args.max_input_kb << 10, args.max_partial_mb_per_user << 20,
                            args.max_connections, args.max_connections_per_user, args.root_connections,
                            args.client_idle_timeout)
    except (ValueError, TypeError) as e:
        p.error(f"client bounds: {e} (from --max-args-kb, --max-input-kb, --max-partial-mb-per-user, "
                f"--max-connections, --max-connections-per-user, --root-connections, --client-idle-timeout)")


def open_file_limit() -> int:
    """Raise the soft open-file limit to the hard one; returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class Connections:
    """The event loop's table of client connections and of the partial frames
    each user holds (one owner: the event loop; nothing here blocks).

    ``total`` is the most connections of all users: non-root users together
    get ``total - root_reserve`` of them, root the rest as well.  ``exempt``:
    uids not held to the per-user bound (the HTTP gateway's, which opens one
    connection per LIP for many users and bounds each API key itself)."""

    def __init__(self, bounds: ClientBounds, total: int, exempt: frozenset = frozenset()):
        self.bounds, self.total, self.exempt = bounds, total, exempt
        self.by_uid: Counter = Counter()
        self.partial: Counter = Counter()           # uid -> bytes of frames being received
        self._room: dict[int, asyncio.Event] = {}   # uid -> set when its partial bytes drop
        self.refused = 0

    def __len__(self) -> int:
        return sum(self.by_uid.values())

    def open(self, uid: int) -> None:
        """Count a new connection of ``uid``; ConnectionRefused over a bound."""
        b, n, mine = self.bounds, len(self), self.by_uid[uid]
        why = None
        if uid != 0 and uid not in self.exempt and mine >= b.max_connections_per_user:
            why = (f"too many connections: uid {uid} has {mine} open, the most one user may "
                   f"(symphony-kernel --max-connections-per-user {b.max_connections_per_user})")
        elif n >= self.total or (uid != 0 and n >= self.total - b.root_connections):
            why = (f"too many connections: {n} are open, the most the kernel serves "
                   f"(symphony-kernel --max-connections {self.total}; the last {b.root_connections} are "
                   f"root's, --root-connections)")
        if why:
            self.refused += 1
            raise ConnectionRefused(why)
        self.by_uid[uid] += 1

    def close(self, uid: int) -> None:
        self.by_uid[uid] -= 1
        if self.by_uid[uid] <= 0:
            del self.by_uid[uid]

    async def reserve(self, uid: int, n: int) -> None:
        """Wait until ``uid``'s frames in flight leave room for ``n`` more bytes
        (a user with none in flight always has room for one frame)."""
        cap = self.bounds.max_partial_bytes_per_user
        while self.partial[uid] and self.partial[uid] + n > cap:
            ev = self._room.setdefault(uid, asyncio.Event())
            ev.clear()
            await ev.wait()
        self.partial[uid] += n

    def release(self, uid: int, n: int) -> None:
        self.partial[uid] -= n
        if self.partial[uid] <= 0:
            del self.partial[uid]
        ev = self._room.pop(uid, None)
        if ev is not None:
            ev.set()

    async def read_request(self, reader: asyncio.StreamReader, uid: int, idle_s: Optional[float]) -> dict:
        """One request frame of ``uid``: its header within ``idle_s`` (None: no limit;
        TimeoutError), its body under the user's partial-frame bound and within
        the idle timeout (a frame that stalls is a dead client)."""
        head = await asyncio.wait_for(reader.readexactly(4), idle_s)
        (n,) = struct.unpack(">I", head)
        if n > MAX_FRAME:
            raise ProtocolError(f"frame of {n} bytes exceeds {MAX_FRAME}")
        await self.reserve(uid, n)
        try:
            body = await asyncio.wait_for(reader.readexactly(n), self.bounds.idle_timeout_s or None)
        except asyncio.TimeoutError:
            raise ProtocolError(f"a frame of {n} bytes did not arrive within {self.bounds.idle_timeout_s:g} s "
                                f"(symphony-kernel --client-idle-timeout)") from None
        finally:
            self.release(uid, n)
        try:
            msg = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            raise ProtocolError(f"a frame that is not JSON: {e}") from None
        if not isinstance(msg, dict):
            raise ProtocolError("a frame must hold a JSON object")
        return msg
