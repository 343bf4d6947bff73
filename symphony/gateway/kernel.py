"""The gateway's side of a kernel's socket (the client RPC, ipc/rpc.py): a Unix socket, or a
remote kernel's TCP port (``tls://HOST:PORT``: TLS and the shared-secret handshake,
ipc/transport.py).  Requests are checked against their types before they are sent,
replies and events as they arrive; a kernel whose reply does not fit is unreachable.

One connection per LIP: `KernelLink.start` opens a connection, spawns the LIP
attached to it and returns a `LipSession` that reads the LIP's events.  The
kernel kills an attached LIP when its connection closes, so an HTTP client
that goes away (the session is closed) takes its LIP and its KV pages with it.
Other requests (`ps`, `stats`, `kv_*`) use a short connection each.

The gateway names the user it acts for in every request (`"user"`); the
kernel accepts that only from root or from the uid it was told is the
gateway's (`symphony-kernel --gateway-uid`), and never for root.
Back-pressure: a session's events are read only as fast as its HTTP client
takes them, so the kernel's output credit stops a LIP whose client reads
slowly (its send() waits) instead of buffering here.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, Optional

import ssl

from symphony.ipc import rpc
from symphony.ipc.protocol import ProtocolError, encode_frame, read_frame
from symphony.ipc.transport import AuthError, Credentials, Endpoint, open_connection

CONNECT_TIMEOUT_S = 10.0


class KernelUnavailable(ConnectionError):
    """The kernel cannot be reached (not started, stopped, or crashed)."""


class KernelRefused(Exception):
    """The kernel refused a request: its error reply (``code``, ``type``, message)."""

    def __init__(self, reply: dict):
        super().__init__(str(reply.get("message", "kernel error")))
        self.code, self.type = reply.get("error"), reply.get("type")


class LipSession:
    """One LIP spawned by the gateway, attached to its own kernel connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, user: str, reply: dict):
        self.reader, self.writer, self.user = reader, writer, user
        self.lip: int = reply["lip"]
        self.first = reply                   # {"event": "started"|"queued", ...}
        self.exit: Optional[dict] = None     # the exit event, once seen
        self.kernel = None                   # the kernels.Kernel it runs on (set by Kernels.spawn)
        self.on_close: Optional[Callable[[], None]] = None     # called once, by close()
        self.on_lost: Optional[Callable[[str], None]] = None   # the connection dropped before the exit

    async def events(self) -> AsyncIterator[dict]:
        """The LIP's events ({"event": "out"|"stdout"|"stderr"|"started", ...})
        up to and including its exit event.  If the kernel goes away first, the
        last event is a synthesized exit with ``"lost": True``."""
        while self.exit is None:
            try:
                ev = await read_frame(self.reader)
            except (asyncio.IncompleteReadError, ConnectionError, ProtocolError, OSError) as e:
                ev = {"event": "exit", "status": 1, "lost": True,
                      "reason": f"lost: the kernel connection closed before the LIP exited ({type(e).__name__})"}
                if self.on_lost is not None:
                    self.on_lost(type(e).__name__)
            if "event" not in ev:            # a reply to a kill sent on this connection
                continue
            try:
                rpc.check_event(ev)
            except rpc.ReplyError as e:
                ev = {"event": "exit", "status": 1, "lost": True, "reason": f"lost: {e}"}
                if self.on_lost is not None:
                    self.on_lost("ReplyError")
            if ev["event"] == "exit":
                self.exit = ev
            yield ev

    async def send_input(self, data: Optional[str]) -> None:
        """One line for the LIP's recv(); None ends its input."""
        msg = {"op": "input", "lip": self.lip, "user": self.user}
        msg.update({"eof": True} if data is None else {"data": data})
        self.writer.write(encode_frame(msg))
        await self.writer.drain()

    async def kill(self) -> None:
        """Ask the kernel to kill the LIP (its exit event still follows)."""
        if self.exit is None and not self.writer.is_closing():
            self.writer.write(encode_frame({"op": "kill", "lip": self.lip, "user": self.user}))
            try:
                await self.writer.drain()
            except (ConnectionError, OSError):
                pass

    async def close(self) -> None:
        """Close the connection: a LIP still running is killed by the kernel."""
        done, self.on_close = self.on_close, None
        if done is not None:
            done()
        if not self.writer.is_closing():
            self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass


