"""``symphony-gateway``: the HTTP front door, a process of its own beside the kernel.

    symphony-gateway --http 0.0.0.0:8000 [--socket PATH] [--keys FILE] [--tls-cert PEM --tls-key PEM]
    symphony-gateway --http 0.0.0.0:8000 --kernel PATH --kernel PATH ...      (several kernels)

It runs uvicorn (with uvloop, httptools, and websockets for the WebSocket
mode of /v1/responses) on the app of app.py, behind the front door of
frontdoor.py (timeouts, and connections bounded per client address), and
talks to its kernels over their Unix sockets (kernels.py; router.py says
which kernel serves what).  Started as root (``symphony-kernel
--http`` does), it reads the key file, the TLS files and binds its port
first, then drops to ``--run-as UID`` (the uid the kernel trusts to act for
the keys' users, ``symphony-kernel --gateway-uid``) before serving; it never
serves as root.  With no keys configured it binds only to loopback and says
so.  SIGHUP reloads the key file; SIGTERM/SIGINT stop it; it also stops when
the process that started it dies (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import signal
import socket
import sys

from . import config as cfgmod
from .keys import KeyFileError, KeyStore, default_key_file

log = logging.getLogger("symphony.gateway")
PR_SET_PDEATHSIG = 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="symphony-gateway", description="Symphony's HTTP gateway (OpenAI API, "
                                "programs over HTTP) in front of one kernel or several.")
    p.add_argument("--http", default="127.0.0.1:8000", metavar="HOST:PORT",
                   help="address to serve (default 127.0.0.1:8000)")
    p.add_argument("--socket", default=None, help="the kernel's Unix socket (default $SYMPHONY_SOCKET or the "
                   "kernel's default path, unless --kernel names them)")
    p.add_argument("--run-as", type=int, default=None, metavar="UID",
                   help="started as root: serve as this uid (= gid) after binding (default: refuse to serve as root)")
    p.add_argument("--parent-death", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-v", "--verbose", action="store_true")
    cfgmod.add_args(p)
    cfgmod.add_routing_args(p)
    return p


def _fit_open_files(door):
    """The door's bounds, its connections within the process's open-file limit
    (raised to its hard limit first; 256 files kept for kernels and the rest)."""
    import dataclasses
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    room = soft - 256 if soft != resource.RLIM_INFINITY else door.max_connections
    if door.max_connections > room:
        log.warning("--max-http-connections %d is more than the open-file limit (%d) leaves room for: %d",
                    door.max_connections, soft, max(room, 16))
        door = dataclasses.replace(door, max_connections=max(room, 16))
    return door


def _drop_privileges(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.geteuid() == 0 or os.getegid() == 0:
        raise RuntimeError("could not drop root privileges")


_BACKLOG = 2048


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(_BACKLOG)
    s.set_inheritable(True)
    return s


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from symphony.ipc.protocol import default_socket_path
    try:
        host, port = cfgmod.parse_hostport(args.http)
        if args.keys is None:
            args.keys = default_key_file()
        kernels = ([args.socket] if args.socket else []) + args.kernel
        cfg = cfgmod.from_args(args, kernels[0] if kernels else default_socket_path(), host, port, kernels)
        keys = KeyStore(cfg.keys_path)
    except (cfgmod.ConfigError, KeyFileError) as e:
        print(f"symphony-gateway: error: {e}", file=sys.stderr)
        return 2
    if os.geteuid() == 0 and args.run_as in (None, 0):
        print("symphony-gateway: error: started as root: give --run-as UID (the uid the kernel trusts with "
              "--gateway-uid); the gateway never serves as root", file=sys.stderr)
        return 2
    if not keys.configured and not cfgmod.is_loopback(cfg.host):
        log.warning("no API keys in %s: serving loopback only (127.0.0.1), not %s; every request runs as "
                    "KVFS user %r (add keys with `symphony keys add`)", cfg.keys_path, cfg.host, cfg.open_user)
        cfg.host = "127.0.0.1"
    elif not keys.configured:
        log.warning("no API keys in %s: loopback only, every request runs as KVFS user %r",
                    cfg.keys_path, cfg.open_user)
    else:
        log.info("%d API keys from %s", len(keys.keys), cfg.keys_path)
    import uvicorn
    import warnings
    from .app import Gateway, build_app
    from .frontdoor import Door, protocol_class
    # uvicorn's "websockets" protocol is the one of its implementations that can refuse a
    # WebSocket handshake with an HTTP status (401, 429): kept on purpose, its notice silenced
    warnings.filterwarnings("ignore", message="The `websockets` implementation is deprecated")
    from symphony.programs import ProgramError
    try:
        gw = Gateway(cfg, keys)
    except (ProgramError, OSError) as e:
        print(f"symphony-gateway: error: a serving program cannot be read: {e}", file=sys.stderr)
        return 2
    app = build_app(gw)
    door = Door(_fit_open_files(cfg.door()))
    gw.metrics.registry.register(door)
    try:
        sock = _bind(cfg.host, cfg.port)
    except OSError as e:
        print(f"symphony-gateway: error: cannot listen on {cfg.host}:{cfg.port}: {e}", file=sys.stderr)
        return 2
    # the front door (frontdoor.py) bounds connections per client address; uvicorn's own
    # limit_concurrency would count every half-sent connection and answer everyone 503
    ucfg = uvicorn.Config(app, loop="uvloop", http=protocol_class(door), ws="websockets", lifespan="on",
                          log_level="warning", access_log=False, ssl_certfile=cfg.tls_cert, ssl_keyfile=cfg.tls_key,
                          timeout_keep_alive=cfg.keep_alive_timeout, limit_concurrency=None,
                          backlog=_BACKLOG)
    try:
        ucfg.load()                                   # reads the TLS files now, before any privilege drop
    except (OSError, ValueError) as e:
        print(f"symphony-gateway: error: TLS: {e}", file=sys.stderr)
        return 2
    if os.geteuid() == 0:
        _preload()                                    # after the drop, root's files are out of reach
        _drop_privileges(args.run_as)
    if args.parent_death:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() == 1:
            return 0
    server = uvicorn.Server(ucfg)
    scheme = "https" if cfg.tls_cert else "http"

    async def serve():
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, _reload, keys)
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            where = (f"the kernel at {cfg.socket_path}" if len(cfg.kernels) == 1 else
                     f"{len(cfg.kernels)} kernels at {', '.join(cfg.kernels)}")
            print(f"symphony-gateway: serving {scheme}://{cfg.host}:{cfg.port} for {where} (uid {os.geteuid()})",
                  file=sys.stderr, flush=True)
        await task
    import uvloop
    uvloop.run(serve())
    return 0 if server.started else 1


# Modules imported on first use by the libraries the gateway runs on: imported
# before a root-started gateway drops its privileges, since the interpreter's
# own files may then be unreadable (e.g. a virtualenv under /root).
PRELOAD = ("anyio._backends._asyncio", "uvicorn.protocols.http.httptools_impl", "uvicorn.lifespan.on",
           "uvicorn.loops.uvloop", "encodings.idna", "email.utils", "http.cookies", "prometheus_client.exposition",
           "prometheus_client.openmetrics.exposition", "symphony.gateway.completions", "symphony.gateway.responses",
           "symphony.gateway.lips", "symphony.gateway.messages", "symphony.gateway.ws",
           "uvicorn.protocols.websockets.websockets_impl", "websockets.legacy.server", "starlette.background", "starlette.datastructures", "starlette.formparsers",
           "json", "hmac", "hashlib")


def _preload() -> None:
    import importlib
    for m in PRELOAD:
        try:
            importlib.import_module(m)
        except ImportError:
            pass


def _reload(keys: KeyStore) -> None:
    try:
        n = keys.reload()
        log.info("SIGHUP: %d API keys from %s", n, keys.path)
    except KeyFileError as e:
        log.error("SIGHUP: the key file was not reloaded (the keys in force stay): %s", e)


if __name__ == "__main__":
    sys.exit(main())
