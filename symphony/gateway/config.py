"""The gateway's configuration: its flags (`add_args`, which ``symphony-kernel --http`` shares;
`add_routing_args`, those of a gateway in front of several kernels) and their validation."""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from typing import Optional

import msgspec

from symphony.ipc.serving import ServeRequest
from symphony.ipc.transport import is_loopback  # noqa: F401  (the gateway's test of a loopback address)

_USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
ROUTES = ("chat", "completions", "responses", "messages")


class ConfigError(ValueError):
    pass


# what a request samples with when its client sets nothing: the serving contract's defaults
# (OpenAI's), checked against the contract's bounds (the words below only say them)
_SAMPLING_BOUNDS = {"temperature": "a number in [0, 2]", "top_p": "a number in (0, 1]",
                    "top_k": "an integer in [0, 2^31] (0: off)", "min_p": "a number in [0, 1] (0: off)"}
SAMPLING = {f.name: f.default for f in msgspec.structs.fields(ServeRequest) if f.name in _SAMPLING_BOUNDS}


def parse_sampling_defaults(text: Optional[str]) -> dict:
    """``--sampling-defaults``: a JSON object of temperature, top_p, top_k, min_p (each
    checked against its bounds) -> every sampling default, OpenAI's where it names none."""
    import json
    out = dict(SAMPLING)
    if not text:
        return out
    try:
        given = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"--sampling-defaults must be a JSON object, e.g. '{{\"top_p\": 0.95, "
                          f"\"min_p\": 0.05}}': {e}") from None
    if not isinstance(given, dict):
        raise ConfigError("--sampling-defaults must be a JSON object of temperature, top_p, top_k, min_p")
    for k, v in given.items():
        if k not in SAMPLING:
            raise ConfigError(f"--sampling-defaults: unknown parameter {k!r} (known: {', '.join(SAMPLING)})")
        try:                                            # what every request's contract will accept
            if v is None:
                raise msgspec.ValidationError("null")
            out[k] = getattr(msgspec.convert({"mode": "text", k: v}, ServeRequest, strict=True), k)
        except msgspec.ValidationError:
            raise ConfigError(f"--sampling-defaults: {k} must be {_SAMPLING_BOUNDS[k]}, got {v!r}") from None
    return out


def parse_hostport(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8000`` for IPv6; ``:8000`` is loopback) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"expected HOST:PORT, got {text!r}")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


