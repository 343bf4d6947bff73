"""Hostile HTTP clients for the isolation tests of the gateway (test_isolation_*.py) and
perf/bench_isolation.py: each runs in threads of the test process, from a client address of
its own (127.0.0.2, ...: the gateway bounds connections per address), until stopped."""
from __future__ import annotations

import json
import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field


def connect_from(addr: str, port: int, rcvbuf: int = 0) -> socket.socket:
    """A TCP connection to the gateway from local address ``addr`` (any of 127/8)."""
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.bind((addr, 0))
    s.settimeout(5)
    s.connect(("127.0.0.1", port))
    s.setblocking(False)
    return s


def request_bytes(path: str, key: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer {key}"
            f"\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data


@dataclass
class SlowHeaders:
    """``n`` connections from ``addr`` that send a request line and part of the headers, then a
    header line every ``every`` seconds (a slowloris); with ``reconnect``, each one the server
    closes is replaced at once (at most ``rate`` new connections a second).  Counts what the
    server did to them."""

    port: int
    addr: str = "127.0.0.2"
    n: int = 500
    every: float = 2.0
    reconnect: bool = False
    rate: float = 1000.0
    opened: int = 0
    closed_by_server: int = 0
    statuses: dict = field(default_factory=dict)
    peak_open: int = 0

    def run(self, stop: threading.Event) -> None:
        sel = selectors.DefaultSelector()
        socks: set = set()

        started = time.monotonic()

        def top_up():
            while len(socks) < self.n and not stop.is_set():
                if self.opened >= self.n and (not self.reconnect or
                                              self.opened - self.n >= self.rate * (time.monotonic() - started)):
                    return
                try:
                    s = connect_from(self.addr, self.port)
                    s.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: 1\r\n")
                except OSError:
                    time.sleep(0.01)
                    return
                socks.add(s)
                sel.register(s, selectors.EVENT_READ)
                self.opened += 1
            self.peak_open = max(self.peak_open, len(socks))

        last = time.monotonic()
        try:
            while not stop.is_set():
                top_up()
                for k, _ in sel.select(timeout=0.05):
                    s = k.fileobj
                    try:
                        data = s.recv(4096)
                    except OSError:
                        data = b""
                    if data[:9] == b"HTTP/1.1 ":
                        code = data[9:12].decode()
                        self.statuses[code] = self.statuses.get(code, 0) + 1
                    sel.unregister(s)
                    s.close()
                    socks.discard(s)
                    self.closed_by_server += 1
                if time.monotonic() - last >= self.every:
                    last = time.monotonic()
                    for s in list(socks):
                        try:
                            s.send(b"X-More: 1\r\n")
                        except OSError:
                            pass
        finally:
            for s in socks:
                s.close()
            sel.close()


class Flood:
    """``n`` clients of one key, each sending ``body(i, j)`` (its j-th request) to ``path`` back to
    back from address ``addr``, reading every answer (streamed or not) whole; a client answered
    other than 200 retries ``retry_s`` later.  ``codes``: the statuses counted.  A context manager:
    the clients run inside the ``with``."""

    def __init__(self, url: str, key: str, n: int, body, path: str = "/v1/chat/completions",
                 addr: str = "127.0.0.2", retry_s: float = 0.2):
        from urllib.parse import urlsplit
        u = urlsplit(url)
        self.host, self.port, self.key, self.n, self.body, self.path = u.hostname, u.port, key, n, body, path
        self.addr, self.retry_s = addr, retry_s
        self.codes: dict = {}
        self.socks: list = []                   # each client's connection now (shut down at the end)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(n)]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        """Stop: every request in flight ends now, its client leaving (the gateway stops its program)."""
        self.stop.set()
        for sk in list(self.socks):
            try:
                sk.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self.threads:
            t.join(60)

    def _client(self, i: int) -> None:
        import http.client
        j, conn = 0, None
        while not self.stop.is_set():
            j += 1
            try:
                if conn is None:
                    conn = http.client.HTTPConnection(self.host, self.port, timeout=600,
                                                      source_address=(self.addr, 0))
                    conn.connect()
                    self.socks.append(conn.sock)
                conn.request("POST", self.path, body=json.dumps(self.body(i, j)).encode(),
                             headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"})
                r = conn.getresponse()
                while r.read(65536) and not self.stop.is_set():
                    pass
                code = r.status
                if self.stop.is_set() or r.will_close:
                    conn.close()
                    conn = None
            except (OSError, http.client.HTTPException):
                if conn is not None:
                    conn.close()
                    conn = None
                if self.stop.is_set():
                    break
                code = "error"
            self.codes[code] = self.codes.get(code, 0) + 1
            if code != 200:
                self.stop.wait(self.retry_s)
        if conn is not None:
            conn.close()


def never_reading_streams(port: int, key: str, body: dict, n: int, addr: str = "127.0.0.3") -> list:
    """``n`` streamed requests whose client reads the first bytes, then nothing (a tiny receive
    buffer); returns the sockets (the caller closes them)."""
    out = []
    for _ in range(n):
        s = connect_from(addr, port, rcvbuf=4096)
        s.setblocking(True)
        s.sendall(request_bytes("/v1/chat/completions", key, body))
        s.recv(64)
        out.append(s)
    return out


def closed_by_peer(s: socket.socket, wait: float = 0.0) -> bool:
    """Whether the server closed or reset ``s`` (within ``wait`` seconds), seen in the socket's
    TCP state: nothing is read, so a client that reads nothing still reads nothing."""
    deadline = time.monotonic() + wait
    while True:
        state = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
        if state != 1:                                   # TCP_ESTABLISHED
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def gateway_pid(kernel_pid: int) -> int:
    """The gateway that ``symphony-kernel --http`` started (its child)."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = open(f"/proc/{d}/stat").read()
            cmd = open(f"/proc/{d}/cmdline", "rb").read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == kernel_pid and b"symphony.gateway" in cmd:
            return int(d)
    raise AssertionError("no gateway process")


def read_response(s: socket.socket, timeout: float = 10) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a Content-Length from blocking socket ``s``: (status, body)."""
    s.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {data!r}")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("closed mid-body")
        body += chunk
    return int(head[9:12]), body
