"""``/v1/responses``: OpenAI's Responses API, in the Open Responses specification's shapes.

``POST /v1/responses`` turns the input items (items.py: a string, messages,
earlier ``function_call`` items and ``function_call_output`` results,
``compaction`` items), the ``instructions`` and, with ``previous_response_id``,
the stored conversation before them into one serving-program run
(serving.py): a `Turn`.  Its events become the response's output items: one
``message`` with an ``output_text`` part, then one ``function_call`` item
per tool call.  Streamed, the events follow the specification's order, each
with its ``sequence_number``:

    response.created, response.in_progress,
    per message:  response.output_item.added, response.content_part.added,
                  response.output_text.delta..., response.output_text.done,
                  response.content_part.done, response.output_item.done
    per call:     response.output_item.added, response.function_call_arguments.delta...,
                  response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

A `Turn` is the same over a WebSocket (ws.py: the specification's WebSocket
mode, the same events as JSON messages).  ``store`` (default true) keeps the
response for ``GET``/``DELETE /v1/responses/{id}``, ``/input_items`` and
continuations (store.py).  A continuation runs on the kernel that served the
response it continues, where the conversation's KV is.  When that kernel
drains, or dies having made the conversation durable
(``--durable-responses``) in a directory another kernel may adopt from, the
files move and the continuation follows them (moves.py); otherwise, while it
is out of rotation, it is a 503 (``previous_response_unavailable``) rather
than a silent recomputation elsewhere.

``POST /v1/responses/compact`` returns a compacted window of a conversation
(``response.compaction``): its system, developer and user messages as they
were, then one ``compaction`` item holding a summary of the whole
conversation, written by the model (greedy, at most ``COMPACT_TOKENS``
tokens).  Sent back as ``input`` (with new items after it), the compaction
item becomes a system message carrying the summary.  Nothing is stored: the
item carries its content (items.py `seal`).
"""
from __future__ import annotations

import time
from typing import AsyncIterator, Optional

from .errors import ApiError
from .items import (SUMMARY_HEAD, Builder, check_tool_outputs, input_messages, new_id, seal, serve_request)
from .schema import CompactRequest, ResponsesRequest, decode
from .serving import ServeRun
from .store import Stored
from .streams import collect, sse_response

COMPACT_TOKENS = 160
COMPACT_PROMPT = ("Write a summary of the conversation above that keeps every fact, name, number, decision and "
                  "open question needed to continue it. Write only the summary.")


class Turn:
    """One response, over HTTP or a WebSocket: its input resolved against the
    conversation it continues (``previous``), its serving run, the response it builds."""

    def __init__(self, gw, r: ResponsesRequest, key, priority: str, previous: Optional[Stored],
                 pin: Optional[int] = None):
        """``pin``: the kernel the continuation runs on (`follow`; default: ``previous``'s)."""
        gw.check_model(r.model)
        msgs, self.items = input_messages(r, gw.cfg.attachments)
        before = previous.conversation if previous is not None else []
        self.conversation = before + msgs
        check_tool_outputs(self.conversation, len(before))
        req, tools, choice = serve_request(r, self.conversation)
        gw.prepare(req, key)
        r.temperature, r.top_p = req["temperature"], req["top_p"]     # the response echoes what applies
        if r.store and gw.cfg.durable_responses and req.get("cache"):
            req["cache"]["durable"] = True              # its conversation's KV survives the kernel
        self.gw, self.r, self.key = gw, r, key
        self.rid = new_id("resp")
        if pin is None and previous is not None:
            pin = previous.kernel
        self.run = ServeRun(gw, "responses", [req], 1, key, priority, pin=pin, pinned_by=r.previous_response_id,
                            follow=(lambda: gw.mover.follow(key.user, previous)) if previous is not None else None)
        self.b = Builder(r, self.rid, tools, choice, self.run)
        self.record: Optional[Stored] = None           # the finished response, as a continuation needs it

    def finish(self) -> dict:
        """The final response object; kept in the store with ``store``, and as `record`."""
        final = self.b.final()
        c = self.run.choices[0]
        said = {"role": "assistant", "content": "".join(c.text)}
        if c.calls:
            said["tool_calls"] = [dict(x) for x in c.calls]
        self.record = Stored(self.key.user, final, self.items, self.conversation + [said], self.run.kernel.index)
        if self.r.store and not self.gw.store.put(self.rid, self.record):
            final["store"] = False                      # larger than the user's whole store: not kept
        return final

    async def events(self) -> AsyncIterator[dict]:
        """The streamed events, after the run's first event was taken (`Gateway.begin`)."""
        b = self.b
        yield b.event("response.created", response=b.resource("in_progress"))
        yield b.event("response.in_progress", response=b.resource("in_progress"))
        async for ev in self.run.rest():
            for e in b.on(ev):
                yield e
        final = self.finish()
        yield b.event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                      response=final)

    def failed(self, e: ApiError) -> dict:
        """The last event of a response that failed after it started."""
        return self.b.event("response.failed", response=self.b.resource(
            "failed", error={"code": e.code or "server_error", "message": e.message}))