@dataclass
class GatewayConfig:
    socket_path: str                                   # the first kernel's
    kernels: list = field(default_factory=list)        # every kernel's socket (default: socket_path alone)
    affinity_entries: int = 100_000
    affinity_slack: int = 32
    host: str = "127.0.0.1"
    port: int = 8000
    keys_path: Optional[str] = None
    open_user: str = "local"
    open_priority: str = "normal"
    max_body_bytes: int = 8 << 20
    max_active: int = 1024
    request_timeout: float = 600.0
    max_stored_responses: int = 1000
    max_stored_bytes: int = 64 << 20
    default_max_tokens: Optional[int] = 2048
    sampling_defaults: dict = field(default_factory=lambda: dict(SAMPLING))
    programs: dict = field(default_factory=dict)
    model_aliases: list = field(default_factory=list)
    attachments: str = "placeholder"
    cache: str = "user"
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None
    durable_responses: bool = False                    # sync each stored response's conversation KV
    kernel_secret: Optional[str] = None                # remote kernels: the shared secret's file
    kernel_ca: Optional[str] = None                    # ... the CA of their certificates (tls://)
    kernel_cert: Optional[str] = None                  # ... this gateway's client certificate (mutual TLS)
    kernel_key: Optional[str] = None
    kernel_credentials: object = None                  # transport.Credentials, read from the files above
    # the front door (frontdoor.py): what a client may hold before and between its requests
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    write_timeout: float = 60.0
    keep_alive_timeout: float = 30.0
    max_header_bytes: int = 64 << 10
    max_connections: int = 4096
    max_conns_per_addr: int = 256
    max_pending_per_addr: int = 16
    max_sockets: int = 256                             # WebSocket connections open at once, all keys
    max_sockets_per_key: int = 16                      # ... of one key
    socket_max_age: float = 3600.0                     # a WebSocket connection's lifetime, seconds

    def door(self):
        """The front door's bounds (frontdoor.DoorConfig)."""
        from .frontdoor import DoorConfig
        return DoorConfig(header_timeout=self.header_timeout, body_timeout=self.body_timeout,
                          write_timeout=self.write_timeout, keep_alive_timeout=self.keep_alive_timeout,
                          max_header_bytes=self.max_header_bytes, max_connections=self.max_connections,
                          max_per_addr=self.max_conns_per_addr, max_pending_per_addr=self.max_pending_per_addr)

    def __post_init__(self):
        from symphony.ipc.transport import Credentials, Endpoint
        self.kernels = list(dict.fromkeys(self.kernels or [self.socket_path]))
        self.socket_path = self.kernels[0]
        try:
            eps = [Endpoint.parse(k) for k in self.kernels]
        except ValueError as e:
            raise ConfigError(f"--kernel {e}") from None
        if any(ep.remote for ep in eps) and self.kernel_credentials is None:
            if not self.kernel_secret:
                raise ConfigError("a kernel at tls:// or tcp:// needs --kernel-secret FILE (the secret given to "
                                  "its --listen-secret)")
            if any(ep.kind == "tls" for ep in eps) and not self.kernel_ca:
                raise ConfigError("a kernel at tls:// needs --kernel-ca PEM (the CA that signed its certificate, "
                                  "or the certificate itself if self-signed)")
            try:
                self.kernel_credentials = Credentials.load(self.kernel_secret, self.kernel_ca, self.kernel_cert,
                                                           self.kernel_key)
            except ValueError as e:
                raise ConfigError(f"--kernel-secret/--kernel-cert: {e}") from None
        if self.affinity_entries < 1:
            raise ConfigError("--affinity-entries must be >= 1")
        if self.affinity_slack < 0:
            raise ConfigError("--affinity-slack must be >= 0")
        if not _USER_RE.fullmatch(self.open_user) or self.open_user == "root":
            raise ConfigError(f"--open-user {self.open_user!r}: a KVFS user name, not root")
        for what, v in (("--max-body-mb", self.max_body_bytes), ("--max-active", self.max_active),
                        ("--max-stored-responses", self.max_stored_responses),
                        ("--max-stored-mb", self.max_stored_bytes)):
            if v < 1:
                raise ConfigError(f"{what} must be >= 1")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ConfigError("--default-max-tokens must be >= 1 (0: none)")
        if not 0 < self.request_timeout <= 86400:
            raise ConfigError("--request-timeout must be in (0, 86400] seconds")
        if self.attachments not in ("placeholder", "refuse"):
            raise ConfigError("--attachments must be 'placeholder' or 'refuse'")
        if self.cache not in ("user", "shared", "off"):
            raise ConfigError("--prefix-cache must be 'user', 'shared' or 'off'")
        for r in self.programs:
            if r not in ROUTES:
                raise ConfigError(f"--program {r}=...: routes are {', '.join(ROUTES)}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("TLS needs both --tls-cert and --tls-key")
        for flag, v in (("--header-timeout", self.header_timeout), ("--body-timeout", self.body_timeout),
                        ("--write-timeout", self.write_timeout), ("--keep-alive-timeout", self.keep_alive_timeout)):
            if not 0 < v <= 86400:
                raise ConfigError(f"{flag} must be in (0, 86400] seconds")
        for flag, v in (("--max-header-kb", self.max_header_bytes >> 10), ("--max-http-connections", self.max_connections),
                        ("--max-conns-per-addr", self.max_conns_per_addr),
                        ("--max-pending-per-addr", self.max_pending_per_addr)):
            if v < 1:
                raise ConfigError(f"{flag} must be >= 1")
        if self.max_conns_per_addr < self.max_pending_per_addr:
            raise ConfigError("--max-conns-per-addr must be >= --max-pending-per-addr")
        if self.max_sockets < 1 or self.max_sockets_per_key < 1:
            raise ConfigError("--max-sockets and --max-sockets-per-key must be >= 1")
        if not 0 < self.socket_max_age <= 86400:
            raise ConfigError("--socket-max-age must be in (0, 86400] seconds")


def add_args(p: argparse.ArgumentParser, *, prefix: str = "") -> None:
    """The gateway's flags (``prefix`` "gateway-" where the kernel passes them on)."""
    g = p.add_argument_group("HTTP gateway")
    g.add_argument(f"--{prefix}keys", dest="keys", default=None, metavar="FILE",
                   help="API key file (default $SYMPHONY_KEYS, /etc/symphony/keys.json for root, else "
                        "~/.config/symphony/keys.json; made by `symphony keys add`). With no keys, the "
                        "gateway serves only loopback, every request as --open-user")
    g.add_argument("--tls-cert", default=None, metavar="PEM", help="serve HTTPS with this certificate")
    g.add_argument("--tls-key", default=None, metavar="PEM", help="... and this private key")
    g.add_argument("--open-user", default="local",
                   help="the KVFS user requests run as when no keys are configured (default local)")
    g.add_argument("--max-body-mb", type=int, default=8, help="largest request body, MiB (default 8)")
    g.add_argument("--max-active", type=int, default=1024,
                   help="requests served at once, all keys (default 1024); beyond, 503 with Retry-After")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="wall-clock limit of one request's program, seconds (default 600)")
    g.add_argument("--max-stored-responses", type=int, default=1000,
                   help="stored /v1/responses kept per user, oldest dropped first (default 1000)")
    g.add_argument("--default-max-tokens", type=int, default=2048,
                   help="tokens a request may generate when the client sets no limit (max_tokens, "
                        "max_completion_tokens, max_output_tokens); 0: up to the end of the context "
                        "(default 2048)")
    g.add_argument("--sampling-defaults", default=None, metavar="JSON",
                   help="what a request samples with when its client sets nothing, as a JSON object of "
                        "temperature, top_p, top_k, min_p, e.g. '{\"top_p\": 0.95, \"min_p\": 0.05}' "
                        "(default: OpenAI's, temperature 1 and no truncation); a value the client sends wins")
    g.add_argument("--max-stored-mb", type=int, default=64,
                   help="MiB of stored /v1/responses kept per user, oldest dropped first (default 64)")
    g.add_argument("--program", action="append", default=[], metavar="ROUTE=PROGRAM",
                   help="serve ROUTE (chat, completions, responses, messages) with PROGRAM, a stock program's name or "
                        "a LIP file (default: the stock program serve)")
    g.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                   help="another name clients may use for the model (repeatable)")
    g.add_argument("--attachments", default="placeholder", choices=["placeholder", "refuse"],
                   help="image, audio and binary file parts in a message: replaced by a line saying what they "
                        "were (default; the model reads text only; inline text files are read) or refused "
                        "with 400")
    g.add_argument("--prefix-cache", default="user", choices=["user", "shared", "off"],
                   help="prefix caching of the serving program: per user (default), shared between the "
                        "keys marked share_cache, or off")
    d = p.add_argument_group("HTTP gateway: the front door (what one client may hold before and between its "
                             "requests; per key, see the key's rpm and max_concurrent)")
    d.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="seconds a request's line and headers may take to arrive, from the connection (or the "
                        "request's first byte) on; beyond, 408 and closed (default 10)")
    d.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a request body may take after its headers, one more for each 64 KiB "
                        "received; beyond, the connection is closed (default 30)")
    d.add_argument("--write-timeout", type=float, default=60.0, metavar="S",
                   help="seconds a client may take nothing of a response it is sent (its connection's send "
                        "buffer full) before the connection, and the request's program, are closed (default 60)")
    d.add_argument("--keep-alive-timeout", type=float, default=30.0, metavar="S",
                   help="seconds an idle connection is kept open between requests (default 30)")
    d.add_argument("--max-header-kb", type=int, default=64, metavar="KB",
                   help="largest request line and headers, KiB; beyond, 431 and closed (default 64)")
    d.add_argument("--max-http-connections", type=int, default=4096, metavar="N",
                   help="connections open at once, all clients (default 4096); beyond, the client address "
                        "holding the most gives one up (its oldest idle, else oldest half-sent), or the new "
                        "connection is refused (503) if it is its own")
    d.add_argument("--max-conns-per-addr", type=int, default=256, metavar="N",
                   help="connections one client address (an IPv6 /64) may have open (default 256); beyond, "
                        "its oldest idle or half-sent one is closed, else the new one is refused (503)")
    d.add_argument("--max-pending-per-addr", type=int, default=16, metavar="N",
                   help="connections of one client address whose request's headers have not all arrived "
                        "(not yet authenticated) for over a second (default 16; a burst of new ones is "
                        "not counted); beyond, its oldest such one is closed (408)")
    g.add_argument("--max-sockets", type=int, default=256,
                   help="WebSocket connections (/v1/responses WebSocket mode) open at once, all keys (default 256)")
    g.add_argument("--max-sockets-per-key", type=int, default=16,
                   help="WebSocket connections one key may have open at once (default 16); beyond, the "
                        "handshake is refused with 429")
    g.add_argument("--socket-max-age", type=float, default=3600.0,
                   help="seconds a WebSocket connection lives (default 3600, the specification's 60 minutes); "
                        "then it ends with the error websocket_connection_limit_reached")


