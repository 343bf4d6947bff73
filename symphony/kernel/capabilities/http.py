"""The http capability: every hop checked against the LIP's grants.

    for each hop (at most MAX_HOPS):
        scheme http/https; host and effective port must match a grant
        resolve the host once; every address must be public, unless the grant
            names that very address (or "localhost" for a loopback one)
        connect to the checked address (no second lookup: no DNS rebinding),
            TLS verified against the host name
        send; read the status and headers
        3xx with a Location, method GET/HEAD: next hop (not followed otherwise)
    body read up to the size cap, all within the call's deadline

No proxy from the environment is used.
"""
from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import time
import urllib.parse
from typing import Optional

from symphony.kernel.failure import fail
from symphony.kernel.capabilities.policy import parse_host

MAX_HOPS = 5
METHODS = ("GET", "POST", "PUT", "DELETE", "HEAD")
_FORBIDDEN_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}
_REDIRECTS = (301, 302, 303, 307, 308)


def check_args(b: dict, max_timeout: float, max_bytes: int) -> tuple:
    """Validate an http call's arguments -> (url, method, body bytes, headers, timeout)."""
    url, method = b.get("url"), b.get("method", "GET")
    if not isinstance(url, str) or not url or len(url) > 8192:
        fail("InvalidArgument", "EINVAL", "url must be a non-empty string of at most 8192 characters")
    if method not in METHODS:
        fail("InvalidArgument", "EINVAL", f"bad HTTP method {method!r} (one of {', '.join(METHODS)})")
    data = b.get("body")
    if data is not None and not isinstance(data, str):
        fail("InvalidArgument", "EINVAL", "body must be a string or None")
    data = data.encode() if data is not None else None
    if data is not None and len(data) > max_bytes:
        fail("InvalidArgument", "EINVAL", f"body larger than {max_bytes} bytes")
    headers = b.get("headers") or {}
    if not isinstance(headers, dict) or len(headers) > 100:
        fail("InvalidArgument", "EINVAL", "headers must be a dict of at most 100 entries")
    for k, v in headers.items():
        if not isinstance(v, str) or not k or any(c in k + v for c in "\r\n\0") or len(k) + len(v) > 8192:
            fail("InvalidArgument", "EINVAL", f"bad header {k[:100]!r}")
        if k.lower() in _FORBIDDEN_HEADERS:
            fail("InvalidArgument", "EINVAL", f"header {k!r} is set by the kernel")
    timeout = b.get("timeout", 10.0)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout <= max_timeout:
        fail("InvalidArgument", "EINVAL", f"timeout must be in (0, {max_timeout}] seconds, got {timeout!r}")
    return url, method, data, headers, float(timeout)


def request(grants: list, url: str, method: str, data: Optional[bytes], headers: dict,
            ctx, max_bytes: int) -> dict:
    """Run the request (following checked redirects) -> {"status", "headers", "body", "url"}.
    ``ctx`` is the pool's job context: its ``deadline`` bounds the whole call, and
    a socket registered with ``on_cancel`` is shut down if the call overruns."""
    granted = [parse_host(g) for g in grants]
    deadline = ctx.deadline
    for hop in range(MAX_HOPS + 1):
        u, host, port = _check_url(granted, url)
        addr = _resolve(granted, host, port, deadline)
        conn = _connection(u.scheme, host, port, addr, deadline)
        try:
            target = urllib.parse.urlunsplit(("", "", u.path or "/", u.query, ""))
            conn.connect()
            ctx.on_cancel(lambda s=conn.sock: _shut(s))
            conn.request(method, target, body=data, headers=headers)
            conn.sock.settimeout(max(0.001, deadline - time.monotonic()))
            r = conn.getresponse()
            loc = r.getheader("Location")
            if r.status in _REDIRECTS and loc and method in ("GET", "HEAD"):
                if hop == MAX_HOPS:
                    fail("CapabilityError", "EIO", f"HTTP: more than {MAX_HOPS} redirects")
                url = urllib.parse.urljoin(url, loc)
                continue
            body = _read(conn, r, deadline, max_bytes)
            return {"status": r.status, "headers": dict(r.headers), "body": body.decode("utf-8", "replace"),
                    "url": url}
        except (OSError, http.client.HTTPException) as e:
            if isinstance(e, (socket.timeout, TimeoutError)) or time.monotonic() >= deadline:
                fail("TimedOut", "ETIMEDOUT", f"HTTP request to {host} timed out")
            fail("CapabilityError", "EIO", f"HTTP request to {host} failed: {e}")
        finally:
            conn.close()


