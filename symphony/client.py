"""Python client for the kernel: its Unix socket, or a remote kernel's TCP port.

    from symphony.client import Client
    with Client() as c:                          # $SYMPHONY_SOCKET or the default path
        lip = c.spawn(open("lip.py").read(), args=["hello"], filename="lip.py")
        for event in c.events():                 # {"event": "out", "data": ...}, ..., {"event": "exit"}
            ...
    Client().ps(); Client().kill(3); Client().kv_ls("/shared")
    blob = Client().kv_export("/home/me/doc.kv"); Client(other).kv_import("/home/me/doc.kv", blob)
    Client("tls://10.0.0.7:7000", user="alice", credentials=Credentials.load("secret", ca="ca.pem"))

Every request is checked against its declared type before it is sent, and every
reply and event as it arrives (symphony/ipc/rpc.py): a malformed request raises
`RpcError` (a ValueError) naming the field, exactly as the kernel would refuse it.
"""
from __future__ import annotations

import hashlib
import socket
import time
from collections import deque
from typing import Iterator, Optional

from .ipc import rpc
from .ipc.protocol import recv_frame_sync, send_frame_sync
from .ipc.transport import Credentials, Endpoint, connect_sync


class KernelError(Exception):
    """The kernel refused a request: ``code`` (e.g. "EPERM") and ``type`` come from its reply."""

    def __init__(self, reply: dict):
        super().__init__(reply.get("message", "kernel error"))
        self.code, self.type = reply.get("error"), reply.get("type")


