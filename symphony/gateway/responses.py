"""``/v1/responses``: OpenAI's Responses API, in the Open Responses specification's shapes.

``POST /v1/responses`` turns the input items (a string, messages, earlier
``function_call`` items and ``function_call_output`` results), the
``instructions`` and, with ``previous_response_id``, the stored conversation
before them into one serving-program run (serving.py).  Its events become
the response's output items: one ``message`` with an ``output_text`` part,
then one ``function_call`` item per tool call.  Streamed, the events follow
the specification's order, each with its ``sequence_number``:

    response.created, response.in_progress,
    per message:  response.output_item.added, response.content_part.added,
                  response.output_text.delta..., response.output_text.done,
                  response.content_part.done, response.output_item.done
    per call:     response.output_item.added, response.function_call_arguments.delta...,
                  response.function_call_arguments.done, response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

``store`` (default true) keeps the response for ``GET``/``DELETE
/v1/responses/{id}``, ``/input_items`` and continuations (store.py).  A
continuation runs on the kernel that served the response it continues,
where the conversation's KV is.  When that kernel drains, or dies having made
the conversation durable (``--durable-responses``) in a directory another
kernel may adopt from, the files move and the continuation follows them
(moves.py); otherwise, while it is out of rotation, it is a 503
(``previous_response_unavailable``) rather than a silent recomputation
elsewhere.
"""
from __future__ import annotations

import secrets
import time

from .errors import ApiError
from .schema import ResponsesRequest, decode, text_of
from .serving import ServeRun
from .store import Stored
from .streams import collect, sse_response
from .tools import output_format, tool_choice, tool_list

LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _new_id(kind: str) -> str:
    return f"{kind}_{secrets.token_hex(16)}"


