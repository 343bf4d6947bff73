"""Server-sent events of a streamed OpenAI-style chat request, as the benchmarks read them
(perf/bench_gateway.py, perf/bench_decode.py, perf/paper/rag_skew.py)."""
from __future__ import annotations

import json
from typing import AsyncIterator, Optional

import httpx


def event(line: str) -> Optional[dict]:
    """The JSON of one ``data:`` line of the stream; None for any other line and ``[DONE]``."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    return json.loads(line[6:])


def content(ev: dict) -> str:
    """The text an event's choices add (their deltas' content)."""
    return "".join((ch.get("delta") or {}).get("content") or "" for ch in ev.get("choices", []))


async def chat_events(client: httpx.AsyncClient, url: str, body: dict) -> AsyncIterator[dict]:
    """POST ``body`` to ``url``/v1/chat/completions and yield its stream's events. RuntimeError
    naming the server for an HTTP error status, a stream the server cuts, or an error event (a
    server's error event ends the request: a failure, not a fast empty answer)."""
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        try:
            async for line in r.aiter_lines():
                ev = event(line)
                if ev is None:
                    continue
                if ev.get("error"):
                    raise RuntimeError(f"{url}: error event: {str(ev['error'])[:300]}")
                yield ev
        except httpx.HTTPError as e:
            raise RuntimeError(f"{url}: the stream broke: {e}") from e