class Client:
    def __init__(self, socket_path: Optional[str] = None, user: Optional[str] = None, timeout: float = 30,
                 *, sock: Optional[socket.socket] = None, credentials: Optional[Credentials] = None):
        """Connect to the kernel at ``socket_path`` (default: $SYMPHONY_SOCKET or the
        default path), or use ``sock``, an already connected Unix socket: the kernel
        knows the caller by the credentials of whoever connected it (SO_PEERCRED).
        ``socket_path`` may also be ``tls://HOST:PORT`` (or ``tcp://`` on loopback), a
        kernel started with ``--listen``: then ``credentials`` (its shared secret and
        CA) are needed, and ``user``, the user to act as (a TCP client acts like a
        trusted gateway, for any user but root)."""
        from .ipc.protocol import default_socket_path
        self.path = socket_path or default_socket_path()
        self.user = user
        self._early: deque = deque()            # events read while awaiting a reply
        if sock is not None:
            self.sock = sock
            self.sock.settimeout(timeout)
            return
        ep = Endpoint.parse(self.path)
        if ep.remote:
            try:
                self.sock = connect_sync(ep, credentials, timeout)
            except OSError as e:
                raise ConnectionError(f"cannot reach the kernel at {ep}: {e}") from None
            self.sock.settimeout(timeout)
            return
        self.path = ep.path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        deadline = time.monotonic() + (timeout or 30)
        while True:
            try:
                self.sock.connect(self.path)
                return
            except (FileNotFoundError, ConnectionRefusedError):
                raise ConnectionError(f"no kernel is listening on {self.path} (start one with symphony-kernel)") from None
            except BlockingIOError:            # the kernel's backlog is full for a moment: try again
                if time.monotonic() > deadline:
                    raise ConnectionError(f"the kernel on {self.path} accepts no connection (its backlog "
                                          f"stayed full)") from None
                time.sleep(0.01)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Close the connection (the kernel detaches this client from its LIPs)."""
        self.sock.close()

    def request(self, msg: dict) -> dict:
        """Send one request frame and return the kernel's reply; RpcError (before sending)
        if it does not fit its type, KernelError if the kernel refused it."""
        req = self._send(msg)
        return self._reply(req)

    def _send(self, msg: dict):
        if self.user:
            msg = dict(msg, user=self.user)
        req = rpc.check_request(msg)
        send_frame_sync(self.sock, msg)
        return req

    def _reply(self, req) -> dict:
        """The reply to ``req``: the next frame that is not an attached LIP's event (those
        are kept, in order, for `events`)."""
        while True:
            reply = recv_frame_sync(self.sock)
            if reply is None:
                raise ConnectionError("the kernel closed the connection")
            if not _is_reply(req, reply):
                self._early.append(rpc.check_event(reply))
                continue
            rpc.check_reply(req, reply)
            if "error" in reply:
                raise KernelError(reply)
            return reply

    def spawn(self, source: str, args=(), **kw) -> int:
        """Start a LIP from its ``source`` text with ``args``; returns its id, whether
        it started or waits in the admission queue (`launch` says which)."""
        return self.launch(source, args, **kw)["lip"]

    def launch(self, source: str, args=(), *, filename: str = "lip.py", grants: Optional[dict] = None,
               limits: Optional[dict] = None, attach: bool = True, priority="normal",
               kv_tokens: Optional[int] = None) -> dict:
        """Start a LIP; returns the kernel's reply: {"event": "started", "lip"}, or
        {"event": "queued", "lip", "position", "waiting_for"} when it waits for a LIP
        slot or KV memory (an attached client then gets {"event": "started", "lip",
        "waited_s"} among its events once it starts).  ``grants``: {"http": [...],
        "read": [...]}; ``limits``: ceilings asked for (memory_bytes, cpu_seconds,
        timeout (which counts the wait), threads); ``attach``: stream its events to
        this client; ``kv_tokens``: the KV tokens it is expected to need (admission
        waits for that much free KV memory).  (A stock program's source:
        ``symphony.programs.resolve(name).read_text()``.)"""
        msg = {"op": "spawn", "source": source, "filename": filename, "args": list(args),
               "grants": grants or {}, "limits": limits or {}, "attach": attach, "priority": priority}
        if kv_tokens is not None:
            msg["kv_tokens"] = kv_tokens
        return self.request(msg)

    def events(self, timeout: Optional[float] = None) -> Iterator[dict]:
        """The attached LIPs' events until the (first) exit event.  If the kernel
        goes away first (it stopped or crashed), the last event is a synthesized
        ``{"event": "exit", "status": 1, "reason": "lost: ...", "lost": True}``:
        the LIP's fate is unknown, and the caller is told so, never left waiting."""
        self.sock.settimeout(timeout)
        while self._early:                       # events that came while a reply was awaited
            ev = self._early.popleft()
            yield ev
            if ev.get("event") == "exit":
                return
        while True:
            try:
                ev = recv_frame_sync(self.sock)
            except (ConnectionError, OSError) as e:
                if isinstance(e, TimeoutError):
                    raise
                ev, why = None, f"{type(e).__name__}: {e}"
            else:
                why = "the kernel closed the connection"
            if ev is None:
                yield {"event": "exit", "status": 1, "lost": True,
                       "reason": f"lost: {why} before the LIP exited (the kernel stopped or crashed)"}
                return
            rpc.check_event(ev)
            yield ev
            if ev.get("event") == "exit":
                return

    def send_input(self, lip: int, data: Optional[str]) -> None:
        """Give LIP ``lip`` one line for its recv(); ``None`` ends its input."""
        self._send({"op": "input", "lip": lip, **({"eof": True} if data is None else {"data": data})})

    def kill(self, lip: int) -> dict:
        """Kill LIP ``lip`` (its owner or root)."""
        return self.request({"op": "kill", "lip": lip})

    def ps(self) -> dict:
        """The live LIPs: {"lips": [{"lip", "user", "state", "pid", "preds", "tokens", ...}]};
        a queued one (state "queued") also has "position" and "waited_s"."""
        return self.request({"op": "ps"})

    def stats(self) -> dict:
        """The kernel's counters (instance, KV pages, LIPs, ...)."""
        return self.request({"op": "stats"})

    def kv_ls(self, path: str = "/") -> list:
        """The entries of KVFS directory ``path``, as this client's user sees them."""
        return self.request({"op": "kv_ls", "path": path})["entries"]

    def kv_rm(self, path: str) -> None:
        """Remove the KV file ``path``."""
        self.request({"op": "kv_rm", "path": path})

    def kv_stat(self, path: str) -> dict:
        """The metadata of KV file ``path`` (owner, mode, length, pages, ...)."""
        return self.request({"op": "kv_stat", "path": path})

    def shutdown(self) -> None:
        """Stop the kernel (root only)."""
        self.request({"op": "shutdown"})

    def drain(self) -> None:
        """Stop the kernel taking new LIPs while those running finish (root only); a gateway
        sees it in `stats` and sends new requests, and the KV files it can, elsewhere."""
        self.request({"op": "drain"})

    def kv_export(self, path: str) -> bytes:
        """The bytes of KV file ``path`` (this user must be allowed to read it): the durable
        file format, checksummed, readable by `kv_import` on any kernel of the same model."""
        req = self._send({"op": "kv_export", "path": path})
        head = self._reply(req)
        blob = b"".join(rpc.recv_raw_sync(self.sock) for _ in range(head["chunks"]))
        if (len(blob) != head["size"] or len(blob) < 44 or blob[-32:].hex() != head["sha256"]
                or hashlib.sha256(memoryview(blob)[12:-32]).hexdigest() != head["sha256"]):
            raise rpc.ReplyError("an export's bytes do not match the size and SHA-256 the kernel announced")
        return blob

    def kv_import(self, path: str, blob: bytes, mode: Optional[int] = None) -> dict:
        """Make KV file ``path`` from exported bytes, as this client's user (who must be
        able to create it; it counts against their quota); {"path", "length", "pages"}.
        KernelError EBADMSG if another model wrote it or a byte differs."""
        frames = rpc.raw_frames(blob)
        msg = {"op": "kv_import", "path": path, "size": len(blob), "sha256": bytes(memoryview(blob)[-32:]).hex(),
               "chunks": len(frames)}
        if mode is not None:
            msg["mode"] = mode
        req = self._send(msg)
        for h, data in frames:
            self.sock.sendall(h)
            self.sock.sendall(data)
        return self._reply(req)

    def kv_adopt(self, peer: str, directory: str) -> dict:
        """Import the durable files a dead kernel left below KVFS ``directory`` that this
        user owned (``peer``: its durable directory's id, from its `stats`; this kernel
        must have been given that directory with --peer-durable-dir)."""
        return self.request({"op": "kv_adopt", "peer": peer, "dir": directory})


def _is_reply(req, frame: dict) -> bool:
    """Whether ``frame`` answers ``req`` rather than being an attached LIP's event: an
    error, or a frame without "event"; for a spawn, its started (no ``waited_s``: that is
    a queued LIP starting later) or queued reply."""
    if "error" in frame or "event" not in frame:
        return True
    return isinstance(req, rpc.Spawn) and (frame["event"] == "queued" or
                                           (frame["event"] == "started" and "waited_s" not in frame))


def run(source: str, args=(), **kw) -> tuple[int, list]:
    """Run a LIP to completion; returns (exit status, events)."""
    sock = kw.pop("socket_path", None)
    user = kw.pop("user", None)
    with Client(sock, user=user) as c:
        c.spawn(source, args, **kw)
        evs = list(c.events())
    return (evs[-1]["status"] if evs and evs[-1].get("event") == "exit" else -1), evs
