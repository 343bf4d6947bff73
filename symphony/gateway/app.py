"""The gateway's ASGI application (Starlette): routes, keys, bounds, errors, logs.

    GET  /health, /metrics                      each kernel's state (503 when none answers); Prometheus
    GET  /v1/models[/{id}]                      the model the kernels serve, and their states
    POST /v1/chat/completions, /v1/completions  OpenAI, streamed (SSE) or not   (completions.py)
    POST /v1/responses; GET|DELETE /v1/responses/{id}; GET /v1/responses/{id}/input_items;
    POST /v1/responses/compact                  OpenAI / Open Responses          (responses.py)
    WebSocket /v1/responses                     its WebSocket mode               (ws.py)
    POST /v1/messages, /v1/messages/count_tokens
                                                Anthropic's Messages API          (messages.py)
    POST /v1/lips; POST /v1/lips/{id}/input; DELETE /v1/lips/{id}; GET /v1/lips
    GET|DELETE /v1/kv?path=; GET /v1/kv/stat?path=
                                                programs and KV files over HTTP  (lips.py)

Every /v1 request is authenticated by its API key (``Authorization: Bearer``
or ``x-api-key``, keys.py), bounded (body size; the key's rate and concurrency; the gateway's
requests in flight: limits.py) and logged (one access-log line: request id,
key, route, status, tokens, time to first token, total time).  Every error is
OpenAI-shaped (Anthropic-shaped on /v1/messages) with its status; nothing a client sends can produce a 500
(a 500 means a bug, and says so in the log with the request id).  With
several kernels (``--kernel`` repeated), each request runs on the one
kernels.py and router.py choose.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from pathlib import Path

import orjson
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute

from symphony.programs import available, resolve

from .config import ROUTES, GatewayConfig
from .errors import ApiError
from .files import pdfs_read
from .kernels import Kernels
from .keys import KeyPolicy, KeyStore
from .limits import Limiter
from .moves import Mover
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .store import ResponseStore
from .streams import ClientGone
from .ws import Sockets

log = logging.getLogger("symphony.gateway")
access = logging.getLogger("symphony.gateway.access")


class Gateway:
    """The gateway's state: its configuration, keys, kernels, limits,
    metrics, stored responses and the programs serving each route."""

    def __init__(self, cfg: GatewayConfig, keys: KeyStore):
        self.cfg, self.keys = cfg, keys
        self.metrics = Metrics()
        self.kernels = Kernels(cfg.kernels, cfg.open_user, capacity=cfg.affinity_entries, slack=cfg.affinity_slack,
                               metrics=self.metrics, credentials=cfg.kernel_credentials, on_draining=self._draining)
        self.limiter = Limiter(cfg.max_active)
        self.store = ResponseStore(cfg.max_stored_responses, cfg.max_stored_bytes)
        self.mover = Mover(self.kernels, self.store, self.cache_dir)      # KV that follows its users (moves.py)
        self._moves: set = set()
        self.sockets = Sockets(cfg)
        self.lips: dict[int, tuple[str, object, dict]] = {}   # gateway LIP id -> (key name, session, row)
        self.models: list[str] = []
        self.context_tokens = 2048
        # every program is read now: a gateway started as root reads them before it drops privileges
        self.stock = _stock_programs()
        self._programs = {route: self._read_program(cfg.programs.get(route, "serve")) for route in ROUTES}

    # ------------------------------------------------------------ start-up
    async def connect(self, wait_s: float = 60.0) -> None:
        """Learn the model from the first kernel to answer (waiting up to
        ``wait_s`` for one); the others join as they answer."""
        try:
            await self.kernels.connect(wait_s)
        except RuntimeError as e:
            raise RuntimeError(f"cannot reach the kernel: {e}") from None
        k = self.kernels.first
        aliases = list(self.cfg.model_aliases) + ([k.model_name] if k.model_name else [])
        self.models = [k.model] + [m for m in dict.fromkeys(aliases) if m != k.model]
        self.context_tokens = k.context
        where = (f"the kernel at {k.socket}" if len(self.kernels) == 1 else
                 f"{len(self.kernels.live())} of {len(self.kernels)} kernels answering")
        log.info("serving model %s (context %d) for %s; programs: %s", self.models[0], self.context_tokens, where,
                 ", ".join(f"{r}={f}" for r, (_, f) in self._programs.items()))

    def _read_program(self, spec: str) -> tuple[str, str]:
        if spec in self.stock:
            return self.stock[spec]
        path = resolve(spec)
        return Path(path).read_text(encoding="utf-8"), Path(path).name

    def program(self, route: str) -> tuple[str, str]:
        return self._programs[route]

    # ------------------------------------------------------------ helpers for routes
    def check_model(self, name: str) -> None:
        if name not in self.models:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                                f"{', '.join(repr(m) for m in self.models)} (GET /v1/models)",
                           code="model_not_found", param="model")

    def cache_dir(self, user: str):
        """The prefix-cache directory the serving program uses for ``user`` (None: no cache)."""
        if self.cfg.cache == "off":
            return None
        if self.cfg.cache == "shared" and any(k.user == user and k.share_cache for k in self.keys.keys):
            return "/shared/serve-cache"
        return f"/home/{user}/serve-cache"

    def _draining(self, k) -> None:
        """A kernel is draining: move its users' KV files in the background."""
        t = asyncio.get_running_loop().create_task(self.mover.evacuate(k))
        self._moves.add(t)
        t.add_done_callback(self._moves.discard)

    def prepare(self, req: dict, key: KeyPolicy) -> dict:
        """The serve request completed by the gateway's policy: the key's prefix
        cache (the contract's ``cache``) and, where the client set none, the limit
        ``--default-max-tokens`` and the sampling of ``--sampling-defaults``."""
        if req.get("max_tokens") is None:
            req["max_tokens"] = self.cfg.default_max_tokens
        for name, value in self.cfg.sampling_defaults.items():
            if req.get(name) is None:
                req[name] = value
        policy = self.cfg.cache
        if policy == "off":
            req["cache"] = None
        elif policy == "shared" and key.share_cache:
            req["cache"] = {"dir": "/shared/serve-cache",
                            "trust": sorted({k.user for k in self.keys.keys if k.share_cache})}
        else:
            req["cache"] = {"dir": f"/home/{key.user}/serve-cache", "trust": []}
        return req

    async def begin(self, run, request: Request) -> dict:
        """Start a serving run and wait for its first event (ApiError if refused);
        the run is closed when the request ends, whatever happens."""
        request.state.run = run
        await run.start()
        try:
            return await run.first()
        except BaseException:
            await run.close()
            raise

    def priority(self, request: Request, key: KeyPolicy) -> str:
        """The scheduling class of an OpenAI request: ``normal`` (``batch`` for a
        key capped there), or what its ``X-Symphony-Priority`` header asks for,
        within the key's ceiling (403 beyond it)."""
        asked = request.headers.get("x-symphony-priority")
        if asked is None:
            return "normal" if key.allows_priority("normal") else "batch"
        if asked not in ("batch", "normal", "interactive"):
            raise ApiError(400, "X-Symphony-Priority must be batch, normal or interactive", param="priority")
        if not key.allows_priority(asked):
            raise ApiError(403, f"this key may ask for priority up to {key.max_priority!r}, not {asked!r}",
                           code="priority_not_allowed", param="priority")
        return asked

    def authenticate(self, request: Request) -> KeyPolicy:
        """The key's policy, or the open policy when no key is configured."""
        if not self.keys.configured:
            return KeyPolicy(name="open", user=self.cfg.open_user, max_priority=self.cfg.open_priority,
                             rpm=1_000_000, max_concurrent=self.cfg.max_active)
        auth = request.headers.get("authorization", "")
        presented = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key")
        key = self.keys.lookup(presented)
        if key is None:
            raise ApiError(401, "a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)"
                           if not presented
                           else "invalid API key", code="invalid_api_key")
        return key

    async def body(self, request: Request) -> bytes:
        """The request body, at most --max-body-mb (413 beyond, without reading it all)."""
        limit = self.cfg.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise ApiError(413, f"the request body is larger than {limit} bytes (symphony-gateway --max-body-mb)",
                           code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is larger than {limit} bytes "
                                    f"(symphony-gateway --max-body-mb)", code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)


