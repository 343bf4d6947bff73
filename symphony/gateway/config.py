"""The gateway's configuration: its flags (`add_args`, which ``symphony-kernel --http`` shares;
`add_routing_args`, those of a gateway in front of several kernels) and their validation."""
from __future__ import annotations

import argparse
import ipaddress
import re
from dataclasses import dataclass, field
from typing import Optional

_USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
ROUTES = ("chat", "completions", "responses", "messages")


class ConfigError(ValueError):
    pass


def parse_hostport(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8000`` for IPv6; ``:8000`` is loopback) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"expected HOST:PORT, got {text!r}")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
    programs: dict = field(default_factory=dict)
    model_aliases: list = field(default_factory=list)
    attachments: str = "placeholder"
    cache: str = "user"
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None
    max_sockets: int = 256                             # WebSocket connections open at once, all keys
    max_sockets_per_key: int = 16                      # ... of one key
    socket_max_age: float = 3600.0                     # a WebSocket connection's lifetime, seconds

    def __post_init__(self):
        self.kernels = list(dict.fromkeys(self.kernels or [self.socket_path]))
        self.socket_path = self.kernels[0]
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
    g.add_argument("--kernel", action="append", default=[], metavar="PATH",
                   help="a kernel's Unix socket; repeat it to serve from several kernels, each request routed "
                        "where its KV is (a continued conversation, a prompt prefix routed before, a program's "
                        "KV files), else to the kernel with the fewest requests in flight")
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
                         model_aliases=list(args.served_model_name), attachments=args.attachments, cache=args.prefix_cache,
                         tls_cert=args.tls_cert, tls_key=args.tls_key, max_sockets=args.max_sockets,
                         max_sockets_per_key=args.max_sockets_per_key, socket_max_age=args.socket_max_age)


def to_argv(args) -> list[str]:
    """The gateway flags of a parsed ``args`` as a command line (``symphony-kernel
    --http`` passes its gateway flags on to the gateway it starts)."""
    out = []
    for flag, v in (("--keys", args.keys), ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key),
                    ("--open-user", args.open_user), ("--max-body-mb", args.max_body_mb),
                    ("--max-active", args.max_active), ("--request-timeout", args.request_timeout),
                    ("--max-stored-responses", args.max_stored_responses),
                    ("--max-stored-mb", args.max_stored_mb), ("--default-max-tokens", args.default_max_tokens),
                    ("--attachments", args.attachments),
                    ("--prefix-cache", args.prefix_cache), ("--max-sockets", args.max_sockets),
                    ("--max-sockets-per-key", args.max_sockets_per_key), ("--socket-max-age", args.socket_max_age)):
        if v is not None:
            out += [flag, str(v)]
    for spec in args.program:
        out += ["--program", spec]
    for name in args.served_model_name:
        out += ["--served-model-name", name]
    return out
