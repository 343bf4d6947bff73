"""The front door: what a client may hold of the gateway before and between its requests.

uvicorn alone bounds none of it: a connection that sends its headers one line
every few seconds is kept for ever, headers may grow without limit, a body
may trickle in for ever, and its only global bound (``limit_concurrency``)
counts every open connection, half-sent ones included, and answers 503 to
everyone once one address has opened that many.  `Door` holds the bounds
(`DoorConfig`, from the gateway's configuration) and the connections of every
client address; `protocol_class(door)` is uvicorn's httptools protocol with
the door in front of it.  Each connection is in one of three states:

    PENDING   opened, or its next request begun, and its headers not all
              received: not authenticated yet
    ACTIVE    its request is being served (authenticated: the per-key limits
              of limits.py apply from here on)
    IDLE      kept alive between requests

and the bounds are:

* **time**: the headers of a request must arrive within ``header_timeout``
  (the first byte included; 408, then closed); a request body within
  ``body_timeout`` of its headers, one second more for each 64 KiB received
  (the connection is closed: the route sees the client leave); a response
  whose client takes nothing for ``write_timeout`` (its send buffer full) is
  closed, and its program with it; an idle connection is closed after
  ``keep_alive_timeout`` (uvicorn's own timer);
* **size**: the request line and headers at most ``max_header_bytes`` (431,
  then closed);
* **per client address** (IPv4, or an IPv6 /64): at most ``max_per_addr``
  connections open and ``max_pending_per_addr`` PENDING for longer than
  ``pending_grace`` (1 s: a burst of honest clients opening at once is all
  PENDING for a moment; the connections a slow-headers attack holds are old).
  Beyond the first, the address's own oldest IDLE connection is closed, else
  its oldest PENDING one; with none, the new connection gets 503 and is
  closed.  Beyond the second (checked whenever the address opens a
  connection or begins a request), its oldest PENDING ones are closed;
* **in all**: at most ``max_connections``.  Beyond it, room is made the same
  way at the address holding the most connections, if that is another
  address holding more than this one; otherwise the new connection gets 503.

So one address can hold at most its own bounds, and a flood from it only
ever closes its own connections.  A WebSocket connection stays counted
against its address after the upgrade (`protocol_class` wraps the
WebSocket protocol uvicorn hands the transport to) and is ACTIVE for its
life; a WebSocket route bounds its sessions per key itself (limits.py).
A TLS handshake that never completes is not seen here (the event loop's
own handshake timeout, 60 s, bounds it).  Behind a reverse proxy every
client has the proxy's address: raise the per-address bounds there.
"""
from __future__ import annotations

import asyncio
import enum
import ipaddress
import logging
import socket
import struct
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("symphony.gateway")

BODY_GRACE_BYTES = 64 << 10          # each 64 KiB received gives a body one more second


class State(enum.Enum):
    PENDING = "pending"
    ACTIVE = "active"
    IDLE = "idle"


