"""Programs and KV files over HTTP, for the key's user.

    POST   /v1/lips                 {"program": NAME | "source": TEXT, "filename", "args", "grants",
                                     "limits", "priority", "kv_tokens", "kv_files"}
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

**Several kernels.**  A LIP runs on the kernel holding the most of the KV
files its request names (``kv_files``, asked of every live kernel with
``kv_stat`` as the key's user), else on the least loaded.  LIP ids are the
gateway's: kernel i's LIP j is ``j * N + i`` with N kernels (with one, the
kernel's own id).  ``/v1/kv`` asks every live kernel: a listing merges
theirs (the first kernel's entry wins a name), ``stat`` answers from the
first that holds the file (naming it in ``kernel``), ``rm`` removes it from
every kernel that holds it.  A kernel out of rotation is not asked.
"""
from __future__ import annotations

import asyncio
import time
from typing import Optional

from starlette.requests import Request

from .errors import ApiError
from .kernel import KernelRefused, KernelUnavailable
from .router import PinnedKernelDown
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
    pin = await _holder(gw, key, r.kv_files)
    try:
        session = await gw.kernels.spawn(key.user, source, r.args, pin=pin, filename=filename,
                                         grants={"http": r.grants.get("http", []), "read": r.grants.get("read", [])},
                                         limits=limits, priority=r.priority, kv_tokens=lambda k: r.kv_tokens)
    except PinnedKernelDown as e:
        k = gw.kernels[e.kernel]
        raise ApiError(503, f"the kernel at {k.socket}, which holds the KV files of kv_files, stopped answering "
                            f"({k.error}); retry", code="kernel_unavailable", param="kv_files", retry_after=5) from None
    except (KernelRefused, KernelUnavailable) as e:
        err = kernel_error(e)
        if isinstance(e, KernelRefused) and e.type in ("ValueError", "SyntaxError", "TypeError") \
                or (isinstance(e, KernelRefused) and e.code == "EINVAL"):
            err.status = 400
        raise err from None
    run = request.state.run = _LipRun(session)
    gid = lip_id(gw, session)
    gw.lips[gid] = (key.name, session, {"lip": gid, "program": filename, "args": r.args,
                                        "priority": r.priority, "submitted": time.time()})

    async def events():
        try:
            yield _relabel(session.first, gid)
            async for ev in session.events():
                yield _relabel(ev, gid)
        finally:
            gw.lips.pop(gid, None)

    return sse_response(run, request, events(), named="event", terminator=None)


def lip_id(gw, session) -> int:
    """The gateway's id of a LIP: the kernel's id with one kernel, else unique across them."""
    return session.lip * len(gw.kernels) + session.kernel.index


def _relabel(ev: dict, gid: int) -> dict:
    return dict(ev, lip=gid) if "lip" in ev else dict(ev)


async def _holder(gw, key, paths: list) -> Optional[int]:
    """The live kernel holding the most of ``paths`` (None: no kernel holds
    any, or there is one kernel only)."""
    live = gw.kernels.live()
    if not paths or len(gw.kernels) == 1 or not live:
        return None

    async def held(k) -> int:
        n = 0
        for p in dict.fromkeys(paths):
            try:
                await k.link.request(key.user, {"op": "kv_stat", "path": p})
                n += 1
            except KernelRefused:
                pass
            except KernelUnavailable as e:
                gw.kernels.lost(k, str(e))
                return 0
        return n
    counts = await asyncio.gather(*(held(k) for k in live))
    best = max(range(len(live)), key=lambda i: counts[i])
    return live[best].index if counts[best] else None


def _own(gw, key, lip: int):
    entry = gw.lips.get(lip)
    if entry is None or entry[0] != key.name:
        raise ApiError(404, f"no LIP {lip} of this key", code="not_found", param="lip")
    return entry[1]


async def send_input(gw, body: bytes, key, request: Request):
    lip = request.path_params["lip"]
    session = _own(gw, key, lip)
    r = decode(body, LipInput)
    if (r.data is None) == (not r.eof):
        raise ApiError(400, "give 'data' (a line) or 'eof': true", param="data")
    await session.send_input(None if r.eof else r.data)
    return {"ok": True, "lip": lip}


