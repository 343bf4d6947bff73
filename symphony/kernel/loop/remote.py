"""The kernel's TCP listener: the client RPC for gateways on other hosts (``--listen``).

    listener = RemoteListener(ListenConfig.build(...), sessions.serve_client)
    await listener.start()                     # logs "listening on tls://HOST:PORT"
    ...
    listener.close()

Every connection is authenticated before a request is read (ipc/transport.py's
handshake with the shared secret, over TLS unless the address is loopback);
one that fails is logged, answered EACCES and closed.  An authenticated peer
is a **remote gateway**: like the trusted local gateway it acts for any user
but root and must name one in every request; root's requests (shutdown, drain,
test hooks) are refused to it.  At most `MAX_HANDSHAKES` connections may be
mid-handshake at once (more are closed at once), so that unauthenticated peers
cannot hold the kernel's descriptors.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import ssl
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

from symphony.ipc.transport import AuthError, is_loopback, read_secret, server_context, server_handshake

log = logging.getLogger("symphony.kernel")

MAX_HANDSHAKES = 64


@dataclass(frozen=True)
class ListenConfig:
    """``--listen`` and its credentials, checked."""

    host: str
    port: int
    secret: bytes
    tls: Optional[ssl.SSLContext]

    @classmethod
    def build(cls, hostport: str, secret_file: Optional[str], cert: Optional[str], key: Optional[str],
              client_ca: Optional[str]) -> "ListenConfig":
        """ValueError naming the flag that is wrong or missing."""
        host, sep, port = hostport.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"--listen: expected HOST:PORT, got {hostport!r}")
        if not secret_file:
            raise ValueError("--listen needs --listen-secret FILE: a TCP port is never open to "
                             "unauthenticated clients")
        if bool(cert) != bool(key):
            raise ValueError("--listen-tls-cert and --listen-tls-key go together")
        if not cert and not is_loopback(host):
            raise ValueError(f"--listen {hostport}: an address other hosts can reach needs TLS "
                             f"(--listen-tls-cert and --listen-tls-key)")
        if client_ca and not cert:
            raise ValueError("--listen-tls-client-ca needs --listen-tls-cert and --listen-tls-key")
        secret = read_secret(secret_file)
        try:
            tls = server_context(cert, key, client_ca) if cert else None
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"--listen-tls-cert/--listen-tls-key: {e}") from None
        return cls(host, int(port), secret, tls)


class RemoteListener:
    """Accepts TCP connections, authenticates them, then hands each to ``serve``
    (``ClientSessions.serve_client(reader, writer, peer)``)."""

    def __init__(self, cfg: ListenConfig, serve: Callable[..., Awaitable[None]]):
        self.cfg, self.serve = cfg, serve
        self.server: Optional[asyncio.AbstractServer] = None
        self.address = ""
        self.pending = 0
        self.refused = 0

    async def start(self) -> str:
        """Listen; returns the address as clients write it (``tls://HOST:PORT``, the port
        the system chose if 0 was asked for)."""
        self.server = await asyncio.start_server(self._accept, self.cfg.host, self.cfg.port, ssl=self.cfg.tls,
                                                 ssl_handshake_timeout=10.0 if self.cfg.tls else None)
        port = self.server.sockets[0].getsockname()[1]
        host = f"[{self.cfg.host}]" if ":" in self.cfg.host else self.cfg.host
        self.address = f"{'tls' if self.cfg.tls else 'tcp'}://{host}:{port}"
        return self.address

    def is_serving(self) -> bool:
        return self.server is not None and self.server.is_serving()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        if self.pending >= MAX_HANDSHAKES:
            self._refused(where, f"{MAX_HANDSHAKES} connections are already authenticating")
            writer.close()
            return
        self.pending += 1
        try:
            await server_handshake(reader, writer, self.cfg.secret)
        except (AuthError, ConnectionError, OSError) as e:
            self._refused(where, str(e))
            writer.close()
            return
        finally:
            self.pending -= 1
        await self.serve(reader, writer, remote=where)

    def _refused(self, where: str, why: str) -> None:
        self.refused += 1
        if self.refused <= 10 or self.refused % 1000 == 0:
            log.warning("remote connection from %s refused (%d so far): %s", where, self.refused, why)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    """The flags of remote gateways and peer kernels (symphony-kernel)."""
    g = p.add_argument_group("remote gateways (the client RPC over TCP, for a gateway on another host)")
    g.add_argument("--listen", default=None, metavar="HOST:PORT",
                   help="also serve the client RPC on TCP HOST:PORT (port 0: any free one, logged), for "
                        "symphony-gateway --kernel tls://HOST:PORT on other hosts; needs --listen-secret, and "
                        "TLS unless HOST is loopback")
    g.add_argument("--listen-secret", default=None, metavar="FILE",
                   help="the shared secret every TCP client must prove it knows (a challenge-response; the "
                        "file: at least 16 bytes, readable by the kernel's user only)")
    g.add_argument("--listen-tls-cert", default=None, metavar="PEM", help="the kernel's TLS certificate")
    g.add_argument("--listen-tls-key", default=None, metavar="PEM", help="... and its private key")
    g.add_argument("--listen-tls-client-ca", default=None, metavar="PEM",
                   help="also demand a client certificate signed by this CA (mutual TLS)")
    g.add_argument("--peer-durable-dir", action="append", default=[], metavar="DIR",
                   help="another kernel's --durable-dir (on shared storage) whose files users may adopt here "
                        "when that kernel is gone (kv_adopt; repeatable)")


def from_args(p: argparse.ArgumentParser, args):
    """(ListenConfig or None, peer durable dirs) from the flags (usage error if one is bad)."""
    from symphony.kernel.loop.transfer import peer_dirs_checked
    listen = None
    try:
        if args.listen is not None:
            listen = ListenConfig.build(args.listen, args.listen_secret, args.listen_tls_cert, args.listen_tls_key,
                                        args.listen_tls_client_ca)
        elif args.listen_secret or args.listen_tls_cert or args.listen_tls_key or args.listen_tls_client_ca:
            raise ValueError("--listen-secret and --listen-tls-* go with --listen HOST:PORT")
        peers = peer_dirs_checked(args.peer_durable_dir)
    except ValueError as e:
        p.error(str(e))
    return listen, peers
