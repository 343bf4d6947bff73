"""Answers that take time: server-sent events, and waiting while watching the client.

* `sse_response`: a generator's objects as SSE frames (``data: {json}``, with
  ``event: NAME`` first when ``named`` says which field names it), then a terminator (chat and
  completions end with ``data: [DONE]``).  Frames are produced only as fast
  as the client takes them (the ASGI server's flow control), so a slow
  reader holds back only its own program (the kernel's output credit stops
  its send()).  A client that disconnects cancels the generator; the run is
  closed in every case, which kills its LIP and frees its pages.
* `collect`: drain a run for a non-streamed answer, but give up (and close
  the run) as soon as the client disconnects.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, Optional

import orjson
from starlette.responses import StreamingResponse

from .errors import ApiError

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


def frame(obj: dict, named: Optional[str] = None) -> bytes:
    """One SSE frame; ``named``: the field of ``obj`` that names its event."""
    data = orjson.dumps(obj)
    if named:
        return b"event: " + str(obj.get(named, "message")).encode() + b"\ndata: " + data + b"\n\n"
    return b"data: " + data + b"\n\n"


def sse_response(run, request, gen: AsyncIterator[dict], *, named: Optional[str] = None,
                 terminator: Optional[bytes] = DONE,
                 on_error: Optional[Callable[[ApiError], dict]] = None) -> StreamingResponse:
    """Stream ``gen``'s objects; an ApiError after the response started
    becomes a last frame (``on_error(e)``, or ``{"error": ...}``)."""
    async def body():
        try:
            async for obj in gen:
                yield frame(obj, named)
            if terminator:
                yield terminator
        except ApiError as e:
            yield frame(on_error(e) if on_error else e.body(), named)
            if terminator:
                yield terminator
        finally:
            await run.close()
    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


async def _disconnected(request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def collect(run, request) -> None:
    """Consume the run's remaining events (the run keeps the results); if the
    client disconnects first, close the run and raise ClientGone."""
    async def drain():
        async for _ in run.rest():
            pass
    work = asyncio.ensure_future(drain())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            work.result()
            return
        work.cancel()
        raise ClientGone()
    finally:
        gone.cancel()
        await run.close()


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""