async def kill(gw, body: bytes, key, request: Request):
    lip = request.path_params["lip"]
    session = _own(gw, key, lip)
    await session.kill()
    return {"ok": True, "lip": lip}


async def listing(gw, body: bytes, key, request: Request):
    mine = {gid: (session, row) for gid, (name, session, row) in gw.lips.items() if name == key.name}
    by_kernel: dict = {}
    for session, _ in mine.values():
        by_kernel.setdefault(session.kernel.index, session.kernel)
    live = {}
    for i, k in by_kernel.items():
        try:
            ps = await k.link.request(key.user, {"op": "ps"})
        except (KernelRefused, KernelUnavailable) as e:
            if len(gw.kernels) == 1:
                raise kernel_error(e) from None
            continue                                  # that kernel's LIPs show as "unreachable"
        live[i] = {r["lip"]: r for r in ps.get("lips", [])}
    out = []
    for gid, (session, row) in sorted(mine.items()):
        rows = live.get(session.kernel.index)
        k = (rows or {}).get(session.lip, {})
        out.append({**row, "state": k.get("state", "exiting" if rows is not None else "unreachable"),
                    "preds": k.get("preds"), "tokens": k.get("tokens"), "position": k.get("position")})
    return {"object": "list", "data": out}


async def _kv_each(gw, key, msg: dict) -> list:
    """``msg`` asked of every live kernel as the key's user: [(kernel, reply or KernelRefused)]
    (503 if no kernel answers)."""
    async def ask(k):
        try:
            return k, await k.link.request(key.user, msg)
        except KernelRefused as e:
            return k, e
        except KernelUnavailable as e:
            gw.kernels.lost(k, str(e))
            return k, None
    answers = [(k, a) for k, a in await asyncio.gather(*(ask(k) for k in gw.kernels.live())) if a is not None]
    if not answers:
        raise gw.kernels.unavailable()
    return answers


def _kv_error(e: KernelRefused) -> ApiError:
    status = {"ENOENT": 404, "EACCES": 403, "EPERM": 403, "ENOTDIR": 400, "EISDIR": 400}.get(e.code, 400)
    return ApiError(status, str(e), code=(e.type or "kv_error").lower(), param="path")


def _first_refusal(answers: list) -> ApiError:
    """The error to answer when no kernel did what was asked: a refusal other
    than 'not found' if one kernel gave it, else the first."""
    refusals = [a for _, a in answers if isinstance(a, KernelRefused)]
    return _kv_error(next((e for e in refusals if e.code != "ENOENT"), refusals[0]))


def _path(request: Request) -> str:
    p = request.query_params.get("path")
    if not p:
        raise ApiError(400, "the query parameter 'path' is required", param="path")
    return p


async def kv_ls(gw, body, key, request: Request):
    answers = await _kv_each(gw, key, {"op": "kv_ls", "path": request.query_params.get("path") or "/"})
    ok = [a for _, a in answers if not isinstance(a, KernelRefused)]
    if not ok:
        raise _first_refusal(answers)
    merged: dict = {}
    for reply in ok:
        for e in reply.get("entries", []):
            merged.setdefault(e.get("name"), e)
    return {"object": "list", "data": list(merged.values())}


async def kv_stat(gw, body, key, request: Request):
    answers = await _kv_each(gw, key, {"op": "kv_stat", "path": _path(request)})
    for k, a in answers:
        if not isinstance(a, KernelRefused):
            return dict(a, kernel=k.socket) if len(gw.kernels) > 1 else a
    raise _first_refusal(answers)


async def kv_rm(gw, body, key, request: Request):
    path = _path(request)
    answers = await _kv_each(gw, key, {"op": "kv_rm", "path": path})
    if all(isinstance(a, KernelRefused) for _, a in answers):
        raise _first_refusal(answers)
    return {"ok": True, "path": path, "deleted": True}
