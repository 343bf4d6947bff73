"""``POST /v1/chat/completions`` and ``POST /v1/completions``.

Each request becomes the serving program's request (serving.py); its events
become OpenAI's ``chat.completion`` / ``text_completion`` objects, or their
streamed chunks (``chat.completion.chunk`` / ``text_completion`` over SSE,
ending with ``data: [DONE]``), exactly as the ``openai`` package parses them.
Besides OpenAI's parameters (``logit_bias`` included), vLLM's extra ones are
taken: ``top_k``, ``structured_outputs`` and the ``guided_*`` names (tools.py).
"""
from __future__ import annotations

import secrets
import time

from .errors import ApiError
from .schema import ChatRequest, CompletionRequest, decode, text_of
from .serving import ServeRun
from .streams import collect, sse_response
from .tools import answer_format, logit_bias, tool_choice, tool_list


def _sampling(r, max_tokens) -> dict:
    stop = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
    if any(not s for s in stop):
        raise ApiError(400, "stop strings must not be empty", param="stop")
    return {"max_tokens": max_tokens, "temperature": r.temperature, "top_p": r.top_p,    # None: the gateway's
            "top_k": None if r.top_k is None else max(0, r.top_k), "min_p": r.min_p, "seed": r.seed,
            "stop": stop, "n": r.n or 1, "presence_penalty": r.presence_penalty or 0.0,
            "frequency_penalty": r.frequency_penalty or 0.0, "logit_bias": logit_bias(r.logit_bias),
            "response_format": answer_format(r)}


# ---------------------------------------------------------------- chat
def chat_request(r: ChatRequest, attachments: str) -> dict:
    """The serve contract's request for a chat completion."""
    messages = []
    for i, m in enumerate(r.messages):
        msg = {"role": m.role, "content": text_of(m.content, f"messages[{i}].content", attachments=attachments)}
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise ApiError(400, "only assistant messages carry tool_calls", param=f"messages[{i}].tool_calls")
            msg["tool_calls"] = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                                 for c in m.tool_calls]
        if m.role == "tool":
            if not m.tool_call_id:
                raise ApiError(400, "a tool message needs tool_call_id", param=f"messages[{i}].tool_call_id")
            msg["tool_call_id"] = m.tool_call_id
        messages.append(msg)
    tools = tool_list([{"name": t.function.name, "description": t.function.description or "",
                        "parameters": t.function.parameters} for t in r.tools or []])
    choice, offered = tool_choice(r.tool_choice, tools, flat=False)
    req = {"mode": "chat", "messages": messages, **_sampling(r, r.max_completion_tokens or r.max_tokens),
           "logprobs": bool(r.logprobs), "top_logprobs": r.top_logprobs or 0,
           "tools": offered, "tool_choice": choice,
           "parallel_tool_calls": True if r.parallel_tool_calls is None else r.parallel_tool_calls,
           "stream": bool(r.stream)}
    if r.top_logprobs and not r.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return req


async def chat_completions(gw, body: bytes, key, request):
    r = decode(body, ChatRequest)
    gw.check_model(r.model)
    req = gw.prepare(chat_request(r, gw.cfg.attachments), key)
    run = ServeRun(gw, "chat", [req], req["n"], key, gw.priority(request, key))
    base = {"id": f"chatcmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": r.model}
    usage_chunk = bool(r.stream_options and r.stream_options.include_usage)
    first = await gw.begin(run, request)
    base["system_fingerprint"] = run.kernel.fingerprint
    if r.stream:
        return sse_response(run, request, _chat_chunks(run, base, usage_chunk, first))
    await collect(run, request)
    choices = []
    for i, c in enumerate(run.choices):
        text = "".join(c.text)
        msg = {"role": "assistant", "content": text if (text or not c.calls) else None, "refusal": None}
        if c.calls:
            msg["tool_calls"] = [{"id": x["id"], "type": "function",
                                  "function": {"name": x["name"], "arguments": x["arguments"]}} for x in c.calls]
        choices.append({"index": i, "message": msg, "finish_reason": c.finish_reason,
                        "logprobs": {"content": c.logprobs, "refusal": None} if req["logprobs"] else None})
    return {**base, "object": "chat.completion", "choices": choices, "usage": _usage(run)}