def _stock_programs() -> dict[str, tuple[str, str]]:
    """Every stock program's (source, file name), by name."""
    out = {}
    for name in available():
        path = Path(resolve(name))
        out[name] = (path.read_text(encoding="utf-8"), path.name)
    return out


# ---------------------------------------------------------------- the ASGI app
def build_app(gw: Gateway, *, connect: bool = True) -> Starlette:
    """The Starlette app serving ``gw``."""
    from . import completions, lips, messages, responses, ws

    def api(handler, route: str, *, needs_body: bool = True, errors: str = "openai"):
        async def endpoint(request: Request):
            request.state.route = route
            request.state.errors = errors                     # the shape of this route's errors
            key = None
            try:
                key = gw.authenticate(request)
                request.state.key = key.name
                # held until the response's last byte (the middleware releases it)
                request.state.slot = gw.limiter.acquire(key.name, key.rpm, key.max_concurrent)
            except ApiError:                        # refusals, a few a second each (limits.py)
                client = request.client.host if request.client else "local"
                await gw.limiter.refused(key.name if key is not None else f"addr:{client}")
                raise
            gw.metrics.active.inc()
            body = await gw.body(request) if needs_body else b""
            async with pdfs_read(body, key.name):       # inline PDFs read off the event loop
                out = await handler(gw, body, key, request)
            if isinstance(out, Response):
                return out
            return Response(orjson.dumps(out), media_type="application/json")
        return endpoint

    async def health(request: Request):
        request.state.route = "health"
        await gw.kernels.refresh()
        rows = gw.kernels.rows()
        up = sum(r["state"] == "up" for r in rows)
        status = "ok" if up == len(rows) else "degraded" if up else "unavailable"
        return Response(orjson.dumps({"status": status, "kernels": rows}), status_code=200 if up else 503,
                        media_type="application/json")

    async def metrics(request: Request):
        request.state.route = "metrics"
        gw.metrics.observe_kernels(gw.kernels, await gw.kernels.refresh())
        return Response(gw.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def models(gw_, body, key, request):
        wanted = request.path_params.get("model")
        kernels = [{"id": r["id"], "socket": r["socket"], "state": r["state"]} for r in gw.kernels.rows()]
        rows = [{"id": m, "object": "model", "created": 0, "owned_by": "symphony",
                 "max_model_len": gw.context_tokens, "kernels": kernels} for m in gw.models]
        if wanted is None:
            return {"object": "list", "data": rows}
        for r in rows:
            if r["id"] == wanted:
                return r
        raise ApiError(404, f"the model {wanted!r} does not exist", code="model_not_found", param="model")

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", api(models, "models", needs_body=False), methods=["GET"]),
        Route("/v1/models/{model:path}", api(models, "models", needs_body=False), methods=["GET"]),
        Route("/v1/chat/completions", api(completions.chat_completions, "chat"), methods=["POST"]),
        Route("/v1/completions", api(completions.completions, "completions"), methods=["POST"]),
        Route("/v1/responses", api(responses.create, "responses"), methods=["POST"]),
        WebSocketRoute("/v1/responses", lambda websocket: ws.endpoint(gw, websocket)),
        Route("/v1/responses/compact", api(responses.compact, "responses.compact"), methods=["POST"]),
        Route("/v1/responses/{rid}", api(responses.get, "responses.get", needs_body=False), methods=["GET"]),
        Route("/v1/responses/{rid}", api(responses.delete, "responses.delete", needs_body=False),
              methods=["DELETE"]),
        Route("/v1/responses/{rid}/input_items", api(responses.input_items, "responses.input_items",
                                                     needs_body=False), methods=["GET"]),
        Route("/v1/messages", api(messages.create, "messages", errors="anthropic"), methods=["POST"]),
        Route("/v1/messages/count_tokens", api(messages.count_tokens, "messages.count_tokens", errors="anthropic"),
              methods=["POST"]),
        Route("/v1/lips", api(lips.submit, "lips.submit"), methods=["POST"]),
        Route("/v1/lips", api(lips.listing, "lips.list", needs_body=False), methods=["GET"]),
        Route("/v1/lips/{lip:int}/input", api(lips.send_input, "lips.input"), methods=["POST"]),
        Route("/v1/lips/{lip:int}", api(lips.kill, "lips.kill", needs_body=False), methods=["DELETE"]),
        Route("/v1/kv", api(lips.kv_ls, "kv.ls", needs_body=False), methods=["GET"]),
        Route("/v1/kv", api(lips.kv_rm, "kv.rm", needs_body=False), methods=["DELETE"]),
        Route("/v1/kv/stat", api(lips.kv_stat, "kv.stat", needs_body=False), methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if connect:
            await gw.connect()
        yield
        await gw.kernels.close()

    async def api_error(request: Request, e: ApiError):
        return Response(e.json(_shape(request.scope)), status_code=e.status, media_type="application/json",
                        headers=e.headers())

    async def client_gone(request: Request, e: ClientGone):
        return Response(b"", status_code=499)

    async def bug(request: Request, e: Exception):
        rid = request.scope.get("state", {}).get("request_id", "?")
        log.error("request %s (%s %s) failed: %s: %s", rid, request.method, request.url.path, type(e).__name__, e,
                  exc_info=e)
        return Response(ApiError(500, f"internal error (request id {rid})").json(_shape(request.scope)), status_code=500,
                        media_type="application/json")

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={ApiError: api_error, ClientGone: client_gone, ClientDisconnect: client_gone,
                                        Exception: bug})
    return AccessLog(app, gw)


def _shape(scope) -> str:
    """The error shape of the route a request reached: "anthropic" or "openai"."""
    return scope.get("state", {}).get("errors", "openai")


class AccessLog:
    """ASGI middleware: a request id, OpenAI-shaped errors for everything that
    goes wrong (unknown routes and methods included), metrics by route and
    status, and one access-log line per request, written when its last byte
    has gone (a stream's too)."""

    def __init__(self, app, gw: Gateway):
        self.app, self.gw = app, gw

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = "req_" + secrets.token_hex(8)
        t0 = time.monotonic()
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        info = {"status": 500, "started": False, "state": state}

        async def send_wrapped(msg):
            if msg["type"] == "http.response.start":
                info["status"], info["started"] = msg["status"], True
                headers = list(msg.get("headers", []))
                headers.append((b"x-request-id", rid.encode()))
                if msg["status"] in (404, 405) and state.get("route") is None:
                    return await self._error(send, ApiError(msg["status"], "unknown route" if msg["status"] == 404
                                                            else "method not allowed for this route",
                                                            code="not_found" if msg["status"] == 404 else None),
                                             rid, info, skip_body=True)
                msg = dict(msg, headers=headers)
            elif msg["type"] == "http.response.body" and info.get("skip_body"):
                return
            await send(msg)

        try:
            await self.app(scope, receive, send_wrapped)
        except ApiError as e:
            if not info["started"]:
                await self._error(send, e, rid, info)
        except (ClientGone, ClientDisconnect):
            info["status"] = 499
        except Exception:                                   # a bug (logged by `bug` once started)
            if not info["started"]:
                log.exception("request %s (%s %s) failed", rid, scope.get("method"), scope.get("path"))
                await self._error(send, ApiError(500, f"internal error (request id {rid})"), rid, info)
        finally:
            run, slot = state.get("run"), state.get("slot")
            if run is not None:
                await run.close()                           # idempotent: a stream closed it already
            if slot is not None:
                slot.release()
                self.gw.metrics.active.dec()
            route = state.get("route") or "unknown"
            self.gw.metrics.requests.labels(route, str(info["status"])).inc()
            tokens = f"{run.prompt_tokens}+{run.completion_tokens}" if run is not None else "-"
            ttft = (f"{(run.first_token_at - run.started) * 1e3:.0f}ms"
                    if run is not None and run.first_token_at else "-")
            access.info("%s %s %s %s key=%s status=%s tokens=%s ttft=%s total=%.0fms", rid, scope.get("method"),
                        scope.get("path"), route, state.get("key", "-"), info["status"], tokens, ttft,
                        (time.monotonic() - t0) * 1e3)

    async def _error(self, send, e: ApiError, rid: str, info: dict, skip_body: bool = False):
        info["status"], info["started"] = e.status, True
        if skip_body:
            info["skip_body"] = True
        body = e.json(_shape({"state": info.get("state", {})}))
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"x-request-id", rid.encode())] + [(k.lower().encode(), v.encode())
                                                       for k, v in e.headers().items()]
        await send({"type": "http.response.start", "status": e.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