def add_routing_args(p: argparse.ArgumentParser) -> None:
    """The flags of a gateway in front of several kernels (``symphony-gateway`` only)."""
    g = p.add_argument_group("several kernels")
    g.add_argument("--kernel", action="append", default=[], metavar="PATH|tls://HOST:PORT",
                   help="a kernel's Unix socket, or tls://HOST:PORT for one on another host (symphony-kernel "
                        "--listen; tcp://127.0.0.1:PORT on loopback); repeat it to serve from several kernels, each "
                        "request routed where its KV is (a continued conversation, a prompt prefix routed before, "
                        "a program's KV files), else to the kernel with the fewest requests in flight")
    g.add_argument("--durable-responses", action="store_true",
                   help="make each stored /v1/responses conversation's KV durable on its kernel (kernels with "
                        "--durable-dir), so that a kernel given that directory with --peer-durable-dir continues "
                        "it when its own kernel is gone")
    g.add_argument("--kernel-secret", default=None, metavar="FILE",
                   help="the shared secret of the TCP kernels (their --listen-secret; readable by this user only)")
    g.add_argument("--kernel-ca", default=None, metavar="PEM",
                   help="the CA that signed the tls:// kernels' certificates (or a self-signed certificate)")
    g.add_argument("--kernel-cert", default=None, metavar="PEM",
                   help="this gateway's client certificate, for kernels that demand one (--listen-tls-client-ca)")
    g.add_argument("--kernel-key", default=None, metavar="PEM", help="... and its private key")
    g.add_argument("--affinity-entries", type=int, default=100_000, metavar="N",
                   help="prompt prefixes the router remembers, least recently used dropped first (default "
                        "100000, about 150 bytes each)")
    g.add_argument("--affinity-slack", type=int, default=32, metavar="N",
                   help="follow a prefix to its kernel unless that kernel has more than N requests in flight "
                        "beyond the least loaded one (default 32)")