def stored_previous(gw, key, rid: Optional[str]) -> Optional[Stored]:
    """The stored response ``rid`` continues (404 ``previous_response_not_found``)."""
    if not rid:
        return None
    prev = gw.store.get(key.user, rid)
    if prev is None:
        raise not_found(rid)
    return prev


async def follow(gw, key, previous: Optional[Stored]) -> Optional[int]:
    """The kernel a continuation of ``previous`` runs on (moves.py: where its KV is now)."""
    return None if previous is None else await gw.mover.follow(key.user, previous)


def not_found(rid: str, status: int = 404) -> ApiError:
    return ApiError(status, f"Previous response with id {rid!r} not found (it was never stored, was deleted, "
                            f"belongs to another user, or was made with store: false on another connection)",
                    code="previous_response_not_found", param="previous_response_id")


async def create(gw, body: bytes, key, request):
    r = decode(body, ResponsesRequest)
    prev = stored_previous(gw, key, r.previous_response_id)
    turn = Turn(gw, r, key, gw.priority(request, key), prev, await follow(gw, key, prev))
    await gw.begin(turn.run, request)
    if r.stream:
        return sse_response(turn.run, request, turn.events(), named="type", terminator=None, on_error=turn.failed)
    await collect(turn.run, request)
    turn.b.from_choice()
    return turn.finish()


async def compact(gw, body: bytes, key, request):
    r = decode(body, CompactRequest)
    gw.check_model(r.model)
    previous = stored_previous(gw, key, r.previous_response_id)
    before = previous.conversation if previous is not None else []
    if r.input in (None, "", []) and before:
        msgs = []
    else:
        msgs, _ = input_messages(ResponsesRequest(model=r.model, input=r.input), gw.cfg.attachments)
    conversation = before + msgs
    check_tool_outputs(conversation, len(before))
    asked = ([{"role": "system", "content": r.instructions}] if r.instructions else []) + conversation + [
        {"role": "user", "content": COMPACT_PROMPT}]
    req = gw.prepare({"mode": "chat", "messages": asked, "max_tokens": COMPACT_TOKENS, "temperature": 0.0,
                      "n": 1, "stream": False}, key)
    run = ServeRun(gw, "responses", [req], 1, key, gw.priority(request, key),
                   pin=previous.kernel if previous is not None else None, pinned_by=r.previous_response_id)
    await gw.begin(run, request)
    await collect(run, request)
    kept = [m for m in conversation if m["role"] in ("system", "developer", "user")
            and not (m["role"] == "system" and m["content"].startswith(SUMMARY_HEAD))]
    output = [{"id": new_id("msg"), "type": "message", "status": "completed", "role": m["role"],
               "content": [{"type": "input_text", "text": m["content"]}]} for m in kept]
    output.append({"id": new_id("cmp"), "type": "compaction",
                   "encrypted_content": seal("".join(run.choices[0].text).strip())})
    return {"id": new_id("cmp"), "object": "response.compaction", "created_at": int(time.time()), "output": output,
            "usage": {"input_tokens": run.prompt_tokens, "input_tokens_details": {"cached_tokens": run.cached_tokens},
                      "output_tokens": run.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": run.prompt_tokens + run.completion_tokens}}


async def get(gw, body, key, request):
    s = _stored(gw, key, request)
    return s.response


async def delete(gw, body, key, request):
    rid = request.path_params["rid"]
    if not gw.store.delete(key.user, rid):
        raise ApiError(404, f"no stored response {rid!r}", code="not_found", param="response_id")
    return {"id": rid, "object": "response", "deleted": True}


async def input_items(gw, body, key, request):
    s = _stored(gw, key, request)
    data = list(s.input_items)
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": False}


def _stored(gw, key, request) -> Stored:
    rid = request.path_params["rid"]
    s = gw.store.get(key.user, rid)
    if s is None:
        raise ApiError(404, f"no stored response {rid!r}", code="not_found", param="response_id")
    return s
