"""A serving program for the gateway's own tests: the serve contract
(userland/serve.py) without a model, so that every answer is known.

The last message (or the prompt) decides:
  "ERROR <status> <code>"  -> an error event, exit 2
  "TOOL <name> <json>"     -> choice i calls <name> with <json>, streamed in 3 pieces
  "CRASH"                  -> an uncaught exception before any event
  "SLOW <n>"               -> n words, 0.2 s apart (for disconnects)
  "BIG <n>"                -> n words of 1 KiB each, as fast as the kernel takes them (slow readers)
  "REQUEST"                -> the request it was given, as JSON text (one event)
  "BADEVENT <kind>"        -> an event outside the contract ("index": a choice the request has not;
                              "order": text before the prompt event; "shape": a text event without text)
  anything else            -> its words echoed, one text event each ("[i] " before choice i > 0)
max_tokens cuts the words (finish "length"); logprobs are -0.5 per word.
The prompt event reports 1 token per word of every message, cached 0.
With "stream": false the events are merged as the contract says (symphony.lip.serving.Events).
With "count_only" it sends the prompt event alone.
"""
import json
import time

from symphony.lip import send
from symphony.lip.serving import Events


def main(request):
    r = json.loads(request)
    if r["mode"] == "chat":
        msgs = r["messages"]
        last = msgs[-1]["content"]
        n_prompt = sum(len(m["content"].split()) for m in msgs)
    else:
        last = r["prompt"] if isinstance(r["prompt"], str) else " ".join(map(str, r["prompt"]))
        n_prompt = len(last.split())
    if last.startswith("CRASH"):
        raise RuntimeError("fake_serve crashed on purpose")
    if last.startswith("BADEVENT"):                     # sent raw: Events would refuse to send it
        kind = last.split()[1]
        if kind != "order":
            send({"event": "prompt", "prompt_tokens": n_prompt, "cached_tokens": 0})
        send({"event": "text", "index": 7, "text": "x"} if kind == "index" else
             {"event": "text", "index": 0} if kind == "shape" else {"event": "text", "index": 0, "text": "x"})
        send({"event": "done", "index": 0, "finish_reason": "stop", "completion_tokens": 1})
        return 0
    if last.startswith("ERROR"):
        _, status, code = last.split()[:3]
        send({"event": "error", "status": int(status), "code": code, "message": f"refused: {code}",
              "param": "messages"})
        return 2
    send({"event": "prompt", "prompt_tokens": n_prompt, "cached_tokens": 0})
    if r.get("count_only"):
        return 0
    if last.startswith("REQUEST"):
        send({"event": "text", "index": 0, "text": request})
        send({"event": "done", "index": 0, "finish_reason": "stop", "completion_tokens": 1})
        return 0
    emit = Events(coalesce=r.get("stream") is False).send
    n = r.get("n", 1)
    if last.startswith("TOOL"):
        _, name, args = last.split(" ", 2)
        for i in range(n):
            third = max(1, len(args) // 3)
            emit({"event": "tool_call", "index": i, "call": 0, "id": f"call_{i}", "name": name,
                  "arguments": args[:third]})
            emit({"event": "tool_call", "index": i, "call": 0, "arguments": args[third:2 * third]})
            emit({"event": "tool_call", "index": i, "call": 0, "arguments": args[2 * third:]})
            emit({"event": "done", "index": i, "finish_reason": "tool_calls", "completion_tokens": 3})
        return 0
    slow = last.startswith("SLOW")
    if slow or last.startswith("BIG"):
        words = [(f"w{k}" if slow else "x" * 1024) for k in range(int(last.split()[1]))]
    else:
        words = last.split()
    limit = r.get("max_tokens") or len(words)
    for i in range(n):
        out = words[:limit]
        for k, w in enumerate(out):
            text = (f"[{i}] " if i and k == 0 else "") + w + (" " if k < len(out) - 1 else "")
            ev = {"event": "text", "index": i, "text": text}
            if r.get("logprobs"):
                ev["logprobs"] = [{"token": text, "bytes": list(text.encode()), "logprob": -0.5,
                                   "top_logprobs": [{"token": text, "bytes": list(text.encode()), "logprob": -0.5}]
                                   * r.get("top_logprobs", 0)}]
            emit(ev)
            if slow:
                time.sleep(0.2)
        emit({"event": "done", "index": i, "finish_reason": "length" if len(words) > limit else "stop",
              "completion_tokens": len(out)})
    return 0
