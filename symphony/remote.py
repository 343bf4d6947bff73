"""A client of the HTTP gateway's program endpoints: ``symphony run --remote URL``.

    from symphony.remote import RemoteClient
    rc = RemoteClient("https://gpu-box:8000", key)        # key: $SYMPHONY_API_KEY by default
    run = rc.launch(source, ["arg"], filename="lip.py")   # POST /v1/lips, an SSE stream
    run.first                                             # {"event": "started"|"queued", "lip", ...}
    for ev in run.events():                               # out / stdout / stderr / started ... exit
        ...
    rc.send_input(run.lip, "a line"); rc.kill(run.lip)

Events are the kernel's own (the same dicts `symphony.client.Client.events`
yields), so ``symphony run`` prints them the same way, local or remote.
Standard library only (http.client): the client machine needs nothing more.
"""
from __future__ import annotations

import http.client
import json
import os
import ssl
from typing import Iterator, Optional
from urllib.parse import urlsplit


class RemoteError(Exception):
    """The gateway refused a request: ``status`` and its OpenAI-shaped error."""

    def __init__(self, status: int, message: str, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.code = status, code


class RemoteRun:
    def __init__(self, resp: http.client.HTTPResponse, conn):
        self._resp, self._conn = resp, conn
        self.first = next(self._frames(), None) or {"event": "exit", "status": 1, "lost": True,
                                                   "reason": "lost: the gateway closed the stream at once"}
        self.lip = self.first.get("lip")

    def _frames(self) -> Iterator[dict]:
        data = []
        while True:
            line = self._resp.readline()
            if not line:
                return
            line = line.rstrip(b"\r\n")
            if line.startswith(b"data:"):
                data.append(line[5:].strip())
            elif not line and data:
                yield json.loads(b"\n".join(data))
                data = []

    def events(self) -> Iterator[dict]:
        """The LIP's events up to its exit (a synthesized ``lost`` exit if the
        connection ends first)."""
        try:
            for ev in self._frames():
                yield ev
                if ev.get("event") == "exit":
                    return
        except (OSError, http.client.HTTPException, ValueError) as e:
            why = f"{type(e).__name__}: {e}"
        else:
            why = "the gateway closed the stream"
        yield {"event": "exit", "status": 1, "lost": True, "reason": f"lost: {why} before the LIP exited"}

    def close(self) -> None:
        self._conn.close()


class RemoteClient:
    def __init__(self, url: str, key: Optional[str] = None, timeout: float = 30):
        u = urlsplit(url if "://" in url else "http://" + url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"--remote {url!r}: expected http(s)://HOST[:PORT]")
        self.scheme, self.host = u.scheme, u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.base = u.path.rstrip("/")
        self.key = key if key is not None else os.environ.get("SYMPHONY_API_KEY")
        self.timeout = timeout

    def _conn(self, timeout: Optional[float]):
        if self.scheme == "https":
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout,
                                               context=ssl.create_default_context())
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def _send(self, method: str, path: str, body=None, timeout: Optional[float] = -1):
        conn = self._conn(self.timeout if timeout == -1 else timeout)
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        try:
            conn.request(method, self.base + path, body=None if body is None else json.dumps(body), headers=headers)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise ConnectionError(f"no gateway answers at {self.scheme}://{self.host}:{self.port}: {e}") from None
        if resp.status >= 400:
            raw = resp.read()
            conn.close()
            try:
                err = json.loads(raw)["error"]
                raise RemoteError(resp.status, err.get("message", ""), err.get("code"))
            except (ValueError, KeyError, TypeError):
                raise RemoteError(resp.status, raw.decode("utf-8", "replace")[:500]) from None
        return conn, resp

    def _json(self, method: str, path: str, body=None) -> dict:
        conn, resp = self._send(method, path, body)
        try:
            return json.loads(resp.read())
        finally:
            conn.close()

    def launch(self, source: str, args=(), *, filename: str = "lip.py", grants: Optional[dict] = None,
               limits: Optional[dict] = None, priority: str = "normal", kv_tokens: Optional[int] = None) -> RemoteRun:
        body = {"source": source, "filename": filename, "args": list(args), "grants": grants or {},
                "limits": limits or {}, "priority": priority}
        if kv_tokens is not None:
            body["kv_tokens"] = kv_tokens
        conn, resp = self._send("POST", "/v1/lips", body, timeout=None)
        return RemoteRun(resp, conn)

    def send_input(self, lip: int, data: Optional[str]) -> None:
        self._json("POST", f"/v1/lips/{lip}/input", {"eof": True} if data is None else {"data": data})

    def kill(self, lip: int) -> dict:
        return self._json("DELETE", f"/v1/lips/{lip}")
