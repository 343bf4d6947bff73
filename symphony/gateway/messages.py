"""``/v1/messages``: Anthropic's Messages API, served by the same serving program as OpenAI's routes.

``POST /v1/messages`` takes Anthropic's request (``model``, ``max_tokens``,
``messages`` of ``user``/``assistant`` turns whose content is a string or
blocks, ``system``, ``stop_sequences``, ``temperature`` in [0, 1], ``top_p``,
``top_k``, ``tools`` with ``input_schema``, ``tool_choice`` ``auto``/``any``/
``tool``/``none``, ``output_config.format`` (a JSON schema the answer follows),
``stream``) and answers with a ``message`` object, or
streamed, Anthropic's events (SSE, ``event:`` named)::

    message_start, ping,
    per block:  content_block_start, content_block_delta..., content_block_stop
                (text: text_delta; tool_use: input_json_delta)
    message_delta (stop_reason, stop_sequence, usage.output_tokens), message_stop
    (a failure after the start: an ``error`` event)

Blocks a request may hold: ``text``; ``image`` and ``document`` (a plain-text
``document`` is read, the others are placeholders or refused, as
``--attachments`` says); on assistant turns ``tool_use`` (and ``thinking``,
dropped); on user turns ``tool_result`` (its content a string or text blocks),
each answering a ``tool_use`` before it.  Any other block type is a 400.
``stop_reason``: ``end_turn``, ``max_tokens``, ``stop_sequence`` (with the
string in ``stop_sequence``) or ``tool_use``.  ``usage.input_tokens`` counts the
prompt tokens that were computed, ``cache_read_input_tokens`` those whose KV
came from the prefix cache.  ``POST /v1/messages/count_tokens`` renders the
same prompt (tools included) and answers ``{"input_tokens": N}``.  Errors are
Anthropic's: ``{"type": "error", "error": {"type", "message"}}``.  A key may be
given as ``x-api-key`` or ``Authorization: Bearer``; ``anthropic-version`` is
accepted and not needed.
"""
from __future__ import annotations

import json
import secrets
from typing import Annotated, Any, Literal, Optional, Union

import msgspec

from symphony.ipc.serving import MAX_STOP as MAX_STOP_SEQUENCES

from .errors import ApiError
from .items import check_tool_outputs
from .schema import Base, Part, decode, text_of
from .serving import ServeRun
from .streams import collect, sse_response
from .tools import tool_choice, tool_list

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


# ---------------------------------------------------------------- the request
class Block(Base):
    """A content block (the fields of every type it may be; `_blocks` checks them per type)."""
    type: str
    text: Optional[str] = None
    source: Optional[dict] = None                   # image, document
    title: Optional[str] = None                     # document
    id: Optional[str] = None                        # tool_use
    name: Optional[str] = None
    input: Any = None
    tool_use_id: Optional[str] = None               # tool_result
    content: Union[str, list["Block"], None] = None
    is_error: Optional[bool] = None


class AMessage(Base):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class ATool(Base):
    name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    input_schema: dict
    description: Optional[str] = None
    type: Optional[str] = None


class AToolChoice(Base):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class Thinking(Base):
    type: str
    budget_tokens: Optional[int] = None


class OutputFormat(Base):
    type: Literal["json_schema"]
    schema: dict


class OutputConfig(Base):
    """``format``: the answer is JSON of this schema (Anthropic's structured outputs);
    ``effort`` is accepted and does nothing (no reasoning model)."""
    format: Optional[OutputFormat] = None
    effort: Optional[str] = None


class CountRequest(Base):
    model: str
    messages: Annotated[list[AMessage], msgspec.Meta(min_length=1)]
    system: Union[str, list[Block], None] = None
    tools: Optional[Annotated[list[ATool], msgspec.Meta(max_length=128)]] = None
    tool_choice: Optional[AToolChoice] = None
    thinking: Optional[Thinking] = None


class MessagesRequest(CountRequest, kw_only=True):
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    stop_sequences: Optional[Annotated[list[Annotated[str, msgspec.Meta(min_length=1)]],
                                       msgspec.Meta(max_length=MAX_STOP_SEQUENCES)]] = None
    stream: bool = False
    temperature: Optional[Annotated[float, msgspec.Meta(ge=0, le=1)]] = None
    top_p: Optional[Annotated[float, msgspec.Meta(gt=0, le=1)]] = None
    top_k: Optional[Annotated[int, msgspec.Meta(ge=0)]] = None
    metadata: Optional[dict] = None
    output_config: Optional[OutputConfig] = None


