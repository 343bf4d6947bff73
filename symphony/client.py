"""Python client for the kernel's Unix socket.

    from symphony.client import Client
    with Client() as c:                          # $SYMPHONY_SOCKET or the default path
        lip = c.spawn(open("lip.py").read(), args=["hello"], filename="lip.py")
        for event in c.events():                 # {"event": "out", "data": ...}, ..., {"event": "exit"}
            ...
    Client().ps(); Client().kill(3); Client().kv_ls("/shared")
"""
from __future__ import annotations

import socket
from typing import Iterator, Optional

from .ipc.protocol import recv_frame_sync, send_frame_sync


class KernelError(Exception):
    def __init__(self, reply: dict):
        super().__init__(reply.get("message", "kernel error"))
        self.code, self.type = reply.get("error"), reply.get("type")


class Client:
    def __init__(self, socket_path: Optional[str] = None, user: Optional[str] = None, timeout: float = 30,
                 *, sock: Optional[socket.socket] = None):
        """Connect to the kernel at ``socket_path`` (default: $SYMPHONY_SOCKET or the
        default path), or use ``sock``, an already connected Unix socket: the kernel
        knows the caller by the credentials of whoever connected it (SO_PEERCRED)."""
        from .ipc.protocol import default_socket_path
        self.path = socket_path or default_socket_path()
        self.user = user
        if sock is not None:
            self.sock = sock
            self.sock.settimeout(timeout)
            return
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(self.path)
        except (FileNotFoundError, ConnectionRefusedError):
            raise ConnectionError(f"no kernel is listening on {self.path} (start one with symphony-kernel)") from None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.sock.close()

    def request(self, msg: dict) -> dict:
        if self.user:
            msg = dict(msg, user=self.user)
        send_frame_sync(self.sock, msg)
        reply = recv_frame_sync(self.sock)
        if reply is None:
            raise ConnectionError("the kernel closed the connection")
        if "error" in reply:
            raise KernelError(reply)
        return reply

    def spawn(self, source: str, args=(), *, filename: str = "lip.py", grants: Optional[dict] = None,
              limits: Optional[dict] = None, attach: bool = True, priority="normal") -> int:
        r = self.request({"op": "spawn", "source": source, "filename": filename, "args": list(args),
                          "grants": grants or {}, "limits": limits or {}, "attach": attach,
                          "priority": priority})
        return r["lip"]

    def events(self, timeout: Optional[float] = None) -> Iterator[dict]:
        """The attached LIPs' events until the (first) exit event.  If the kernel
        goes away first (it stopped or crashed), the last event is a synthesized
        ``{"event": "exit", "status": 1, "reason": "lost: ...", "lost": True}``:
        the LIP's fate is unknown, and the caller is told so, never left waiting."""
        self.sock.settimeout(timeout)
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
            yield ev
            if ev.get("event") == "exit":
                return

    def send_input(self, lip: int, data: Optional[str]) -> None:
        msg = {"op": "input", "lip": lip, **({"eof": True} if data is None else {"data": data})}
        if self.user:
            msg["user"] = self.user
        send_frame_sync(self.sock, msg)

    def kill(self, lip: int) -> dict:
        return self.request({"op": "kill", "lip": lip})

    def ps(self) -> dict:
        return self.request({"op": "ps"})

    def stats(self) -> dict:
        return self.request({"op": "stats"})

    def kv_ls(self, path: str = "/") -> list:
        return self.request({"op": "kv_ls", "path": path})["entries"]

    def kv_rm(self, path: str) -> None:
        self.request({"op": "kv_rm", "path": path})

    def kv_stat(self, path: str) -> dict:
        return self.request({"op": "kv_stat", "path": path})

    def shutdown(self) -> None:
        self.request({"op": "shutdown"})


def run(source: str, args=(), **kw) -> tuple[int, list]:
    """Run a LIP to completion; returns (exit status, events)."""
    sock = kw.pop("socket_path", None)
    user = kw.pop("user", None)
    with Client(sock, user=user) as c:
        c.spawn(source, args, **kw)
        evs = list(c.events())
    return (evs[-1]["status"] if evs and evs[-1].get("event") == "exit" else -1), evs
