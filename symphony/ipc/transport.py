"""Where a kernel listens and how a client reaches it: a Unix socket, or TCP for a gateway
on another host, always authenticated and, off the host, encrypted.

    ep = Endpoint.parse("tls://10.0.0.7:7000")          # or "/run/symphony.sock", "tcp://127.0.0.1:7000"
    creds = Credentials.load(secret_file="/etc/symphony/kernel.secret", ca="/etc/symphony/kernel-ca.pem")
    reader, writer = await open_connection(ep, creds)   # connected, TLS checked, handshake done
    s = connect_sync(ep, creds)                         # the same for a blocking socket (symphony.client)

A Unix socket needs nothing more: the kernel knows the peer by SO_PEERCRED.  Over
TCP there is no such thing, so a connection proves it knows the kernel's shared
secret before anything else is read (`server_handshake`), and the kernel proves
it too (mutual: a client never sends a program to an impostor)::

    kernel -> {"hello": PROTOCOL, "nonce": N_k}          32 random bytes, hex
    client -> {"auth": PROTOCOL, "nonce": N_c, "mac": HMAC-SHA256(secret, "client" | N_k | N_c)}
    kernel -> {"ok": true, "mac": HMAC-SHA256(secret, "kernel" | N_k | N_c)}
              or {"error": "EACCES", ...} and the connection closes

Fresh nonces on both sides make a recorded exchange useless to replay; the
comparison is constant-time.  ``tls://`` wraps the connection in TLS (Python's
ssl, TLS 1.2 at least) and checks the kernel's certificate against ``ca`` and the
host name; the kernel may also demand a client certificate (mutual TLS).
``tcp://`` (no TLS) is accepted only for loopback addresses: a secret-bearing
exchange never crosses a network in the clear.  Frames before the handshake
ends are at most `HELLO_MAX` bytes.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import ssl
import stat
import struct
from dataclasses import dataclass, field
from typing import Optional

import orjson

from .protocol import ProtocolError, encode_frame

PROTOCOL = "symphony-rpc-1"
HELLO_MAX = 4096                 # bytes of a frame before the handshake ends
HANDSHAKE_TIMEOUT_S = 10.0
MIN_SECRET_BYTES = 16


class AuthError(ConnectionError):
    """The other side did not prove it knows the shared secret, or the TLS check failed."""


@dataclass(frozen=True)
class Endpoint:
    """A kernel's address: ``kind`` "unix" (``path``), "tcp" or "tls" (``host``, ``port``)."""

    kind: str
    path: Optional[str] = None
    host: Optional[str] = None
    port: int = 0

    @classmethod
    def parse(cls, spec: str) -> "Endpoint":
        """"PATH" or "unix://PATH", "tls://HOST:PORT", "tcp://HOST:PORT" (loopback only);
        ValueError naming what is wrong."""
        if not isinstance(spec, str) or not spec:
            raise ValueError("a kernel address must be a Unix socket path, tls://HOST:PORT or tcp://HOST:PORT")
        if spec.startswith("unix://"):
            return cls("unix", path=spec[len("unix://"):])
        for kind in ("tls", "tcp"):
            if spec.startswith(f"{kind}://"):
                host, sep, port = spec[len(kind) + 3:].rpartition(":")
                host = host.strip("[]")
                if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                    raise ValueError(f"{spec!r}: expected {kind}://HOST:PORT")
                if kind == "tcp" and not is_loopback(host):
                    raise ValueError(f"{spec!r}: tcp:// is not encrypted and serves loopback addresses only; "
                                     f"use tls://{host}:{port} (with the kernel's --listen-tls-cert)")
                return cls(kind, host=host, port=int(port))
        if "://" in spec:
            raise ValueError(f"{spec!r}: unknown scheme (unix://, tls:// or tcp://)")
        return cls("unix", path=spec)

    @property
    def remote(self) -> bool:
        return self.kind != "unix"

    def __str__(self) -> str:
        if self.kind == "unix":
            return self.path
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.kind}://{host}:{self.port}"