# ---------------------------------------------------------------- the routes
async def create(gw, body: bytes, key, request):
    r = decode(body, MessagesRequest)
    req = gw.prepare(_serve_request(gw, r, count_only=False), key)
    run = ServeRun(gw, "messages", [req], 1, key, gw.priority(request, key))
    first = await gw.begin(run, request)
    mid = "msg_" + secrets.token_hex(12)
    if r.stream:
        return sse_response(run, request, _events(run, r, mid, first), named="type", terminator=None,
                            on_error=lambda e: e.body("anthropic"))
    await collect(run, request)
    c = run.choices[0]
    content = ([{"type": "text", "text": "".join(c.text)}] if c.text and "".join(c.text) or not c.calls else [])
    content += [{"type": "tool_use", "id": _tool_id(x["id"]), "name": x["name"], "input": _input(x["arguments"])}
                for x in c.calls]
    return {"id": mid, "type": "message", "role": "assistant", "model": r.model, "content": content,
            "stop_reason": _stop_reason(c), "stop_sequence": c.stop_sequence,
            "usage": dict(_usage(run), output_tokens=c.completion_tokens)}


async def count_tokens(gw, body: bytes, key, request):
    r = decode(body, CountRequest)
    req = gw.prepare(_serve_request(gw, r, count_only=True), key)
    run = ServeRun(gw, "messages", [req], 1, key, gw.priority(request, key))
    first = await gw.begin(run, request)
    await run.close()
    return {"input_tokens": first["prompt_tokens"]}