def input_messages(r: ResponsesRequest, attachments: str) -> tuple[list[dict], list[dict]]:
    """(serve-contract messages, the input items as stored) of a request's input."""
    if r.input is None or r.input == [] or r.input == "":
        raise ApiError(400, "input is required", param="input")
    if isinstance(r.input, str):
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": r.input}]}
        return [{"role": "user", "content": r.input}], [item]
    msgs, items = [], []
    for i, it in enumerate(r.input):
        where = f"input[{i}]"
        kind = it.type or ("message" if it.role else None)
        if kind == "message":
            if it.role is None:
                raise ApiError(400, f"{where}: a message needs a role", param=f"{where}.role")
            text = text_of(it.content, f"{where}.content", attachments=attachments)
            msgs.append({"role": "system" if it.role == "developer" else it.role, "content": text})
            ctype = "output_text" if it.role == "assistant" else "input_text"
            items.append({"type": "message", "role": it.role, "content": [{"type": ctype, "text": text}]})
        elif kind == "function_call":
            if not it.call_id or not it.name or it.arguments is None:
                raise ApiError(400, f"{where}: a function_call needs call_id, name and arguments", param=where)
            call = {"id": it.call_id, "name": it.name, "arguments": it.arguments}
            if msgs and msgs[-1]["role"] == "assistant" and "tool_calls" in msgs[-1]:
                msgs[-1]["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
            items.append({"type": "function_call", "call_id": it.call_id, "name": it.name,
                          "arguments": it.arguments})
        elif kind == "function_call_output":
            if not it.call_id or it.output is None:
                raise ApiError(400, f"{where}: a function_call_output needs call_id and output", param=where)
            out = it.output if isinstance(it.output, str) else text_of(it.output, f"{where}.output", attachments=attachments)
            msgs.append({"role": "tool", "tool_call_id": it.call_id, "content": out})
            items.append({"type": "function_call_output", "call_id": it.call_id, "output": out})
        elif kind == "reasoning":
            continue                                   # no reasoning model: nothing to carry
        else:
            raise ApiError(400, f"{where}: input items of type {kind!r} are not supported", param=f"{where}.type")
    for it in items:
        it["id"] = _new_id("msg" if it["type"] == "message" else "fc" if it["type"] == "function_call" else "fco")
    return msgs, items


def serve_request(r: ResponsesRequest, conversation: list[dict]) -> tuple[dict, list, object]:
    """(the serve request, the tools echoed in the response, the tool_choice echoed)."""
    if r.background:
        raise ApiError(400, "background responses are not supported", param="background")
    given = []
    for i, t in enumerate(r.tools or []):
        if t.type != "function" or not t.name:
            raise ApiError(400, f"tools[{i}]: only function tools are supported (type 'function' with a name)",
                           param=f"tools[{i}].type")
        given.append({"name": t.name, "description": t.description or "", "parameters": t.parameters})
    tools = tool_list(given)
    choice, offered = tool_choice(r.tool_choice, tools, flat=True)
    include = set(r.include or [])
    want_lp = LOGPROBS_INCLUDE in include
    fmt = r.text.format if r.text and r.text.format else None
    messages = ([{"role": "system", "content": r.instructions}] if r.instructions else []) + conversation
    req = {"mode": "chat", "messages": messages, "max_tokens": r.max_output_tokens,
           "temperature": 1.0 if r.temperature is None else r.temperature,
           "top_p": 1.0 if r.top_p is None else r.top_p, "seed": r.seed, "stop": [], "n": 1,
           "presence_penalty": r.presence_penalty or 0.0, "frequency_penalty": r.frequency_penalty or 0.0,
           "logprobs": want_lp, "top_logprobs": r.top_logprobs or 0,
           "response_format": output_format(fmt.type, fmt.schema, "text.format") if fmt else None,
           "tools": offered, "tool_choice": choice,
           "parallel_tool_calls": True if r.parallel_tool_calls is None else r.parallel_tool_calls,
           "stream": bool(r.stream)}
    echoed_tools = [{"type": "function", "name": t["name"], "description": t["description"] or None,
                     "parameters": t["parameters"], "strict": True} for t in tools]
    echoed_choice = r.tool_choice if r.tool_choice is not None else ("auto" if tools else "none")
    return req, echoed_tools, echoed_choice


class Builder:
    """The response object and its streamed events, built from a run's events."""

    def __init__(self, r: ResponsesRequest, rid: str, tools, choice, run):
        self.r, self.rid, self.tools, self.choice, self.run = r, rid, tools, choice, run
        self.created = int(time.time())
        self.output: list[dict] = []
        self.seq = 0
        self._msg = None           # the open message item
        self._calls: dict = {}     # call index -> its item

    def resource(self, status: str, *, error=None, incomplete=None, usage=None) -> dict:
        r = self.r
        fmt = r.text.format if r.text and r.text.format else None
        text_format = {"type": "text"}
        if fmt is not None and fmt.type != "text":
            text_format = {"type": fmt.type}
            if fmt.type == "json_schema":
                text_format.update(name=fmt.name or "output", schema=fmt.schema, strict=bool(fmt.strict),
                                   description=fmt.description)
        done = status in ("completed", "incomplete", "failed")
        return {"id": self.rid, "object": "response", "created_at": self.created,
                "completed_at": int(time.time()) if done else None, "status": status,
                "incomplete_details": incomplete, "model": r.model,
                "previous_response_id": r.previous_response_id, "instructions": r.instructions,
                "output": list(self.output), "error": error, "tools": self.tools, "tool_choice": self.choice,
                "truncation": r.truncation or "disabled",
                "parallel_tool_calls": True if r.parallel_tool_calls is None else r.parallel_tool_calls,
                "text": {"format": text_format}, "top_p": 1.0 if r.top_p is None else r.top_p,
                "presence_penalty": r.presence_penalty or 0.0, "frequency_penalty": r.frequency_penalty or 0.0,
                "top_logprobs": r.top_logprobs or 0, "temperature": 1.0 if r.temperature is None else r.temperature,
                "reasoning": None, "usage": usage, "max_output_tokens": r.max_output_tokens,
                "max_tool_calls": r.max_tool_calls, "store": r.store, "background": False,
                "service_tier": "default", "metadata": r.metadata or {}, "safety_identifier": None,
                "prompt_cache_key": None}

    def usage(self) -> dict:
        run = self.run
        return {"input_tokens": run.prompt_tokens, "input_tokens_details": {"cached_tokens": run.cached_tokens},
                "output_tokens": run.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": run.prompt_tokens + run.completion_tokens}

    def event(self, kind: str, **fields) -> dict:
        e = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return e

    # -- output items, as events
    def _open_message(self):
        self._msg = {"id": _new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                     "content": []}
        self.output.append(self._msg)
        idx = len(self.output) - 1
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self.event("response.output_item.added", output_index=idx, item=dict(self._msg, content=[])),
                self.event("response.content_part.added", item_id=self._msg["id"], output_index=idx,
                           content_index=0, part=part)]

    def _close_message(self):
        if self._msg is None:
            return []
        m, idx = self._msg, self.output.index(self._msg)
        text = "".join(m.pop("_text", []))
        lps = m.pop("_logprobs", [])
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": lps}
        m["content"], m["status"] = [part], "completed"
        self._msg = None
        return [self.event("response.output_text.done", item_id=m["id"], output_index=idx, content_index=0,
                           text=text, logprobs=lps),
                self.event("response.content_part.done", item_id=m["id"], output_index=idx, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=idx, item=m)]

    def on(self, ev: dict) -> list[dict]:
        """The streaming events one run event makes."""
        out = []
        if ev["event"] == "text":
            if self._msg is None:
                out += self._open_message()
            m = self._msg
            m.setdefault("_text", []).append(ev["text"])
            lps = ev.get("logprobs") or []
            m.setdefault("_logprobs", []).extend(lps)
            out.append(self.event("response.output_text.delta", item_id=m["id"], output_index=self.output.index(m),
                                  content_index=0, delta=ev["text"], logprobs=lps))
        elif ev["event"] == "tool_call":
            if ev["start"]:
                out += self._close_message()
                item = {"id": _new_id("fc"), "type": "function_call", "status": "in_progress",
                        "call_id": ev["id"], "name": ev["name"], "arguments": ""}
                self.output.append(item)
                self._calls[ev["call"]] = item
                out.append(self.event("response.output_item.added", output_index=len(self.output) - 1,
                                      item=dict(item)))
            item = self._calls.get(ev["call"])
            if item is not None and ev["delta"]:
                item["arguments"] += ev["delta"]
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.output.index(item), delta=ev["delta"]))
        elif ev["event"] == "done":
            out += self.finish_items()
        return out

    def finish_items(self) -> list[dict]:
        out = self._close_message()
        for item in self._calls.values():
            if item["status"] == "in_progress":
                item["status"] = "completed"
                idx = self.output.index(item)
                out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=idx, name=item["name"], arguments=item["arguments"]))
                out.append(self.event("response.output_item.done", output_index=idx, item=dict(item)))
        if not self.output:                                # an empty answer is still a message
            out += self._open_message() + self._close_message()
        return out

    def from_choice(self) -> None:
        """The output items of a finished run at once (a response that is not streamed)."""
        c = self.run.choices[0]
        text = "".join(c.text)
        if text or not c.calls:
            self.output.append({"id": _new_id("msg"), "type": "message", "status": "completed", "role": "assistant",
                                "content": [{"type": "output_text", "text": text, "annotations": [],
                                             "logprobs": c.logprobs}]})
        for x in c.calls:
            self.output.append({"id": _new_id("fc"), "type": "function_call", "status": "completed",
                                "call_id": x["id"], "name": x["name"], "arguments": x["arguments"]})

    def final(self) -> dict:
        c = self.run.choices[0]
        if c.finish_reason == "length":
            return self.resource("incomplete", incomplete={"reason": "max_output_tokens"}, usage=self.usage())
        return self.resource("completed", usage=self.usage())


