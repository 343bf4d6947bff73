"""Programs and KV files over HTTP, for the key's user.

    POST   /v1/lips                 {"program": NAME | "source": TEXT, "filename", "args", "grants",
                                     "limits", "priority", "kv_tokens"}
                                    -> SSE: the LIP's events as the kernel sends them, one
                                       `event: KIND` frame each: queued / started, out, stdout,
                                       stderr, exit {"status", "reason"}
    POST   /v1/lips/{id}/input      {"data": LINE} or {"eof": true}: one line for its recv()
    DELETE /v1/lips/{id}            kill it (its exit event ends its stream)
    GET    /v1/lips                 this key's running LIPs
    GET    /v1/kv?path=DIR          list a KVFS directory   (as the key's user)
    GET    /v1/kv/stat?path=PATH    one file's metadata
    DELETE /v1/kv?path=PATH         remove a file

A LIP submitted here lives as long as its event stream: a client that
disconnects kills it (and gets its pages back), as ``symphony run`` does
locally.  A program is a stock program's name (never a path on the server)
or the LIP's source.  Grants and the priority are checked against the key's
policy (403 beyond it); limits are the kernel's ceilings.  Another key's LIP
is 404, as if it did not exist.  ``symphony run --remote URL`` speaks this.
"""
from __future__ import annotations

import time
from starlette.requests import Request

from .errors import ApiError
from .kernel import KernelRefused, KernelUnavailable
from .schema import LipInput, LipRequest, decode
from .serving import kernel_error
from .streams import sse_response


class _LipRun:
    """What the access log and the middleware's cleanup see of a LIP stream."""

    def __init__(self, session):
        self.session, self.started, self.first_token_at = session, time.monotonic(), None
        self.prompt_tokens = self.completion_tokens = 0
        self._closed = False

    async def close(self):
        if not self._closed:
            self._closed = True
            await self.session.close()


def _program(gw, r: LipRequest) -> tuple[str, str]:
    if (r.program is None) == (r.source is None):
        raise ApiError(400, "give exactly one of 'program' (a stock program's name) and 'source'", param="program")
    if r.source is not None:
        return r.source, r.filename or "lip.py"
    if r.program not in gw.stock:
        raise ApiError(404, f"no stock program named {r.program!r}; the stock programs are "
                            f"{', '.join(sorted(gw.stock))}", code="program_not_found", param="program")
    return gw.stock[r.program]


async def submit(gw, body: bytes, key, request: Request):
    r = decode(body, LipRequest)
    source, filename = _program(gw, r)
    if set(r.grants) - {"http", "read"}:
        raise ApiError(400, "grants are {\"http\": [HOST[:PORT]...], \"read\": [DIR...]}", param="grants")
    denied = key.allows_grants(r.grants)
    if denied is not None:
        raise ApiError(403, f"this key may not grant {denied}", code="grant_not_allowed", param="grants")
    if not key.allows_priority(r.priority):
        raise ApiError(403, f"this key may ask for priority up to {key.max_priority!r}, not {r.priority!r}",
                       code="priority_not_allowed", param="priority")
    limits = {k: (int(v) if k in ("memory_bytes", "threads") else v) for k, v in r.limits.items()}
    try:
        session = await gw.link.start(key.user, source, r.args, filename=filename,
                                      grants={"http": r.grants.get("http", []), "read": r.grants.get("read", [])},
                                      limits=limits, priority=r.priority, kv_tokens=r.kv_tokens)
    except (KernelRefused, KernelUnavailable) as e:
        err = kernel_error(e)
        if isinstance(e, KernelRefused) and e.type in ("ValueError", "SyntaxError", "TypeError") \
                or (isinstance(e, KernelRefused) and e.code == "EINVAL"):
            err.status = 400
        raise err from None
    run = request.state.run = _LipRun(session)
    gw.lips[session.lip] = (key.name, session, {"lip": session.lip, "program": filename, "args": r.args,
                                                "priority": r.priority, "submitted": time.time()})

    async def events():
        try:
            yield dict(session.first)
            async for ev in session.events():
                yield ev
        finally:
            gw.lips.pop(session.lip, None)

    return sse_response(run, request, events(), named="event", terminator=None)


def _own(gw, key, lip: int):
    entry = gw.lips.get(lip)
    if entry is None or entry[0] != key.name:
        raise ApiError(404, f"no LIP {lip} of this key", code="not_found", param="lip")
    return entry[1]


async def send_input(gw, body: bytes, key, request: Request):
    session = _own(gw, key, request.path_params["lip"])
    r = decode(body, LipInput)
    if (r.data is None) == (not r.eof):
        raise ApiError(400, "give 'data' (a line) or 'eof': true", param="data")
    await session.send_input(None if r.eof else r.data)
    return {"ok": True, "lip": session.lip}


async def kill(gw, body: bytes, key, request: Request):
    session = _own(gw, key, request.path_params["lip"])
    await session.kill()
    return {"ok": True, "lip": session.lip}


async def listing(gw, body: bytes, key, request: Request):
    mine = {lip: row for lip, (name, _, row) in gw.lips.items() if name == key.name}
    try:
        ps = await gw.link.request(key.user, {"op": "ps"})
    except (KernelRefused, KernelUnavailable) as e:
        raise kernel_error(e) from None
    live = {r["lip"]: r for r in ps.get("lips", [])}
    out = []
    for lip, row in sorted(mine.items()):
        k = live.get(lip, {})
        out.append({**row, "state": k.get("state", "exiting"), "preds": k.get("preds"), "tokens": k.get("tokens"),
                    "position": k.get("position")})
    return {"object": "list", "data": out}


async def _kv(gw, key, msg: dict):
    try:
        return await gw.link.request(key.user, msg)
    except KernelRefused as e:
        status = {"ENOENT": 404, "EACCES": 403, "EPERM": 403, "ENOTDIR": 400, "EISDIR": 400}.get(e.code, 400)
        raise ApiError(status, str(e), code=(e.type or "kv_error").lower(), param="path") from None
    except KernelUnavailable as e:
        raise kernel_error(e) from None


def _path(request: Request) -> str:
    p = request.query_params.get("path")
    if not p:
        raise ApiError(400, "the query parameter 'path' is required", param="path")
    return p


async def kv_ls(gw, body, key, request: Request):
    reply = await _kv(gw, key, {"op": "kv_ls", "path": request.query_params.get("path") or "/"})
    return {"object": "list", "data": reply.get("entries", [])}


async def kv_stat(gw, body, key, request: Request):
    return await _kv(gw, key, {"op": "kv_stat", "path": _path(request)})


async def kv_rm(gw, body, key, request: Request):
    path = _path(request)
    await _kv(gw, key, {"op": "kv_rm", "path": path})
    return {"ok": True, "path": path, "deleted": True}