async def _events(run, r: MessagesRequest, mid: str, first: dict):
    usage = _usage(run)
    yield {"type": "message_start", "message": {
        "id": mid, "type": "message", "role": "assistant", "model": r.model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": dict(usage, output_tokens=0)}}
    yield {"type": "ping"}
    block, open_kind = -1, None                          # the index and kind of the open block
    async for ev in run.rest():
        kind = ev["event"]
        if kind == "text" and ev["text"]:
            if open_kind != "text":
                if open_kind is not None:
                    yield {"type": "content_block_stop", "index": block}
                block, open_kind = block + 1, "text"
                yield {"type": "content_block_start", "index": block, "content_block": {"type": "text", "text": ""}}
            yield {"type": "content_block_delta", "index": block, "delta": {"type": "text_delta", "text": ev["text"]}}
        elif kind == "tool_call":
            if ev["start"]:
                if open_kind is not None:
                    yield {"type": "content_block_stop", "index": block}
                block, open_kind = block + 1, "tool_use"
                yield {"type": "content_block_start", "index": block, "content_block": {
                    "type": "tool_use", "id": _tool_id(ev["id"]), "name": ev["name"], "input": {}}}
            if ev["delta"]:
                yield {"type": "content_block_delta", "index": block,
                       "delta": {"type": "input_json_delta", "partial_json": ev["delta"]}}
        elif kind == "done":
            if open_kind is None:                        # an empty answer is still one text block
                block, open_kind = 0, "text"
                yield {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
            yield {"type": "content_block_stop", "index": block}
    c = run.choices[0]
    yield {"type": "message_delta", "delta": {"stop_reason": _stop_reason(c), "stop_sequence": c.stop_sequence},
           "usage": {"output_tokens": c.completion_tokens}}
    yield {"type": "message_stop"}


# ---------------------------------------------------------------- helpers
def _serve_request(gw, r, *, count_only: bool) -> dict:
    """The serving program's request for a Messages (or count_tokens) request."""
    gw.check_model(r.model)
    if r.thinking is not None and r.thinking.type != "disabled":
        raise ApiError(400, "thinking: extended thinking is not supported by this model", param="thinking")
    messages = _conversation(r, gw.cfg.attachments)
    given = []
    for i, t in enumerate(r.tools or []):
        if t.type not in (None, "custom"):
            raise ApiError(400, f"tools.{i}.type: server tools ({t.type!r}) are not supported; give custom tools "
                                f"(name, description, input_schema)", param=f"tools.{i}.type")
        given.append({"name": t.name, "description": t.description or "", "parameters": t.input_schema})
    tools = tool_list(given)
    tc = r.tool_choice
    choice, offered = tool_choice(None if tc is None else {"auto": "auto", "any": "required", "none": "none"}.get(
        tc.type, {"type": "function", "name": tc.name}), tools, flat=True)
    req = {"mode": "chat", "messages": messages, "tools": offered, "tool_choice": choice,
           "parallel_tool_calls": not (tc is not None and tc.disable_parallel_tool_use), "n": 1}
    if count_only:
        return dict(req, count_only=True, stream=False)
    fmt = r.output_config.format if r.output_config else None
    return dict(req, max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,  # None: the gateway's
                stop=list(r.stop_sequences or []),
                stream=r.stream, response_format=None if fmt is None else {"type": "json_schema", "schema": fmt.schema})


def _conversation(r, attachments: str) -> list[dict]:
    """The serve-contract messages of a request: the system prompt, then each turn's
    blocks (tool results become ``tool`` messages, before the turn's text)."""
    out = []
    if r.system:
        system = r.system if isinstance(r.system, str) else "\n".join(
            _text_block(b, f"system.{j}") for j, b in enumerate(r.system))
        out.append({"role": "system", "content": system})
    for i, m in enumerate(r.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts, calls, results = [], [], []
        for j, b in enumerate(m.content):
            at = f"messages.{i}.content.{j}"
            kind = b.type
            if kind == "text":
                texts.append(_text_block(b, at))
            elif kind in ("image", "document"):
                texts.append(_attachment(b, at, attachments))
            elif kind == "tool_use" and m.role == "assistant":
                if not b.id or not b.name or not isinstance(b.input, dict):
                    raise ApiError(400, f"{at}: a tool_use block needs id, name and an object input", param=at)
                calls.append({"id": b.id, "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)})
            elif kind == "tool_result" and m.role == "user":
                if not b.tool_use_id:
                    raise ApiError(400, f"{at}: a tool_result block needs tool_use_id", param=at)
                text = b.content if isinstance(b.content, str) else "\n".join(
                    _text_block(x, f"{at}.content.{k}") for k, x in enumerate(b.content or []))
                results.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                "content": f"Error: {text}" if b.is_error else text})
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue                                 # no thinking model: nothing to carry
            else:
                raise ApiError(400, f"{at}.type: {m.role} messages may not hold content blocks of type "
                                    f"{kind[:64]!r}", param=f"{at}.type")
        out += results
        if texts or calls or not results:
            msg = {"role": m.role, "content": "\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    if r.messages[-1].role == "assistant":
        raise ApiError(400, "the last message must be a user message: continuing a prefilled assistant turn is "
                            "not supported", param="messages")
    check_tool_outputs(out, what="tool_result block", param="messages")
    return out


def _text_block(b: Block, at: str) -> str:
    if b.type != "text" or not isinstance(b.text, str):
        raise ApiError(400, f"{at}: expected a text block with text, got type {b.type[:64]!r}", param=f"{at}.type")
    return b.text


def _attachment(b: Block, at: str, attachments: str) -> str:
    """An image or document block as text: a plain-text document's text (with its title),
    else a placeholder or a 400, as ``--attachments`` says."""
    src = b.source if isinstance(b.source, dict) else {}
    if b.type == "document" and src.get("type") == "text" and isinstance(src.get("data"), str):
        return f"[document {b.title or 'document'}]\n{src['data']}\n"
    if b.type == "document" and src.get("type") == "base64":
        part = Part(type="input_file", filename=b.title or "document",
                    file_data=f"data:{src.get('media_type') or 'application/octet-stream'};base64,{src.get('data', '')}")
    else:
        part = Part(type="input_image" if b.type == "image" else "input_file", filename=b.title or b.type)
    return text_of([part], at, attachments=attachments)


def _usage(run) -> dict:
    return {"input_tokens": run.prompt_tokens - run.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": run.cached_tokens}


def _stop_reason(c) -> str:
    return "stop_sequence" if c.stop_sequence else STOP_REASONS.get(c.finish_reason, "end_turn")


def _tool_id(call_id: str) -> str:
    """A serving program's call id (``call_<hex>``) as Anthropic spells tool-use ids."""
    return "toolu_" + call_id.split("_", 1)[-1]


def _input(arguments: str):
    """A call's arguments as the tool_use block's input (an object; {} for arguments
    cut short by max_tokens, which do not parse)."""
    try:
        v = json.loads(arguments)
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}