@dataclass(frozen=True)
class Credentials:
    """What a client needs for a TCP kernel: the shared ``secret``; for tls://, the ``ca``
    that signed the kernel's certificate (its own file if self-signed), and, if the kernel
    demands one, this client's ``cert`` and ``key``.  Every file is read when the
    credentials are made (a gateway then gives up root and need not read them again)."""

    secret: bytes
    ca: Optional[str] = None
    cert: Optional[str] = None
    key: Optional[str] = None
    tls: Optional[ssl.SSLContext] = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if bool(self.cert) != bool(self.key):
            raise ValueError("a client certificate needs both its cert and its key")
        if self.ca and self.tls is None:
            try:
                ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)
                ctx.minimum_version = ssl.TLSVersion.TLSv1_2
                if self.cert:
                    ctx.load_cert_chain(self.cert, self.key)
            except (OSError, ssl.SSLError) as e:
                raise ValueError(f"TLS files {self.ca}, {self.cert}: {e}") from None
            object.__setattr__(self, "tls", ctx)

    @classmethod
    def load(cls, secret_file: str, ca: Optional[str] = None, cert: Optional[str] = None,
             key: Optional[str] = None) -> "Credentials":
        return cls(read_secret(secret_file), ca, cert, key)

    def context(self, ep: Endpoint) -> Optional[ssl.SSLContext]:
        """The TLS context for ``ep`` (None for tcp:// and unix)."""
        if ep.kind != "tls":
            return None
        if self.tls is None:
            raise ValueError(f"{ep}: a tls:// kernel needs the CA that signed its certificate (--kernel-ca)")
        return self.tls