class KernelLink:
    """Requests to the kernel at ``address`` (a Unix socket path, or ``tls://HOST:PORT``
    with ``credentials``) on behalf of named users."""

    def __init__(self, address: str, credentials: Optional[Credentials] = None):
        self.endpoint = Endpoint.parse(address)
        self.address = self.socket_path = str(self.endpoint)
        self.credentials = credentials

    async def _connect(self):
        try:
            return await open_connection(self.endpoint, self.credentials, CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError, ssl.SSLError) as e:
            why = f"{type(e).__name__}: {e}" if isinstance(e, (AuthError, ssl.SSLError)) else str(e) or type(e).__name__
            raise KernelUnavailable(f"the kernel at {self.address} is not reachable: {why}") from None

    async def _ask(self, reader, writer, msg: dict, frames: list = ()) -> dict:
        try:
            req = rpc.check_request(msg)              # refused here as the kernel would refuse it
        except rpc.RpcError as e:
            raise KernelRefused({"error": e.code, "type": "RpcError", "message": str(e)}) from None
        writer.write(encode_frame(msg))
        for h, data in frames:                      # raw frames of KV data (an import)
            writer.write(h)
            writer.write(data)
            await writer.drain()
        await writer.drain()
        return await self._answer(reader, req)

    async def _answer(self, reader, req) -> dict:
        try:
            reply = await read_frame(reader)
            rpc.check_reply(req, reply)
        except (asyncio.IncompleteReadError, ConnectionError, ProtocolError, OSError) as e:
            raise KernelUnavailable(f"the kernel closed the connection ({type(e).__name__})") from None
        if "error" in reply:
            raise KernelRefused(reply)
        return reply

    async def request(self, user: str, msg: dict) -> dict:
        """One request (ps, stats, kv_ls, kv_stat, kv_rm, kv_adopt) as ``user``; its reply."""
        reader, writer = await self._connect()
        try:
            return await self._ask(reader, writer, dict(msg, user=user))
        finally:
            writer.close()

    async def export(self, user: str, path: str) -> bytes:
        """KV file ``path``'s bytes, read as ``user`` (KernelRefused if they may not)."""
        reader, writer = await self._connect()
        try:
            req = rpc.KvExport(path=path, user=user)
            head = await self._ask(reader, writer, {"op": "kv_export", "path": path, "user": user})
            parts = []
            for _ in range(head["chunks"]):
                try:
                    parts.append(await rpc.read_raw(reader))
                except (asyncio.IncompleteReadError, ConnectionError, OSError, rpc.RpcError) as e:
                    raise KernelUnavailable(f"an export from {self.address} broke off ({type(e).__name__})") from None
            blob = b"".join(parts)
            if len(blob) != head["size"] or blob[-32:].hex() != head["sha256"]:   # the importer checks the content
                raise KernelUnavailable(f"an export of {req.path} from {self.address} came cut short")
            return blob
        finally:
            writer.close()

    async def import_(self, user: str, path: str, blob: bytes) -> dict:
        """Make KV file ``path`` (and the directories above it) from ``blob`` as ``user``;
        the kernel's `Imported` reply."""
        reader, writer = await self._connect()
        frames = rpc.raw_frames(blob)
        try:
            return await self._ask(reader, writer, {"op": "kv_import", "path": path, "user": user, "size": len(blob),
                                                    "sha256": blob[-32:].hex(), "parents": True,
                                                    "chunks": len(frames)}, frames)
        finally:
            writer.close()

    async def start(self, user: str, source: str, args: list, *, filename: str, grants: dict,
                    limits: dict, priority: str, kv_tokens: Optional[int] = None) -> LipSession:
        """Spawn a LIP for ``user`` attached to a new connection; KernelRefused
        if the kernel refuses it (bad program, over a limit, queue full)."""
        reader, writer = await self._connect()
        msg = {"op": "spawn", "user": user, "source": source, "filename": filename, "args": list(args),
               "grants": grants, "limits": limits, "attach": True, "priority": priority}
        if kv_tokens is not None:
            msg["kv_tokens"] = kv_tokens
        try:
            reply = await self._ask(reader, writer, msg)
        except BaseException:
            writer.close()
            raise
        return LipSession(reader, writer, user, reply)
