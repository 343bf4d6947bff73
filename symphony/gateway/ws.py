"""WebSocket mode of ``/v1/responses`` (the Open Responses specification's WebSocket transport).

A client opens ``GET /v1/responses`` as a WebSocket (``Authorization: Bearer``
or ``x-api-key`` on the handshake) and sends one JSON text message per turn::

    {"type": "response.create", "model": ..., "input": ..., "previous_response_id"?: ..., ...}

(the body of ``POST /v1/responses`` without ``stream``, ``stream_options`` or
``background``, which are refused).  Each turn is answered with the same
events as a streamed HTTP response (responses.py `Turn`), each a JSON text
message, ending with ``response.completed``, ``response.incomplete`` or
``response.failed``; a turn refused before it starts gets one error envelope::

    {"type": "error", "status": 400, "error": {"type", "code", "message", "param"}}

and the connection stays open (a message that is not JSON, not an object, or
not ``response.create`` is such an error too).  Turns run one at a time, in
the order they arrive; while one runs, later messages wait (at most
``MAX_QUEUED``; beyond, the socket is not read: TCP pushes back).

**Continuation.**  The connection keeps its most recent finished response
(the conversation up to it) in memory: ``previous_response_id`` naming it
continues with only the new input, ``store: false`` included.  Another id is
looked up among the key's stored responses (``store: true``); a response made
with ``store: false`` on another connection, or one evicted, is
``previous_response_not_found``.  A continuation that fails (a 4xx or 5xx
error, or ``response.failed``) evicts the response it named from the
connection.  ``POST /v1/responses/compact``'s output, sent as ``input``,
starts a new chain.

**Bounds.**  A key may hold ``--max-sockets-per-key`` connections, the
gateway ``--max-sockets`` (beyond, the handshake is refused with 429/503); a
message is at most ``--max-body-mb``; each turn takes a request slot of its
key (rate and concurrency, limits.py) while it runs; a connection holds at
most one conversation in memory and lives ``--socket-max-age`` seconds, then
ends with the error ``websocket_connection_limit_reached`` (after the turn in
flight).  A client that goes away mid-response stops its program (its run is
closed, the kernel kills the LIP and frees its pages).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import Optional

import orjson
from starlette.responses import Response
from starlette.websockets import WebSocket, WebSocketDisconnect

from .errors import ApiError
from .files import pdfs_read
from .responses import Turn, follow, not_found
from .schema import ResponsesRequest, convert
from .store import Stored

log = logging.getLogger("symphony.gateway")
access = logging.getLogger("symphony.gateway.access")

MAX_QUEUED = 8                      # response.create messages waiting behind the one that runs
HTTP_ONLY = ("stream", "stream_options", "background")
_GONE = object()                    # the inbox's end: the client closed


class Sockets:
    """The open connections, per key (the gateway's; one event loop)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.per_key: dict[str, int] = {}
        self.total = 0

    def admit(self, key) -> None:
        """Count one more connection of ``key`` (ApiError 429/503 past the bounds)."""
        n = self.per_key.get(key.name, 0)
        if n >= self.cfg.max_sockets_per_key:
            raise ApiError(429, f"this key has {n} WebSocket connections open, its limit is "
                                f"{self.cfg.max_sockets_per_key} (symphony-gateway --max-sockets-per-key); close "
                                f"one first", code="websocket_connection_limit", retry_after=1)
        if self.total >= self.cfg.max_sockets:
            raise ApiError(503, f"the gateway has {self.total} WebSocket connections open, its most "
                                f"(--max-sockets {self.cfg.max_sockets}); retry shortly", code="overloaded",
                           retry_after=5)
        self.per_key[key.name] = n + 1
        self.total += 1

    def release(self, key) -> None:
        self.total -= 1
        self.per_key[key.name] -= 1
        if not self.per_key[key.name]:
            del self.per_key[key.name]


async def endpoint(gw, ws: WebSocket) -> None:
    """One WebSocket connection of ``/v1/responses``: authenticate, admit, serve, clean up."""
    try:
        key = gw.authenticate(ws)
        gw.sockets.admit(key)
    except ApiError as e:
        await _deny(ws, e)
        return
    try:
        await ws.accept()
        await Connection(gw, ws, key).serve()
    finally:
        gw.sockets.release(key)


class Connection:
    """One accepted connection: a reader (messages into the inbox; the client's
    going away) and the turns, one at a time."""

    def __init__(self, gw, ws: WebSocket, key):
        self.gw, self.ws, self.key = gw, ws, key
        self.id = "ws_" + secrets.token_hex(8)
        self.inbox: asyncio.Queue = asyncio.Queue(MAX_QUEUED)
        self.latest: Optional[tuple[str, Stored]] = None     # the most recent finished response: (id, record)
        self.gone = asyncio.Event()
        self.expired = False

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._read())
        timer = loop.call_later(self.gw.cfg.socket_max_age, self._expire)
        try:
            while not self.expired:
                msg = await self.inbox.get()
                if msg is _GONE:
                    return
                if not await self._while_here(self._turn(msg)):
                    return
            await self._send(_envelope(ApiError(
                400, f"Responses websocket connection limit reached ({self.gw.cfg.socket_max_age:.0f} seconds). "
                     f"Create a new websocket connection to continue.", code="websocket_connection_limit_reached")))
            with contextlib.suppress(Exception):
                await self.ws.close(1000)
        except (WebSocketDisconnect, OSError, RuntimeError):
            pass                                          # the client went away while we sent
        except Exception:                                 # a bug: say so, end this connection only
            log.exception("WebSocket connection %s (key %s) failed", self.id, self.key.name)
            with contextlib.suppress(Exception):
                await self.ws.close(1011)
        finally:
            timer.cancel()
            reader.cancel()

    async def _while_here(self, work) -> bool:
        """Run ``work`` (a turn) until it ends or the client goes away (then cancel
        it: its run is closed); whether the client is still here."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(self.gone.wait())
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            return False
        task.result()                                     # its error, if any (a bug, or the client gone)
        return True

    def _expire(self) -> None:
        self.expired = True
        if self.inbox.empty():
            self.inbox.put_nowait(None)                   # wake the loop: it ends the connection

    async def _read(self) -> None:
        try:
            while True:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                data = msg.get("text")
                if data is None:
                    data = msg.get("bytes") or b""
                await self.inbox.put(data)
        except Exception:                                 # noqa: BLE001 - any failure to read is the end
            pass
        finally:
            self.gone.set()
            with contextlib.suppress(asyncio.QueueFull):
                self.inbox.put_nowait(_GONE)
            if self.inbox.full():                         # make room for the end mark
                with contextlib.suppress(asyncio.QueueEmpty):
                    self.inbox.get_nowait()
                self.inbox.put_nowait(_GONE)

    # ------------------------------------------------------------ one turn
    async def _turn(self, data) -> None:
        if data is None:
            return
        gw, t0, state = self.gw, time.monotonic(), {"status": 200}
        turn, slot, prev_id = None, None, None
        try:
            r = self._request(data)
            prev_id = r.previous_response_id
            slot = gw.limiter.acquire(self.key.name, self.key.rpm, self.key.max_concurrent)
            gw.metrics.active.inc()
            prev = self._previous(prev_id)
            where = await follow(gw, self.key, prev)
            async with pdfs_read(data, self.key.name):  # inline PDFs read off the event loop
                turn = Turn(gw, r, self.key, gw.priority(self.ws, self.key), prev, where)
            await turn.run.start()
            await turn.run.first()
            failed = False
            try:
                async for e in turn.events():
                    await self._send(e)
            except ApiError as e:
                state["status"], failed = e.status, True
                await self._send(turn.failed(e))
            if failed:
                self._evict(prev_id)
            elif turn.record is not None:
                self.latest = (turn.rid, turn.record)
        except ApiError as e:
            state["status"] = e.status
            self._evict(prev_id)
            await self._send(_envelope(e))
        except BaseException:                             # the client went away (or a bug, logged above)
            state["status"] = 499
            raise
        finally:
            if turn is not None:
                await turn.run.close()
            if slot is not None:
                slot.release()
                gw.metrics.active.dec()
            self._log(turn, state["status"], t0)

    def _request(self, data) -> ResponsesRequest:
        """A message as a response request (ApiError 400/413 for one that is not)."""
        if len(data) > self.gw.cfg.max_body_bytes:
            raise ApiError(413, f"the message is larger than {self.gw.cfg.max_body_bytes} bytes "
                                f"(symphony-gateway --max-body-mb)", code="request_too_large")
        try:
            d = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise ApiError(400, f"the message is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(d, dict) or d.get("type") != "response.create":
            got = d.get("type") if isinstance(d, dict) else type(d).__name__
            raise ApiError(400, f"expected a JSON object with type 'response.create', got {str(got)[:64]!r}",
                           code="invalid_event", param="type")
        for f in HTTP_ONLY:
            if f in d:
                raise ApiError(400, f"{f!r} is an HTTP field: it must not be sent in a WebSocket response.create",
                               param=f)
        del d["type"]
        r = convert(d, ResponsesRequest)
        r.stream = True                                   # a socket's turns are streamed, always
        return r

    def _previous(self, rid: Optional[str]) -> Optional[Stored]:
        """The response a turn continues: this connection's latest, else the key's stored ones."""
        if not rid:
            return None
        if self.latest is not None and self.latest[0] == rid:
            return self.latest[1]
        prev = self.gw.store.get(self.key.user, rid)
        if prev is None:
            raise not_found(rid, 400)
        return prev

    def _evict(self, rid: Optional[str]) -> None:
        if rid and self.latest is not None and self.latest[0] == rid:
            self.latest = None

    async def _send(self, obj: dict) -> None:
        if self.gone.is_set():
            raise WebSocketDisconnect(1006)
        await self.ws.send_text(orjson.dumps(obj).decode())

    def _log(self, turn, status: int, t0: float) -> None:
        run = turn.run if turn is not None else None
        self.gw.metrics.requests.labels("responses.ws", str(status)).inc()
        tokens = f"{run.prompt_tokens}+{run.completion_tokens}" if run is not None else "-"
        ttft = f"{(run.first_token_at - run.started) * 1e3:.0f}ms" if run is not None and run.first_token_at else "-"
        access.info("%s WS /v1/responses responses.ws key=%s status=%s tokens=%s ttft=%s total=%.0fms", self.id,
                    self.key.name, status, tokens, ttft, (time.monotonic() - t0) * 1e3)


def _envelope(e: ApiError) -> dict:
    """An error as WebSocket mode sends it."""
    return {"type": "error", "status": e.status,
            "error": {"type": e.type, "code": e.code or e.type, "message": e.message, "param": e.param}}


async def _deny(ws: WebSocket, e: ApiError) -> None:
    """Refuse a handshake with ``e`` as an HTTP error (or a close, where the server cannot)."""
    try:
        await ws.send_denial_response(Response(e.json(), status_code=e.status, media_type="application/json",
                                               headers=e.headers()))
    except RuntimeError:
        await ws.close(1008, e.message[:120])