async def create(gw, body: bytes, key, request):
    r = decode(body, ResponsesRequest)
    gw.check_model(r.model)
    msgs, items = input_messages(r, gw.cfg.attachments)
    conversation, pin = msgs, None
    if r.previous_response_id:
        prev = gw.store.get(key.user, r.previous_response_id)
        if prev is None:
            raise ApiError(404, f"no stored response {r.previous_response_id!r} (it was never stored, was "
                                f"deleted, or belongs to another user)", code="previous_response_not_found",
                           param="previous_response_id")
        conversation, pin = prev.conversation + msgs, await gw.mover.follow(key.user, prev)
    req, tools, choice = serve_request(r, conversation)
    gw.prepare(req, key)
    if r.store and gw.cfg.durable_responses and req.get("cache"):
        req["cache"]["durable"] = True             # its conversation's last checkpoint survives the kernel
    rid = _new_id("resp")
    run = ServeRun(gw, "responses", [req], 1, key, gw.priority(request, key), pin=pin,
                   pinned_by=r.previous_response_id,
                   follow=(lambda: gw.mover.follow(key.user, prev)) if r.previous_response_id else None)
    b = Builder(r, rid, tools, choice, run)
    await gw.begin(run, request)

    def keep():
        final = b.final()
        if r.store:
            c = run.choices[0]
            said = {"role": "assistant", "content": "".join(c.text)}
            if c.calls:
                said["tool_calls"] = [dict(x) for x in c.calls]
            if not gw.store.put(rid, Stored(key.user, final, items, conversation + [said], run.kernel.index)):
                final["store"] = False                 # larger than the user's whole store: not kept
        return final

    if r.stream:
        async def events():
            yield b.event("response.created", response=b.resource("in_progress"))
            yield b.event("response.in_progress", response=b.resource("in_progress"))
            async for ev in run.rest():
                for e in b.on(ev):
                    yield e
            final = keep()
            yield b.event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                          response=final)

        def failed(e: ApiError) -> dict:
            return b.event("response.failed", response=b.resource(
                "failed", error={"code": e.code or "server_error", "message": e.message}))
        return sse_response(run, request, events(), named="type", terminator=None, on_error=failed)
    await collect(run, request)
    b.from_choice()
    return keep()


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
