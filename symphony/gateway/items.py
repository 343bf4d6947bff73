"""Responses API items: input items to the serving program's messages, its events to output items.

* `input_messages`: a request's ``input`` (a string, or items: messages, with
  an assistant message's ``phase`` kept, ``function_call`` items the model made
  earlier, ``function_call_output`` results, ``compaction`` items made by
  ``/v1/responses/compact``; ``reasoning`` items are dropped) as serve-contract
  messages, and the items as stored for ``/input_items``;
* `check_tool_outputs`: every ``function_call_output`` answers a call made
  before it in the conversation (400 otherwise, as OpenAI answers);
* `serve_request`: the serving program's request for a response;
* `Builder`: the response object and its streamed events, built from a run's
  events (the same objects over SSE and over a WebSocket);
* `seal` / `unseal`: a compaction item's ``encrypted_content``.
"""
from __future__ import annotations

import base64
import binascii
import secrets
import time
import zlib

import orjson

from .errors import ApiError
from .schema import ResponsesRequest, text_of
from .tools import output_format, tool_choice, tool_list

LOGPROBS_INCLUDE = "message.output_text.logprobs"
SEAL = "symc1."                     # a compaction's content: this prefix, then base64url(zlib(JSON))
MAX_SEALED = 1 << 20                # a compaction's decompressed JSON, at most


def new_id(kind: str) -> str:
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
            if it.phase is not None and it.role != "assistant":
                raise ApiError(400, f"{where}: only assistant messages have a phase", param=f"{where}.phase")
            text = text_of(it.content, f"{where}.content", attachments=attachments)
            msgs.append({"role": "system" if it.role == "developer" else it.role, "content": text})
            ctype = "output_text" if it.role == "assistant" else "input_text"
            item = {"type": "message", "role": it.role, "content": [{"type": ctype, "text": text}]}
            if it.phase is not None:
                item["phase"] = it.phase
            items.append(item)
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
        elif kind == "compaction":
            if not isinstance(it.encrypted_content, str):
                raise ApiError(400, f"{where}: a compaction item needs encrypted_content", param=where)
            summary = unseal(it.encrypted_content, f"{where}.encrypted_content")
            msgs.append({"role": "system", "content": f"{SUMMARY_HEAD}\n{summary}"})
            items.append({"type": "compaction", "encrypted_content": it.encrypted_content})
        elif kind == "reasoning":
            continue                                   # no reasoning model: nothing to carry
        else:
            raise ApiError(400, f"{where}: input items of type {kind!r} are not supported", param=f"{where}.type")
    for it in items:
        it["id"] = new_id(_ID_KIND[it["type"]])
    return msgs, items


_ID_KIND = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "compaction": "cmp"}
SUMMARY_HEAD = "A summary of the conversation so far (it replaces the earlier turns):"


def check_tool_outputs(conversation: list[dict], first: int = 0, *, what: str = "function call output",
                       param: str = "input") -> None:
    """Each tool result from message ``first`` on answers a call made before it in
    ``conversation`` (ApiError 400, as OpenAI's ``No tool call found``)."""
    made = set()
    for k, m in enumerate(conversation):
        for c in m.get("tool_calls") or ():
            made.add(c["id"])
        if m["role"] == "tool" and k >= first and m.get("tool_call_id") not in made:
            raise ApiError(400, f"no tool call found for {what} with call id {m.get('tool_call_id')!r}",
                           code="invalid_request", param=param)


def seal(summary: str) -> str:
    """A compaction's ``encrypted_content``: opaque to clients, not secret (it holds a
    summary of what the client sent and the model said, nothing else)."""
    raw = zlib.compress(orjson.dumps({"v": 1, "summary": summary}))
    return SEAL + base64.urlsafe_b64encode(raw).decode()


def unseal(content: str, where: str) -> str:
    """The summary a compaction item carries (ApiError 400 for content not made by `seal`)."""
    bad = ApiError(400, f"{where}: not a compaction made by this server's /v1/responses/compact", param=where)
    if not content.startswith(SEAL):
        raise bad
    try:
        z = zlib.decompressobj()
        raw = z.decompress(base64.urlsafe_b64decode(content[len(SEAL):]), MAX_SEALED)
        d = orjson.loads(raw) if not z.unconsumed_tail else None
    except (binascii.Error, ValueError, zlib.error, orjson.JSONDecodeError):
        raise bad from None
    if not isinstance(d, dict) or d.get("v") != 1 or not isinstance(d.get("summary"), str):
        raise bad
    return d["summary"]


def serve_request(r: ResponsesRequest, conversation: list[dict]) -> tuple[dict, list, object]:
    """(the serve request, the tools echoed in the response, the tool_choice echoed)."""
    if r.background:
        raise ApiError(400, "background responses are not supported", param="background")
    given = []
    for i, t in enumerate(r.tools or []):
        if t.type != "function" or not t.name:
            raise ApiError(400, f"tools[{i}]: a tool of type {t.type!r} is not supported: only function tools "
                                f"(type 'function' with a name; no hosted tools such as file_search or web_search)",
                           param=f"tools[{i}].type")
        given.append({"name": t.name, "description": t.description or "", "parameters": t.parameters})
    tools = tool_list(given)
    choice, offered = tool_choice(r.tool_choice, tools, flat=True)
    include = set(r.include or [])
    want_lp = LOGPROBS_INCLUDE in include
    fmt = r.text.format if r.text and r.text.format else None
    messages = ([{"role": "system", "content": r.instructions}] if r.instructions else []) + conversation
    req = {"mode": "chat", "messages": messages, "max_tokens": r.max_output_tokens,
           "temperature": r.temperature, "top_p": r.top_p, "seed": r.seed, "stop": [], "n": 1,   # None: the gateway's
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
                "service_tier": "default", "metadata": r.metadata or {}, "safety_identifier": r.safety_identifier,
                "prompt_cache_key": r.prompt_cache_key}

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
        self._msg = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
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
                item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress",
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
            self.output.append({"id": new_id("msg"), "type": "message", "status": "completed", "role": "assistant",
                                "content": [{"type": "output_text", "text": text, "annotations": [],
                                             "logprobs": c.logprobs}]})
        for x in c.calls:
            self.output.append({"id": new_id("fc"), "type": "function_call", "status": "completed",
                                "call_id": x["id"], "name": x["name"], "arguments": x["arguments"]})

    def final(self) -> dict:
        c = self.run.choices[0]
        if c.finish_reason == "length":
            return self.resource("incomplete", incomplete={"reason": "max_output_tokens"}, usage=self.usage())
        return self.resource("completed", usage=self.usage())