@dataclass(frozen=True)
class DoorConfig:
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    write_timeout: float = 60.0
    keep_alive_timeout: float = 30.0
    max_header_bytes: int = 64 << 10
    max_connections: int = 4096
    max_per_addr: int = 256
    max_pending_per_addr: int = 16
    pending_grace: float = 1.0          # a connection PENDING this long counts against max_pending_per_addr

    def __post_init__(self):
        if not isinstance(self.pending_grace, (int, float)) or not 0 <= self.pending_grace <= 60:
            raise ValueError(f"pending_grace must be in [0, 60] seconds, got {self.pending_grace!r}")
        for name in ("header_timeout", "body_timeout", "write_timeout", "keep_alive_timeout"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 < v <= 86400:
                raise ValueError(f"{name} must be in (0, 86400] seconds, got {v!r}")
        for name in ("max_header_bytes", "max_connections", "max_per_addr", "max_pending_per_addr"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.max_header_bytes < 1024:
            raise ValueError("max_header_bytes must be >= 1024")


def address_of(peer) -> str:
    """A client's address for the per-address bounds: the IPv4 address, the
    /64 of an IPv6 one (one host may hold a whole /64), else "local"."""
    if not peer:
        return "local"
    host = peer[0] if isinstance(peer, (tuple, list)) else str(peer)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return str(host)
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class Door:
    """Every open connection by client address, and what was refused or closed
    (`stats`).  Lives on the gateway's event loop."""

    def __init__(self, cfg: DoorConfig = DoorConfig()):
        self.cfg = cfg
        self.conns: dict[str, dict] = {}            # address -> {protocol: None}, oldest first
        self.open = 0
        self.counts: Counter = Counter()            # refused, evicted, header/body/write timeouts, too large

    def stats(self) -> dict:
        pending = sum(1 for a in self.conns.values() for p in a if p.door_state is State.PENDING)
        return {"connections": self.open, "pending": pending, "addresses": len(self.conns), **self.counts}

    def collect(self):
        """prometheus-client's collector interface: the door's gauges and counters
        (``registry.register(door)``)."""
        st = self.stats()
        yield GaugeMetricFamily("symphony:gateway_connections", "Client connections open", value=st["connections"])
        yield GaugeMetricFamily("symphony:gateway_connections_pending", "Client connections whose request's "
                                "headers have not all arrived", value=st["pending"])
        yield GaugeMetricFamily("symphony:gateway_client_addresses", "Client addresses with connections open",
                                value=st["addresses"])
        c = CounterMetricFamily("symphony:gateway_connections_closed", "Connections the front door refused or "
                                "closed, by why", labels=["reason"])
        for why in ("refused_per_address", "refused_full", "evicted_pending", "evicted_idle", "header_timeouts",
                    "body_timeouts", "write_timeouts", "too_large_headers"):
            c.add_metric([why], self.counts[why])
        yield c

    # ------------------------------------------------------------------ the policy
    def admit(self, conn) -> bool:
        """A connection from ``conn.door_addr`` opens (PENDING); False: refuse it.
        May close other connections of the same address, or of the heaviest one."""
        here = self.conns.setdefault(conn.door_addr, {})
        if len(here) >= self.cfg.max_per_addr and not self._make_room(here, idle_first=True):
            self._forget_if_empty(conn.door_addr)
            self.counts["refused_per_address"] += 1
            return False
        if self.open >= self.cfg.max_connections:
            heaviest = max(self.conns, key=lambda a: len(self.conns[a]))
            mine = len(here)
            if heaviest == conn.door_addr or len(self.conns[heaviest]) <= mine + 1 or \
                    not self._make_room(self.conns[heaviest], idle_first=True):
                self._forget_if_empty(conn.door_addr)
                self.counts["refused_full"] += 1
                return False
        here[conn] = None
        self.open += 1
        conn.door_state, conn.door_since = State.PENDING, time.monotonic()
        self._limit_pending(conn)
        return True

    def pending(self, conn) -> None:
        """``conn`` begins a request: PENDING until its headers are in."""
        if conn.door_state is not State.PENDING:
            conn.door_state, conn.door_since = State.PENDING, time.monotonic()
            here = self.conns.get(conn.door_addr)
            if here is not None and conn in here:       # oldest-first order: it is the newest now
                del here[conn]
                here[conn] = None
            self._limit_pending(conn)

    def release(self, conn) -> None:
        here = self.conns.get(conn.door_addr)
        if here is not None and conn in here:
            del here[conn]
            self.open -= 1
            self._forget_if_empty(conn.door_addr)

    # ------------------------------------------------------------------ helpers
    def _limit_pending(self, conn) -> None:
        here, old = self.conns[conn.door_addr], time.monotonic() - self.cfg.pending_grace
        pending = [p for p in here if p.door_state is State.PENDING and p.door_since <= old]
        while len(pending) > self.cfg.max_pending_per_addr:
            victim = pending.pop(0)                      # the oldest: this address's slowest
            self.counts["evicted_pending"] += 1
            victim.door_close(408)

    def _make_room(self, here: dict, idle_first: bool) -> bool:
        """Close one connection of ``here``: its oldest IDLE, else its oldest PENDING."""
        for state in ((State.IDLE, State.PENDING) if idle_first else (State.PENDING,)):
            for p in here:
                if p.door_state is state:
                    self.counts["evicted_" + state.value] += 1
                    p.door_close(408 if state is State.PENDING else None)
                    return True
        return False

    def _forget_if_empty(self, addr: str) -> None:
        if not self.conns.get(addr, True):
            del self.conns[addr]


def protocol_class(door: Door) -> type:
    """uvicorn's httptools protocol behind ``door`` (pass it as uvicorn's ``http``)."""
    return type("GuardedHttpProtocol", (GuardedHttp,), {"door": door})


_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


class GuardedHttp(HttpToolsProtocol):
    """HttpToolsProtocol with the door's bounds (see the module docstring)."""

    door: Door

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.door_addr = "local"
        self.door_state: Optional[State] = None
        self.door_header_bytes = 0
        self.door_timer: Optional[asyncio.TimerHandle] = None
        self.door_body_deadline = 0.0
        self.door_write_timer: Optional[asyncio.TimerHandle] = None
        self.door_closed = False

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.door_addr = address_of(self.client)
        if not self.door.admit(self):
            self.door_close(503)
            return
        self._arm(self.door.cfg.header_timeout, self._header_timeout)

    def connection_lost(self, exc) -> None:
        self._disarm()
        self._cancel_write_timer()
        self.door.release(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.door_closed:
            return
        if self.door_state is State.ACTIVE and self.door_body_deadline:
            self.door_body_deadline += len(data) / BODY_GRACE_BYTES
        super().data_received(data)

    # ------------------------------------------------------------------ the parser's moments
    def on_message_begin(self) -> None:
        if self.door_closed:
            return
        super().on_message_begin()
        self.door_header_bytes = 0
        if self.door_state is not State.PENDING:
            self.door.pending(self)
            self._arm(self.door.cfg.header_timeout, self._header_timeout)

    def on_url(self, url: bytes) -> None:
        if self._header_bytes(len(url)):
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._header_bytes(len(name) + len(value) + 4):
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self.door_closed:
            return
        self._disarm()
        self.door_state = State.ACTIVE
        if any(n == b"transfer-encoding" or (n == b"content-length" and v.strip() not in (b"", b"0"))
               for n, v in self.headers):
            self.door_body_deadline = self.loop.time() + self.door.cfg.body_timeout
            self._arm(self.door.cfg.body_timeout, self._body_timeout)
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self.door_closed:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self.door_closed:
            return
        self._disarm()
        self.door_body_deadline = 0.0
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.pipeline or self.door_closed:
            return
        self.door_state = State.IDLE
        self.door_header_bytes = 0

    def handle_websocket_upgrade(self) -> None:
        self._disarm()
        self.door_state = State.ACTIVE
        super().handle_websocket_upgrade()
        ws = self.transport.get_protocol()
        if ws is not self:
            self.transport.set_protocol(_Counted(ws, lambda: self.door.release(self)))

    # ------------------------------------------------------------------ writes the client does not take
    def pause_writing(self) -> None:
        super().pause_writing()
        if self.door_write_timer is None:
            self.door_write_timer = self.loop.call_later(self.door.cfg.write_timeout, self._write_timeout)

    def resume_writing(self) -> None:
        self._cancel_write_timer()
        super().resume_writing()

    # ------------------------------------------------------------------ helpers
    def door_close(self, status: Optional[int]) -> None:
        """Close this connection (the door's verdict): with ``status`` when no
        response has started on it, else cut."""
        if self.door_closed:
            return
        self.door_closed = True
        self._disarm()
        self.door.release(self)                         # its room is free now, not when the loop says so
        idle = self.cycle is None or self.cycle.response_complete
        if status is not None and idle and not self.transport.is_closing():
            reason = _REASONS[status]
            self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                                 % (status, reason, len(reason), reason))
            self.transport.close()
        else:
            _reset(self.transport)

    def _header_bytes(self, n: int) -> bool:
        """Count ``n`` bytes of a request's line and headers; False (and the
        connection closed with 431) beyond ``max_header_bytes``."""
        if self.door_closed:
            return False
        self.door_header_bytes += n
        if self.door_header_bytes <= self.door.cfg.max_header_bytes:
            return True
        self.door.counts["too_large_headers"] += 1
        self.door_close(431)
        return False

    def _arm(self, seconds: float, fn) -> None:
        self._disarm()
        self.door_timer = self.loop.call_later(seconds, fn)

    def _disarm(self) -> None:
        if self.door_timer is not None:
            self.door_timer.cancel()
            self.door_timer = None

    def _cancel_write_timer(self) -> None:
        if self.door_write_timer is not None:
            self.door_write_timer.cancel()
            self.door_write_timer = None

    def _header_timeout(self) -> None:
        self.door_timer = None
        if self.door_state is State.PENDING:
            self.door.counts["header_timeouts"] += 1
            self.door_close(408)

    def _body_timeout(self) -> None:
        self.door_timer = None
        late = self.door_body_deadline - self.loop.time()
        if late > 0:                                      # the body kept coming: its deadline moved
            self._arm(late, self._body_timeout)
            return
        self.door.counts["body_timeouts"] += 1
        self.door_close(None)

    def _write_timeout(self) -> None:
        self.door_write_timer = None
        self.door.counts["write_timeouts"] += 1
        self.door_close(None)


def _reset(transport) -> None:
    """Close with a reset (SO_LINGER 0): what is still queued for a client that
    stopped reading is dropped now, not kept in the socket's send buffer."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()


class _Counted(asyncio.Protocol):
    """A protocol another one handed its transport to (a WebSocket after the
    upgrade), still counted against its address until it closes."""

    def __init__(self, inner: asyncio.Protocol, on_lost):
        self.inner, self.on_lost = inner, on_lost

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc) -> None:
        try:
            self.inner.connection_lost(exc)
        finally:
            self.on_lost()