async def _chat_chunks(run, base, usage_chunk, first):
    def chunk(choices, **extra):
        d = {**base, "object": "chat.completion.chunk", "choices": choices, **extra}
        if usage_chunk and "usage" not in d:
            d["usage"] = None
        return d
    for i in range(len(run.choices)):
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    async for ev in run.rest():
        i, kind = ev.get("index"), ev["event"]
        if kind == "text":
            lp = {"content": ev["logprobs"], "refusal": None} if ev.get("logprobs") else None
            yield chunk([{"index": i, "delta": {"content": ev["text"]}, "logprobs": lp, "finish_reason": None}])
        elif kind == "tool_call":
            call = {"index": ev["call"], "function": {"arguments": ev["delta"]}}
            if ev["start"]:
                call.update(id=ev["id"], type="function", function={"name": ev["name"], "arguments": ev["delta"]})
            yield chunk([{"index": i, "delta": {"tool_calls": [call]}, "logprobs": None, "finish_reason": None}])
        elif kind == "done":
            yield chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": ev["finish_reason"]}])
    if usage_chunk:
        yield chunk([], usage=_usage(run))


def _usage(run) -> dict:
    return {**run.usage(), "prompt_tokens_details": {"cached_tokens": run.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": 0}}


# ---------------------------------------------------------------- completions
def completion_requests(r: CompletionRequest) -> list[dict]:
    """One serve request per prompt of a (possibly batched) completion."""
    p = r.prompt
    if isinstance(p, str):
        prompts = [p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [list(p)]
    elif all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
        prompts = list(p)
    else:
        raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of "
                            "token id lists", param="prompt")
    if any(isinstance(x, list) and any(t < 0 for t in x) for x in prompts):
        raise ApiError(400, "token ids must be >= 0", param="prompt")
    if not prompts or any(len(x) == 0 for x in prompts):
        raise ApiError(400, "prompt must not be empty", param="prompt")
    if len(prompts) > 16:
        raise ApiError(400, f"at most 16 prompts a request, got {len(prompts)}", param="prompt")
    if r.best_of is not None and r.best_of != (r.n or 1):
        raise ApiError(400, "best_of other than n is not supported", param="best_of")
    if r.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if r.echo and r.logprobs is not None:
        raise ApiError(400, "echo together with logprobs is not supported", param="echo")
    s = _sampling(r, r.max_tokens)
    return [{"mode": "text", "prompt": x, "echo": r.echo, **s, "logprobs": r.logprobs is not None,
             "top_logprobs": r.logprobs or 0, "stream": bool(r.stream)} for x in prompts]


async def completions(gw, body: bytes, key, request):
    r = decode(body, CompletionRequest)
    gw.check_model(r.model)
    reqs = [gw.prepare(x, key) for x in completion_requests(r)]
    run = ServeRun(gw, "completions", reqs, r.n or 1, key, gw.priority(request, key))
    base = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
            "model": r.model}
    want_lp = r.logprobs is not None
    usage_chunk = bool(r.stream_options and r.stream_options.include_usage)
    first = await gw.begin(run, request)
    base["system_fingerprint"] = run.kernel.fingerprint
    if r.stream:
        return sse_response(run, request, _completion_chunks(run, base, want_lp, usage_chunk, first))
    await collect(run, request)
    choices = []
    for i, c in enumerate(run.choices):
        text = "".join(c.text)
        choices.append({"index": i, "text": text, "finish_reason": c.finish_reason,
                        "logprobs": _legacy_logprobs(c.logprobs, 0) if want_lp else None})
    return {**base, "choices": choices, "usage": _usage(run)}


async def _completion_chunks(run, base, want_lp, usage_chunk, first):
    offsets = [0] * len(run.choices)
    extra = {"usage": None} if usage_chunk else {}
    async for ev in run.rest():
        i, kind = ev.get("index"), ev["event"]
        if kind == "text":
            lp = _legacy_logprobs(ev.get("logprobs") or [], offsets[i]) if want_lp else None
            offsets[i] += len(ev["text"])
            yield {**base, "choices": [{"index": i, "text": ev["text"], "logprobs": lp, "finish_reason": None}],
                   **extra}
        elif kind == "done":
            yield {**base, "choices": [{"index": i, "text": "", "logprobs": None,
                                        "finish_reason": ev["finish_reason"]}], **extra}
    if usage_chunk:
        yield {**base, "choices": [], "usage": _usage(run)}


def _legacy_logprobs(entries: list, offset: int) -> dict:
    """The completions API's logprobs: parallel lists, top ones as {token: logprob}."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        out["tokens"].append(e.get("token", ""))
        out["token_logprobs"].append(e.get("logprob"))
        out["top_logprobs"].append({t.get("token", ""): t.get("logprob") for t in e.get("top_logprobs") or []})
        out["text_offset"].append(offset)
        offset += len(e.get("token", ""))
    return out