# ---------------------------------------------------------------- helpers
def _check_url(granted: list, url: str):
    try:
        u = urllib.parse.urlsplit(url)
        host, port = (u.hostname or "").lower(), u.port
    except ValueError:
        fail("InvalidArgument", "EINVAL", f"bad URL {url[:200]!r}")
    if u.scheme not in ("http", "https") or not host or u.username or u.password:
        fail("InvalidArgument", "EINVAL", f"bad URL {url[:200]!r}: http(s)://host[:port]/path, no credentials")
    port = port or (443 if u.scheme == "https" else 80)
    if not any(g.matches(host, port) for g in granted):
        fail("PermissionDenied", "EACCES", f"HTTP to {host}:{port} is not granted to this LIP "
             f"(granted: {', '.join(map(str, granted)) or 'none'})")
    return u, host, port


def _resolve(granted: list, host: str, port: int, deadline: float) -> str:
    """One address for ``host``; internal addresses only when the grant names them."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        fail("CapabilityError", "EIO", f"HTTP: cannot resolve {host}: {e}")
    if time.monotonic() >= deadline:
        fail("TimedOut", "ETIMEDOUT", f"HTTP: resolving {host} took past the deadline")
    addrs = list(dict.fromkeys(i[4][0] for i in infos))
    for a in addrs:
        ip = ipaddress.ip_address(a.split("%")[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
            ip = ip.ipv4_mapped
        if ip.is_multicast or ip.is_unspecified:
            fail("PermissionDenied", "EACCES", f"HTTP: {host} resolves to {ip}, which is never allowed")
        if not ip.is_global and not _names_internal(granted, host, ip, port):
            fail("PermissionDenied", "EACCES", f"HTTP: {host} resolves to the internal address {ip}; "
                 "grant that address itself to reach it")
    if not addrs:
        fail("CapabilityError", "EIO", f"HTTP: {host} has no address")
    return addrs[0]


def _names_internal(granted: list, host: str, ip, port: int) -> bool:
    for g in granted:
        if g.port not in (None, port):
            continue
        if g.host == host == "localhost" and ip.is_loopback:
            return True
        try:
            if ipaddress.ip_address(g.host) == ip and g.host == host:
                return True
        except ValueError:
            pass
    return False


class _PinnedHTTP(http.client.HTTPConnection):
    """Connects to an already checked address; the Host header keeps the name."""

    def __init__(self, host, port, addr, timeout):
        super().__init__(host, port, timeout=timeout)
        self._addr = addr

    def connect(self):
        self.sock = socket.create_connection((self._addr, self.port), self.timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _PinnedHTTPS(_PinnedHTTP):
    default_port = 443

    def connect(self):
        super().connect()
        self.sock = ssl.create_default_context().wrap_socket(self.sock, server_hostname=self.host)


def _connection(scheme, host, port, addr, deadline) -> http.client.HTTPConnection:
    left = deadline - time.monotonic()
    if left <= 0:
        fail("TimedOut", "ETIMEDOUT", f"HTTP request to {host} timed out")
    cls = _PinnedHTTPS if scheme == "https" else _PinnedHTTP
    return cls(host, port, addr, left)


def _shut(sock) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _read(conn, r, deadline: float, max_bytes: int) -> bytes:
    """The body, up to ``max_bytes``, every read bounded by what is left of the deadline."""
    out, left = [], max_bytes
    while left > 0:
        t = deadline - time.monotonic()
        if t <= 0:
            raise socket.timeout("deadline")
        if conn.sock is not None:
            conn.sock.settimeout(t)
        b = r.read(min(left, 1 << 16))
        if not b:
            break
        out.append(b)
        left -= len(b)
    return b"".join(out)