def from_args(args, socket_path: str, host: str, port: int, kernels: Optional[list] = None) -> GatewayConfig:
    programs = {}
    for spec in args.program:
        route, sep, prog = spec.partition("=")
        if not sep or not prog:
            raise ConfigError(f"--program {spec!r}: expected ROUTE=PROGRAM")
        programs[route] = prog
    return GatewayConfig(socket_path=socket_path, kernels=list(kernels or []), host=host, port=port,
                         affinity_entries=getattr(args, "affinity_entries", 100_000),
                         affinity_slack=getattr(args, "affinity_slack", 32), keys_path=args.keys,
                         open_user=args.open_user, max_body_bytes=args.max_body_mb << 20,
                         max_active=args.max_active, request_timeout=args.request_timeout,
                         max_stored_responses=args.max_stored_responses,
                         max_stored_bytes=args.max_stored_mb << 20, programs=programs,
                         default_max_tokens=args.default_max_tokens or None,
                         sampling_defaults=parse_sampling_defaults(getattr(args, "sampling_defaults", None)),
                         model_aliases=list(args.served_model_name), attachments=args.attachments, cache=args.prefix_cache,
                         tls_cert=args.tls_cert, tls_key=args.tls_key, header_timeout=args.header_timeout,
                         body_timeout=args.body_timeout, write_timeout=args.write_timeout,
                         keep_alive_timeout=args.keep_alive_timeout, max_header_bytes=args.max_header_kb << 10,
                         max_connections=args.max_http_connections, max_conns_per_addr=args.max_conns_per_addr,
                         max_pending_per_addr=args.max_pending_per_addr,
                         durable_responses=getattr(args, "durable_responses", False),
                         kernel_secret=getattr(args, "kernel_secret", None), kernel_ca=getattr(args, "kernel_ca", None),
                         kernel_cert=getattr(args, "kernel_cert", None), kernel_key=getattr(args, "kernel_key", None),
                         max_sockets=args.max_sockets, max_sockets_per_key=args.max_sockets_per_key,
                         socket_max_age=args.socket_max_age)


def to_argv(args) -> list[str]:
    """The gateway flags of a parsed ``args`` as a command line (``symphony-kernel
    --http`` passes its gateway flags on to the gateway it starts)."""
    out = []
    for flag, v in (("--keys", args.keys), ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key),
                    ("--open-user", args.open_user), ("--max-body-mb", args.max_body_mb),
                    ("--max-active", args.max_active), ("--request-timeout", args.request_timeout),
                    ("--max-stored-responses", args.max_stored_responses),
                    ("--max-stored-mb", args.max_stored_mb), ("--default-max-tokens", args.default_max_tokens),
                    ("--sampling-defaults", args.sampling_defaults),
                    ("--attachments", args.attachments),
                    ("--prefix-cache", args.prefix_cache), ("--header-timeout", args.header_timeout),
                    ("--body-timeout", args.body_timeout), ("--write-timeout", args.write_timeout),
                    ("--keep-alive-timeout", args.keep_alive_timeout), ("--max-header-kb", args.max_header_kb),
                    ("--max-http-connections", args.max_http_connections), ("--max-conns-per-addr", args.max_conns_per_addr),
                    ("--max-pending-per-addr", args.max_pending_per_addr),
                    ("--max-sockets", args.max_sockets), ("--max-sockets-per-key", args.max_sockets_per_key),
                    ("--socket-max-age", args.socket_max_age)):
        if v is not None:
            out += [flag, str(v)]
    for spec in args.program:
        out += ["--program", spec]
    for name in args.served_model_name:
        out += ["--served-model-name", name]
    return out