def read_secret(path: str) -> bytes:
    """A shared secret from ``path``: at least `MIN_SECRET_BYTES` bytes once stripped, in
    a regular file no other user may read (ValueError otherwise)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ValueError(f"secret file {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"secret file {path} is not a regular file")
    if st.st_mode & 0o077:
        raise ValueError(f"secret file {path} is readable by other users (mode {st.st_mode & 0o777:03o}): "
                         f"chmod 600 {path}")
    with open(path, "rb") as f:
        secret = f.read().strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"secret file {path} holds {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed "
                         f"(e.g. python -c 'import secrets; print(secrets.token_hex(32))' > {path})")
    return secret


def server_context(cert: str, key: str, client_ca: Optional[str] = None) -> ssl.SSLContext:
    """The kernel's TLS context (``client_ca``: demand a client certificate it signed)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    if client_ca:
        ctx.load_verify_locations(client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------- the handshake
def _mac(secret: bytes, who: bytes, n_k: str, n_c: str) -> str:
    return hmac.new(secret, who + b"|" + n_k.encode() + b"|" + n_c.encode(), hashlib.sha256).hexdigest()


async def _read_small(reader: asyncio.StreamReader) -> dict:
    (n,) = struct.unpack(">I", await reader.readexactly(4))
    if n > HELLO_MAX:
        raise AuthError(f"a handshake frame of {n} bytes (at most {HELLO_MAX})")
    try:
        msg = orjson.loads(await reader.readexactly(n))
    except orjson.JSONDecodeError:
        raise AuthError("a handshake frame that is not JSON") from None
    if not isinstance(msg, dict):
        raise AuthError("a handshake frame must be a JSON object")
    return msg


async def server_handshake(reader, writer, secret: bytes, timeout: float = HANDSHAKE_TIMEOUT_S) -> None:
    """The kernel's side: AuthError (after telling the client) unless it proves the secret."""
    n_k = secrets.token_hex(32)
    writer.write(encode_frame({"hello": PROTOCOL, "nonce": n_k}))
    try:
        msg = await asyncio.wait_for(_read_small(reader), timeout)
    except asyncio.TimeoutError:
        raise AuthError(f"no handshake within {timeout:g} s") from None
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        raise AuthError(f"the connection closed during the handshake ({type(e).__name__})") from None
    n_c, mac = msg.get("nonce"), msg.get("mac")
    ok = (msg.get("auth") == PROTOCOL and isinstance(n_c, str) and 32 <= len(n_c) <= 128 and isinstance(mac, str)
          and hmac.compare_digest(mac.encode(), _mac(secret, b"client", n_k, n_c).encode()))
    if not ok:
        writer.write(encode_frame({"error": "EACCES", "type": "AuthFailed",
                                   "message": "authentication failed: wrong secret or protocol"}))
        raise AuthError("the client did not prove it knows the secret")
    writer.write(encode_frame({"ok": True, "mac": _mac(secret, b"kernel", n_k, n_c)}))
    await writer.drain()


async def client_handshake(reader, writer, secret: bytes, timeout: float = HANDSHAKE_TIMEOUT_S) -> None:
    """A client's side: AuthError unless the kernel accepts it and proves the secret too."""
    async def go():
        hello = await _read_small(reader)
        if hello.get("hello") != PROTOCOL or not isinstance(hello.get("nonce"), str):
            raise AuthError(f"not a Symphony kernel speaking {PROTOCOL}")
        n_k, n_c = hello["nonce"], secrets.token_hex(32)
        writer.write(encode_frame({"auth": PROTOCOL, "nonce": n_c, "mac": _mac(secret, b"client", n_k, n_c)}))
        await writer.drain()
        return _check_answer(await _read_small(reader), secret, n_k, n_c)
    try:
        await asyncio.wait_for(go(), timeout)
    except asyncio.TimeoutError:
        raise AuthError(f"the kernel did not complete the handshake within {timeout:g} s") from None
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        if isinstance(e, AuthError):
            raise
        raise AuthError(f"the kernel closed the connection during the handshake ({type(e).__name__})") from None


def _check_answer(ans: dict, secret: bytes, n_k: str, n_c: str) -> None:
    if "error" in ans:
        raise AuthError(f"the kernel refused the connection: {ans.get('message')}")
    if not (ans.get("ok") is True and isinstance(ans.get("mac"), str)
            and hmac.compare_digest(ans["mac"].encode(), _mac(secret, b"kernel", n_k, n_c).encode())):
        raise AuthError("the kernel did not prove it knows the secret (an impostor, or another secret)")


# ---------------------------------------------------------------- connecting
async def open_connection(ep: Endpoint, creds: Optional[Credentials] = None, timeout: float = 10.0):
    """(reader, writer) connected to ``ep``, TLS checked and the handshake done.
    OSError / asyncio.TimeoutError if it cannot connect; AuthError; ssl.SSLError."""
    if ep.kind == "unix":
        return await asyncio.wait_for(asyncio.open_unix_connection(ep.path), timeout)
    if creds is None:
        raise AuthError(f"{ep}: a TCP kernel needs the shared secret (--kernel-secret)")
    ctx = creds.context(ep)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(ep.host, ep.port, ssl=ctx), timeout)
    try:
        await client_handshake(reader, writer, creds.secret, timeout)
    except BaseException:
        writer.close()
        raise
    return reader, writer


def connect_sync(ep: Endpoint, creds: Optional[Credentials], timeout: float = 10.0) -> socket.socket:
    """A blocking socket connected to a TCP or TLS ``ep``, handshake done (AuthError, OSError)."""
    if creds is None:
        raise AuthError(f"{ep}: a TCP kernel needs the shared secret")
    ctx = creds.context(ep)
    sock = socket.create_connection((ep.host, ep.port), timeout=timeout)
    try:
        if ctx is not None:
            sock = ctx.wrap_socket(sock, server_hostname=ep.host)
        from .protocol import recv_frame_sync, send_frame_sync
        hello = recv_frame_sync(sock)
        if not isinstance(hello, dict) or hello.get("hello") != PROTOCOL or not isinstance(hello.get("nonce"), str):
            raise AuthError(f"{ep} is not a Symphony kernel speaking {PROTOCOL}")
        n_k, n_c = hello["nonce"], secrets.token_hex(32)
        send_frame_sync(sock, {"auth": PROTOCOL, "nonce": n_c, "mac": _mac(creds.secret, b"client", n_k, n_c)})
        ans = recv_frame_sync(sock)
        if not isinstance(ans, dict):
            raise AuthError(f"{ep} closed the connection during the handshake")
        _check_answer(ans, creds.secret, n_k, n_c)
    except (ProtocolError, BaseException):
        sock.close()
        raise
    return sock
